"""Copy hints: where in the context a decode step is likely to copy from, as extra entry points of its search.

A query-aware graph is trained on the prefill's queries, and a decode query that copies from the context
(a needle's digits, a passkey, a quoted line) is unlike all of them: the prefill never saw the text it
copies being continued, so no training list holds the keys such a query wants, and a beam from the hubs
never reaches them (BENCHMARKS.md "Scale": at 128K the heads that copy find ~half of a digit step's top-10
keys). Those keys are where induction heads look: the token after an earlier occurrence of the current
context. So each step the decoder finds the longest suffix (up to ``n_max`` tokens) of the sequence so far
that occurred before, and hands the positions right after its latest ``cap`` occurrences to the search as
extra entry points (prompt-lookup decoding uses the same match to draft tokens), with those of the ``carry``
steps before moved on (:class:`CopyHints`). They cost at most ``cap``·(1 + ``carry``) inner products per head,
counted as scanned; the search goes on from them as from any entry point, so a wrong hint costs its inner
product and nothing else.
"""

from __future__ import annotations

import numpy as np

N_MAX = 3  # longest suffix matched: 4 found the same keys on the 128K niah dump's copying heads, 1-2 match too often
CARRY = 2  # earlier steps whose continuations a step's hints carry on (cap·(1 + CARRY) hints at most)


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
    """The copy hints of one generation: positions for the next step's searches (``cap`` 0: none).

    A step's hints are its own continuations and those of the ``carry`` steps before it, moved on by one position per
    step: a copy goes on where it was even after the model writes a token the text does not have there (": \n"
    where the needle reads ": "), when the context then matches nowhere."""

    def __init__(self, cap: int, n_max: int = N_MAX, carry: int = CARRY) -> None:
        self.cap = cap
        self.n_max = n_max
        self.carry = carry
        self.positions: np.ndarray | None = None
        self._tokens = np.empty(0, np.int64)  # the sequence so far (its own copy: a list → array per step costs ms at 128K)
        self._n = 0
        self._recent: list[np.ndarray] = []  # the continuations of the last steps, newest first

    def update(self, ids: list[int]) -> None:
        """Set the hints for the step whose input is the last of ``ids`` (the sequence so far: the previous call's plus
        the tokens appended since; one token per call carries the earlier steps' continuations on)."""
        if self.cap <= 0:
            return
        n = len(ids)
        if n > len(self._tokens):
            grown = np.empty(max(n, 2 * len(self._tokens)) + 64, np.int64)
            grown[:self._n] = self._tokens[:self._n]
            self._tokens = grown
        self._tokens[self._n:n] = ids[self._n:]
        fresh = continuations(self._tokens[:n], self.n_max, self.cap)
        self._recent = [fresh, *self._recent[:self.carry]] if n == self._n + 1 else [fresh]
        self._n = n
        moved = np.concatenate([p + age for age, p in enumerate(self._recent)])
        moved = moved[moved < n]
        _, first = np.unique(moved, return_index=True)
        self.positions = moved[np.sort(first)]

    def rows(self, first: int) -> np.ndarray | None:
        """The hints as rows of a CPU store whose row 0 is position ``first`` (the window's sink size)."""
        if self.positions is None:
            return None
        rows = self.positions - first
        return rows[rows >= 0]
