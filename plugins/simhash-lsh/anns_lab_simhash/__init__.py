"""SimHash LSH in the style of MagicPIG: L tables of K random-hyperplane sign bits.

A key is a candidate for a query when their K-bit codes agree in at least ``min_collisions``
of the L tables; candidates are then scored exactly by inner product and the top-k returned.
SimHash collides by angle, not inner product, so large-norm keys get no head start.

``n_scanned`` = candidates scored + K·L: hashing a query takes K·L inner products with the
hyperplanes, and anns-lab counts every inner product a query costs. ``bytes_read`` = 4·d per
vector scanned (candidates and hyperplanes) + every key's codes, compared with the query's
(``n·L·⌈K/8⌉``: K bits a table), as magicpig counts them.
"""

from __future__ import annotations

import math

import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.indexes import KeyRowsIndex, Param
from anns_lab.indexes.growable import Growable
from anns_lab.indexes.persist import expect


class SimHashLSH(KeyRowsIndex):
    """SimHash LSH (K bits × L tables, seeded Gaussian hyperplanes); candidates scored exactly."""

    build_params = {
        "K": Param(4, 1, 30, help="bits per table"),
        "L": Param(32, 1, 1024, help="number of tables"),
        "seed": Param(0, 0, 2**31 - 1, help="hyperplane seed"),
    }
    search_params = {"min_collisions": Param(2, 1, 1024, help="tables a key must share with the query (≤ L)")}
    search_grid = {"min_collisions": (8, 6, 4, 3, 2, 1)}  # fewest candidates first

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        K, L = self.params["K"], self.params["L"]
        rng = np.random.default_rng(self.params["seed"])
        self._planes = rng.standard_normal((L * K, keys.shape[1])).astype(np.float32)
        self._hold_keys(keys)
        self._hold_codes(keys)

    def _hold_codes(self, keys: np.ndarray) -> None:
        """The (n, L) uint32 codes of ``keys``, grown by each add (which writes its own rows)."""
        self._codes = Growable.of(self._hash(keys))

    def _hash(self, x: np.ndarray) -> np.ndarray:
        bits = (x @ self._planes.T > 0).reshape(len(x), self.params["L"], self.params["K"])
        return (bits.astype(np.uint32) << np.arange(self.params["K"], dtype=np.uint32)).sum(axis=2, dtype=np.uint32)

    def _search(self, queries: np.ndarray, k: int, min_collisions: int):
        if min_collisions > self.params["L"]:
            raise IndexConfigError(f"simhash: min_collisions={min_collisions} exceeds the number of tables L={self.params['L']}")
        ids = np.full((len(queries), k), -1, np.int64)
        scores = np.full((len(queries), k), -np.inf, np.float32)
        n_scanned = np.zeros(len(queries), np.int64)
        for row, (q, code) in enumerate(zip(queries, self._hash(queries))):
            cand = np.flatnonzero((self._codes.table == code).sum(axis=1) >= min_collisions)
            s = self._keys[cand] @ q
            top = np.argsort(-s, kind="stable")[:k]
            ids[row, : len(top)], scores[row, : len(top)] = cand[top], s[top]
            n_scanned[row] = len(cand) + self._planes.shape[0]
        codes = self.n_keys * self.params["L"] * math.ceil(self.params["K"] / 8)
        return ids, scores, n_scanned, n_scanned * 4 * self.dim + codes

    def grid(self) -> list[dict]:
        return [{"min_collisions": m} for m in self.search_grid["min_collisions"] if m <= self.params["L"]]

    def max_scanned(self) -> int:
        return self.n_keys + self._planes.shape[0]

    def _add(self, keys: np.ndarray) -> None:
        self._append_keys(keys)
        self._codes.append(self._hash(keys))

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys, "planes": self._planes}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        K, L = self.params["K"], self.params["L"]
        self._planes = expect(arrays, "planes", np.float32, (L * K, self.dim), finite=True)
        self._hold_keys(expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True))
        self._hold_codes(self._keys)
