"""The search both retrievers share: partial scores of every key, the ``budget`` best of them scored exactly.

Counting, in full-dimension products and float32 bytes as every index of the lab: a query's partial pass reads r of
the d numbers of each of n keys, ``ceil(n·r/d)`` products' worth (as pqcache counts its codeword products) and 4·r·n
bytes; each candidate is then scored exactly, one product and 4·d bytes. Positions are the ids: none is read.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from anns_lab.indexes import KeyRowsIndex, Param
from anns_lab.indexes.growable import Growable
from anns_lab.indexes.key_store import KeyRows
from anns_lab.indexes.scan_rows import largest, score_rows, select_largest

BUDGETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)
RANKS = (0.125, 0.25, 0.5)

RANK = Param(0.25, 1e-6, 1.0, help="share r/d of the dimensions the partial scores use (r = max(1, ⌊rank·d + ½⌋))")
BUDGET = Param(1024, 1, 1 << 30, help="keys scored exactly: those of the best partial scores")


def columns(table: np.ndarray) -> Growable:
    """A (d, n) float32 table grown by columns (the keys transposed, or their coordinates): an ``add`` writes its own
    columns where a new (d, n) table cost O(n·d) and two tables at once. The kernels take its ``buf`` whole
    (C-contiguous, read up to the keys they are given): numba typed a view of its columns as a strided array and left
    its partial pass unvectorised, 1.5-1.8x slower a search."""
    return Growable.of(table, axis=1, dtype=np.float32)


def transposed(rows: KeyRows, n: int) -> Growable:
    """Rows ``[0, n)`` of a store's head, transposed, at least: one table per head of the store, shared by every index
    built on it (double-sparsity's query heads of a GQA group in the decoder: one copy where each held its own),
    grown here to ``n`` columns; the columns past an index's keys are rows it has not been given yet, never read."""
    def grow(table: Growable) -> None:
        if table.n < n:
            table.append(rows.view(n)[table.n:].T)

    return rows.shared("transposed", lambda: columns(rows.view(n).T), grow)


class TransposedKeys(KeyRowsIndex):
    """What sparq and double-sparsity share: the keys and their transposed copy (:func:`transposed`: one per head of
    the key store, grown by each add), a grid of ranks and budgets, the budget calibrated, two reads of each key at
    most. A subclass chooses each query's channels and searches with :func:`search_channels` on ``_by_dim.buf``."""

    search_params = {"rank": RANK, "budget": BUDGET}
    search_grid = {"rank": RANKS, "budget": BUDGETS}
    calibrated_by = "budget"  # the decoder raises the keys scored exactly, at the rank given

    def _hold_transposed(self, keys: np.ndarray) -> None:
        """Hold ``keys`` (from ``_build`` or ``_restore``) and their transpose, (d, n), r rows of it read a query."""
        self._hold_keys(keys)
        self._by_dim = transposed(self._rows, len(keys))

    def grid(self) -> list[dict]:
        return grid(self.n_keys)

    def max_scanned(self) -> int:
        return 2 * self.n_keys

    def _add(self, keys: np.ndarray) -> None:
        self._append_keys(keys)
        self._by_dim = transposed(self._rows, self.n_keys + len(keys))


def channels(rank: float, dim: int) -> int:
    """r: the dimensions a partial score uses."""
    return max(1, min(dim, math.floor(rank * dim + 0.5)))  # halves up (Python's round takes them to even)


def partial_cost(n: int, r: int, d: int) -> tuple[int, int]:
    """(products, bytes) of one query's partial pass over ``n`` keys."""
    return math.ceil(n * r / d), 4 * r * n


def search(table: np.ndarray, dims: np.ndarray, weights: np.ndarray, keys: np.ndarray, queries: np.ndarray,
           budget: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each query's partial scores (``weights[i]`` times rows ``dims[i]`` of ``table`` (d', ≥ n: its first n columns
    read, C-contiguous for numba's vectorised pass), summed), its ``budget`` keys of largest partial score scored
    exactly on ``keys`` (n, d), their top-``k``: (ids, scores, keys scored)."""
    nq = len(queries)
    ids = np.full((nq, k), -1, np.int64)
    scores = np.full((nq, k), -np.inf, np.float32)
    scored = np.zeros(nq, np.int64)
    _search(table, np.ascontiguousarray(dims, np.int64), np.ascontiguousarray(weights, np.float32), keys,
            np.ascontiguousarray(queries, np.float32), budget, ids, scores, scored)
    return ids, scores, scored


def search_channels(by_dim: np.ndarray, dims: np.ndarray, keys: np.ndarray, queries: np.ndarray, budget: int,
                    k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each query's partial scores on its channels ``dims`` (rows of the transposed keys ``by_dim``, (d, ≥ n)), the
    ``budget`` best scored exactly: (ids, scores, n_scanned, bytes_read), counted as the module says (sparq's and
    double-sparsity's search: the query's own channels, or its head's)."""
    n, d = keys.shape
    ids, scores, scored = search(by_dim, dims, np.take_along_axis(queries, dims, axis=1), keys, queries, budget, k)
    products, nbytes = partial_cost(n, dims.shape[1], d)
    return ids, scores, products + scored, nbytes + 4 * d * scored


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})  # sums in SIMD lanes: finite float32 throughout
def _search(table, dims, weights, keys, queries, budget, ids, scores, scored):
    """:func:`search` on one thread, without BLAS (its team spun beside the decoder's torch: 35 CPU ms of a token's
    search took 93 ms of wall time at Gemma-3 8K) and without gathered copies of the rows or the candidates."""
    n = keys.shape[0]
    k = ids.shape[1]
    c = min(budget, n)
    approx = np.empty(n, np.float32)
    exact = np.empty(c, np.float32)
    for i in range(len(queries)):
        approx[:] = 0.0
        for a in range(dims.shape[1]):  # row by row: each read whole, in order
            w = weights[i, a]
            row = table[dims[i, a]]
            for j in range(n):
                approx[j] += w * row[j]
        cand = select_largest(approx, c)  # by id: the exact scores' ties go to the lower id
        score_rows(keys, cand, queries[i], exact)
        top = largest(exact, min(k, c))
        for t in range(len(top)):
            ids[i, t] = cand[top[t]]
            scores[i, t] = exact[top[t]]
        scored[i] = c


def grid(n_keys: int) -> list[dict]:
    """Each rank crossed with the budgets up to every key (exact search ends each rank's run)."""
    budgets = sorted({min(b, n_keys) for b in BUDGETS} | {n_keys})
    return [{"rank": r, "budget": b} for r in RANKS for b in budgets]
