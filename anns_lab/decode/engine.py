"""The generation loop: one full-attention chunked prefill, then greedy decoding per mode.

A prefill is shared by every mode of a run (the cache is copied per mode), so ``full`` is
measured on exactly the same prompt state as the retrieval modes. After the prefill each
retrieval mode builds its indexes on the non-window prefill keys of every long-range layer
(timed as ``build_s``) and decodes with :mod:`anns_lab.decode.attention`. In retrieval modes
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

from anns_lab.decode.attention import DecodeError, Retrieval, StepTimes, retrieving
from anns_lab.decode.cache import device_kv_bytes, require_ring, window_cache
from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.dumps.models import forward_tokens
from anns_lab.window import Window


@dataclass
class Mode:
    """A decoding mode: ``full``, ``window``, or an index (one plan for every layer, or per layer)."""

    name: str
    plan: IndexPlan | None = None
    per_layer: dict[int, IndexPlan] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.name if self.name in ("full", "window") else "index"

    def plan_for(self, layer: int) -> IndexPlan | None:
        return self.per_layer.get(layer, self.plan)

    def uses_queries(self) -> bool:
        from anns_lab.indexes import registry

        plans = [p for p in [self.plan, *self.per_layer.values()] if p is not None]
        return self.kind == "index" and any(registry.get(p.name).uses_train_queries for p in plans)


@dataclass
class Settings:
    """Window, top-k and insertion batch shared by every mode of a run."""

    window: Window = Window()
    topk: int = 100
    add_batch: int = 64
    chunk: int = 2048
    train_queries: int = 0  # prefill queries given to attention-aware indexes, evenly strided (0 = all)
    lists_on_device: bool | None = None  # training lists of the indexes on the accelerator (None: when it is CUDA)


@dataclass
class Prefilled:
    """The state after a full-attention prefill: cache, last logits, captured queries, time."""

    ids: list[int]
    cache: object
    logits: torch.Tensor
    queries: dict[int, np.ndarray]
    seconds: float


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


def prefill(lm, ids: list[int], settings: Settings, capture_queries: bool) -> Prefilled:
    """Chunked full-attention prefill of ``ids``; keeps long-range layers' queries when asked."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.model.config)
    ctl = Retrieval(lm.long_range_layers, "full", settings.window, capture_queries)
    t0 = time.perf_counter()
    logits = None
    with torch.inference_mode(), retrieving(lm.model, ctl):
        for start in range(0, len(ids), settings.chunk):
            logits = forward_tokens(lm, cache, ids, start, min(start + settings.chunk, len(ids)))
    _sync(lm.model.device)
    queries = {layer: ctl.prefill_queries(layer) for layer in lm.long_range_layers} if capture_queries else {}
    return Prefilled(list(ids), cache, logits[0, -1].float(), queries, time.perf_counter() - t0)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def build_stores(lm, pre: Prefilled, mode: Mode, settings: Settings,
                 steps: int = 64) -> tuple[dict[int, LayerStore], list[str]]:
    """One LayerStore per long-range layer, holding the non-window prefill keys/values and its indexes, with room
    for the ``steps`` tokens a run of that many steps moves out of the window."""
    cfg = lm.config
    n_heads = cfg.num_attention_heads
    lo, hi = settings.window.outside(len(pre.ids))
    stores, notes = {}, []
    for layer in lm.long_range_layers:
        layer_cache = pre.cache.layers[layer]
        keys = layer_cache.keys[0, :, lo:hi].to("cpu", torch.float32).numpy()
        values = layer_cache.values[0, :, lo:hi].to("cpu", torch.float32).numpy()
        plan = mode.plan_for(layer)
        store = LayerStore(layer, n_heads, keys, values, settings.topk, plan, settings.add_batch, steps)
        queries = _subsample(pre.queries.get(layer), settings.train_queries)
        store.build(queries, _device_lists(lm, plan, queries, layer_cache.keys[0, :, lo:hi], settings))
        stores[layer] = store
    first = next(iter(stores.values()), None)
    if first is not None and first.indexes and not first.supports_add:
        notes.append(f"{first.plan.name} has no add(): tokens leaving the window are kept exactly in a CPU side-buffer")
    return stores, notes


def _device_lists(lm, plan, queries: np.ndarray | None, keys: torch.Tensor, settings: Settings) -> np.ndarray | None:
    """The training queries' top lists computed where the keys are (``device_lists``), for an index that takes
    them, when ``settings.lists_on_device`` (default: the model is on CUDA); else None (the build computes them)."""
    on = settings.lists_on_device if settings.lists_on_device is not None else torch.device(lm.model.device).type == "cuda"
    if not on or plan is None or queries is None:
        return None
    from anns_lab.indexes import registry

    cls = registry.get(plan.name)
    if not (cls.uses_train_queries and cls.accepts_train_topk):
        return None
    from anns_lab.decode.device_lists import train_topk

    width = cls.train_topk_width(keys.shape[1], **plan.build_params)
    return train_topk(queries, keys, width, queries.shape[0] // keys.shape[0])


def _subsample(queries: np.ndarray | None, n: int) -> np.ndarray | None:
    """At most ``n`` prefill queries (H, t, d), evenly spaced and always including the last one."""
    if queries is None or n <= 0 or queries.shape[1] <= n:
        return queries
    pick = np.linspace(queries.shape[1] - 1, 0, n).round().astype(np.int64)[::-1]
    return np.ascontiguousarray(queries[:, pick])


def run_mode(lm, pre: Prefilled, mode: Mode, settings: Settings, max_new: int, stop_ids=(),
             teacher: list[int] | None = None, keep_logits: bool = False, keep_cache: bool = False) -> ModeRun:
    """Greedy decoding (or teacher forcing with ``teacher``) from a copy of the prefill state.

    ``keep_cache`` keeps the decode cache on the result (``run.cache``, for inspection); by default it
    is freed with the run's end, so that runs kept for their timings do not hold accelerator memory.
    """
    n_steps = len(teacher) if teacher is not None else max_new
    stores, notes = ({}, []) if mode.kind != "index" else build_stores(lm, pre, mode, settings, n_steps)
    build_s = sum(s.build_s for s in stores.values())
    if stores:
        from anns_lab.decode.kernels import warmup

        warmup()
    ctl = Retrieval(lm.long_range_layers, mode.kind, settings.window, False)
    ctl.stores = stores
    ctl.phase = "decode"
    with torch.inference_mode():  # the prefill's tensors are inference tensors; so are the copies
        if mode.kind == "full":
            cache = copy.deepcopy(pre.cache)
        else:  # long-range layers keep the window only; the tokens they evict go to ctl.evicted
            cache = window_cache(pre.cache, lm.long_range_layers, settings.window, ctl.evicted)
    ids = list(pre.ids)
    logits = pre.logits
    out_tokens, all_logits, steps, step_s = [], [], [], []
    t0 = time.perf_counter()
    with torch.inference_mode(), retrieving(lm.model, ctl):
        for i in range(n_steps):
            if keep_logits:
                all_logits.append(logits.detach().to("cpu"))
            tok = teacher[i] if teacher is not None else int(logits.argmax())
            out_tokens.append(tok)
            if teacher is None and (tok in stop_ids or i == n_steps - 1):
                break
            ids.append(tok)
            ts = time.perf_counter()
            logits = forward_tokens(lm, cache, ids, len(ids) - 1, len(ids))[0, -1].float()
            _sync(lm.model.device)
            step_s.append(time.perf_counter() - ts)
            steps.append(ctl.take_times())
    if teacher is not None and keep_logits:
        all_logits.append(logits.detach().to("cpu"))
    decode_s = time.perf_counter() - t0
    run = ModeRun(mode.name, out_tokens, all_logits, build_s, decode_s, steps, step_s, notes, device_kv_bytes(cache))
    run.cache = cache if keep_cache else None
    run.stores = stores  # kept for inspection (tests, index sizes)
    return run


def summarize(run: ModeRun) -> dict:
    """Per generated token means (ms) of retrieval, CPU attention, accelerator attention, merge, other; tokens/s."""
    # The first decode step also compiles each index's search kernel (numba): left out when there are others.
    skip = 1 if len(run.step_s) >= 3 else 0
    first_step = run.step_s[0] if run.step_s else None  # the first token to use the index (kept in time to first token)
    run = ModeRun(run.mode, run.tokens, [], run.build_s, run.decode_s, run.steps[skip:], run.step_s[skip:],
                  device_kv_bytes=run.device_kv_bytes)
    n = len(run.step_s)
    if n == 0:
        return {"steps": 0, "device_kv_bytes": run.device_kv_bytes, "build_s": run.build_s, "first_step_s": first_step}

    def ms(values) -> float:
        return 1000.0 * float(np.mean(values))

    other = [w - (s.insert + s.overlap + s.merge) for w, s in zip(run.step_s, run.steps)]
    scanned = [x for s in run.steps for x in s.scanned]
    return {
        "steps": n,
        "retrieval_ms": ms([s.retrieval for s in run.steps]),
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
        "first_step_s": first_step,
        "device_kv_bytes": run.device_kv_bytes,
        "warmup_steps_excluded": skip,
    }


def check_window(settings: Settings, n_prompt: int, modes: list[Mode], max_new: int) -> None:
    """Refuse a window that covers the whole prompt, or a top-k of 0 / more than the CPU side will ever hold."""
    w = settings.window
    require_ring(w)
    if not any(m.kind != "full" for m in modes):
        return
    if w.size >= n_prompt:
        raise DecodeError(f"--window {w} ({w.size} tokens) is not "
                          f"smaller than the context of {n_prompt} tokens: nothing would be retrieved; "
                          "use a smaller --window or a longer --context")
    if any(m.kind == "index" for m in modes):
        most = n_prompt + max_new - w.size
        if settings.topk < 1 or settings.topk > most:
            raise DecodeError(f"--topk {settings.topk} must lie in [1, {most}]: {most} keys lie outside the window "
                              f"by the end of this run ({n_prompt} prompt + {max_new} new tokens, window "
                              f"{w.sink}+{w.recent})")
