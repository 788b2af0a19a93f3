"""Graph kernels (numba) shared by the graph indexes: one idea per module.

- :mod:`.simd`: the fixed-order SIMD inner product and the prefetch intrinsic.
- :mod:`.utils`: heaps, visited sets, the per-thread workspace, the serial-or-chunked runner.
- :mod:`.search`: the one best-first search (query time and build time).
- :mod:`.multi`: one kernel call searching the graphs of several heads, interleaved.
- :mod:`.edges`: CSR of reverse edges, row merges, reachability.
- :mod:`.prune`: the RobustPrune occlusion rule (inner product).
- :mod:`.vamana`: the Vamana insertion pass and OOD-DiskANN's RobustStitch.
- :mod:`.roar`: RoarGraph's projection, descent links, top-list upkeep and connectivity passes.
- :mod:`.hubs`: entry points from the training queries.

A graph is a fixed-width adjacency ``nbrs`` (n, R) int32 with ``degree`` (n,) int32 (row i's
neighbours are ``nbrs[i, :degree[i]]``) over the key rows ``data`` (n, d) float32, passed as one
:class:`Graph`. Similarity is always the inner product; every inner product a search computes is
counted (``n_scanned``), entry points included. Style as in pynndescent: ``@njit(cache=True,
nogil=True)``, parallel arrays, epoch-stamped visited arrays, lock-free two-phase updates (a
parallel phase writes only slots fixed beforehand, then each row is owned by one iteration), so
a seeded build is deterministic whatever the thread count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from anns_lab.indexes.growable import Growable
from anns_lab.indexes.persist import expect, expect_ids
from anns_lab.kernel_cache import install

install()  # numba's cache keyed on every kernel source, before any submodule defines a kernel


class Graph(NamedTuple):
    """One graph as the kernels take it: key rows, adjacency rows and their lengths."""

    data: np.ndarray  # (n, d) float32, C-contiguous
    nbrs: np.ndarray  # (n, R) int32, -1 past the degree
    degree: np.ndarray  # (n,) int32


@dataclass
class Adjacency:
    """A graph's adjacency rows and degrees as an index holds them, grown together with spare rows: an ``add``
    writes the new rows and its neighbours' in place where stacking the old rows copied the graph."""

    nbrs: Growable
    degree: Growable

    @classmethod
    def of(cls, nbrs: np.ndarray, degree: np.ndarray) -> Adjacency:
        return cls(Growable.of(nbrs, fill=-1, dtype=np.int32), Growable.of(degree, dtype=np.int32))

    def rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``[0, n)`` as (nbrs, degree) views; rows past the old end are empty."""
        return self.nbrs.resize(n), self.degree.resize(n)

    @property
    def nbytes(self) -> int:
        """Both buffers, spare rows included."""
        return self.nbrs.buf.nbytes + self.degree.buf.nbytes


class HoldsAdjacency:
    """What the graph indexes (roargraph, vamana, robust-vamana) share: their adjacency as an :class:`Adjacency`,
    rows ``[0, n)`` exposed as the ``_nbrs`` / ``_degree`` views the kernels take. A pickle or copy carries the
    buffers alone: the views would come back as arrays of their own, the graph held twice."""

    _VIEWS = ("_nbrs", "_degree", "_graph")  # _graph: roargraph's cached Graph of the views

    def _hold_graph(self, nbrs: np.ndarray, degree: np.ndarray, n: int) -> None:
        self._adjacency = Adjacency.of(nbrs, degree)
        self._expose(n)

    def _expose(self, n: int) -> None:
        """Rows ``[0, n)`` as ``_nbrs`` / ``_degree`` (an add's new rows empty, the old ones in place)."""
        self._nbrs, self._degree = self._adjacency.rows(n)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._VIEWS}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "_adjacency" in state:
            self._expose(self._adjacency.nbrs.n)


def saved_graph(arrays: dict[str, np.ndarray], n: int, dim: int, R: int) -> Graph:
    """The :class:`Graph` of a saved index's ``keys``/``nbrs``/``degree`` arrays, for n keys of dimension
    ``dim`` and rows of width R, or IndexConfigError: finite keys, degrees in [0, R], every edge a key id."""
    keys = expect(arrays, "keys", np.float32, (n, dim), finite=True)
    nbrs = expect(arrays, "nbrs", np.int32, (n, R))
    degree = expect_ids("degree", expect(arrays, "degree", np.int32, (n,)), 0, R + 1)
    expect_ids("nbrs", nbrs[np.arange(R) < degree[:, None]], 0, n)
    return Graph(keys, nbrs, degree)
