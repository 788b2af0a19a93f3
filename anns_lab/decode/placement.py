"""KV placement of one long-range layer: the CPU store, its indexes and the side-buffer.

Positions ``[0, sink)`` and the most recent ``recent`` positions form the static window W,
which stays in the model's cache on the accelerator. Every other position lives here, in
CPU memory, as row ``position − sink`` of one key and one value array per KV head. Rows
``[0, n_indexed)`` are in the indexes; rows ``[n_indexed, n_rows)`` are the side-buffer of
tokens that have left the recent window since, attended exactly (every step, all of them)
until ``add_batch`` of them have gathered, when they are inserted into the indexes with
``add``. An index without ``add`` keeps them in the side-buffer for good (still exact).

Indexes: one per (layer, query head) when the index learns from queries (attention-aware);
otherwise its keys are those of the KV head, so one index serves the whole GQA group (the
same object, searched with the group's queries in one batch). Either way a group's indexes
are built on one physical key array.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from anns_lab.decode.kernels import attend_rows_and_range
from anns_lab.indexes import protocol, registry
from anns_lab.indexes.base import SearchResult, resolve_params
from anns_lab.indexes.graph.multi import GraphGroup


@dataclass
class IndexPlan:
    """Which index a layer uses: registry name, build and search parameters."""

    name: str
    build_params: dict = field(default_factory=dict)
    search_params: dict = field(default_factory=dict)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in {**self.build_params, **self.search_params}.items()]
        return self.name + (f"({', '.join(parts)})" if parts else "")


@dataclass
class SideResult:
    """The CPU side of one step: partial attention and what it cost."""

    out: np.ndarray
    m: np.ndarray
    z: np.ndarray
    retrieval_s: float
    attention_s: float
    scanned: float  # mean fraction of indexed keys scanned per query head (nan when nothing was searched)


class LayerStore:
    """CPU keys/values of one layer outside the static window, with the layer's indexes."""

    def __init__(self, layer: int, n_heads: int, keys: np.ndarray, values: np.ndarray, topk: int,
                 plan: IndexPlan | None, add_batch: int):
        self.layer = layer
        self.n_heads = n_heads
        g, n, d = keys.shape
        self.group = n_heads // g
        cap = max(16, 2 * n)
        self.keys = np.zeros((g, cap, d), np.float32)
        self.values = np.zeros((g, cap, d), np.float32)
        self.keys[:, :n] = keys
        self.values[:, :n] = values
        self.n_rows = n
        self.n_indexed = 0
        self.topk = topk
        self.plan = plan
        self.add_batch = add_batch
        self.indexes: list = []  # per query head (a group may share one object)
        self.build_s = 0.0
        self._shared: list[list[int]] = []  # heads of each distinct index (an index per KV head serves its group)
        self._graphs: GraphGroup | None = None  # per-head graph indexes: one kernel call searches them all
        self._beam = 0
        self._bound: int | None = None  # the indexes' max_scanned(), once a search after a build or add has been checked

    # -- build and grow ----------------------------------------------------------------------------

    def build(self, queries: np.ndarray | None) -> None:
        """Build the indexes on every row held now; ``queries`` (H, t, d) are the prefill queries (attention-aware only)."""
        if self.plan is None or self.n_rows == 0:
            return
        t0 = time.perf_counter()
        cls = registry.get(self.plan.name)
        n = self.n_rows
        per_kv = [np.ascontiguousarray(self.keys[g, :n]) for g in range(self.keys.shape[0])]  # one array per group
        if cls.uses_train_queries:
            if queries is None:
                raise ValueError("attention-aware index needs the prefill queries")
            self.indexes = [cls(**self.plan.build_params).build(per_kv[h // self.group], np.ascontiguousarray(queries[h]))
                            for h in range(self.n_heads)]
        else:
            shared = [cls(**self.plan.build_params).build(k) for k in per_kv]
            self.indexes = [shared[h // self.group] for h in range(self.n_heads)]
        self.n_indexed = n
        self._bound = None
        self._prepare_search()
        self.build_s = time.perf_counter() - t0

    def _prepare_search(self) -> None:
        """Cache how a step searches: the head groups of shared indexes, or one GraphGroup of per-head graphs."""
        groups: dict[int, list[int]] = {}
        for h, index in enumerate(self.indexes):
            groups.setdefault(id(index), []).append(h)
        self._shared = list(groups.values())
        self._graphs = None
        if len(self._shared) == self.n_heads and self.indexes:
            cls = type(self.indexes[0])
            graph_like = all(hasattr(ix, "graph_arrays") and hasattr(ix, "entries_for") for ix in self.indexes)
            if graph_like and set(cls.search_params) == {"L"} and all(type(ix) is cls for ix in self.indexes):
                self._beam = resolve_params(cls.__name__, cls.search_params, self.plan.search_params)["L"]
                self._graphs = GraphGroup(self.indexes)

    @property
    def supports_add(self) -> bool:
        return bool(self.indexes) and self.indexes[0].supports_add

    def extend(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Append tokens that left the recent window (G, t, d) to the store, then to the indexes when a batch is full."""
        t = keys.shape[1]
        if self.n_rows + t > self.keys.shape[1]:
            cap = max(self.n_rows + t, 2 * self.keys.shape[1])
            for name in ("keys", "values"):
                old = getattr(self, name)
                grown = np.zeros((old.shape[0], cap, old.shape[2]), np.float32)
                grown[:, : self.n_rows] = old[:, : self.n_rows]
                setattr(self, name, grown)
        self.keys[:, self.n_rows:self.n_rows + t] = keys
        self.values[:, self.n_rows:self.n_rows + t] = values
        self.n_rows += t
        if self.supports_add and self.n_rows - self.n_indexed >= self.add_batch:
            new = self.keys[:, self.n_indexed:self.n_rows]
            for heads in self._shared:
                self.indexes[heads[0]].add(np.ascontiguousarray(new[heads[0] // self.group]))
            self.n_indexed = self.n_rows
            self._bound = None
            if self._graphs is not None:
                self._graphs.refresh()  # add() reallocates the graph arrays and may add entry points

    # -- the CPU side of a decode step ---------------------------------------------------------------

    def _check(self, res: SearchResult, q: np.ndarray, k: int, heads: list[int]) -> None:
        """The index protocol on the result for query ``heads`` (its ids index the store's rows, so a bad one must
        never reach the kernel): every rule, scores against the keys, on the first search after a build or add,
        then ids and counts (vectorised, a few µs)."""
        owner = f"{self.plan.name} (layer {self.layer})"
        if self._bound is None:  # first search since the indexes last changed
            for i, h in enumerate(heads):
                protocol.check_result(owner, tuple(a[i:i + 1] for a in res), 1, k, self.n_indexed,
                                      self.indexes[h].max_scanned(), q[h:h + 1],
                                      self.keys[h // self.group, :self.n_indexed])
        else:
            protocol.check_result(owner, res, len(heads), k, self.n_indexed, self._bound, check_scores=False)

    def side(self, q: np.ndarray, scaling: float) -> SideResult:
        """Search each head's index with its query, then attend over the hits and the side-buffer (GIL released).

        Per-head graph indexes (roargraph) are searched in one kernel call (:class:`GraphGroup`);
        an index shared by a KV head's group gets the group's queries in one batch; any other
        per-head index class goes through its ``search_group``. The side-buffer rows
        ``[n_indexed, n_rows)`` are passed to the attention kernel as a range, not gathered.
        """
        t0 = time.perf_counter()
        q = np.ascontiguousarray(q, dtype=np.float32)
        scanned = float("nan")
        if self.indexes and self.n_indexed:
            k = min(self.topk, self.n_indexed)
            if self._graphs is not None:
                res = self._graphs.search(q, k, self._beam)
            elif len(self._shared) == self.n_heads:  # one index per query head: the class searches them all in one call
                res = type(self.indexes[0]).search_group(self.indexes, q, k, **self.plan.search_params)
            else:  # a shared index per KV head: its group's queries in one batch
                res = SearchResult(np.empty((self.n_heads, k), np.int64), np.empty((self.n_heads, k), np.float32),
                                   np.empty(self.n_heads, np.int64))
                for heads in self._shared:
                    part = self.indexes[heads[0]].search(q[heads], k, **self.plan.search_params)
                    self._check(part, q, k, heads)
                    for mine, got in zip(res, part):
                        mine[heads] = got
            if len(self._shared) == self.n_heads:
                self._check(res, q, k, list(range(self.n_heads)))
            if self._bound is None:  # the full check has run: later steps check ids and counts only
                self._bound = max(index.max_scanned() for index in self.indexes)
            rows = np.ascontiguousarray(res.ids)
            scanned = float(res.n_scanned.mean()) / self.n_indexed
        else:
            rows = np.empty((self.n_heads, 0), np.int64)
        t1 = time.perf_counter()
        out, m, z = attend_rows_and_range(q, self.keys, self.values, rows, self.n_indexed, self.n_rows, float(scaling))
        t2 = time.perf_counter()
        return SideResult(out, m, z, t1 - t0, t2 - t1, scanned)
