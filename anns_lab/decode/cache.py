"""The accelerator's KV cache during retrieval decoding: only the static window W (docs/decoder.md).

After the prefill, each long-range layer's cache is cut down to the sink (positions
``[0, sink)``) and the most recent ``recent`` positions; everything else lives in the CPU
:class:`~anns_lab.decode.placement.LayerStore`. :class:`WindowLayer` keeps those
``sink + recent`` tokens in one tensor per keys/values: slots ``[0, sink)`` hold the sink, slots
``[sink, sink + recent)`` are a ring for the recent tokens, position ``p ≥ sink`` living in
slot ``sink + (p − sink) mod recent``. A decode step writes its token into the slot of the
token that leaves the window (position ``p − recent``), after handing that token to the
eviction hook (the CPU store for index modes; nothing for ``window`` mode, which drops it).
So the device holds exactly ``sink + recent`` tokens per long-range layer, one token is
written and one read back per step, and nothing is reallocated.

The slots are not in position order. That is harmless because the only reader of these
keys on a decode step is the retrieval attention (:mod:`anns_lab.decode.attention`), which
attends over the whole window without a mask, and softmax attention does not depend on the
order of its keys. RoPE is already applied to the cached keys, and the model takes the new
token's position from ``cache_position``; the layer still reports the true sequence length
(``cumulative_length``, as transformers' sliding-window layer does), which the mask builder
uses as the query offset. Its mask sizes describe the stored window (``kv_offset = 0``,
``kv_length = stored + query``), so a causal mask built from them allows every stored key.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicLayer

from anns_lab.errors import DecodeError
from anns_lab.window import Window

# hook(layer index, keys (batch, kv heads, t, d), values): the tokens leaving the recent window
EvictHook = Callable[[int, torch.Tensor, torch.Tensor], None]


class WindowLayer(DynamicLayer):
    """A long-range layer's cache holding only the sink and a ring of the most recent tokens."""

    is_sliding = False  # the model's mask for full-attention layers is sized from this layer
    is_croppable = False  # evicted tokens are gone from the device: no rollback

    def __init__(self, layer_idx: int, window: Window, on_evict: EvictHook | None = None):
        super().__init__()
        require_ring(window)
        self.layer_idx = layer_idx
        self.window = window
        self.on_evict = on_evict
        self.cumulative_length = 0  # tokens seen, evicted or not: the true sequence length

    @classmethod
    def from_layer(cls, layer, layer_idx: int, window: Window, on_evict: EvictHook | None = None) -> WindowLayer:
        """The window of a full layer's cache (copied: the full tensors are not kept alive by the new layer)."""
        out = cls(layer_idx, window, on_evict)
        sink, recent = window
        if layer.keys is None or layer.keys.numel() == 0:
            return out
        keys, values = layer.keys, layer.values
        n = keys.shape[-2]
        out.cumulative_length = n
        out._init_like(keys, values)
        if n <= window.size:  # nothing has left the window yet: slot = position
            out.keys, out.values = keys.clone(), values.clone()
            return out
        # The last `recent` positions [n − recent, n) go to their ring slots, sink + (p − sink) mod recent.
        slots = window.slot(torch.arange(n - recent, n, device=keys.device))
        out.keys = torch.empty(*keys.shape[:-2], window.size, keys.shape[-1], dtype=keys.dtype, device=keys.device)
        out.values = torch.empty(*values.shape[:-2], window.size, values.shape[-1], dtype=values.dtype,
                                 device=values.device)
        out.keys[..., :sink, :] = keys[..., :sink, :]
        out.values[..., :sink, :] = values[..., :sink, :]
        out.keys[..., slots, :] = keys[..., n - recent:, :]
        out.values[..., slots, :] = values[..., n - recent:, :]
        return out

    def _init_like(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        # Set directly: lazy_initialization's signature differs between transformers releases.
        self.device, self.dtype = keys.device, keys.dtype
        self.keys = keys.new_empty((*keys.shape[:-2], 0, keys.shape[-1]))
        self.values = values.new_empty((*values.shape[:-2], 0, values.shape[-1]))
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self._init_like(key_states, key_states if value_states is None else value_states)

    @property
    def stored(self) -> int:
        """Tokens held on the device (≤ sink + recent)."""
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Add the new tokens; once the window is full, evict the token each one replaces. Returns the window."""
        if not self.is_initialized:
            self._init_like(key_states, value_states)
        t = key_states.shape[-2]
        cap = self.window.size
        room = cap - self.stored
        if room >= t:  # still filling: slot = position, plain append
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.cumulative_length += t
            return self.keys, self.values
        if t != 1 or room != 0:
            # Several new tokens would need keys that leave the window within the same forward.
            raise DecodeError(f"the window cache of layer {self.layer_idx} takes one token per forward once full "
                              f"({self.stored} of {cap} slots used, {t} new tokens)")
        p = self.cumulative_length
        slot = self.window.slot(p)  # holds position p − recent, which leaves the window now
        if self.on_evict is not None:
            self.on_evict(self.layer_idx, self.keys[..., slot:slot + 1, :], self.values[..., slot:slot + 1, :])
        self.keys[..., slot:slot + 1, :] = key_states
        self.values[..., slot:slot + 1, :] = value_states
        self.cumulative_length = p + 1
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # Older transformers pass cache_position (a tensor) instead of the query length.
        q = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
        return min(self.stored + q, self.window.size), 0

    def crop(self, tokens_to_remove: int) -> None:
        raise DecodeError("a window cache cannot be cropped: evicted tokens are no longer on the device")

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise DecodeError("retrieval decoding runs batch 1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise DecodeError("retrieval decoding runs batch 1")


def require_ring(window: Window) -> None:
    """The decoder's window needs a ring of at least one recent slot: the token being decoded attends to itself there."""
    if window.recent < 1:
        raise DecodeError(f"--window {window}: sink must be ≥ 0 and recent ≥ 1 tokens")


def window_cache(full, long_range: list[int], window: Window, on_evict: EvictHook | None = None,
                 whole: set[int] = frozenset()):
    """A cache for retrieval decoding from a prefilled ``full`` cache, which is left untouched.

    Long-range layers become :class:`WindowLayer` (their window copied), but those in ``whole``, which stay deep copies
    of the whole layer until :func:`narrow_layer` cuts them (``--until-built exact``: attended in full while their
    indexes build); other layers (Gemma-3's sliding-window layers) are deep copies, as ``copy.deepcopy(full)`` would
    make them.
    """
    out = copy.copy(full)  # the cache object's own settings; its layer list is replaced below
    wanted = set(long_range) - set(whole)
    out.layers = [WindowLayer.from_layer(layer, i, window, on_evict) if i in wanted else copy.deepcopy(layer)
                  for i, layer in enumerate(full.layers)]
    missing = wanted - set(range(len(full.layers)))
    if missing:
        raise DecodeError(f"long-range layers {sorted(missing)} are not in the prefilled cache of {len(full.layers)} layers")
    return out


def narrow_layer(cache, layer: int, window: Window, on_evict: EvictHook | None, since: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut ``cache``'s whole long-range ``layer`` to its window (a :class:`WindowLayer` in its place, evicting to
    ``on_evict`` from then on) and return the keys and values (G, t, d) of the positions ``[since, n − recent)``: those
    that left the window after ``since`` while the layer was whole, for the CPU store that takes the layer over."""
    whole = cache.layers[layer]
    n = whole.keys.shape[-2]
    cache.layers[layer] = WindowLayer.from_layer(whole, layer, window, on_evict)
    end = max(since, n - window.recent)
    return whole.keys[0, :, since:end], whole.values[0, :, since:end]


def device_kv_bytes(cache) -> int:
    """Bytes of keys and values the cache holds (on whatever device it lives: the accelerator's share of the KV)."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
