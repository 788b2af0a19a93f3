"""ShadowKV-style chunk landmarks with static outlier chunks (Sun et al., "ShadowKV: KV Cache in Shadows for
High-Throughput Long-Context LLM Inference", ICML 2025; code bytedance/ShadowKV).

The keys, in position order, are cut into chunks of ``chunk_size`` consecutive keys (8, as ShadowKV); a chunk's
landmark is the mean of its keys. The chunks whose keys agree least with their landmark (the lowest minimum cosine
similarity of a key with it) are outliers, which ShadowKV keeps whole beside the local window: every query scores
their keys (ShadowKV keeps a fixed 48 chunks; here the same share of the chunks, 0.29%, so that a shorter context
keeps the proportion). A query scores every other chunk's landmark, reads the ``ceil(budget / chunk_size)`` chunks of
largest landmark score, scores their keys and the outliers' exactly and returns the top-k.

Not modelled: ShadowKV keeps the pre-RoPE keys in low rank on the GPU and rebuilds a selected chunk's keys from it (a
memory saving, whose keys are approximations): here a selected key is the exact key. Its GQA rule (a KV head's chunks
chosen by the largest softmax any of its query heads gives) is per query head here, as for every index of the lab.

Counting: ``n_scanned`` = landmarks scored + keys scored (the selected chunks' and the outliers'); ``bytes_read`` =
4·d per landmark (float32, every landmark) + 8 per chunk id read (each selected landmark's chunk, each outlier chunk) +
4·d per key scored.
"""

from __future__ import annotations

import math

import numpy as np

from anns_lab.indexes import KeyRowsIndex, Param
from anns_lab.indexes.persist import expect

BUDGETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)
OUTLIERS = 48 / 16384  # ShadowKV's 48 outlier chunks of 8 keys (bytedance/ShadowKV's `outlier_chunk`) at its 128K contexts, as a share
# (96 until session 62, which no reference gives: 5 chunks against 3 at 8K, the same recall)
EPS = 1e-8  # the norm floor of torch's cosine_similarity, which ShadowKV calls


def chunk_stats(keys: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk of ``size`` rows (the last may be short): the mean of its keys (c, d) float32, and the least cosine
    similarity of one of its keys with that mean (c,) float64."""
    n, d = keys.shape
    c = -(-n // size)
    x = np.zeros((c * size, d), np.float64)
    x[:n] = keys
    x = x.reshape(c, size, d)
    counts = np.full(c, size, np.float64)
    counts[-1] = n - (c - 1) * size
    means = x.sum(axis=1) / counts[:, None]
    # Elementwise products reduced per row: a chunk's values do not depend on which other chunks are computed beside it.
    dots = (x * means[:, None, :]).sum(axis=2)
    norms = np.maximum(np.sqrt((x * x).sum(axis=2)), EPS) * np.maximum(np.sqrt((means * means).sum(axis=1)), EPS)[:, None]
    cos = dots / norms
    cos[-1, int(counts[-1]):] = np.inf  # the short last chunk's missing rows
    return means.astype(np.float32), cos.min(axis=1)


class ShadowKVLandmarks(KeyRowsIndex):
    """ShadowKV: chunk-mean landmarks ranked by the query, the best chunks' keys and the outlier chunks' scored exactly."""

    build_params = {
        "chunk_size": Param(8, 1, 4096, help="keys per chunk (ShadowKV: 8)"),
        "outliers": Param(OUTLIERS, 0.0, 1.0, help="fraction of the chunks kept as outliers, scored by every query "
                                                   "(ShadowKV: 48 chunks of 8 at 128K, 0.29%)"),
    }
    search_params = {"budget": Param(2048, 1, 1 << 30, help="tokens read: the ceil(budget/chunk_size) chunks of "
                                                            "largest landmark score (ShadowKV: 2048)")}
    search_grid = {"budget": BUDGETS}

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        self._hold_keys(keys)
        means, self._min_cos = chunk_stats(keys, self.params["chunk_size"])
        self._split(means)

    def _split(self, means: np.ndarray) -> None:
        """Outliers: the chunks of least minimum cosine (ties by position); landmarks: the other chunks' ``means``."""
        c = len(self._min_cos)
        n_out = min(c, int(math.floor(self.params["outliers"] * c + 0.5)))
        order = np.argsort(self._min_cos, kind="stable")
        self._outlier_chunks = np.sort(order[:n_out]).astype(np.int64)
        self._landmark_chunks = np.sort(order[n_out:]).astype(np.int64)
        self._landmarks = np.ascontiguousarray(means[self._landmark_chunks])

    @property
    def n_landmarks(self) -> int:
        return len(self._landmark_chunks)

    def _keys_of(self, chunks: np.ndarray) -> np.ndarray:
        size = self.params["chunk_size"]
        ids = (chunks[:, None] * size + np.arange(size)).ravel()
        return ids[ids < len(self._keys)]

    def _search(self, queries: np.ndarray, k: int, budget: int):
        size, d = self.params["chunk_size"], queries.shape[1]
        n_read = min(math.ceil(budget / size), self.n_landmarks)
        scores_all = queries @ self._landmarks.T
        outlier_ids = self._keys_of(self._outlier_chunks)
        ids = np.full((len(queries), k), -1, np.int64)
        scores = np.full((len(queries), k), -np.inf, np.float32)
        scored = np.zeros(len(queries), np.int64)
        for row, q in enumerate(queries):  # one query at a time: a batch gives what single queries give
            best = np.argsort(-scores_all[row], kind="stable")[:n_read]
            cand = np.concatenate([outlier_ids, self._keys_of(self._landmark_chunks[best])])
            s = self._keys[cand] @ q
            top = np.argsort(-s, kind="stable")[:k]
            ids[row, : len(top)], scores[row, : len(top)] = cand[top], s[top]
            scored[row] = len(cand)
        n_scanned = self.n_landmarks + scored
        bytes_read = 4 * d * self.n_landmarks + 8 * (n_read + len(self._outlier_chunks)) + 4 * d * scored
        return ids, scores, n_scanned, bytes_read

    def grid(self) -> list[dict]:
        # Budgets past the last landmark's chunk read every key: end on the one that reads them all (exact search).
        full = max(1, self.n_landmarks * self.params["chunk_size"])
        return [{"budget": b} for b in sorted({min(b, full) for b in self.search_grid["budget"]} | {full})]

    def max_scanned(self) -> int:
        return self.n_keys + self.n_landmarks

    def _add(self, keys: np.ndarray) -> None:
        # New keys fill the last chunk, then new chunks: only the chunks from the last old one on are computed again
        # (and the old outliers' means, which no landmark holds), then the outliers are chosen again among all chunks:
        # what a build on every key gives.
        size = self.params["chunk_size"]
        first = len(self._keys) // size  # the old chunks before it are whole and unchanged
        means = np.empty((first, self.dim), np.float32)
        kept = self._landmark_chunks < first
        means[self._landmark_chunks[kept]] = self._landmarks[kept]
        if len(out := self._outlier_chunks[self._outlier_chunks < first]):
            means[out] = chunk_stats(self._keys[self._keys_of(out)], size)[0]
        new_means, min_cos = chunk_stats(self._append_keys(keys)[first * size:], size)
        self._min_cos = np.concatenate([self._min_cos[:first], min_cos])
        self._split(np.vstack([means, new_means]))

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        self._build(expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True), None)  # from a file
