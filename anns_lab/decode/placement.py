"""KV placement of one long-range layer: the CPU store, its indexes and the side-buffer.

Positions ``[0, sink)`` and the most recent ``recent`` positions form the static window W,
which stays in the model's cache on the accelerator. Every other position lives here, in
CPU memory, as row ``position − sink`` of one key and one value array per KV head. Rows
``[0, n_indexed)`` are in the indexes; rows ``[n_indexed, n_rows)`` are the side-buffer of
tokens that have left the recent window since, attended exactly (every step, all of them)
until ``add_batch`` of them have gathered, when they are inserted into the indexes with
``add``. An index without ``add`` keeps them in the side-buffer for good (still exact).

Indexes: one per (layer, query head) when the index learns from queries (attention-aware), on that
head's prefill queries; otherwise its keys are those of the KV head, so one index serves the whole GQA
group (the same object, searched with the group's queries in one batch). ``--train-group group|strided``
makes the attention-aware ones so too: one per KV head, trained on its group's queries
(:mod:`anns_lab.indexes.group_queries`); ``--train-group unlisted`` keeps one per query head and gives each its
group's other heads' newest queries for the keys its own lists leave out. Either way the indexes are built
on the heads of the layer's :class:`~anns_lab.indexes.key_store.KeyStore`, the one copy of its
CPU keys, and every step searches them with one ``search_group`` call (the index protocol's hook).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from anns_lab.decode.kernels import attend_rows_and_range, merge
from anns_lab.errors import AnnsLabError, IndexFailed, IndexResultError, error_text
from anns_lab.indexes import protocol, registry
from anns_lab.indexes.base import SearchResult
from anns_lab.indexes.build_processes import BuildProcesses, Spool, can_build
from anns_lab.indexes.estimate import Estimate, estimate_terms, weighted_partial
from anns_lab.indexes.group_queries import other_heads
from anns_lab.indexes.held_memory import overlaps
from anns_lab.indexes.key_store import KeyStore
from anns_lab.indexes.threads import map_one_thread


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
    bytes_read: int = 0  # index data read by this layer's searches, summed over its query heads
    retrieval_cpu_s: float = 0.0  # the search's CPU time on its thread: retrieval_s less any wait for a core


class LayerStore:
    """CPU keys/values of one layer outside the static window, with the layer's indexes."""

    def __init__(self, layer: int, n_heads: int, keys: np.ndarray, values: np.ndarray, topk: int,
                 plan: IndexPlan | None, add_batch: int, reserve: int = 64):
        """``reserve``: rows to allocate beyond the prompt's for tokens that will leave the window (the decoder
        passes its number of steps); a longer run grows the buffers by a quarter at a time (``KeyStore.append``)."""
        self.layer = layer
        self.n_heads = n_heads
        self.group = n_heads // keys.shape[0]
        # At least one spare row, so that the store always copies: the caller's arrays may view the model's cache.
        cap = max(16, keys.shape[1] + max(1, reserve))
        # The one copy of the layer's CPU keys: the indexes are built on its heads and read them there.
        self.key_store, self.value_store = KeyStore(keys, cap), KeyStore(values, cap)
        self.n_indexed = 0
        self.topk = topk
        self.plan = plan
        self.add_batch = add_batch
        self.indexes: list = []  # per query head (a group may share one object)
        self.build_s = 0.0
        self.calibration = None  # decode.calibrate.Calibration, when the search was calibrated after the build
        self.build_span = None  # (queued, started, ended) seconds from the prefill's end (or the mode's build start after it), set by decode.builds
        self.layers_at_once = None  # layers its mode's builds ran at once (decode.builds.EarlyBuilds' workers), set there
        self._summaries: dict[int, tuple] = {}  # per head of an estimator with summaries: (Summaries, value sums)
        self._bound: int | None = None  # the indexes' max_scanned(), once a search after a build or add has been checked

    # -- build and grow ----------------------------------------------------------------------------

    def build(self, queries: np.ndarray | None, train_topk: np.ndarray | None = None, per_kv_head: bool = False,
              others: bool = False, beside: bool = False, processes: BuildProcesses | None = None,
              then: Callable[[Spool], None] | None = None, positions: dict[str, np.ndarray] | None = None) -> None:
        """Build the indexes on every row held now; ``queries`` (H, t, d) are the prefill queries (attention-aware only),
        ``train_topk`` (H, t, c) their top keys when computed elsewhere (``device_lists``). ``per_kv_head``: queries and
        lists are (G, m, ·), one set per KV head (its GQA group's, :mod:`indexes.group_queries`), and one
        attention-aware index per KV head serves its group, as every other index does. ``others`` (per query head, an
        index that accepts them): each head's index also gets its group's other heads' newest queries (and lists) as
        ``group_queries`` (``--train-group unlisted``). The indexes are built side by side, one core each
        (:func:`indexes.threads.map_one_thread`: the same indexes as one after another, without the kernels' thread teams
        waiting on each other beside the prefill; ``beside``: the prefill still runs, so a layer of one index builds on
        one thread too, and every build thread runs below the prefill's priority), or in the worker ``processes``
        (:mod:`indexes.build_processes`: the same indexes, no build waiting for this process's GIL) where the index
        class saves and restores exactly (:func:`build_processes.can_build`: its arrays are how a build comes back) and
        more than one index builds or the prefill runs beside them; there ``then(spool)`` runs once they are taken,
        with the spool that still holds their arrays (a task in a worker can read them: the decoder's calibration).
        ``positions``: ``key_positions`` and ``train_positions`` for an index that reads them (``Index.reads_positions``;
        per query head), given to every build."""
        if self.plan is None or self.n_rows == 0:
            return
        if positions is not None and per_kv_head:  # a KV head's rows interleave its group's queries (check_window)
            raise ValueError("positions are a query head's own: not for one index per KV head")
        t0 = time.perf_counter()
        cls = registry.get(self.plan.name)
        rows = [self.key_store.head(g) for g in range(self.key_store.buf.shape[0])]
        # the store's rows are the decode's keys, and the queries its calibration's: an index writing into them would
        # change the attention computed from them (checked once per build; a step's search is not, for its time)
        before = protocol.input_sums(self.key_store.buf[:, :self.n_rows], queries)
        shared = per_kv_head or not cls.uses_train_queries  # one index per KV head serves its group
        if cls.uses_train_queries:
            if queries is None:
                raise ValueError("attention-aware index needs the prefill queries")
            items = [(i if per_kv_head else i // self.group,
                      {"train_queries": np.ascontiguousarray(queries[i]),
                       **({} if train_topk is None else {"train_topk": train_topk[i]}),
                       **(self._others(i, queries, train_topk) if others else {}), **(positions or {})})
                     for i in range(len(rows) if per_kv_head else self.n_heads)]
        else:
            items = [(g, {}) for g in range(len(rows))]
        params = self.plan.build_params
        # a lone index after the prefill keeps the libraries' full teams on this thread (map_one_thread); a worker
        # has one thread
        if processes is not None and can_build(cls) and (beside or len(items) > 1):
            with processes.spooled_build(cls, params, rows, items) as (built, spool):
                self._built(built, shared, queries, before)
                if then is not None:
                    then(spool)
        else:
            self._built(map_one_thread(lambda item: cls(**params).build(rows[item[0]], **item[1]), items, beside),
                        shared, queries, before)
        self.build_s = time.perf_counter() - t0

    def _built(self, built: list, shared: bool, queries: np.ndarray | None = None, before=None) -> None:
        """Take the indexes ``built`` (one per KV head where ``shared``, serving its GQA group), once the store's keys
        and ``queries`` are checked unchanged where ``before`` has their sums."""
        self.indexes = [built[h // self.group] for h in range(self.n_heads)] if shared else built
        if before is not None and protocol.input_sums(self.key_store.buf[:, :self.n_rows], queries) != before:
            raise protocol.inputs_changed(self.plan.name)
        for index in built:  # its size is read at the run's end (cpu_bytes): refused now, not after every step
            protocol.held_bytes(self.plan.name, index)
        self.n_indexed = self.n_rows
        self._bound = None
        self._sum_values()

    def scan_exactly(self) -> None:
        """Serve the layer by an exact scan (``flat``: one per KV head, the exact top-k of every indexed key) in place of
        its indexes: what calibration does where raising their search would read more than the scan
        (:mod:`decode.calibrate`)."""
        flat = registry.get("flat")
        self.plan = IndexPlan(flat.name)
        self._built([flat().build(self.key_store.head(g)) for g in range(self.key_store.buf.shape[0])], shared=True)

    def _others(self, head: int, queries: np.ndarray, train_topk: np.ndarray | None) -> dict[str, np.ndarray]:
        """``group_queries`` (and ``group_topk``) of query head ``head``: its GQA group's other heads' newest rows
        (:func:`indexes.group_queries.other_heads`); none for a group of one."""
        first = head - head % self.group
        own = head - first
        group = other_heads(list(queries[first:first + self.group]), own)
        if group is None:
            return {}
        if train_topk is None:
            return {"group_queries": group}
        return {"group_queries": group, "group_topk": other_heads(list(train_topk[first:first + self.group]), own)}

    @property
    def keys(self) -> np.ndarray:
        """(G, capacity, d) keys, rows ``[0, n_rows)`` valid (the buffer is replaced when it grows)."""
        return self.key_store.buf

    @property
    def values(self) -> np.ndarray:
        return self.value_store.buf

    @property
    def n_rows(self) -> int:
        return self.key_store.n

    def _groups(self) -> list[list[int]]:
        """The heads of each distinct index (an index per KV head serves its GQA group)."""
        groups: dict[int, list[int]] = {}
        for h, index in enumerate(self.indexes):
            groups.setdefault(id(index), []).append(h)
        return list(groups.values())

    def _sum_values(self) -> None:
        """Value sums of each estimator's summaries (the store owns the values): once per build and after add."""
        self._summaries = {}
        for heads in self._groups():
            summ = self.indexes[heads[0]].summaries()
            if summ is not None:
                sums = summ.value_sums(self.values[heads[0] // self.group, : self.n_indexed])
                self._summaries.update({h: (summ, sums) for h in heads})

    def cpu_bytes(self) -> int:
        """Bytes of the layer's CPU side: the keys and values held (rows ``[0, n_rows)``; the buffers' spare capacity is
        untouched) and each distinct index's ``nbytes`` less the arrays it reads from this store or shares with an
        index counted before it (an index with its own copy of the keys, as faiss's flat, counts that copy;
        double-sparsity's query heads, one transposed copy of their KV head's keys)."""
        own, seen = 0, [self.keys]
        for heads in self._groups():
            index = self.indexes[heads[0]]
            arrays = index.held_arrays()
            shared = sum(a.nbytes for a in arrays if any(overlaps(a, b) for b in seen))
            own += protocol.held_bytes(type(index).name, index) - shared
            seen += arrays
        held = self.keys[:, : self.n_rows]
        return 2 * held.nbytes + own  # values: the keys' shape

    @property
    def supports_add(self) -> bool:
        return bool(self.indexes) and self.indexes[0].supports_add

    def extend(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Append tokens that left the recent window (G, t, d) to the store, then to the indexes when a batch is full."""
        self.key_store.append(keys)
        self.value_store.append(values)
        if self.supports_add and self.n_rows - self.n_indexed >= self.add_batch:
            new = self.keys[:, self.n_indexed:self.n_rows]
            for h, index in {id(ix): (h, ix) for h, ix in reversed(list(enumerate(self.indexes)))}.values():
                index.add(new[h // self.group])  # once per distinct index: rows its store (ours) holds already
            self.n_indexed = self.n_rows
            self._sum_values()
            self._bound = None

    # -- the CPU side of a decode step ---------------------------------------------------------------

    def _check(self, res: SearchResult, q: np.ndarray, k: int) -> None:
        """The index protocol on the heads' results (their ids index the store's rows, so a bad one must never reach
        the kernel): every rule, scores against the keys, on the first search after a build or add, then ids and
        counts (vectorised, a few µs); an estimate's rules on every step (its ids index the store's rows too, and
        numpy takes a negative one from the end: ~40-55 µs per index at 8K keys), the summaries' own after they
        change. The later steps' lighter checks start only once a first search has passed all of them."""
        owner = f"{self.plan.name} (layer {self.layer})"
        first = self._bound is None  # the first search since the indexes last changed
        if first:
            for h, index in enumerate(self.indexes):
                protocol.check_result(owner, tuple(a[h:h + 1] for a in res[:3]), 1, k, self.n_indexed, index.max_scanned(),
                                      q[h:h + 1], self.keys[h // self.group, :self.n_indexed])
        else:
            protocol.check_result(owner, res, self.n_heads, k, self.n_indexed, self._bound, check_scores=False)
        for heads in self._groups():  # the estimator rules, per distinct index on its rows of the result
            index = self.indexes[heads[0]]
            if index.estimates or res.estimate is not None:
                part = SearchResult(res.ids[heads], res.scores[heads], res.n_scanned[heads], None,
                                    None if res.estimate is None else res.estimate.rows(heads))
                if first:
                    protocol.check_estimate(owner, part, index)
                else:  # against the summaries the attention uses (taken, and checked, when the index last changed)
                    protocol.check_estimate(owner, part, index, self._summaries.get(heads[0], (None, None))[0])
        if first:  # later steps: ids and counts only, and the estimate against the summaries checked here
            self._bound = max(index.max_scanned() for index in self.indexes)

    def side(self, q: np.ndarray, scaling: float, hints: np.ndarray | None = None) -> SideResult:
        """Search each head's index with its query, then attend over the hits and the side-buffer (GIL released).

        Every index class is searched through its ``search_group`` (the protocol's hook: one call for
        the layer's heads; roargraph runs every head's graph search in one kernel, the default one
        batch per index shared by a GQA group). The side-buffer rows ``[n_indexed, n_rows)`` are
        passed to the attention kernel as a range, not gathered. ``hints``: rows every search also enters
        at (the copy hints, :mod:`decode.copy_hints`), given to index classes that take them (``takes_hints``).
        """
        t0, c0 = time.perf_counter(), time.thread_time()
        q = np.ascontiguousarray(q, dtype=np.float32)
        scanned = float("nan")
        n_bytes = 0
        estimate = None
        if self.indexes and self.n_indexed:
            k = min(self.topk, self.n_indexed)
            cls = type(self.indexes[0])
            extra = {}
            if hints is not None and cls.takes_hints:
                extra["hints"] = hints[hints < self.n_indexed]
            try:
                res = cls.search_group(self.indexes, q, k, **extra, **cls.scaled(self.plan.search_params, scaling))
            except IndexResultError:  # the index's name and the rule are in it
                raise
            except AnnsLabError as err:  # the index's name is in it (base.Index's checks of what its search returned)
                raise IndexFailed(f"layer {self.layer}: {err}") from err
            except (Exception, SystemExit) as err:  # a plugin's own: named (from the CPU side's thread it says neither)
                raise IndexFailed(f"layer {self.layer}: {self.plan.name}'s search raised {error_text(err)}") from err
            self._check(res, q, k)
            estimate = res.estimate
            rows = np.ascontiguousarray(res.ids)
            scanned = float(res.n_scanned.mean()) / self.n_indexed
            n_bytes = int(res.bytes_read.sum())
        else:
            rows = np.empty((self.n_heads, 0), np.int64)
        # The CPU clock read first here and last at the start: its interval then lies inside the wall clock's, so a
        # search that never waits reads CPU ≤ wall (thread_time is a system call of about a microsecond).
        c1 = time.thread_time()
        t1 = time.perf_counter()
        out, m, z = attend_rows_and_range(q, self.keys, self.values, rows, self.n_indexed, self.n_rows, float(scaling))
        if estimate is not None and not estimate.is_empty:
            out, m, z = self._add_estimate(q, float(scaling), estimate, out, m, z)
        t2 = time.perf_counter()
        return SideResult(out, m, z, t1 - t0, t2 - t1, scanned, n_bytes, c1 - c0)

    def _add_estimate(self, q: np.ndarray, scaling: float, estimate: Estimate, out: np.ndarray, m: np.ndarray,
                      z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The exact partial (out, m, z) merged with each head's weighted estimate (samples and summaries)."""
        o_e, m_e, z_e = np.zeros_like(out), np.full_like(m, -np.inf), np.zeros_like(z)
        for h in range(self.n_heads):
            g = h // self.group
            summ, sums = self._summaries.get(h, (None, None))
            terms = estimate_terms(q[h], self.keys[g], self.values[g], scaling, *estimate.row(h), summ, sums)
            o_e[h], m_e[h], z_e[h] = weighted_partial(*terms)
        keep = (z > 0) | (z_e > 0)  # a head with neither part stays empty (output 0, max −inf, normaliser 0)
        with np.errstate(invalid="ignore", divide="ignore"):  # those heads' 0/0 is replaced below
            merged = merge(out, m, z, o_e, m_e, z_e)
            m_all = np.maximum(m, m_e)
            z_all = np.where(z > 0, np.exp(m - m_all) * z, 0.0) + np.where(z_e > 0, np.exp(m_e - m_all) * z_e, 0.0)
        return np.where(keep[:, None], merged, 0.0), np.where(keep, m_all, -np.inf), z_all

