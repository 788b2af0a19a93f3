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

from anns_lab.decode.kernels import attend_rows
from anns_lab.indexes import registry


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
        self.build_s = time.perf_counter() - t0

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
            seen = set()
            for h, index in enumerate(self.indexes):
                if id(index) not in seen:
                    seen.add(id(index))
                    index.add(np.ascontiguousarray(new[h // self.group]))
            self.n_indexed = self.n_rows

    # -- the CPU side of a decode step ---------------------------------------------------------------

    def side(self, q: np.ndarray, scaling: float) -> SideResult:
        """Search each head's index with its query, add the side-buffer rows, attend over them (GIL released)."""
        t0 = time.perf_counter()
        parts, scanned = [], []
        if self.indexes and self.n_indexed:
            k = min(self.topk, self.n_indexed)
            rows = np.empty((self.n_heads, k), np.int64)
            groups: dict[int, list[int]] = {}
            for h, index in enumerate(self.indexes):
                groups.setdefault(id(index), []).append(h)
            if len(groups) == self.n_heads:  # one index per query head: the class searches them all in one call
                res = type(self.indexes[0]).search_group(self.indexes, q, k, **self.plan.search_params)
                rows[:] = res.ids
                scanned.extend((res.n_scanned / self.n_indexed).tolist())
            else:  # a shared index per KV head: its group's queries in one batch
                for heads in groups.values():
                    res = self.indexes[heads[0]].search(q[heads], k, **self.plan.search_params)
                    rows[heads] = res.ids
                    scanned.extend((res.n_scanned / self.n_indexed).tolist())
            parts.append(rows)
        if self.n_rows > self.n_indexed:
            pending = np.arange(self.n_indexed, self.n_rows, dtype=np.int64)
            parts.append(np.broadcast_to(pending, (self.n_heads, len(pending))))
        t1 = time.perf_counter()
        rows = np.ascontiguousarray(np.concatenate(parts, axis=1)) if parts else np.full((self.n_heads, 1), -1, np.int64)
        out, m, z = attend_rows(np.ascontiguousarray(q, dtype=np.float32), self.keys, self.values, rows, float(scaling))
        t2 = time.perf_counter()
        return SideResult(out, m, z, t1 - t0, t2 - t1, float(np.mean(scanned)) if scanned else float("nan"))
