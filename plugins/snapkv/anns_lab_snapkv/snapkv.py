"""SnapKV's key selection (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024;
code FasterDecoding/SnapKV).

At the end of the prefill the prompt's last ``window`` queries (the observation window) attend to the keys before
them; each key's votes are its softmax weights summed over those queries, smoothed along the positions by a pooling
of ``kernel`` keys (average, zeros beyond the ends counted, or maximum), and the keys of most votes are kept. Every
later query attends to the kept keys alone: the selection is made once, whatever the query, where the lab's other
indexes choose per query. Here the ranking is kept whole, so that ``budget`` (the kept keys) is a search parameter
and a sweep reads every budget from one build; a search scores the ``budget`` best-voted keys exactly, and every key
added after the build (SnapKV keeps the generated tokens), and returns their top-k.

Not modelled: SnapKV keeps the observation window's own keys (the lab's static window holds the prompt's last 512);
its softmax runs over the whole prompt, here over the keys the index holds (the static window's are never passed to
an index), which weighs a query whose attention stays in the window as much as one that reaches back; the scale is
1/√d unless ``scale`` is given (Llama, SmolLM2, Gemma-3's 256-dimensional heads alike). The observation queries are
the last rows of the training queries, at their own positions whatever ``--train-positions`` says
(``Index.own_positions``). The GQA rule is per query head (SnapKV's, after ``repeat_kv``), as for every index of the
lab. In the decoder a step attends the top-k (``--topk``) of the keys a search scores: SnapKV attends every kept key,
so ``--topk`` at least ``budget`` runs it as its reference does.

Counting: the selection is the build's (``window`` products per key, made once); a search computes one product per
key it scores and reads 4·d + 8 bytes for it (its float32 row and its int64 id in the kept list), so
``n_scanned`` = ``min(budget, keys built)`` + keys added and ``bytes_read`` = (4·d + 8) × that.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from anns_lab.errors import IndexConfigError
from anns_lab.indexes import KeyRowsIndex, Param
from anns_lab.indexes.persist import expect, expect_ids
from anns_lab.indexes.scan_rows import largest, score_rows

BUDGETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)
POOLINGS = ("avg", "max")
VOTE_BYTES = 64 << 20  # float64 weights of the window's queries over the keys held at once (the default's 32 rows: one
# block up to 256K keys)


def votes(keys: np.ndarray, window_queries: np.ndarray, scale: float) -> np.ndarray:
    """Each key's softmax weight summed over ``window_queries`` (float64, (n,)); each query's softmax over ``keys``.
    Read :data:`VOTE_BYTES` of weights at a time: a window of thousands over 128K keys is gigabytes at once."""
    total = np.zeros(len(keys))
    rows = max(1, VOTE_BYTES // (8 * max(1, len(keys))))
    for lo in range(0, len(window_queries), rows):
        logits = (window_queries[lo:lo + rows] @ keys.T).astype(np.float64) * scale
        logits -= logits.max(axis=1, keepdims=True)
        weights = np.exp(logits)
        weights /= weights.sum(axis=1, keepdims=True)
        total += weights.sum(axis=0)
    return total


def pooled(values: np.ndarray, kernel: int, pooling: str) -> np.ndarray:
    """``values`` smoothed over ``kernel`` neighbours (odd), centred, same length: the average with the zeros beyond the
    ends counted (torch's ``avg_pool1d`` with padding ``kernel // 2``) or the maximum (``max_pool1d``)."""
    half = kernel // 2
    fill = 0.0 if pooling == "avg" else -np.inf
    windows = np.lib.stride_tricks.sliding_window_view(np.pad(values, half, constant_values=fill), kernel)
    return windows.mean(axis=1) if pooling == "avg" else windows.max(axis=1)


def ranking(keys: np.ndarray, window_queries: np.ndarray, kernel: int, pooling: str, scale: float) -> np.ndarray:
    """Key ids by pooled votes, most first (ties: the lower id first): the order SnapKV keeps keys in."""
    return np.argsort(-pooled(votes(keys, window_queries, scale), kernel, pooling), kind="stable").astype(np.int64)


class SnapKV(KeyRowsIndex):
    """SnapKV: the keys the prompt's last queries attend to most, chosen once; each query searches them exactly."""

    build_params = {
        "window": Param(32, 1, 1 << 20, help="observation window: the last training queries that vote (SnapKV: 32)"),
        "kernel": Param(5, 1, 1023, help="keys pooled around each vote, odd (SnapKV: 5)"),
        "pooling": Param("avg", choices=POOLINGS, help="how the votes are pooled (SnapKV: avg)"),
        "scale": Param(0.0, 0.0, 1e6, help="softmax scale of the votes' q·k; 0 = 1/√d"),
    }
    search_params = {"budget": Param(1024, 1, 1 << 30, help="prompt keys kept: the most voted (keys added later "
                                                           "are always searched)")}
    search_grid = {"budget": BUDGETS}
    uses_train_queries = True
    own_positions = True  # the window scores the context as it attended it, at its own positions
    restores_exactly = True

    def __init__(self, **build_params) -> None:
        super().__init__(**build_params)
        if self.params["kernel"] % 2 == 0:
            raise IndexConfigError(f"{self._owner()}: parameter kernel={self.params['kernel']} must be odd (the pool is "
                                   "centred on each key)")

    def train_rows(self, n_keys: int, m: int) -> np.ndarray:
        return np.arange(max(0, m - self.params["window"]), m)

    def newest_train_queries(self) -> int:
        return self.params["window"]

    def _build(self, keys: np.ndarray, train_queries: np.ndarray) -> None:
        scale = self.params["scale"] or 1.0 / np.sqrt(keys.shape[1])
        window = train_queries[-self.params["window"]:]
        self._set_up(keys, ranking(keys, window, self.params["kernel"], self.params["pooling"], scale))

    def _set_up(self, keys: np.ndarray, order: np.ndarray) -> None:
        self._hold_keys(keys)
        self._order = order
        self._kept: dict[int, np.ndarray] = {}  # by budget: the ids searched, ascending

    def kept(self, budget: int) -> np.ndarray:
        """The ids a search at ``budget`` scores, ascending: the ``budget`` most voted and every key added since."""
        ids = self._kept.get(budget)
        if ids is None:
            built = len(self._order)
            ids = np.sort(np.concatenate([self._order[:budget], np.arange(built, self.n_keys, dtype=np.int64)]))
            if len(self._kept) >= 8:  # a sweep walks the grid; the decoder keeps one budget
                self._kept.clear()
            self._kept[budget] = ids
        return ids

    def _search(self, queries: np.ndarray, k: int, budget: int):
        cand = self.kept(budget)
        ids = np.full((len(queries), k), -1, np.int64)
        scores = np.full((len(queries), k), -np.inf, np.float32)
        _search(self._keys, cand, queries, ids, scores)
        scored = np.full(len(queries), len(cand), np.int64)
        return ids, scores, scored, (4 * self.dim + 8) * scored

    def grid(self) -> list[dict]:
        built = len(self._order)  # the last point keeps every key: exact search
        return [{"budget": b} for b in sorted({min(b, built) for b in BUDGETS} | {built})]

    def _add(self, keys: np.ndarray) -> None:
        self._append_keys(keys)
        self._kept.clear()

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys, "order": self._order}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        keys = expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True)
        order = expect(arrays, "order", np.int64, (None,))
        built = len(order)
        if not 1 <= built <= self.n_keys or not np.array_equal(np.sort(expect_ids("order", order, 0, built)),
                                                               np.arange(built)):
            raise IndexConfigError(f"array 'order' is not a ranking of the first keys (a permutation of 0..n-1, "
                                   f"n ≤ {self.n_keys})")
        self._set_up(keys, order)


@njit(cache=True, nogil=True)
def _search(keys, cand, queries, ids, scores):
    """Each query's exact products with the keys ``cand`` (ascending) and its top-k of them, ties to the lower id."""
    m = min(ids.shape[1], len(cand))
    exact = np.empty(len(cand), np.float32)
    for i in range(len(queries)):
        score_rows(keys, cand, queries[i], exact)
        best = largest(exact, m)
        for t in range(m):
            ids[i, t] = cand[best[t]]
            scores[i, t] = exact[best[t]]
