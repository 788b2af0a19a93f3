"""The generation loop: a full-attention chunked prefill, then greedy decoding per mode.

A prefill can serve several modes (the cache is copied per mode); the prefills of one prompt
compute the same cache, so ``full`` is measured on exactly the same prompt state as the retrieval
modes (:func:`anns_lab.decode.runner.prefill_groups` says which modes share one). Each retrieval mode builds its
indexes on the non-window prefill keys of every long-range layer (timed as ``build_s``), from the
moment the prompt's last chunk has passed that layer (:mod:`anns_lab.decode.builds`: the part that
overlaps the prefill is ``build_hidden_s``), and decodes with :mod:`anns_lab.decode.attention`. In retrieval modes
the decode cache is not a copy of the prefill cache: its long-range layers hold only the
static window (:mod:`anns_lab.decode.cache`), the rest being in the CPU stores, so the
accelerator's KV is O(window) rather than O(context); ``full`` decodes on a copy of the whole cache.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from anns_lab import stops
from anns_lab.decode import calibrate as calibration
from anns_lab.decode.attention import DecodeError, Retrieval, StepTimes, retrieving, sync
from anns_lab.decode.builds import EarlyBuilds, build_stores, builds_after
from anns_lab.decode.cache import device_kv_bytes, narrow_layer, require_ring, window_cache
from anns_lab.decode.copy_hints import CopyHints
from anns_lab.decode.options import Settings, calibrates, mode_kind
from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.dumps.models import forward_tokens
from anns_lab.errors import IndexConfigError
from anns_lab.indexes import group_queries, registry
from anns_lab.io import is_int
from anns_lab.window import Window


@dataclass
class Mode:
    """A decoding mode: ``full``, ``window``, or an index (one plan for every layer, or per layer)."""

    name: str
    plan: IndexPlan | None = None
    per_layer: dict[int, IndexPlan] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return mode_kind(self.name)

    def plan_for(self, layer: int) -> IndexPlan | None:
        return self.per_layer.get(layer, self.plan)

    def uses_queries(self, settings: "Settings | None" = None) -> bool:
        """Whether the prefill must keep the long-range layers' queries for this mode: to train an attention-aware
        index, or to calibrate any index's search (``settings.calibrate``)."""
        if self.kind != "index":
            return False
        if settings is not None and calibrates(settings.calibrate):
            return True
        return any(registry.get(p.name).uses_train_queries for p in self.plans())

    def plans(self) -> list[IndexPlan]:
        """Every index plan of the mode: its own and its layers' (none for ``full`` and ``window``)."""
        return [p for p in [self.plan, *self.per_layer.values()] if p is not None]


def kept_queries(modes: list[Mode], settings: "Settings") -> int | None:
    """How many of each head's newest prefill queries a prefill for ``modes`` keeps per long-range layer when it keeps
    any (:meth:`Mode.uses_queries`): all of them (None) where an attention-aware index may read any, else the most
    that its indexes read (:meth:`Index.newest_train_queries`: SnapKV's window) and a calibration reads
    (:data:`calibrate.QUERIES`, with ``settings.calibrate``); at 128K on Gemma-3 all of them are ~1.6 GB. All of them
    too where fewer could change what the build is given: ``settings.train_queries`` strides over them all, a
    ``--train-group`` other than ``head`` mixes or ranks a head's rows by their count, and queries moved by RoPE
    (an index without ``own_positions``) are placed by a draw over them all."""
    needs = [calibration.QUERIES] if calibrates(settings.calibrate) else []
    for mode in modes:
        for plan in mode.plans():
            cls = registry.get(plan.name)
            if cls.uses_train_queries:
                newest = cls(**plan.build_params).newest_train_queries()
                if newest is not None and not (is_int(newest) and newest >= 1):  # a plugin's word, checked before a prefill
                    raise IndexConfigError(f"{plan.name}: newest_train_queries() is {newest!r}, not None or a whole "
                                           "number of queries >= 1")
                if newest is None or settings.train_queries or settings.train_group != "head" or not cls.own_positions:
                    return None
                needs.append(newest)
    return max(needs, default=calibration.QUERIES)  # none: no mode keeps any


@dataclass
class Prefilled:
    """The state after a full-attention prefill: cache, last logits, captured queries, time."""

    ids: list[int]
    cache: object
    logits: torch.Tensor
    queries: dict[int, np.ndarray]
    seconds: float
    early: EarlyBuilds | None = None  # the index modes' builds started during the prefill (run_mode takes them)
    scaling: dict[int, float] = field(default_factory=dict)  # each long-range layer's softmax scale


@dataclass
class ModeRun:
    """What one mode produced from one prefill: tokens, optional per-step logits, timings."""

    mode: str
    tokens: list[int]
    logits: list[torch.Tensor]
    build_s: float
    decode_s: float
    steps: list[StepTimes]
    step_s: list[float]
    notes: list[str] = field(default_factory=list)
    device_kv_bytes: int = 0  # keys + values held by the decode cache (on the accelerator) at the end of decoding
    build_hidden_s: float = 0.0  # of build_s, the seconds that ran while the prefill was still running
    cpu_bytes: int = 0  # CPU-side stores and indexes of the long-range layers at the end of decoding
    cpu_keys: int = 0  # tokens those stores held, summed over the layers
    prefill_s: float = 0.0  # the prefill this run decoded from (with any builds that overlapped it), seconds
    calibration: dict = field(default_factory=dict)  # layer -> {param, value, weight_recall, tried, per_head, target; an estimator's output_error, bound; exact_scan: the value's bytes over a scan's, where the layer was scanned instead} where the search was calibrated
    build_layers: dict = field(default_factory=dict)  # layer -> [queued, started, ended]: its builds, seconds from the prefill's end (built after it: from the mode's build start)
    exact_steps: int | None = None  # --until-built exact: the leading decode steps in which a layer attended its whole cache (its index still building)
    hand_over_steps: dict = field(default_factory=dict)  # --until-built exact: layer -> the first step its index served (None: no step)
    layers_at_once: int | None = None  # layers its builds ran at once (--build-layers as resolved: auto, the threads' budget)
    setup_s: float = 0.0  # from its indexes ready (the run's start for the others) to its first step: the cache cut to the window, the hooks
    forced_steps: int = 0  # --question-after-prefill: the leading steps that fed the question (the last of them gives the answer's first token)
    question_calibration: dict = field(default_factory=dict)  # --calibrate-question: as calibration, read on the question's steps before its last (in that step's time)
    error: str | None = None  # the mode failed on this prompt (its indexes' build or search broke): why, in words
    trace: str | None = None  # and where: the error's traceback, its cause's (a plugin's own line) included


def prefill(lm, ids: list[int], settings: Settings, capture_queries: bool, build_modes: list[Mode] = (),
            progress: bool = False, newest_queries: int | None = None) -> Prefilled:
    """Chunked full-attention prefill of ``ids``; keeps long-range layers' queries when asked (with ``newest_queries``
    only each head's newest so many: :func:`kept_queries`). The index modes
    ``build_modes`` start their builds while it runs (:class:`builds.EarlyBuilds`, when
    ``settings.build_during_prefill``): call ``pre.early.wait()`` before decoding. ``progress``: a progress bar
    over the chunks (on stderr) when the prompt spans several."""
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    warm_accelerator(lm, ids, settings)
    cache = DynamicCache(config=lm.model.config)
    ctl = Retrieval(lm.long_range_layers, "full", settings.window, capture_queries, newest_queries, len(ids))
    early = None
    if settings.build_during_prefill and any(m.kind == "index" for m in build_modes):
        early = EarlyBuilds(lm, len(ids), [m for m in build_modes if m.kind == "index"], settings, cache,
                            ctl.prefill_queries if capture_queries else (lambda layer: None), ctl.scaling)
    t0 = time.perf_counter()
    logits = None
    bar = tqdm(total=len(ids), unit="tok", desc=f"prefill {lm.name}", disable=not progress or len(ids) <= settings.chunk)
    try:
        with torch.inference_mode(), retrieving(lm.model, ctl):
            for start in range(0, len(ids), settings.chunk):
                end = min(start + settings.chunk, len(ids))
                if end == len(ids) and early is not None:
                    ctl.layer_done = early.layer_done  # the last chunk completes each long-range layer as it passes it
                logits = forward_tokens(lm, cache, ids, start, end)
                bar.update(end - start)
                stops.check()  # a Ctrl-C a finalizer swallowed (stops.py): stop between chunks
        sync(lm.model.device)
        check_finite(logits[0, -1], f"the full-attention prefill of {len(ids)} tokens through {lm.name}")
    except BaseException:
        if early is not None:
            early.close()
        raise
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    if early is not None:
        early.prefill_done()
    queries = {layer: ctl.prefill_queries(layer) for layer in lm.long_range_layers} if capture_queries else {}
    return Prefilled(list(ids), cache, logits[0, -1].float(), queries, seconds, early, ctl.scaling)


def warm_accelerator(lm, ids: list[int], settings: Settings) -> None:
    """On an accelerator, an untimed forward of the prompt's first chunk and then of one more token through a throwaway
    cache, so that the timed prefill and first decode step after it find the CUDA context, cuBLAS handles and the
    model's kernels of both shapes loaded, as a serving process does (an index mode's own step kernels, its window
    attention and merge, still load in its first step: against it, not for it). Without it the first prefill and step
    of a process (``full``'s, which runs first) would carry that one-off cost and flatter every other mode's time to
    first token against it. On the CPU there is no such cost worth a chunk's forward."""
    if lm.model.device.type != "cpu" and len(ids) > 1:
        forward_untimed(lm, ids[:min(settings.chunk, len(ids) - 1) + 1], settings)


def forward_untimed(lm, ids: list[int], settings: Settings) -> None:
    """A forward of ``ids`` (at least two) but the last through the full-attention path and a throwaway cache, then of
    the last alone (a decode step's shape); nothing is kept."""
    from transformers import DynamicCache

    ctl = Retrieval(lm.long_range_layers, "full", settings.window, False)
    cache = DynamicCache(config=lm.model.config)
    with torch.inference_mode(), retrieving(lm.model, ctl):
        forward_tokens(lm, cache, ids, 0, len(ids) - 1)
        ctl.phase = "decode"
        forward_tokens(lm, cache, ids, len(ids) - 1, len(ids))
    sync(lm.model.device)


def run_mode(lm, pre: Prefilled, mode: Mode, settings: Settings, max_new: int, stop_ids=(),
             teacher: list[int] | None = None, keep_logits: bool = False, keep_cache: bool = False,
             forced: list[int] = ()) -> ModeRun:
    """Greedy decoding (or teacher forcing with ``teacher``) from a copy of the prefill state; ``forced``: tokens fed
    first, one decode step each, through the mode's attention (a question asked after the prefill), then ``max_new``
    greedy ones (the run's tokens are those).

    ``keep_cache`` keeps the decode cache on the result (``run.cache``, for inspection); by default it
    is freed with the run's end, so that runs kept for their timings do not hold accelerator memory.
    """
    stores, notes, build_s, hidden_s = {}, [], 0.0, 0.0
    building = None  # --until-built exact: the builds still running while the decode steps attend the layers whole
    if mode.kind == "index" and settings.until_built == "exact" and teacher is None:
        building = pre.early if pre.early is not None and pre.early.has(mode.name) else builds_after(lm, pre, mode, settings)
    elif mode.kind == "index" and pre.early is not None and pre.early.has(mode.name):
        stores, notes, build_s, hidden_s = pre.early.take(mode.name)
    elif mode.kind == "index":
        stores, notes, build_s = build_stores(lm, pre, mode, settings)
    ready = time.perf_counter()  # what follows until the first step is in the time to first token too
    threads = torch.get_num_threads()  # set again after the steps that leave the builds a core
    try:
        if stores or building is not None:
            from anns_lab.decode.kernels import warmup

            warmup()
        ctl = Retrieval(lm.long_range_layers, mode.kind, settings.window, False)
        ctl.stores = stores
        ctl.whole = set(lm.long_range_layers) if building is not None else set()
        ctl.phase = "decode"
        plans = [mode.plan_for(layer) for layer in lm.long_range_layers] if mode.kind == "index" else []
        if settings.copy_hints > 0 and any(registry.get(name).takes_hints for name in {p.name for p in plans if p is not None}):
            ctl.hints = CopyHints(settings.copy_hints)  # only where a search uses them: the others' steps do not pay for them
        exact_steps, handed = 0, {}
        probed = question_probes(mode, settings, teacher, len(forced))
        if probed:
            ctl.step_queries = {}
        raised: dict = {}
        if building is not None:
            torch.set_num_threads(steps_threads(lm.model.device, threads))
        with torch.inference_mode():  # the prefill's tensors are inference tensors; so are the copies
            if mode.kind == "full":
                cache = copy.deepcopy(pre.cache)
            else:  # long-range layers keep the window only; the tokens they evict go to ctl.evicted
                cache = window_cache(pre.cache, lm.long_range_layers, settings.window, ctl.evicted, ctl.whole)
        ids = list(pre.ids)
        logits = pre.logits
        out_tokens, all_logits, steps, step_s = [], [], [], []
        n_steps = len(teacher) if teacher is not None else len(forced) + max_new
        t0 = time.perf_counter()
        setup_s = t0 - ready
        with torch.inference_mode(), retrieving(lm.model, ctl):
            for i in range(n_steps):
                if keep_logits:
                    all_logits.append(logits.detach().to("cpu"))
                tok = teacher[i] if teacher is not None else forced[i] if i < len(forced) else int(logits.argmax())
                if i >= len(forced):
                    out_tokens.append(tok)
                    if teacher is None and (tok in stop_ids or i == n_steps - 1):
                        break
                ids.append(tok)
                ts = time.perf_counter()
                if building is not None:  # in the step's time: a layer whose build has ended goes over to its index
                    whole = set(ctl.whole)
                    hand_over(ctl, cache, building.ready(mode.name), settings.window)
                    handed |= dict.fromkeys(whole - ctl.whole, len(step_s))
                    exact_steps += bool(ctl.whole)  # a layer still building: attended whole this step
                    if not ctl.whole:
                        torch.set_num_threads(threads)
                if ctl.hints is not None:  # in the step's time: the decoder pays for its hints
                    ctl.hints.update(ids)
                if probed and i == probed:  # in the step's time: the answer's first token waits for it
                    raised = calibrate_on_steps(ctl, settings.calibrate, pre.scaling)
                logits = forward_tokens(lm, cache, ids, len(ids) - 1, len(ids))[0, -1].float()
                sync(lm.model.device)
                step_s.append(time.perf_counter() - ts)
                steps.append(ctl.take_times())
                check_finite(logits, f"--mode {mode.name} at decode step {i + 1} of {n_steps}")  # outside its time
                stops.check()
        if teacher is not None and keep_logits:
            all_logits.append(logits.detach().to("cpu"))
        decode_s = time.perf_counter() - t0
        if building is not None:  # the builds that outlasted the decode: waited for after it, for the run's record
            try:
                built, notes, build_s, hidden_s = building.take(mode.name)
            finally:
                building.close()
            with torch.inference_mode():  # the cache's tensors are inference tensors
                hand_over(ctl, cache, {layer: s for layer, s in built.items() if layer in ctl.whole}, settings.window)
            stores = ctl.stores
    except BaseException:  # the builds must not outlive the run (an interrupt, a build's or a step's error)
        if building is not None:
            building.close()
        raise
    finally:
        if building is not None:
            torch.set_num_threads(threads)
    run = ModeRun(mode.name, out_tokens, all_logits, build_s, decode_s, steps, step_s, notes, device_kv_bytes(cache),
                  hidden_s, sum(s.cpu_bytes() for s in stores.values()), sum(s.n_rows for s in stores.values()),
                  pre.seconds)
    run.calibration = {layer: calibration_record(s.calibration) for layer, s in stores.items()
                       if s.calibration is not None}
    run.build_layers = {layer: [round(t, 4) for t in s.build_span] for layer, s in stores.items()
                        if s.build_span is not None}
    run.layers_at_once = next((s.layers_at_once for s in stores.values() if s.layers_at_once is not None), None)
    if building is not None:
        run.exact_steps = exact_steps
        run.hand_over_steps = {layer: handed.get(layer) for layer in lm.long_range_layers}
    run.setup_s = setup_s
    run.forced_steps = min(len(forced), len(step_s))
    run.question_calibration = {layer: calibration_record(c) for layer, c in raised.items()}
    if raised:
        run.notes.append("again, before the answer: " + calibration.describe(
            list(raised.values()), settings.calibrate, f"the queries of the question's first {probed} steps"))
    run.cache = cache if keep_cache else None
    run.stores = stores  # kept for inspection (tests, index sizes)
    return run


def calibration_record(c: "calibration.Calibration") -> dict:
    """A layer's calibration as the JSON keeps it (:attr:`ModeRun.calibration`)."""
    return ({"param": c.param, "value": c.value, "weight_recall": c.weight_recall,
             "tried": {str(v): r for v, r in c.tried.items()},  # each probe's value -> its reading
             "per_head": list(c.per_head),  # each query head's reading at the value set
             "target": c.target}
            | ({"output_error": c.output_error, "bound": c.bound} if c.output_error is not None else {})
            | ({"exact_scan": c.exact_scan} if c.exact_scan is not None else {}))


def question_probes(mode: Mode, settings: Settings, teacher, n_forced: int) -> int:
    """With ``settings.calibrate_question``: how many of the question's steps (all but its last, whose logits give
    the answer's first token) an index mode's searches are raised again on (:func:`calibrate_on_steps`); else 0."""
    on = settings.calibrate_question and mode.kind == "index" and teacher is None and calibrates(settings.calibrate)
    return max(0, n_forced - 1) if on else 0


def calibrate_on_steps(ctl: Retrieval, target: float | str, scaling: dict[int, float]) -> dict:
    """Each store's search raised where the decode steps' queries that ``ctl`` recorded (``step_queries``) find less
    than ``target`` (:func:`calibrate.calibrate`, which never lowers it); recording stops. Returns the layers'
    :class:`calibrate.Calibration`."""
    steps, ctl.step_queries = ctl.step_queries, None
    found = {}
    for layer, rows in sorted(steps.items()):
        if (c := calibration.calibrate(ctl.stores[layer], np.stack(rows, axis=1), target, scaling[layer])) is not None:
            found[layer] = c
    return found


def check_finite(logits: torch.Tensor, where: str) -> None:
    """Refuse logits with a NaN or an infinity: greedy decoding and the KL read them as numbers, and a broken model
    (e.g. a bad --rope-scaling) scored a KL of nan and a top-1 agreement of 100%."""
    if not bool(torch.isfinite(logits).all()):
        raise DecodeError(f"{where}: the logits are not finite (NaN or infinity): the model, its configuration (e.g. "
                          "--rope-scaling) or this mode's attention is broken; nothing it scored would be a measurement")


def steps_threads(device: torch.device, threads: int) -> int:
    """torch's threads for the decode steps while layers are still whole (``--until-built exact``): where torch runs on
    the CPU, one fewer, so that the builds have a core (beside steps on every core they advanced ~6× slower than alone
    and the index served no step of a 400-token answer on 2 cores: BENCHMARKS "Decoding while the indexes build")."""
    return max(1, threads - 1) if torch.device(device).type == "cpu" else threads


def hand_over(ctl: Retrieval, cache, built: dict[int, LayerStore], window: Window) -> None:
    """Each ``built`` layer, attended whole until now, goes over to its store: its cache is cut to the window, and the
    tokens that left the window since the prompt are appended to the store (into its index by ``add_batch``, as a
    step's are)."""
    for layer, store in built.items():
        keys, values = narrow_layer(cache, layer, window, ctl.evicted, window.sink + store.n_rows)
        if keys.shape[1]:
            store.extend(keys.to("cpu", torch.float32).numpy(), values.to("cpu", torch.float32).numpy())
        ctl.stores[layer] = store
        ctl.whole.discard(layer)


def warmup_steps(run: ModeRun) -> int:
    """Leading decode steps of ``run`` its per-token means leave out: those in which a layer was still attended whole
    while its index built (``--until-built exact``: their times are the builds' contention and full attention, not the
    index's), then the first (the first search on the run's new indexes: cold caches, the search threads waking; until
    ``builds.warm_up`` it also compiled numba's search kernels) where at least two more follow it."""
    exact = run.exact_steps or 0
    return exact + (1 if len(run.step_s) - exact >= 3 else 0)


def exact_seconds(run: ModeRun) -> float:
    """Wall time of ``run``'s leading steps with a layer still whole (``--until-built exact``), the set-up before the
    first included, seconds."""
    return (run.setup_s if run.exact_steps else 0.0) + float(np.sum(run.step_s[:run.exact_steps or 0]))


def first_step_seconds(run: ModeRun) -> float | None:
    """The first decode step (the second token: the prefill's logits give the first), with the set-up before it (the
    cache cut to the window, the decoder's hooks): in the time to first token, not in the per-token means. With a
    question fed after the prefill, its steps instead: the last of them gives the answer's first token."""
    return run.setup_s + float(np.sum(run.step_s[:max(1, run.forced_steps)])) if run.step_s else None


def summarize(run: ModeRun, skip: int | None = None) -> dict:
    """Per generated token means (ms) of retrieval, CPU attention, accelerator attention, merge, other; tokens/s.
    ``skip``: leading steps left out of the means (default :func:`warmup_steps`; runner._pool passes 0 for the steps
    of several runs, each already without its own)."""
    skip = warmup_steps(run) if skip is None else skip
    first_step = first_step_seconds(run)
    cpu = {"cpu_bytes_per_key": run.cpu_bytes / run.cpu_keys} if run.cpu_keys else {}
    if run.exact_steps is not None:  # --until-built exact
        cpu |= {"exact_steps": run.exact_steps, "exact_s": exact_seconds(run)}
    run = ModeRun(run.mode, run.tokens, [], run.build_s, run.decode_s, run.steps[skip:], run.step_s[skip:],
                  device_kv_bytes=run.device_kv_bytes, build_hidden_s=run.build_hidden_s)
    n = len(run.step_s)
    if n == 0:
        return {"steps": 0, "device_kv_bytes": run.device_kv_bytes, "build_s": run.build_s,
                "build_hidden_s": run.build_hidden_s, "first_step_s": first_step} | cpu

    def ms(values) -> float:
        return 1000.0 * float(np.mean(values))

    other = [w - (s.insert + s.overlap + s.merge) for w, s in zip(run.step_s, run.steps)]
    scanned = [x for s in run.steps for x in s.scanned]
    return {
        "steps": n,
        "retrieval_ms": ms([s.retrieval for s in run.steps]),
        "retrieval_cpu_ms": ms([s.retrieval_cpu for s in run.steps]),
        "cpu_attention_ms": ms([s.cpu_attention for s in run.steps]),
        "accel_attention_ms": ms([s.accel_attention for s in run.steps]),
        "merge_ms": ms([s.merge for s in run.steps]),
        "insert_ms": ms([s.insert for s in run.steps]),
        "other_ms": ms(other),
        "token_ms": ms(run.step_s),
        "tokens_per_s": n / float(np.sum(run.step_s)),
        "scanned_fraction": float(np.mean(scanned)) if scanned else None,
        "bytes_read_per_token": float(np.mean([s.bytes_read for s in run.steps])) if scanned else None,
        "build_s": run.build_s,
        "build_hidden_s": run.build_hidden_s,
        "first_step_s": first_step,
        "device_kv_bytes": run.device_kv_bytes,
        "warmup_steps_excluded": skip,
    } | cpu


def check_window(settings: Settings, n_prompt: int, modes: list[Mode], fed: int, dim: int,
                 option: str = "--context") -> None:
    """Refuse an empty prompt, a window that covers the whole prompt, a top-k of 0 / more than the CPU side will ever
    hold (``fed``: the tokens that enter the cache after the prompt; the last generated one never does), or index
    build parameters that cannot index the prompt's keys outside the window (``dim``: the heads' dimension).
    ``option``: the one that set the prompt's length (``--context``, or ``--prompt`` for a free prompt), named in the
    errors."""
    w = settings.window
    require_ring(w)
    if n_prompt < 1:  # every mode, full too: the prefill of no token has no logits to decode from
        fix = "give a non-empty --prompt" if option == "--prompt" else f"give a {option} of at least 1"
        raise DecodeError(f"a prompt of {n_prompt} tokens: nothing to prefill; {fix}")
    if not any(m.kind != "full" for m in modes):
        return
    if w.size >= n_prompt:
        raise DecodeError(f"--window {w} ({w.size} tokens) is not "
                          f"smaller than the context of {n_prompt} tokens: nothing would be retrieved; "
                          f"use a smaller --window or a longer {option}")
    if any(m.kind == "index" for m in modes):
        most = n_prompt + fed - w.size
        if settings.topk < 1 or settings.topk > most:
            raise DecodeError(f"--topk {settings.topk} must lie in [1, {most}]: {most} keys lie outside the window "
                              f"by the end of this run ({n_prompt} prompt + {fed} tokens fed back, window "
                              f"{w.sink}+{w.recent})")
    for m in modes:  # built over the prompt's keys outside the window (e.g. an ivf nlist above them): before the prefill
        for plan in {id(p): p for p in m.plans()}.values():
            index = registry.create(plan.name, **plan.build_params)
            if index.reads_positions and settings.train_group not in group_queries.PER_HEAD:
                raise DecodeError(f"--mode {m.name} reads each training query's position; --train-group "
                                  f"{settings.train_group} interleaves a GQA group's queries, which have none of their "
                                  "own: use --train-group head or unlisted")
            try:
                index.check_dim(dim)
            except IndexConfigError as err:
                raise DecodeError(f"{err}: --mode {m.name} cannot index this model's keys of dimension {dim}: set its "
                                  "--build-param") from None
            try:
                index.check_keys(n_prompt - w.size)
            except IndexConfigError as err:  # the index's text alone blamed a parameter the user may never have set
                raise DecodeError(f"{err}: --mode {m.name} cannot index the {n_prompt - w.size} keys outside the window "
                                  f"of this prompt: use a longer {option} or set its --build-param") from None
