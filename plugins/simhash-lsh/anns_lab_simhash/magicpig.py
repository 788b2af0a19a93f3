"""MagicPIG-style LSH sampling (Chen et al., ICLR 2025): an estimator, not a top-k index.

The SimHash tables of :class:`~anns_lab_simhash.SimHashLSH` (``K`` sign bits × ``L`` tables,
seeded Gaussian hyperplanes) decide which keys are sampled: a key is sampled for a query when
their codes agree in at least ``min_collisions`` tables. Over the random hyperplanes that
happens with probability ``p = P(Binomial(L, u) ≥ min_collisions)``, ``u = (1 − θ/π)^K``, θ the
angle between query and key; each sampled key gets importance weight ``1/p``, so the estimate
of the softmax's numerator and normaliser is unbiased over the ``seed`` (Horvitz–Thompson).
There are no exact ids (every row of ``ids`` is padding); ``min_collisions = 0`` samples
every key with ``p = 1``, which is exact attention. Tables: ``K`` 8 × ``L`` 64 by default, where MagicPIG's
configuration has 10 × 150: there, on SmolLM2 8K, its codes alone are 300 B a key against a 256-B key and no grid
point reads under one full scan (BENCHMARKS "Estimators").

``center`` (default on, as MagicPIG does): keys are hashed after subtracting their mean μ (fixed at
build), and θ is the angle between q and k − μ. Softmax is unchanged by the shift (it adds q·μ to
every logit), but attention keys share a large common direction, and without it almost no key
collides with an out-of-distribution query.

Counting: ``n_scanned`` = sampled keys (their logits) + ``K·L`` hyperplanes, + 1 when centred (q·μ, which
turns a centred logit q·(k − μ) into the attention's q·k); ``bytes_read`` =
those vectors and the sampled keys' values as float32, plus the key codes compared (``n·L·⌈K/8⌉``
bytes, a packed table's width).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import binom

from anns_lab.errors import IndexConfigError
from anns_lab.indexes import Param
from anns_lab.indexes.estimate import Estimate
from anns_lab.indexes.growable import Growable
from anns_lab.indexes.persist import expect

from anns_lab_simhash import SimHashLSH


def sampling_probability(cos: np.ndarray, K: int, L: int, min_collisions: int) -> np.ndarray:
    """P(a key at cosine ``cos`` to the query agrees with it in ≥ ``min_collisions`` of L K-bit SimHash tables)."""
    theta = np.arccos(np.clip(cos, -1.0, 1.0))
    u = (1.0 - theta / math.pi) ** K
    return binom.sf(min_collisions - 1, L, u)


class MagicPIG(SimHashLSH):
    """MagicPIG LSH sampling: keys colliding in ≥ min_collisions of L K-bit tables, weighted 1/P(sampled)."""

    build_params = {
        "K": Param(8, 1, 30, help="bits per table"),
        "L": Param(64, 1, 1024, help="number of tables"),
        "seed": Param(0, 0, 2**31 - 1, help="hyperplane seed"),
        "center": Param(True, help="hash keys minus their mean (MagicPIG's centering)"),
    }
    search_params = {"min_collisions": Param(2, 0, 1024, help="tables a key must share with the query (≤ L); "
                                                              "0 samples every key (exact)")}
    search_grid = {"min_collisions": (4, 3, 2, 1, 0)}  # fewest samples first; 0 = every key
    estimates = True
    unbiased = True

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        self._mean = keys.mean(axis=0) if self.params["center"] else np.zeros(keys.shape[1], np.float32)
        super()._build(keys, train_queries)

    def _hold_codes(self, keys: np.ndarray) -> None:
        """The codes and norms of ``keys`` minus their mean (queries are hashed as they are), grown by each add;
        the mean is set first (``_build``, ``_restore``)."""
        centred = keys - self._mean
        self._codes = Growable.of(self._hash(centred))
        self._norms = Growable.of(np.linalg.norm(centred.astype(np.float64), axis=1))

    def max_scanned(self) -> int:
        return super().max_scanned() + int(self.params["center"])  # q·μ

    def _add(self, keys: np.ndarray) -> None:
        self._append_keys(keys)
        centred = keys - self._mean
        self._codes.append(self._hash(centred))
        self._norms.append(np.linalg.norm(centred.astype(np.float64), axis=1))

    def _arrays(self) -> dict[str, np.ndarray]:
        return {**super()._arrays(), "mean": self._mean}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        self._mean = expect(arrays, "mean", np.float32, (self.dim,), finite=True)  # the codes' centre, then
        super()._restore(arrays)  # the planes and keys checked there (a saved index is a file people exchange), coded

    def _search(self, queries: np.ndarray, k: int, min_collisions: int):
        K, L = self.params["K"], self.params["L"]
        if min_collisions > L:
            raise IndexConfigError(f"{self._owner()}: min_collisions={min_collisions} exceeds the number of tables L={L}")
        nq, n, d = len(queries), len(self._keys), self._keys.shape[1]
        samples, weights = [], []
        n_scanned = np.zeros(nq, np.int64)
        for row, (q, code) in enumerate(zip(queries, self._hash(queries))):
            cand = np.flatnonzero((self._codes.table == code).sum(axis=1) >= min_collisions)
            dots = (self._keys[cand] - self._mean).astype(np.float64) @ q.astype(np.float64)
            cos = dots / np.maximum(self._norms.table[cand] * np.linalg.norm(q.astype(np.float64)), 1e-30)
            p = sampling_probability(cos, K, L, min_collisions)
            keep = p > 0  # a key with p = 0 cannot have collided; guards the weight against rounding
            samples.append(cand[keep])
            weights.append(1.0 / p[keep])
            n_scanned[row] = len(cand) + K * L + int(self.params["center"])
        estimate = Estimate.make(samples, weights, nq=nq)
        bytes_read = (n_scanned + estimate.n_terms()) * 4 * d + n * L * math.ceil(K / 8)
        ids = np.full((nq, k), -1, np.int64)
        scores = np.full((nq, k), -np.inf, np.float32)
        return ids, scores, n_scanned, bytes_read, estimate

    def grid(self) -> list[dict]:
        return [{"min_collisions": m} for m in self.search_grid["min_collisions"] if m <= self.params["L"]]

