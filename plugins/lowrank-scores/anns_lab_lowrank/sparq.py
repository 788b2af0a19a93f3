"""SparQ Attention's key selection (Ribar et al., "SparQ Attention: Bandwidth-Efficient LLM Inference", ICML 2024;
code graphcore-research/llm-inference-research).

A query keeps its r components of largest magnitude; every key is scored on those r dimensions alone, read from a
second, transposed copy of the keys (one row per dimension, as SparQ stores K twice so that r of its rows are read
whole); the ``budget`` keys of largest partial score are scored exactly and the top-k returned.

Not modelled: SparQ's softmax temperature for the partial scores (it rescales them, never reorders them: the same
keys are chosen), its forced recent tokens (the lab's static window holds them) and its mean-value reallocation (the
rest of the softmax as the mean value, an estimate; this is a top-k index). Its GQA rule is per query head here, as
for every index of the lab.

Counting (:mod:`anns_lab_lowrank.partial`): ``n_scanned`` = ceil(n·r/d) + keys scored exactly; ``bytes_read`` =
4·r·n + 4·d per key scored. Choosing the r components reads the query alone: nothing of the index.
"""

from __future__ import annotations

import numpy as np

from anns_lab.indexes.persist import expect
from anns_lab_lowrank import partial


class SparQ(partial.TransposedKeys):
    """SparQ: every key scored on the query's r largest components, the best ``budget`` scored exactly."""

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        self._hold_transposed(keys)  # SparQ's second copy of the keys

    def _search(self, queries: np.ndarray, k: int, rank: float, budget: int):
        r = partial.channels(rank, self.dim)
        dims = np.sort(np.argsort(-np.abs(queries), axis=1, kind="stable")[:, :r], axis=1)  # each query's own
        return partial.search_channels(self._by_dim.buf, dims, self._keys, queries, budget, k)

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        self._build(expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True), None)  # from a file
