"""Quest-style page selection (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context
LLM Inference", ICML 2024).

The keys, in position order, are cut into pages of ``page_size`` consecutive keys; each page keeps
the per-dimension minimum and maximum of its keys. A query's upper bound on any key of a page is
``Σᵢ max(qᵢ·minᵢ, qᵢ·maxᵢ) = q⁺·max + q⁻·min`` (q⁺, q⁻ the positive and negative parts of q). The
pages of largest bound holding ``budget`` tokens (``ceil(budget / page_size)`` pages) are read and
their keys scored exactly; the top-k of those is returned.

Counting: a page bound costs two d-dimensional products (q⁺ with the max row, q⁻ with the min row),
so ``n_scanned = 2 · n_pages + keys scored``; ``bytes_read = 8·d · n_pages`` (both float32 rows of
every page) ``+ 4·d · keys scored``.
"""

from __future__ import annotations

import math

import numpy as np

from anns_lab.indexes import KeyRowsIndex, Param
from anns_lab.indexes.growable import Growable
from anns_lab.indexes.persist import expect

BUDGETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)


def page_bounds(keys: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-page (n_pages, d) minimum and maximum of ``keys`` cut into pages of ``page_size`` rows (last may be short)."""
    n, d = keys.shape
    n_pages = -(-n // page_size)
    pad = n_pages * page_size - n
    lo = np.concatenate([keys, np.full((pad, d), np.inf, np.float32)]).reshape(n_pages, page_size, d).min(axis=1)
    hi = np.concatenate([keys, np.full((pad, d), -np.inf, np.float32)]).reshape(n_pages, page_size, d).max(axis=1)
    return np.ascontiguousarray(lo), np.ascontiguousarray(hi)


class QuestPages(KeyRowsIndex):
    """Quest pages: per-page key min/max, the pages of largest upper bound read and their keys scored exactly."""

    build_params = {"page_size": Param(16, 1, 4096, help="keys per page (Quest: 16)")}
    search_params = {"budget": Param(1024, 1, 1 << 30, help="tokens read: the ceil(budget/page_size) pages of largest bound")}
    search_grid = {"budget": BUDGETS}

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        self._hold_keys(keys)
        self._min, self._max = (Growable.of(b) for b in page_bounds(keys, self.params["page_size"]))

    @property
    def n_pages(self) -> int:
        return self._min.n

    def bounds(self, q: np.ndarray) -> np.ndarray:
        """Upper bound of q·k over each page's keys (n_pages,): q⁺·max + q⁻·min."""
        return self._max.table @ np.maximum(q, 0) + self._min.table @ np.minimum(q, 0)

    def _search(self, queries: np.ndarray, k: int, budget: int):
        size, d = self.params["page_size"], queries.shape[1]
        n_read = min(math.ceil(budget / size), self.n_pages)
        ids = np.full((len(queries), k), -1, np.int64)
        scores = np.full((len(queries), k), -np.inf, np.float32)
        scored = np.zeros(len(queries), np.int64)
        for row, q in enumerate(queries):  # one query at a time: a batch gives what single queries give
            pages = np.argsort(-self.bounds(q), kind="stable")[:n_read]
            cand = (pages[:, None] * size + np.arange(size)).ravel()
            cand = cand[cand < len(self._keys)]
            s = self._keys[cand] @ q
            top = np.argsort(-s, kind="stable")[:k]
            ids[row, : len(top)], scores[row, : len(top)] = cand[top], s[top]
            scored[row] = len(cand)
        n_scanned = 2 * self.n_pages + scored
        return ids, scores, n_scanned, 8 * d * self.n_pages + 4 * d * scored

    def grid(self) -> list[dict]:
        # Budgets past the last page read every key: end on the one that reads them all (exact search).
        full = self.n_pages * self.params["page_size"]
        return [{"budget": b} for b in sorted({min(b, full) for b in self.search_grid["budget"]} | {full})]

    def max_scanned(self) -> int:
        return self.n_keys + 2 * self.n_pages

    def _add(self, keys: np.ndarray) -> None:
        # New keys fill the last page, then new pages: only the pages from the last old one on change.
        size = self.params["page_size"]
        first = (len(self._keys) // size) * size
        lo, hi = page_bounds(self._append_keys(keys)[first:], size)
        for bound, new in ((self._min, lo), (self._max, hi)):  # the last old page's bound is written again
            bound.resize(first // size)
            bound.append(new)

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        self._build(expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True), None)  # from a file
