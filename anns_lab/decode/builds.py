"""A decode's index builds: one :class:`LayerStore` per long-range layer, built after the prefill or while it runs.

A long-range layer's keys, values and queries are complete once the prompt's last chunk has passed that
layer, while the later layers of that chunk still compute. :class:`EarlyBuilds` starts each such layer's
builds (every index mode's) on worker threads at that moment, so the build time that overlaps the prefill is
hidden from the time to first token. The stores are the ones :func:`build_stores` makes after the prefill
(same inputs, same builds): decoding is bit-identical either way. Only the prefill's last chunk overlaps: an
earlier chunk leaves every layer incomplete (a layer-major prefill would let layer L's build start after
L + 1 of the layers' passes over the whole prompt).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from functools import partial

import numpy as np
import torch

from anns_lab.decode import calibrate as calibration
from anns_lab.decode.options import LAYERS_AT_ONCE, MIN_LAYERS_AT_ONCE, calibrates
from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.dumps import rope
from anns_lab.errors import AnnsLabError, IndexFailed, error_text
from anns_lab.indexes import build_processes, registry
from anns_lab.indexes.group_queries import PER_HEAD, group_queries
from anns_lab.indexes.threads import (lower_priority, numba_threadsafe, settle, stopping_on,
                                     thread_budget)


def layer_store(lm, cache, n_ids: int, layer: int, plan: IndexPlan | None, settings, queries: np.ndarray | None,
                scaling: float | None = None, beside: bool = False) -> LayerStore:
    """The layer's CPU store of its non-window prefill keys/values (read from ``cache``, ``n_ids`` tokens long),
    with its indexes built from the layer's prefill ``queries`` (H, t, d) and, with ``settings.calibrate``, its search
    calibrated on their newest at the layer's softmax ``scaling``; ``beside``: the prefill still runs
    (:meth:`LayerStore.build`; the calibration's searches too run on the one-thread workers below its priority then)."""
    lo, hi = settings.window.outside(n_ids)
    layer_cache = cache.layers[layer]
    keys = layer_cache.keys[0, :, lo:hi].to("cpu", torch.float32).numpy()
    values = layer_cache.values[0, :, lo:hi].to("cpu", torch.float32).numpy()
    store = LayerStore(layer, lm.config.num_attention_heads, keys, values, settings.topk, plan, settings.add_batch,
                       settings.steps)
    calibrating = calibrates(settings.calibrate) and queries is not None
    if calibrating and scaling is None:
        raise ValueError("calibrating a layer's search needs its softmax scaling (the prefill records it)")
    newest = np.ascontiguousarray(queries[:, -calibration.QUERIES:]) if calibrating else None  # own positions
    aware = queries is not None and plan is not None and registry.get(plan.name).uses_train_queries
    if aware:
        kept = subsampled_positions(queries.shape[1], settings.train_queries)
        positions = kept + (n_ids - queries.shape[1])  # the prompt's newest where only they were kept (engine.kept_queries)
        if len(kept) < queries.shape[1]:
            queries = queries[:, kept]
        # Only the rows the build will learn from are prepared (at 8K a quarter: the move cost as much as a tenth of
        # a build), each as it would be among all; one index per query head only (a group's set is subsampled whole).
        rows = registry.get(plan.name)(**plan.build_params).train_rows(hi - lo, len(positions)) \
            if settings.train_group == "head" else None
        place = "own" if registry.get(plan.name).own_positions else rope.check_place(settings.train_positions)
        freqs = rope.inv_freq(lm.config, layer) if place != "own" else None  # moved to the decode steps' positions (dumps.rope)
        queries = rope.placed(queries, positions, n_ids, n_ids + settings.steps - 1, freqs, place, rows=rows)  # all heads at once
    per_kv = aware and settings.train_group not in PER_HEAD
    others = aware and settings.train_group == "unlisted" and registry.get(plan.name).accepts_group_queries
    if per_kv:  # one training set per KV head: its GQA group's queries
        group = queries.shape[0] // keys.shape[0]
        queries = np.stack([group_queries(list(queries[g * group:(g + 1) * group]), settings.train_group)
                            for g in range(keys.shape[0])])
    processes = build_processes.pool() if settings.build_processes and plan is not None \
        and build_processes.can_build(registry.get(plan.name)) else None
    in_worker: list = []  # with the builds in workers, the calibration too, on the indexes they left in the spool
    # an estimator's calibration reads the values (its output error), which the workers' spool does not hold
    then = partial(_calibrate_in_worker, processes, store, newest, settings.calibrate, scaling, in_worker) \
        if calibrating and processes is not None and not registry.get(plan.name).estimates else None
    where = {"key_positions": np.arange(lo, hi), "train_positions": positions if rows is None else positions[rows]} \
        if aware and registry.get(plan.name).reads_positions else None  # both the prompt's (InfLLM)
    store.build(queries, _device_lists(lm, plan, queries, layer_cache.keys[0, :, lo:hi], settings), per_kv_head=per_kv,
                others=others, beside=beside, processes=processes, then=then, positions=where)
    if calibrating and not in_worker:
        # in the store's build_s too (the decoder times its modes by the layers' spans, :meth:`EarlyBuilds.take`)
        t0 = time.perf_counter()
        store.calibration = calibration.calibrate(store, newest, settings.calibrate, scaling, beside)
        store.build_s += time.perf_counter() - t0
    return store


def _calibrate_in_worker(processes, store: LayerStore, newest: np.ndarray, target: float | str, scaling: float,
                         done: list, spool) -> None:
    """``store``'s calibration (:func:`calibrate.calibrate`) run in a worker on the indexes its builds left in ``spool``
    (:func:`calibrate_spooled`), and applied here (``done`` then holds True): its searches take the worker's GIL, not
    the decoding process's (a SmolLM2 8K layer's, one probe: 0.06 s alone, 0.7 s beside a thread running Python)."""
    store.calibration = processes.run(calibrate_spooled, spool, store.layer, store.n_heads, store.topk, store.plan,
                                      newest, target, scaling)
    done.append(True)
    if store.calibration is not None:
        calibration.apply(store, store.calibration)


def calibrate_spooled(spool, layer: int, n_heads: int, topk: int, plan: IndexPlan, newest: np.ndarray,
                      target: float | str, scaling: float):
    """:func:`calibrate.calibrate` of a layer whose indexes workers built (``spool``: their arrays and the key rows),
    in a worker, which imports it by name: the same indexes and probes as in the decoding process."""
    keys = build_processes.spooled_keys(spool)
    # the keys stand in for the values, which only an estimator's calibration reads (never run here: layer_store)
    store = LayerStore(layer, n_heads, keys, keys, topk, plan, add_batch=1, reserve=1)
    rows = [store.key_store.head(g) for g in range(len(keys))]
    store._built(build_processes.spooled_indexes(spool, rows), len(spool.heads) < n_heads)
    return calibration.calibrate(store, newest, target, scaling, change_store=False)  # applied in the decoder


WARM_KEYS = 2560  # keys per KV head of the layer :func:`warm_up` builds (fewer: faiss's k-means warns for pqcache's codebooks)
_WARMED: set = set()  # (plan, heads, KV heads, head dim) warmed in this process


def warm_up(lm, modes: list, settings, failed: list | None = None) -> float:
    """Compile (or load from numba's on-disk cache) what the index ``modes`` run at each of their plans, on a random
    layer of the model's shape (the step's kernel takes a layer's heads as a tuple: its arity is part of the
    signature), before anything is timed: the build, its calibration, a step's search and attention, an add.
    Otherwise a fresh install compiles them inside its first decode (SmolLM2 8K on 2 cores: the builds ~28 s longer,
    the first step ~6 s), and the time to first token counts it. Once per plan and shape in a process. Failures are
    left to the real builds, which report them with the real data (``failed`` gets each plan's error). Returns the
    seconds it took."""
    from anns_lab.decode.kernels import warmup as warm_step_kernels

    t0 = time.perf_counter()
    cfg = lm.config
    n_heads, n_kv = cfg.num_attention_heads, rope.kv_heads(cfg)
    dim = rope.head_dim(cfg)
    plans = {p.describe(): p for m in modes if m.kind == "index" for p in map(m.plan_for, lm.long_range_layers) if p}
    rng = np.random.default_rng(0)
    for described, plan in plans.items():
        if (described, n_heads, n_kv, dim) in _WARMED:
            continue
        keys, values = (rng.standard_normal((n_kv, WARM_KEYS, dim), dtype=np.float32) for _ in range(2))
        queries = rng.standard_normal((n_heads, WARM_KEYS // 2, dim), dtype=np.float32)
        try:
            store = LayerStore(-1, n_heads, keys, values, min(settings.topk, WARM_KEYS // 4), plan, settings.add_batch)
            cls = registry.get(plan.name)
            where = {"key_positions": np.arange(WARM_KEYS), "train_positions": np.arange(0, WARM_KEYS, 2)} \
                if cls.reads_positions else None
            store.build(queries if cls.uses_train_queries else None, positions=where)
            if calibrates(settings.calibrate):
                # a reading only: the steps below warm the mode's own search even where a real layer would be scanned
                calibration.calibrate(store, queries[:, -calibration.QUERIES:], settings.calibrate, dim ** -0.5,
                                      change_store=False)
            hints = np.arange(4, dtype=np.int64) if registry.get(plan.name).takes_hints else None
            store.side(queries[:, -1], dim ** -0.5, hints)
            store.extend(keys[:, :settings.add_batch], values[:, :settings.add_batch])
            store.side(queries[:, -1], dim ** -0.5, hints)
            _WARMED.add((described, n_heads, n_kv, dim))
        except (Exception, SystemExit) as err:  # noqa: BLE001 - a warm-up only: the real build says it
            if failed is not None:
                failed.append((described, err))
    warm_step_kernels()
    return time.perf_counter() - t0


def build_stores(lm, pre, mode, settings) -> tuple[dict[int, LayerStore], list[str], float]:
    """One LayerStore per long-range layer of ``mode``, built after the prefill ``pre`` as :class:`EarlyBuilds` builds
    them once a prefill has ended (several layers at once): (stores, notes, seconds)."""
    early = builds_after(lm, pre, mode, settings)
    try:
        stores, notes, seconds, _ = early.take(mode.name)
    finally:
        early.close()
    return stores, notes, seconds


def builds_after(lm, pre, mode, settings) -> EarlyBuilds:
    """Every long-range layer's builds of ``mode`` queued after the prefill ``pre`` (several layers at once)."""
    early = EarlyBuilds(lm, len(pre.ids), [mode], settings, pre.cache, pre.queries.get, pre.scaling)
    early.prefill_done()
    try:
        for layer in lm.long_range_layers:
            early.layer_done(layer)
    except BaseException:
        early.close()
        raise
    return early


def worker_indexes(modes: list) -> tuple[str, ...]:
    """The names of ``modes``' indexes that build in worker processes with ``--build-processes``
    (:func:`build_processes.can_build`)."""
    names = {p.name for m in modes if m.kind == "index" for p in m.plans()}
    return tuple(sorted(n for n in names if build_processes.can_build(registry.get(n))))


def start_build_processes(modes: list, settings) -> tuple[build_processes.BuildProcesses, float] | None:
    """With ``settings.build_processes``, the worker processes of the index builds, started (once per process, their
    kernels loaded) before a prefill's clock runs, and the seconds that took; None where there is nothing to start."""
    names = worker_indexes(modes)
    if not (settings.build_processes and names):
        return None
    t0 = time.perf_counter()
    workers = build_processes.pool(warm=names)
    return workers, time.perf_counter() - t0


def store_notes(stores: dict[int, LayerStore], settings) -> list[str]:
    """What a mode's table row should carry as notes: a side-buffer kept for good, the calibrated search."""
    notes = []
    # a layer scanned instead (decode.calibrate) serves by flat: the mode's own index is told by another, where one is
    first = next((s for s in stores.values() if s.calibration is None or s.calibration.exact_scan is None),
                 next(iter(stores.values()), None))
    if first is not None and first.indexes and not first.supports_add:
        notes.append(f"{first.plan.name} has no add(): tokens leaving the window are kept exactly in a CPU side-buffer")
    if calibrates(settings.calibrate) and first is not None and first.indexes:
        done = [s.calibration for s in stores.values() if s.calibration is not None]
        if done:
            notes.append(calibration.describe(done, settings.calibrate))
        elif calibration.store_grid(first.indexes) is None and type(first.indexes[0]).search_grid:  # several parameters (an index without any, as flat's exact scan, has none to set)
            notes.append(f"{first.plan.name} has several search grid parameters and names none to raise "
                         "(Index.calibrated_by): not calibrated")
    return notes


def layers_at_once(asked: int, modes: int = 1, indexes: int = 1) -> int:
    """Layers that build at once for ``asked`` (``--build-layers``; 0: auto, an index per thread of the budget for
    layers of ``indexes`` indexes (:func:`indexes_per_layer`), at least :data:`options.MIN_LAYERS_AT_ONCE`): at most the
    threads' budget, and one where several modes build (each mode's seconds its own) or numba's ``workqueue`` layer
    runs (it aborts on two parallel callers)."""
    budget = thread_budget()
    if asked == LAYERS_AT_ONCE:
        asked = max(MIN_LAYERS_AT_ONCE, budget // max(1, indexes))
    return max(1, min(asked, budget)) if modes == 1 and numba_threadsafe() else 1


def indexes_per_layer(lm, mode, settings) -> int:
    """The indexes one long-range layer of ``mode`` builds (:meth:`LayerStore.build`): one per query head for an
    attention-aware index trained per head, one per KV head for the others (key-only indexes, ``--train-group
    group|strided``); a query head's where the mode names no plan."""
    config = lm.config
    heads = config.num_attention_heads
    plan = mode.plan_for(lm.long_range_layers[0]) if lm.long_range_layers else None
    if plan is None:
        return heads
    per_head = registry.get(plan.name).uses_train_queries and (settings is None or settings.train_group in PER_HEAD)
    return heads if per_head else rope.kv_heads(config)


class EarlyBuilds:
    """The index modes' stores, built on worker threads from the moment the prefill's last chunk passes each layer.

    ``layer_done(layer)`` (from the attention hook, prefill thread) queues that layer's builds, mode by mode;
    ``prefill_done()`` marks the end of the prefill; ``take(mode)`` waits for that mode's stores and returns
    them with the wall seconds during which its builds ran and the part of those before the prefill ended (hidden).
    One mode (the decoder's case: each index mode has a prefill of its own) builds :func:`layers_at_once` layers at
    once (``--build-layers``, default auto: an index per thread of the budget, at least two) where the process gives
    its kernels two threads or more (:func:`threads.thread_budget`; not under numba's ``workqueue`` layer,
    :func:`threads.numba_threadsafe`): a layer at a time left a core idle at each layer's end (its last heads, the
    next layer's keys copied and queries moved, on one thread): at 8K the builds after the prefill took 1.14x as long
    (BENCHMARKS "Two layers at once after the prefill"). On the H200 host's 16 cores Gemma-3's three layers of four
    heads at once built in 4.2 s against 5.9 s two at a time, SmolLM2's eight layers of nine gained nothing over two
    (BENCHMARKS "The CUDA path, a third lease"). Each layer in flight holds its copies of the keys and moved queries (a
    Llama-3-8B layer at 128K: ~1 GB; the memory estimate counts them). Several modes build one layer at a time, so that
    each mode's seconds are its own builds' (a later mode's builds wait for the earlier ones without that wait being
    counted).
    """

    def __init__(self, lm, n_ids: int, modes: list, settings, cache, queries_of, scaling: dict[int, float]):
        self.lm, self.n_ids, self.modes, self.settings, self.cache = lm, n_ids, modes, settings, cache
        self.queries_of = queries_of  # layer -> (H, t, d) prefill queries or None, once the layer is complete
        self.scaling = scaling  # layer -> softmax scale (the prefill's record, filled by its first chunk)
        self.jobs: dict[str, dict[int, Future]] = {m.name: {} for m in modes}
        self.finished: dict[str, dict[int, tuple]] = {m.name: {} for m in modes}  # handed over early (:meth:`ready`)
        self.prefill_end: float | None = None
        self.ready_at: dict[int, float] = {}  # perf_counter when each layer was complete and its builds queued
        # numba's workqueue layer aborts the process when two threads run its parallel kernels at once: a layer at a time
        self.workers = layers_at_once(LAYERS_AT_ONCE if settings is None else settings.build_layers, len(modes),
                                      indexes_per_layer(lm, modes[0], settings) if lm is not None and modes else 1)
        # Below the prefill's priority, as the builds' own threads beside it (threads.lower_priority): what it runs
        # itself (the keys' copy, the queries' RoPE move, a budget of one's builds) must not slow the prefill either.
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="anns-early-build",
                                        initializer=lower_priority)
        self._stop = threading.Event()  # set at an error or interrupt: the layers building stop at their running heads

    def layer_done(self, layer: int) -> None:
        """Queue ``layer``'s builds (prefill thread); a build that has already failed is raised here instead, so that
        the prefill ends at once rather than after its last chunk (at 128K, minutes of it)."""
        failed = self._failure()
        if failed is not None:
            raise failed
        self.ready_at[layer] = time.perf_counter()
        queries = self.queries_of(layer)
        for mode in self.modes:
            self.jobs[mode.name][layer] = self._pool.submit(self._build, layer, mode.plan_for(layer), queries)

    def _build(self, layer: int, plan, queries) -> tuple[LayerStore, float, float]:
        t0 = time.perf_counter()
        # Beside the prefill, or beside another layer's builds: every kernel on one thread (a full team would spin
        # against the other work's threads), the index builds and the calibration on the lowered pool's threads.
        beside = self.prefill_end is None or self.workers > 1
        if self._stop.is_set():  # taken from the queue as the builds were being stopped
            raise CancelledError("stopped")
        try:
            with torch.inference_mode(), stopping_on(self._stop):  # inference tensors as the prefill's (per thread)
                store = layer_store(self.lm, self.cache, self.n_ids, layer, plan, self.settings, queries,
                                    self.scaling.get(layer), beside=beside)
        except CancelledError:  # stopped (threads.stopping_on): another layer's error is the one to tell
            raise
        except (Exception, SystemExit) as err:  # a plugin's sys.exit would end the decode without a word
            self._stop.set()  # the layers building stop at their running heads, the queued ones do not start
            raise _named(err, layer, plan) from err
        return store, t0, time.perf_counter()

    def _failure(self) -> BaseException | None:
        """The error of a build that has failed so far (not one only stopped), or None."""
        for jobs in self.jobs.values():
            for f in jobs.values():
                if f.done() and not f.cancelled():
                    err = f.exception()
                    if err is not None and not isinstance(err, CancelledError):
                        return err
        return None

    def prefill_done(self) -> None:
        self.prefill_end = time.perf_counter()

    def wait(self, progress: bool = False) -> None:
        """Block until every queued build has finished (decoding must not share the CPU with them); re-raises a build's
        error (or an interrupt) once it happens, the builds still queued then cancelled rather than left to hold the CPU
        and the cache (:func:`threads.settle`). ``progress``: a bar over the layers' builds (at 8K on two cores a
        minute passed in silence after the prefill)."""
        from tqdm.auto import tqdm

        futures = [f for jobs in self.jobs.values() for f in jobs.values()]
        bar = tqdm(total=len(futures), unit="layer", desc="index builds", disable=not progress or len(futures) < 2)
        for f in futures:  # from the builds' threads, or at once for those already done
            f.add_done_callback(lambda _: bar.update(1))
        try:  # at a layer's error, not after the layers queued before it: the others meanwhile built on for nothing
            settle(futures, self._stop)
        finally:
            self.close()
            bar.close()

    def close(self) -> None:
        """Stop the builds: the layers queued are cancelled, those building stop at their heads then running."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def has(self, name: str) -> bool:
        return bool(self.jobs.get(name))

    def ready(self, name: str) -> dict[int, LayerStore]:
        """The stores of mode ``name`` whose builds have ended since the last call, without waiting (the decoder's
        steps poll it with ``--until-built exact``); a failed build's error is raised here, the others stopped."""
        jobs = self.jobs[name]
        ended = sorted(layer for layer, f in jobs.items() if f.done())
        if any(jobs[layer].exception() is not None for layer in ended if not jobs[layer].cancelled()):
            self.take(name)  # raises the first error once the builds still running have stopped
        out = {}
        for layer in ended:
            self.finished[name][layer] = done = jobs.pop(layer).result()
            out[layer] = self._spanned(layer, *done)
        return out

    def take(self, name: str) -> tuple[dict[int, LayerStore], list[str], float, float]:
        """(stores, notes, build seconds, of which hidden behind the prefill) of mode ``name``, those :meth:`ready`
        handed over too; its jobs are handed over once (a second run of the mode builds afresh)."""
        jobs = self.jobs.pop(name)
        done = dict(zip(sorted(jobs), settle([f for _, f in sorted(jobs.items())], self._stop)))
        done = dict(sorted((self.finished.pop(name, {}) | done).items()))
        stores = {layer: self._spanned(layer, *d) for layer, d in done.items()}
        end = self.prefill_end if self.prefill_end is not None else float("inf")
        spans = [(t0, t1) for _, t0, t1 in done.values()]
        return stores, store_notes(stores, self.settings), covered(spans), covered(spans, end)

    def _spanned(self, layer: int, store: LayerStore, t0: float, t1: float) -> LayerStore:
        """``store`` with its ``layers_at_once`` (this pool's workers) and ``build_span``: when its builds were queued,
        started and ended, from the prefill's end
        (where the first token's wait went, layer by layer)."""
        store.layers_at_once = self.workers
        store.build_span = tuple(t - self.prefill_end for t in (self.ready_at[layer], t0, t1)) \
            if self.prefill_end is not None else None
        return store


def _named(err: BaseException, layer: int, plan: IndexPlan | None) -> IndexFailed:
    """``err``, raised building ``layer``'s store, as one line that names the layer and the index (a plugin's own error
    names neither, and with two layers at once the traceback does not say which)."""
    if isinstance(err, AnnsLabError):  # the index's name is in it (base.Index's checks: "flat: keys contain NaN ...")
        return IndexFailed(f"building layer {layer}'s indexes: {err}")
    what = plan.name if plan is not None else "its store"
    return IndexFailed(f"building layer {layer}'s indexes: {what} raised {error_text(err)}")


def covered(spans: list[tuple[float, float]], end: float = float("inf")) -> float:
    """The seconds of the union of the ``(start, stop)`` spans before ``end``: layers built at once count once."""
    total, reach = 0.0, float("-inf")
    for t0, t1 in sorted(spans):
        t0, t1 = max(t0, reach), min(t1, end)
        if t1 > t0:
            total += t1 - t0
        reach = max(reach, t1)
    return total


def _device_lists(lm, plan, queries: np.ndarray | None, keys: torch.Tensor, settings) -> np.ndarray | None:
    """The training queries' top lists computed where the keys are (``device_lists``), for an index that takes
    them, when ``settings.lists_on_device`` (default: the model is on CUDA); else None (the build computes them)."""
    on = settings.lists_on_device if settings.lists_on_device is not None else torch.device(lm.model.device).type == "cuda"
    if not on or plan is None or queries is None:
        return None
    cls = registry.get(plan.name)
    if not (cls.uses_train_queries and cls.accepts_train_topk):
        return None
    from anns_lab.decode.device_lists import train_topk

    width = cls.train_topk_width(keys.shape[1], **plan.build_params)
    return train_topk(queries, keys, width, queries.shape[0] // keys.shape[0])


def subsampled_positions(t: int, n: int) -> np.ndarray:
    """The positions of at most ``n`` of ``t`` prefill queries, evenly spaced and always including the last one."""
    if n <= 0 or t <= n:
        return np.arange(t)
    return np.linspace(t - 1, 0, n).round().astype(np.int64)[::-1]


def subsample(queries: np.ndarray | None, n: int) -> np.ndarray | None:
    """At most ``n`` prefill queries (H, t, d), evenly spaced and always including the last one."""
    if queries is None or n <= 0 or queries.shape[1] <= n:
        return queries
    return np.ascontiguousarray(queries[:, subsampled_positions(queries.shape[1], n)])
