"""HNSW-NGFix*: an HNSW base graph repaired where the training queries find it hard (Hua et al., "Dynamically Detect
and Fix Hardness for Efficient Approximate Nearest Neighbor Search", SIGMOD 2026, arXiv 2510.22316; code
yuhuifishash/NGFix).

Build, on keys K (n, d) and training queries Q (m, d) (kernels in :mod:`.fixing`):

1. **Base graph**: HNSW's bottom layer (hnswlib, space ``ip``, ``2·M`` links per key), searched from one entry point,
   the key of largest inner product with the keys' mean (the reference sets it so every 100,000 inserts, i.e. for its
   datasets of millions; below that its entry stays the first key). hnswlib builds it with its upper layers, which the
   search does not use (the reference inserts into the bottom layer alone).
2. **NGFix**, per training query with its exact top-``2·N`` keys (``fixes``: N = 100, then N = 10 for the nearest,
   as the reference's build runs): the *escape hardness* of the pair (i, j) of its first N keys is the least rank h
   such that a path from i to j runs through keys of rank ≤ h only (within the top 2·N; none: infinite). A pair of
   hardness above N is a defect; the defects, the closest pairs of keys first, get an edge i → j unless the edges
   added before already join them. A key holds at most ``MEX`` such edges; a harder one replaces its easiest.
3. **RFix**, per training query: when a search of beam 10 from the entry point ends at a key u worse than the
   query's 10th, u gets edges (at most 6, by HNSW's occlusion rule) to the keys better than u among the ``rfix_ef``
   best that a search of that beam from u scans (the reference: every key it scans that is better than u): the way
   from where searches get stuck to the query's neighbourhood. A repair edge a row holds already is not added again.

The training queries are at most ``max_train`` (auto as roargraph's: max(2048, n/4), an even stride), their lists
exact (faiss's kNN, or given to ``build`` as ``train_topk``: computed where they are cheap, the decoder's
``device_lists`` on the accelerator), taken one after the other (the reference: on threads in no fixed order, under locks), so a build
is deterministic.

Search: the lab's best-first search (``graph.search``) with beam ``L`` from the entry point over each key's repair
edges then its base links; with ``L`` < k it returns the k best of every key scanned, as roargraph's (the reference's
search widens the beam to k and stops after ``L`` expansions instead). ``n_scanned`` counts every inner
product, the entry point's included; ``bytes_read`` as every graph index's (``graph.search.bytes_read``).

``add`` inserts the new keys into hnswlib's graph (the reference: into the bottom layer, HNSW's rule) and keeps every
repair edge; it repairs nothing (no queries). ``save`` writes hnswlib's own file format as bytes, the keys, the
repair edges and their hardness, and the entry point (no pickle).

Not modelled: the reference's approximate lists (``AKNN``, from its own graph) and its RaBitQ codes; its build with
exact lists is this one's.
"""

from __future__ import annotations

import numba
import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.indexes.base import Param
from anns_lab.indexes.graph import Graph
from anns_lab.indexes.graph.search import bytes_read, search_batch
from anns_lab.indexes.hnsw import HNSWIndex
from anns_lab.indexes.persist import expect, expect_ids
from anns_lab.indexes.roargraph import auto_train, subsample
from anns_lab.indexes.topk import topk_ip

from anns_lab_ngfix.fixing import EH_INF, RFIX_EH, RFIX_NQ, fix_graph

BEAMS = (10, 15, 20, 30, 40, 60, 80, 100, 150, 200, 300, 400, 600, 800, 1200, 1600)


class NGFixIndex(HNSWIndex):
    """HNSW-NGFix*: HNSW's bottom layer with edges added where the training queries' neighbourhoods are hard to search."""

    name = "ngfix"
    build_params = {
        **HNSWIndex.build_params,
        "M": Param(16, 2, 128, help="HNSW's M: the base graph (its bottom layer) has 2·M links per key (the reference: 16)"),
        "ef_construction": Param(200, 1, 4096, help="hnswlib's beam while building the base graph (the reference: 500)"),
        "MEX": Param(48, 1, 250, help="repair edges per key at most (the reference: 48)"),
        "fix_lists": Param(100, 1, 100, help="N of NGFix's first pass: the pairs of a training query's top N keys "
                                             "are checked within its top 2·N (the reference: 100, then 10; at most 100, "
                                             "as its lists of 200)"),
        "fix_near": Param(10, 0, 100, help="N of the second pass, on the nearest keys (0 = none; the reference: 10)"),
        "rfix_ef": Param(1500, 0, 1 << 16, help="RFix's beam from a stuck key (0 = no RFix; the reference: 1500)"),
        "max_train": Param(0, 0, 1 << 30, help="training queries used at most, an even stride (0 = auto: max(2048, n/4), "
                                               "roargraph's rule)"),
    }
    search_params = {"L": Param(100, 1, 1 << 16, help="beam width (L < k: the k best of every key scanned)")}
    search_grid = {"L": BEAMS}
    auto_rules = {"max_train": "2026-12-01"}
    uses_train_queries = True
    accepts_train_topk = True

    def train_rows(self, n_keys: int, m: int) -> np.ndarray | None:
        return subsample(m, self.params["max_train"] or auto_train(n_keys))

    @classmethod
    def train_topk_width(cls, n_keys: int, **build_params) -> int:
        """Top keys per training query a build reads: 2 × the longer NGFix list (the hardness is judged within them)."""
        p = cls(**build_params).params
        return min(n_keys, 2 * max(p["fix_lists"], p["fix_near"]))

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None, train_topk: np.ndarray | None = None) -> None:
        super()._build(keys, None)  # hnswlib's graph, through _set
        rows = self.train_rows(len(keys), len(train_queries))
        queries = np.ascontiguousarray(train_queries if rows is None else train_queries[rows], np.float32)
        fixes = np.array([n for n in (self.params["fix_lists"], self.params["fix_near"]) if n > 0], np.int64)
        width = type(self).train_topk_width(len(keys), **self.params)
        if train_topk is None:
            gt = np.ascontiguousarray(topk_ip(queries, keys, width), np.int64)
        elif train_topk.shape[1] < width:
            raise IndexConfigError(f"{self._owner()}: train_topk has {train_topk.shape[1]} keys per query; this build "
                                   f"needs {width} ({type(self).__name__}.train_topk_width({len(keys)}))")
        else:  # computed elsewhere, e.g. on the accelerator during the prefill (decode.device_lists)
            gt = np.ascontiguousarray((train_topk if rows is None else train_topk[rows])[:, :width], np.int64)
        self.entry = int(np.argmax(keys @ keys.mean(axis=0, dtype=np.float64).astype(np.float32)))
        nbrs, degree, nfix, eh = self._combined(self.graph.nbrs, self.graph.degree)
        slots = len(keys) + max(self.params["rfix_ef"], RFIX_NQ)  # graph.utils.heap_slots of either RFix search
        ws = (np.zeros(len(keys), np.int32), np.empty(slots, np.float32), np.empty(slots, np.int64),
              np.empty(0, np.int64), np.empty(0, np.float32))
        self.n_fixed = fix_graph(self._keys, nbrs, degree, nfix, eh, queries, gt, fixes, self.entry,
                                 self.params["rfix_ef"], RFIX_NQ, ws)
        self._set_fixes(nbrs, degree, nfix, eh)

    def _combined(self, base_nbrs: np.ndarray, base_degree: np.ndarray, fix: np.ndarray | None = None,
                  fix_eh: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        """One adjacency of width MEX + 2·M: each row's repair edges ``fix`` (-1 padded; none when None), then its
        base links; with the rows' degree, repair count and the repair edges' hardness (n, MEX)."""
        n, mex = len(base_nbrs), self.params["MEX"]
        nfix = np.zeros(n, np.int32) if fix is None else (fix >= 0).sum(axis=1).astype(np.int32)
        nbrs = np.full((n, mex + base_nbrs.shape[1]), -1, np.int32)
        eh = np.zeros((n, mex), np.int32) if fix_eh is None else fix_eh.astype(np.int32)
        if fix is not None:
            nbrs[:, :mex] = fix
        cols = nfix[:, None] + np.arange(base_nbrs.shape[1])  # each base link right after the row's repair edges
        np.put_along_axis(nbrs, cols, base_nbrs, axis=1)
        return nbrs, (nfix + base_degree).astype(np.int32), nfix, eh

    def _set_fixes(self, nbrs: np.ndarray, degree: np.ndarray, nfix: np.ndarray, eh: np.ndarray) -> None:
        """Keep the searched adjacency; drop the base graph's arrays as extracted from hnswlib (upper layers included:
        the search starts at the one entry point), keeping the size of what hnswlib holds for ``add`` and ``save``."""
        self.nbrs, self.degree = nbrs, degree
        self.nfix, self.eh = nfix.astype(np.int32), eh
        self.library_bytes = self.graph.library_bytes
        del self.graph

    def fix_edges(self) -> tuple[np.ndarray, np.ndarray]:
        """The repair edges (n, MEX) int32, newest first, -1 padded, and their escape hardness (n, MEX) (0 where none)."""
        mex = self.params["MEX"]
        used = np.arange(mex) < self.nfix[:, None]
        return np.where(used, self.nbrs[:, :mex], -1).astype(np.int32), np.where(used, self.eh, 0)

    def _add(self, keys: np.ndarray) -> None:
        fix, fix_eh = self.fix_edges()
        super()._add(keys)  # hnswlib inserts them; its bottom layer becomes the new base links
        n_new = len(keys)
        fix = np.vstack([fix, np.full((n_new, fix.shape[1]), -1, np.int32)])
        fix_eh = np.vstack([fix_eh, np.zeros((n_new, fix_eh.shape[1]), fix_eh.dtype)])
        self._set_fixes(*self._combined(self.graph.nbrs, self.graph.degree, fix, fix_eh))

    def _search(self, queries: np.ndarray, k: int, L: int):
        entries = np.full((len(queries), 1), self.entry, np.int64)
        ids, scores, scanned, words = search_batch(Graph(self._keys, self.nbrs, self.degree), queries, entries, L, k,
                                                   numba.get_num_threads())
        return ids, scores, scanned, bytes_read(self.dim, scanned, words, 1)

    def max_scanned(self) -> int:
        return self.n_keys

    @property
    def nbytes(self) -> int:
        """The searched adjacency, degrees, repair counts and hardness, the keys, and the hnswlib index kept for
        ``add`` and ``save`` (its links and a second copy of the vectors)."""
        keys = self._rows.held(self.n_keys)
        return sum(a.nbytes for a in (keys, self.nbrs, self.degree, self.nfix, self.eh)) + self.library_bytes

    def _arrays(self) -> dict[str, np.ndarray]:
        fix, fix_eh = self.fix_edges()
        return {**super()._arrays(), "fix_edges": fix, "fix_hardness": fix_eh.astype(np.int32),
                "entry": np.array([self.entry], np.int64)}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        super()._restore(arrays)
        n, mex = self.n_keys, self.params["MEX"]
        fix = expect(arrays, "fix_edges", np.int32, (n, mex))
        fix_eh = expect(arrays, "fix_hardness", np.int32, (n, mex))
        entry = expect(arrays, "entry", np.int64, (1,))
        expect_ids("fix_edges", fix[fix >= 0], 0, n)
        expect_ids("entry", entry, 0, n)
        used = fix >= 0
        if (used[:, 1:] & ~used[:, :-1]).any() or (fix < -1).any():
            raise IndexConfigError("array 'fix_edges' is not rows of key ids padded at their ends with -1")
        # A repair joins a pair harder than its pass's N (a finite hardness is a rank within the top 2·N) or is RFix's.
        passes = [size for size in (self.params["fix_lists"], self.params["fix_near"]) if size > 0]
        low, span = min(passes), 2 * max(passes)
        held = fix_eh[used]
        finite = (held > low) & (held < span)
        if (fix_eh[~used] != 0).any() or not (finite | np.isin(held, (RFIX_EH, EH_INF))).all():
            raise IndexConfigError(f"array 'fix_hardness' holds values no build writes (above {low} and below {span}, "
                                   f"{RFIX_EH} or {EH_INF} where an edge is, 0 where none)")
        if (fix == np.arange(n)[:, None]).any():
            raise IndexConfigError("array 'fix_edges' links a key to itself, which no build does")
        self.entry = int(entry[0])
        self._set_fixes(*self._combined(self.graph.nbrs, self.graph.degree, fix, fix_eh))
