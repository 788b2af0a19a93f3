"""Loki's key selection (Singhania et al., "Loki: Low-rank Keys for Efficient Sparse Attention", NeurIPS 2024; code
hpcgroup/loki).

The keys' principal components (the eigenvectors of their covariance, largest variance first) are a basis fixed at
build; every key is held in it, and a query scores each key on the first r components alone (its own r coordinates,
r products with the basis); the ``budget`` keys of largest partial score are scored exactly and the top-k returned.

Not modelled: Loki fits the basis offline on a calibration text (per layer and head, before or after RoPE); here it
is fitted on the keys the index holds (post-RoPE, the dump's own text: it can only help it). Keys added later are
held in the build's basis, as Loki's offline basis serves every key. Loki scores the chosen keys in the rotated basis;
here on the keys themselves (the same products, exact to float32 rounding). Its GQA rule is per query head here, as
for every index of the lab.

Counting (:mod:`anns_lab_lowrank.partial`): ``n_scanned`` = r (the query's coordinates) + ceil(n·r/d) + keys scored
exactly; ``bytes_read`` = 4·d·r (the basis vectors read) + 4·r·n + 4·d per key scored.
"""

from __future__ import annotations

import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.indexes import KeyRowsIndex
from anns_lab.indexes.persist import expect
from anns_lab_lowrank import partial

ORTHONORMAL = 1e-4  # a saved basis may be off an orthonormal one by float32 rounding, not more


def principal_basis(keys: np.ndarray) -> np.ndarray:
    """(d, d) float32: the keys' principal directions as columns, largest variance first (each column's sign fixed
    so that its largest entry is positive)."""
    x = keys.astype(np.float64)
    x -= x.mean(axis=0)
    values, vectors = np.linalg.eigh(x.T @ x)
    vectors = vectors[:, np.argsort(-values, kind="stable")]
    vectors *= np.sign(vectors[np.argmax(np.abs(vectors), axis=0), np.arange(len(vectors))])
    return vectors.astype(np.float32)


class Loki(KeyRowsIndex):
    """Loki: every key scored on the keys' r leading principal components, the best ``budget`` scored exactly."""

    search_params = {"rank": partial.RANK, "budget": partial.BUDGET}
    search_grid = {"rank": partial.RANKS, "budget": partial.BUDGETS}
    calibrated_by = "budget"  # the decoder raises the keys scored exactly, at the rank given

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        self._set(keys, principal_basis(keys))

    def _set(self, keys: np.ndarray, basis: np.ndarray) -> None:
        self._hold_keys(keys)
        self._basis = basis
        # (d, n): the keys' coordinates, one row per component, the first r rows read whole by a query
        self._coords = partial.columns(basis.T @ keys.T)

    def _search(self, queries: np.ndarray, k: int, rank: float, budget: int):
        n, d = self._keys.shape
        r = partial.channels(rank, d)
        # each query's first r coordinates in the basis (einsum's own loop: no BLAS team for r·d products)
        weights = np.einsum("qd,dr->qr", queries, self._basis[:, :r])
        dims = np.broadcast_to(np.arange(r), (len(queries), r))
        ids, scores, scored = partial.search(self._coords.buf, dims, weights, self._keys, queries, budget, k)
        products, nbytes = partial.partial_cost(n, r, d)
        return ids, scores, r + products + scored, 4 * d * r + nbytes + 4 * d * scored

    def grid(self) -> list[dict]:
        return partial.grid(self.n_keys)

    def max_scanned(self) -> int:
        return 2 * self.n_keys + self.dim

    def _add(self, keys: np.ndarray) -> None:
        # the new keys' coordinates only: every key's again cost n·d² products an add (0.54 G multiply-adds at Gemma-3 8K)
        self._append_keys(keys)
        self._coords.append(self._basis.T @ keys.T)

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys, "basis": self._basis}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        keys = expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True)
        basis = expect(arrays, "basis", np.float32, (self.dim, self.dim), finite=True)
        off = np.abs(basis.T.astype(np.float64) @ basis - np.eye(self.dim)).max()
        if not off <= ORTHONORMAL:
            raise IndexConfigError(f"array 'basis' is not orthonormal (off by {off:.2g})")
        self._set(keys, basis)
