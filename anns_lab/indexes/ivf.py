"""``ivf``: inverted file over k-means lists (faiss ``IndexIVFFlat``, inner product).

Counting: a query scores all ``nlist`` centroids, then every key of its ``nprobe`` probed
lists, so ``n_scanned = nlist + Σ sizes of the probed lists``. The per-query sum is taken from
the coarse assignment we pass to faiss's ``search_preassigned``; faiss's own counter
``indexIVF_stats.ndis`` (which excludes the centroids) must equal its total over the batch,
and the search raises if it does not. That counter is one per process, so searches hold a lock from its reset
to its read (searches from several threads at once, e.g. the decoder calibrating two layers, would add to each
other's count). ``bytes_read``: the ``nlist`` centroids and every vector of the
probed lists (4·dim bytes each, float32) plus the probed lists' ids (8 bytes each, faiss ``idx_t``).
"""

from __future__ import annotations

import math
import threading

import faiss
import numpy as np
from faiss.contrib.ivf_tools import add_preassigned

from anns_lab.errors import IndexConfigError
from anns_lab.indexes.base import Index, Param, pad_topk
from anns_lab.indexes.held_memory import filled_one_by_one
from anns_lab.indexes.persist import expect, expect_ids, refuse_faiss_payload


_STATS = threading.Lock()  # faiss.cvar.indexIVF_stats: one per process


def auto_nlist(n_keys: int) -> int:
    """Default list count: 2·√n, but at least 39 keys per list (faiss's k-means minimum)."""
    return max(1, min(round(2 * math.sqrt(n_keys)), n_keys // 39))


def check_nlist(owner: str, nlist: int, n_keys: int) -> None:
    """Refuse more k-means lists than keys (``nlist`` 0: the auto rule's), naming the index that asked for them (one
    whose top-k is an IVF: its own name, not ivf's)."""
    if (nlist := nlist or auto_nlist(n_keys)) > n_keys:
        raise IndexConfigError(f"{owner}: nlist={nlist} is larger than the number of keys ({n_keys})")


class IVFIndex(Index):
    """faiss IVF-Flat with inner product; nprobe = nlist is exhaustive and exact."""

    name = "ivf"
    restores_exactly = True  # tests/test_build_processes.py
    build_params = {
        "nlist": Param(0, 0, 1 << 20, help="number of k-means lists; 0 = auto (2·√n, ≥39 keys per list)"),
        "seed": Param(1234, 0, 2**31 - 1, help="k-means seed"),
    }
    search_params = {"nprobe": Param(8, 1, 1 << 20, help="lists probed per query (clipped to nlist)")}
    search_grid = {"nprobe": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)}
    auto_rules = {"nlist": "2026-11-29"}  # auto_nlist

    def check_keys(self, n_keys: int) -> None:
        check_nlist(self._owner(), self.params["nlist"], n_keys)

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        nlist = self.params["nlist"] or auto_nlist(len(keys))
        quantizer = faiss.IndexFlatIP(keys.shape[1])
        index = faiss.IndexIVFFlat(quantizer, keys.shape[1], nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = self.params["seed"]
        index.train(keys)
        index.add(keys)
        self._set(index)

    def _set(self, index: faiss.IndexIVFFlat) -> None:
        self._index = index
        self.nlist = index.nlist

    def list_sizes(self) -> np.ndarray:
        """Number of keys in each inverted list, read from faiss's invlists."""
        invlists = self._index.invlists
        return np.array([invlists.list_size(i) for i in range(self.nlist)], dtype=np.int64)

    @property
    def nbytes(self) -> int:
        """The centroids and faiss's lists as allocated: each list's keys and ids (8 bytes each) at the capacity of a
        vector filled one entry at a time (faiss's ``add_core``), up to twice their size."""
        return self.nlist * self.key_bytes() + int(filled_one_by_one(self.list_sizes()).sum()) * (self.key_bytes() + 8)

    def _search(self, queries: np.ndarray, k: int, nprobe: int):
        nprobe = min(nprobe, self.nlist)
        coarse_scores, probed = self._index.quantizer.search(queries, nprobe)
        listed = self.list_sizes()[probed].sum(axis=1)
        n_scanned = self.nlist + listed
        with _STATS:
            self._index.nprobe = nprobe  # faiss's wrapper checks the assignment width against it
            faiss.cvar.indexIVF_stats.reset()
            scores, ids = self._index.search_preassigned(queries, k, probed, coarse_scores)
            ndis = faiss.cvar.indexIVF_stats.ndis
        if ndis != int(n_scanned.sum()) - self.nlist * len(queries):
            raise RuntimeError("IVF scan count disagrees with faiss indexIVF_stats.ndis")
        ids, scores = pad_topk(ids, scores)
        return ids, scores, n_scanned, n_scanned * self.key_bytes() + 8 * listed

    def grid(self) -> list[dict]:
        # Clip to nlist and end on nprobe = nlist, so the top of every sweep is exhaustive.
        values = sorted({min(v, self.nlist) for v in self.search_grid["nprobe"]} | {self.nlist})
        return [{"nprobe": v} for v in values]

    def max_scanned(self) -> int:
        return self.n_keys + self.nlist

    def _add(self, keys: np.ndarray) -> None:
        self._index.add(keys)

    def _arrays(self) -> dict[str, np.ndarray]:
        # Plain arrays, not faiss's own binary format: its C++ reader trusts the file's sizes and offsets, and a saved
        # index is a file people exchange. The lists are rebuilt in id order on load, as build and add fill them.
        invlists, d = self._index.invlists, self.dim
        keys = np.empty((self.n_keys, d), np.float32)
        lists = np.empty(self.n_keys, np.int64)
        for i in range(self.nlist):
            size = invlists.list_size(i)
            if size:
                ids = faiss.rev_swig_ptr(invlists.get_ids(i), size)
                keys[ids] = faiss.rev_swig_ptr(invlists.get_codes(i), size * d * 4).view(np.float32).reshape(size, d)
                lists[ids] = i
        return {"centroids": self._index.quantizer.reconstruct_n(0, self.nlist), "keys": keys, "lists": lists}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        refuse_faiss_payload(arrays)
        centroids = expect(arrays, "centroids", np.float32, (None, self.dim), finite=True)
        keys = expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True)
        nlist = len(centroids)
        if not 1 <= nlist <= self.n_keys or self.params["nlist"] not in (0, nlist):
            raise IndexConfigError(f"array 'centroids' holds {nlist} lists for {self.n_keys} keys (nlist "
                                   f"{self.params['nlist'] or 'auto'})")
        lists = expect_ids("lists", expect(arrays, "lists", np.int64, (self.n_keys,)), 0, nlist)
        quantizer = faiss.IndexFlatIP(self.dim)
        quantizer.add(centroids)
        index = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.is_trained = True
        add_preassigned(index, keys, lists)
        self._set(index)
