"""Copy hints: where in the context a decode step is likely to copy from, as extra entry points of its search.

A query-aware graph is trained on the prefill's queries, and a decode query that copies from the context
(a needle's digits, a passkey, a quoted line) is unlike all of them: the prefill never saw the text it
copies being continued, so no training list holds the keys such a query wants, and a beam from the hubs
never reaches them (BENCHMARKS.md "Scale": at 128K the heads that copy find ~half of a digit step's top-10
keys). Those keys are where induction heads look: the token after an earlier occurrence of the current
context. So each step the decoder finds the longest suffix (up to ``n_max`` tokens) of the sequence so far
that occurred before, and hands the positions right after its latest ``cap`` occurrences to the search as
extra entry points (prompt-lookup decoding uses the same match to draft tokens). They cost ``cap`` inner
products per head, counted as scanned; the search goes on from them as from any entry point, so a wrong
hint costs its inner product and nothing else.
"""

from __future__ import annotations

import numpy as np

N_MAX = 3  # longest suffix matched: 4 found the same keys on the 128K niah dump's copying heads, 1-2 match too often


def continuations(tokens: np.ndarray, n_max: int = N_MAX, cap: int = 8) -> np.ndarray:
    """Positions right after the latest ``cap`` earlier occurrences of the longest suffix of ``tokens`` (at most
    ``n_max`` tokens) that occurs before, latest first; empty when not even the last token occurred before."""
    tokens = np.asarray(tokens)
    n = len(tokens)
    if n < 2:
        return np.empty(0, np.int64)
    ends = np.flatnonzero(tokens[:n - 1] == tokens[n - 1])  # where an earlier occurrence of each suffix would end
    for length in range(min(n_max, n - 1), 0, -1):
        ok = ends >= length - 1
        for j in range(1, length):
            ok[ok] = tokens[ends[ok] - j] == tokens[n - 1 - j]
        if ok.any():
            return (ends[ok][::-1][:cap] + 1).astype(np.int64)
    return np.empty(0, np.int64)


class CopyHints:
    """The copy hints of one generation: positions for the next step's searches (``cap`` 0: none)."""

    def __init__(self, cap: int, n_max: int = N_MAX) -> None:
        self.cap = cap
        self.n_max = n_max
        self.positions: np.ndarray | None = None
        self._tokens = np.empty(0, np.int64)  # the sequence so far (its own copy: a list → array per step costs ms at 128K)
        self._n = 0

    def update(self, ids: list[int]) -> None:
        """Set the hints for the step whose input is the last of ``ids`` (the sequence so far: the previous call's plus
        the tokens appended since)."""
        if self.cap <= 0:
            return
        if len(ids) > len(self._tokens):
            grown = np.empty(max(len(ids), 2 * len(self._tokens)) + 64, np.int64)
            grown[:self._n] = self._tokens[:self._n]
            self._tokens = grown
        self._tokens[self._n:len(ids)] = ids[self._n:]
        self._n = len(ids)
        self.positions = continuations(self._tokens[:self._n], self.n_max, self.cap)

    def rows(self, first: int) -> np.ndarray | None:
        """The hints as rows of a CPU store whose row 0 is position ``first`` (the window's sink size)."""
        if self.positions is None:
            return None
        rows = self.positions - first
        return rows[rows >= 0]
