"""``flat``: exact maximum-inner-product search (faiss ``IndexFlatIP``); the lab's ground-truth baseline."""

from __future__ import annotations

import faiss
import numpy as np

from anns_lab.indexes.base import Index, pad_topk
from anns_lab.indexes.held_memory import grown_capacity
from anns_lab.indexes.persist import expect


class FlatIndex(Index):
    """Exact top-k by inner product. Every query scans every key: ``n_scanned = n_keys``."""

    name = "flat"
    restores_exactly = True  # tests/test_build_processes.py

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        self._index = faiss.IndexFlatIP(keys.shape[1])
        self._index.add(keys)
        self._capacity = len(keys)  # rows faiss's vector holds memory for (one resize from empty: exactly these)

    def _search(self, queries: np.ndarray, k: int):
        scores, ids = self._index.search(queries, k)
        ids, scores = pad_topk(ids, scores)
        return ids, scores, np.full(len(queries), self._index.ntotal, dtype=np.int64)

    def _add(self, keys: np.ndarray) -> None:
        self._capacity = grown_capacity(self._capacity, self._index.ntotal, len(keys))
        self._index.add(keys)

    @property
    def nbytes(self) -> int:
        """faiss's key vector as allocated: its capacity, which ``add`` grows as the C++ library's vector does."""
        return self._capacity * self.key_bytes()

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": faiss.rev_swig_ptr(self._index.get_xb(), self._index.ntotal * self._index.d).reshape(-1, self._index.d)}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        self._build(expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True), None)
