"""RetrievalAttention as a registered transformers attention function (no model class is patched).

The model is told to use ``"anns_retrieval"``; the function below sees each layer's post-RoPE
query (1, H, t, d) and the cache's keys/values (1, G, n, d) after the update. What it does
depends on the active :class:`Retrieval` controller (a context variable):

- prefill (any t): the model's own implementation (full attention); the queries of long-range
  layers are kept when an attention-aware index will be built from them;
- decode (t = 1) on a long-range layer in a retrieval mode: the accelerator attends over the
  static window W while a worker thread runs the CPU side (index search + numba attention over
  the retrieved rows and the side-buffer); the two are merged exactly (kernels.merge). The
  layer's device cache is then a :class:`~anns_lab.decode.cache.WindowLayer` holding W only;
  the token it evicts each step comes to :meth:`Retrieval.evicted`, which moves it to the CPU
  store (index modes) or drops it (``window``);
- everything else (sliding-window layers, ``full`` mode): the model's own implementation.

Timing per decode step is collected in :class:`StepTimes`. Both sides are timed on their own
thread; ``overlap_s`` is the wall time of the concurrent section, so
``other = step wall − Σ (insert + overlap + merge)`` and parts may add up to more than the wall.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from anns_lab.decode.copy_hints import CopyHints
from anns_lab.decode.kernels import attend_window, merge
from anns_lab.decode.placement import LayerStore
from anns_lab.dumps.models import attention_masks, unmodelled
from anns_lab.errors import DecodeError
from anns_lab.indexes.threads import one_thread
from anns_lab.window import Window

RETRIEVAL_IMPL = "anns_retrieval"


@dataclass
class StepTimes:
    """Seconds spent in one decode step (summed over layers)."""

    retrieval: float = 0.0
    retrieval_cpu: float = 0.0  # the searches' thread CPU time (wall less waits for a core: see runner.LEGEND)
    cpu_attention: float = 0.0
    accel_attention: float = 0.0
    merge: float = 0.0
    insert: float = 0.0  # moving tokens that left the window to the CPU store and into the indexes
    overlap: float = 0.0  # wall time of the concurrent sections
    scanned: list = field(default_factory=list)
    bytes_read: int = 0  # index data read by the step's searches, all layers and query heads


def sync(device: torch.device | str) -> None:
    """Wait for ``device``'s queued kernels (CUDA), so that a timer read after it counts them."""
    device = device if isinstance(device, torch.device) else torch.device(device)  # per layer and step: no parse
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Retrieval:
    """State of one generation: phase, mode, window, and the CPU stores of the long-range layers."""

    def __init__(self, long_range: list[int], mode: str, window: Window, capture_queries: bool,
                 newest_queries: int | None = None, n_tokens: int | None = None):
        self.long_range = set(long_range)
        self.mode = mode  # "full", "window", or "index"
        self.window = window
        self.phase = "prefill"
        self.capture_queries = capture_queries
        self.newest_queries = newest_queries  # prefill: keep only each head's newest this many (None: all)
        self.n_tokens = n_tokens  # prefill: the prompt's length, the size of the buffers that keep all queries
        if capture_queries and newest_queries is None and n_tokens is None:
            raise ValueError("keeping every prefill query needs the prompt's length (n_tokens) for its buffers")
        self.queries: dict[int, torch.Tensor] = {}  # prefill: each long-range layer's kept queries (H, t, d), float32
        self._filled: dict[int, int] = {}  # prefill, all queries kept: the positions each layer's buffer holds
        self.scaling: dict[int, float] = {}  # prefill: each long-range layer's softmax scale, as its attention got it
        self.layer_done = None  # prefill: called with a long-range layer once its keys and queries are complete
        self.stores: dict[int, LayerStore] = {}
        self.whole: set[int] = set()  # decode: long-range layers still attended over their whole cache (--until-built exact)
        self.inner = "sdpa"
        self.hints: CopyHints | None = None  # decode: where this step may copy from (entry points of the searches)
        self.step_queries: dict[int, list[np.ndarray]] | None = None  # decode, when a dict: each indexed layer's step queries (H, d), kept
        self.times = StepTimes()
        self._pool: ThreadPoolExecutor | None = None

    # -- the per-call dispatch ---------------------------------------------------------------------

    def attend(self, module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if (extra := unmodelled(kwargs)) is not None:
            raise DecodeError(f"layer {layer}: the model's attention adds {extra}, which retrieval decoding does not "
                              "model; such models are not supported")
        inner = ALL_ATTENTION_FUNCTIONS[self.inner]
        if layer not in self.long_range:
            return inner(module, query, key, value, attention_mask, **kwargs)
        if self.phase == "prefill":
            self.scaling[layer] = float(kwargs.get("scaling") or module.scaling)
            if self.capture_queries:
                self._keep_queries(layer, query[0].detach())
            if self.layer_done is not None:  # the prompt's last chunk: this layer's cache and queries are final
                self.layer_done(layer)
            return inner(module, query, key, value, attention_mask, **kwargs)
        if query.shape[0] != 1 or query.shape[2] != 1:
            raise DecodeError("retrieval decoding runs batch 1, one token per step")
        if self.mode == "full" or layer in self.whole:
            sync(query.device)
            t0 = time.perf_counter()
            out = inner(module, query, key, value, attention_mask, **kwargs)
            sync(query.device)
            elapsed = time.perf_counter() - t0
            self.times.accel_attention += elapsed
            # Counted as this layer's attention section, as in the retrieval modes, so "other" means the same
            # (everything outside long-range attention) in every mode.
            self.times.overlap += elapsed
            return out
        return self._retrieval_step(module, query, key, value, kwargs.get("scaling") or module.scaling)

    def evicted(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Eviction hook of the window cache (decode/cache.py): tokens (1, G, t, d) leaving the recent window.

        Index modes move them to the layer's CPU store (and from there into its indexes); ``window``
        mode has no store and drops them.
        """
        store = self.stores.get(layer)
        if store is None:
            return
        sync(keys.device)  # the kernels queued before (the step's earlier layers) are not this copy's: as in `attend`
        t0 = time.perf_counter()
        store.extend(keys[0].to("cpu", torch.float32).numpy(), values[0].to("cpu", torch.float32).numpy())
        self.times.insert += time.perf_counter() - t0

    def _retrieval_step(self, module, query, key, value, scaling):
        layer = module.layer_idx
        if key.shape[2] > self.window.size:
            # The device must hold the window only; anything beyond it would be attended twice or lost.
            raise DecodeError(f"layer {layer}: {key.shape[2]} cached tokens on the device, more than the window of "
                              f"{self.window.size}; retrieval decoding needs the window cache (decode.cache)")
        q = query[0, :, 0, :]
        store = self.stores.get(layer)
        future = None
        sync(q.device)  # the step's queued kernels (earlier layers, this one's projections) belong to "other", as in full
        t_start = time.perf_counter()
        if self.mode == "index" and store is not None:
            q_cpu = q.detach().to("cpu", torch.float32).numpy()
            if self.step_queries is not None:  # a copy: on the CPU the step's query tensor may be q_cpu's own memory
                self.step_queries.setdefault(layer, []).append(q_cpu.copy())
            hints = None if self.hints is None else self.hints.rows(self.window.sink)
            future = self._executor().submit(store.side, q_cpu, scaling, hints)
        # Accelerator side: the static window (sinks + recent) is the whole device cache of this layer; its
        # slots are not in position order, which softmax attention without a mask does not care about.
        t0 = time.perf_counter()
        o_w, m_w, z_w = attend_window(q, key[0], value[0], scaling)
        sync(q.device)
        self.times.accel_attention += time.perf_counter() - t0
        if future is None:
            self.times.overlap += time.perf_counter() - t_start
            return o_w.to(query.dtype).reshape(1, 1, *o_w.shape), None
        side = future.result()
        self.times.overlap += time.perf_counter() - t_start
        self.times.retrieval += side.retrieval_s
        self.times.retrieval_cpu += side.retrieval_cpu_s
        self.times.cpu_attention += side.attention_s
        if side.scanned == side.scanned:
            self.times.scanned.append(side.scanned)
        self.times.bytes_read += side.bytes_read
        t0 = time.perf_counter()
        dev = q.device
        o = merge(o_w.double(), m_w.double(), z_w.double(), torch.from_numpy(side.out).to(dev),
                  torch.from_numpy(side.m).to(dev), torch.from_numpy(side.z).to(dev))
        o = o.to(query.dtype).reshape(1, 1, *o.shape)  # (batch, t, H, d) as the model expects
        sync(dev)
        self.times.merge += time.perf_counter() - t0
        return o, None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            # one query per head: a thread team would only pay its wake-up
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="anns-cpu-side", initializer=one_thread)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def take_times(self) -> StepTimes:
        t, self.times = self.times, StepTimes()
        return t

    def _keep_queries(self, layer: int, chunk: torch.Tensor) -> None:
        """Keep a prefill chunk's queries (H, t, d) of ``layer`` in float32 on the CPU: each head's newest
        ``newest_queries``, or all of them, copied into one buffer per layer of the prompt's length (``n_tokens``).
        Copied either way, so that no chunk's tensor is held (the model's memory for the next one); one buffer leaves
        nothing to concatenate after the prefill (a copy of each layer's queries, beside them, outside every timed
        part: BENCHMARKS "Where the 8K first token goes today")."""
        if self.newest_queries is not None:
            newest = chunk[:, -self.newest_queries:].to("cpu", torch.float32, copy=True)
            kept = self.queries.get(layer)
            self.queries[layer] = newest if kept is None else \
                torch.cat([kept, newest], dim=1)[:, -self.newest_queries:].clone()
            return
        done, t = self._filled.get(layer, 0), chunk.shape[1]
        if done + t > self.n_tokens:  # a layer called twice in a forward would misplace every row
            raise DecodeError(f"layer {layer}: prefill queries for positions {done}..{done + t - 1} of a "
                              f"{self.n_tokens}-token prompt: its attention ran more than once per token (a model "
                              "that runs a layer's attention twice a forward is not supported)")
        if layer not in self.queries:
            self.queries[layer] = torch.empty((chunk.shape[0], self.n_tokens, chunk.shape[2]), dtype=torch.float32)
        self.queries[layer][:, done:done + t].copy_(chunk)
        self._filled[layer] = done + t

    def prefill_queries(self, layer: int) -> np.ndarray | None:
        """(H, t, d) float32 prefill queries of ``layer``, if captured (the early builds and the prefill's result
        share the array); read once the prompt has passed the layer (before, a contiguous copy of the positions so
        far)."""
        kept = self.queries.get(layer)
        if kept is None:
            return None
        filled = self._filled.get(layer, kept.shape[1])
        return kept.numpy() if filled == kept.shape[1] else np.ascontiguousarray(kept[:, :filled].numpy())


_ACTIVE: ContextVar[Retrieval | None] = ContextVar("anns_lab_retrieval", default=None)


def _retrieval_attention(module, query, key, value, attention_mask, **kwargs):
    active = _ACTIVE.get()
    if active is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    return active.attend(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(RETRIEVAL_IMPL, _retrieval_attention)


@contextlib.contextmanager
def retrieving(model, controller: Retrieval):
    """Within the block ``model`` attends through ``controller``; the model's own implementation is restored after."""
    inner = model.config._attn_implementation
    if inner == RETRIEVAL_IMPL:
        inner = "sdpa"
    controller.inner = inner
    # Masks are built per implementation name; ours must get exactly the masks the inner one expects.
    AttentionMaskInterface.register(RETRIEVAL_IMPL, attention_masks(inner))
    token = _ACTIVE.set(controller)
    model.set_attn_implementation(RETRIEVAL_IMPL)
    try:
        yield controller
    finally:
        model.set_attn_implementation(inner)
        _ACTIVE.reset(token)
        controller.close()
