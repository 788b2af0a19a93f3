"""InfLLM's context memory (Xiao et al., "InfLLM: Training-Free Long-Context Extrapolation for LLMs with an Efficient
Context Memory", NeurIPS 2024; code thunlp/InfLLM).

InfLLM cuts the context beyond its local window into blocks of ``block`` consecutive tokens (its memory units). While a
token is still inside the local window, the queries that follow it attend to it; the softmax weights it receives are
summed into its representative score. When its block leaves the window, the ``repr`` tokens of highest score are the
block's representatives, and the block is kept as the mean of their keys. A later query scores every block by that
mean (one product a block) and attends the keys of the ``blocks`` best ones. Here the scores come from the training
queries at their own positions (``Index.own_positions``): each key's weight from every training query at most
``local`` positions after it (its own position included: the attention is causal), each query's softmax over the
index's keys it reaches; ``blocks`` is a search parameter (a sweep reads every value from one build), and a search
scores the chosen blocks' keys exactly, and every key added after the build, and returns their top-k.

Not modelled: InfLLM chooses one set of blocks for all heads of a layer (the query heads' products with their
representatives summed), here each query head chooses its own, as every index of the lab serves a query head (finer:
in its favour); its softmax runs over the local window's keys and the memory it attended, here over the index's keys
within ``local`` positions (the sink and the static window are never passed to an index); InfLLM gives the memory one
relative position (its queries rotated by ``n_local``), here the model's RoPE stands; keys added after the build
(the decoder's generated tokens) form no blocks: every search scores them, as it scores the built keys after the last
whole block (InfLLM attends that remainder whole too). The lab's static window plays InfLLM's
initial and local tokens. In the decoder a step attends the top-k (``--topk``) of the keys a search scores: InfLLM
attends every key of its blocks, so ``--topk`` at least ``blocks`` × ``block`` runs it as its reference does.

Counting: a search computes one product per block (its representative mean, 4·d bytes) and one per key of the chosen
blocks, of the remainder and per added key (4·d bytes each, contiguous rows), and reads 8 bytes of each chosen block's offset:
``n_scanned`` = blocks built + keys scored, ``bytes_read`` = 4·d·``n_scanned`` + 8 × blocks chosen. The build's
products (each training query with the keys it reaches) are the build's, made once.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from anns_lab.errors import IndexConfigError
from anns_lab.indexes import KeyRowsIndex, Param
from anns_lab.indexes.persist import expect
from anns_lab.indexes.scan_rows import largest, score_rows, select_largest

BLOCKS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
CHUNK = 256  # training queries scored at once: a (CHUNK, local + span) matrix of products


def local_scores(keys: np.ndarray, key_pos: np.ndarray, queries: np.ndarray, query_pos: np.ndarray, local: int,
                 scale: float) -> np.ndarray:
    """Each key's softmax weight summed over the ``queries`` at most ``local`` positions after it (float64, (n,)); each
    query's softmax over the keys it reaches (positions in (t - local, t]). Both position arrays ascending.

    The products are torch's: its team is the calling thread's (one thread on the decoder's build threads,
    ``indexes.threads``), where numpy's BLAS keeps a pool of its own that several builds at once spin against (a
    Gemma-3 8K layer's four builds: 10x slower, session 52)."""
    import torch

    scores = torch.zeros(len(keys), dtype=torch.float64)
    all_keys = torch.tensor(keys)  # a copy: the keys may be a read-only view (the queries: a chunk at a time)
    positions = torch.from_numpy(np.ascontiguousarray(key_pos, dtype=np.int64))
    for a in range(0, len(queries), CHUNK):
        t = query_pos[a:a + CHUNK]
        lo = int(np.searchsorted(key_pos, t[0] - local, side="right"))
        hi = int(np.searchsorted(key_pos, t[-1], side="right"))
        if hi <= lo:
            continue
        at = torch.from_numpy(np.ascontiguousarray(t, dtype=np.int64))[:, None]
        p = positions[lo:hi][None, :]
        reached = (p <= at) & (p > at - local)
        logits = (torch.tensor(queries[a:a + CHUNK]) @ all_keys[lo:hi].T) * scale
        logits.masked_fill_(~reached, -torch.inf)
        weights = torch.softmax(logits[reached.any(dim=1)], dim=1)
        scores[lo:hi] += weights.sum(dim=0, dtype=torch.float64)
    return scores.numpy()


def block_starts(n_keys: int, block: int) -> np.ndarray:
    """The first id of each whole block of ``block`` consecutive keys, then the end of the last one: the keys after it
    (fewer than a block) stay outside the blocks, as InfLLM keeps the remainder that fills no block, and every search
    reads them."""
    return np.arange(0, n_keys // block * block + 1, block, dtype=np.int64)


def representatives(keys: np.ndarray, scores: np.ndarray, starts: np.ndarray, n_repr: int) -> np.ndarray:
    """Each block's vector: the mean of its ``n_repr`` keys of highest score (ties: the lower id), float32 (blocks, d)."""
    reps = np.empty((len(starts) - 1, keys.shape[1]), np.float32)
    for b, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
        best = s + np.argsort(-scores[s:e], kind="stable")[:n_repr]
        reps[b] = keys[best].mean(axis=0, dtype=np.float64)
    return reps


class InfLLM(KeyRowsIndex):
    """InfLLM: blocks of consecutive keys, each the mean of the keys its following queries attended most; a query
    reads the blocks it scores highest."""

    build_params = {
        "block": Param(128, 1, 1 << 20, help="keys a block (InfLLM: 128)"),
        "repr": Param(4, 1, 1 << 20, help="representative keys a block, the most attended (InfLLM: 4)"),
        "local": Param(4096, 1, 1 << 30, help="positions after a key whose queries score it (InfLLM's local window: "
                                             "4096)"),
        "scale": Param(0.0, 0.0, 1e6, help="softmax scale of the scores' q·k; 0 = 1/√d"),
    }
    search_params = {"blocks": Param(16, 1, 1 << 30, help="blocks read a query, the best by their representative "
                                                         "(InfLLM: 16); keys added later are always searched")}
    search_grid = {"blocks": BLOCKS}
    uses_train_queries = True
    own_positions = True  # the queries score the keys as they attended them, where they were
    reads_positions = True
    restores_exactly = True

    def __init__(self, **build_params) -> None:
        super().__init__(**build_params)
        if self.params["repr"] > self.params["block"]:
            raise IndexConfigError(f"{self._owner()}: parameter repr={self.params['repr']} must not exceed "
                                   f"block={self.params['block']} (representatives are keys of the block)")

    def _build(self, keys: np.ndarray, train_queries: np.ndarray, key_positions: np.ndarray,
               train_positions: np.ndarray) -> None:
        scale = self.params["scale"] or 1.0 / np.sqrt(keys.shape[1])
        scores = local_scores(keys, key_positions, train_queries, train_positions, self.params["local"], scale)
        starts = block_starts(len(keys), self.params["block"])
        self._set_up(keys, representatives(keys, scores, starts, self.params["repr"]), starts)

    def _set_up(self, keys: np.ndarray, reps: np.ndarray, starts: np.ndarray) -> None:
        self._hold_keys(keys)
        self._reps, self._starts = reps, starts

    def _search(self, queries: np.ndarray, k: int, blocks: int):
        ids = np.full((len(queries), k), -1, np.int64)
        scores = np.full((len(queries), k), -np.inf, np.float32)
        scanned = np.empty(len(queries), np.int64)
        _search(self._keys, self._reps, self._starts, queries, blocks, ids, scores, scanned)
        chosen = min(blocks, len(self._reps))
        return ids, scores, scanned, 4 * self.dim * scanned + 8 * chosen

    def grid(self) -> list[dict]:
        built = max(1, len(self._reps))  # the last point reads every block: exact search
        return [{"blocks": b} for b in sorted({min(b, built) for b in BLOCKS} | {built})]

    def max_scanned(self) -> int:
        return len(self._reps) + self.n_keys

    def _add(self, keys: np.ndarray) -> None:
        self._append_keys(keys)

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys, "representatives": self._reps, "starts": self._starts}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        keys = expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True)
        starts = expect(arrays, "starts", np.int64, (None,))
        if not (len(starts) >= 1 and 0 <= starts[-1] <= self.n_keys
                and np.array_equal(starts, block_starts(int(starts[-1]), self.params["block"]))):
            raise IndexConfigError(f"array 'starts' is not a partition of the first keys into blocks of "
                                   f"{self.params['block']} (0, block, 2·block, ..., at most n = {self.n_keys})")
        reps = expect(arrays, "representatives", np.float32, (len(starts) - 1, self.dim), finite=True)
        self._set_up(keys, reps, starts)


@njit(cache=True, nogil=True)
def _search(keys, reps, starts, queries, n_blocks, ids, scores, scanned):
    """Each query's products with every block's representative, then with the keys of its ``n_blocks`` best blocks
    (ties: the lower block) and every key after the blocks; its top-k of those keys, ties to the lower id."""
    nb = len(reps)
    built = starts[nb]
    block_ids = np.arange(nb)
    block_scores = np.empty(nb, np.float32)
    cand = np.empty(len(keys), np.int64)
    exact = np.empty(len(keys), np.float32)
    for i in range(len(queries)):
        score_rows(reps, block_ids, queries[i], block_scores)
        c = 0
        for b in select_largest(block_scores, min(n_blocks, nb)):  # in block order: candidates stay ascending
            for j in range(starts[b], starts[b + 1]):
                cand[c] = j
                c += 1
        for j in range(built, len(keys)):
            cand[c] = j
            c += 1
        score_rows(keys, cand[:c], queries[i], exact[:c])
        m = min(ids.shape[1], c)
        best = largest(exact[:c], m)
        for t in range(m):
            ids[i, t] = cand[best[t]]
            scores[i, t] = exact[best[t]]
        scanned[i] = nb + c
