"""The search both retrievers share: partial scores of every key, the ``budget`` best of them scored exactly.

Counting, in full-dimension products and float32 bytes as every index of the lab: a query's partial pass reads r of
the d numbers of each of n keys, ``ceil(n·r/d)`` products' worth (as pqcache counts its codeword products) and 4·r·n
bytes; each candidate is then scored exactly, one product and 4·d bytes. Positions are the ids: none is read.
"""

from __future__ import annotations

import math

import numpy as np

from anns_lab.indexes import Param

BUDGETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)
RANKS = (0.125, 0.25, 0.5)

RANK = Param(0.25, 1e-6, 1.0, help="share r/d of the dimensions the partial scores use (r = max(1, ⌊rank·d + ½⌋))")
BUDGET = Param(1024, 1, 1 << 30, help="keys scored exactly: those of the best partial scores")


def channels(rank: float, dim: int) -> int:
    """r: the dimensions a partial score uses."""
    return max(1, min(dim, math.floor(rank * dim + 0.5)))  # halves up (Python's round takes them to even)


def partial_cost(n: int, r: int, d: int) -> tuple[int, int]:
    """(products, bytes) of one query's partial pass over ``n`` keys."""
    return math.ceil(n * r / d), 4 * r * n


def best_exact(q: np.ndarray, keys: np.ndarray, partial: np.ndarray, budget: int, k: int):
    """The top-``k`` by exact score among the ``budget`` keys of largest ``partial`` score: (ids, scores, scored)."""
    n = len(keys)
    c = min(budget, n)
    cand = np.arange(n) if c == n else np.sort(np.argpartition(-partial, c - 1)[:c])
    s = keys[cand] @ q
    top = np.argsort(-s, kind="stable")[:k]
    return cand[top], s[top], c


def grid(n_keys: int) -> list[dict]:
    """Each rank crossed with the budgets up to every key (exact search ends each rank's run)."""
    budgets = sorted({min(b, n_keys) for b in BUDGETS} | {n_keys})
    return [{"rank": r, "budget": b} for r in RANKS for b in budgets]
