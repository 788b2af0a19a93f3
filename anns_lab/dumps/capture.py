"""See the exact Q, K and V that a model's attention receives, through transformers' AttentionInterface.

A registered attention function records the post-RoPE query and the new keys and values of each
call (before any GQA repeat, so K/V come once per KV head), then hands over to the model's own
implementation. No model class is patched: the model is only told to use ``"anns_capture"``.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from anns_lab.dumps.models import attention_masks, unmodelled
from anns_lab.errors import DumpError

CAPTURE_IMPL = "anns_capture"


class Sink(Protocol):
    """Receives one attention call: q (H, t, d), new k and v (G, t, d) for ``layer``, at ``row`` onwards."""

    def record(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> None: ...


class StopForward(Exception):
    """Raised after the deepest layer still needed, when no logits are wanted (saves the rest of the model)."""


_ACTIVE: ContextVar[tuple[Sink, str, int | None] | None] = ContextVar("anns_lab_capture", default=None)


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    if (extra := unmodelled(kwargs)) is not None:
        raise DumpError(f"layer {module.layer_idx}: the model's attention adds {extra}, which a dump cannot record; "
                        "such models are not supported")
    active = _ACTIVE.get()
    inner_name = active[1] if active else "sdpa"
    if active is not None:
        sink, _, stop_after = active
        if query.shape[0] != 1:
            raise DumpError("capture supports batch size 1")
        t = query.shape[2]
        # The cache returns past + new states; the new ones are the last t (also for sliding-window layers).
        sink.record(module.layer_idx, query[0], key[0, :, -t:], value[0, :, -t:], kwargs.get("scaling") or module.scaling)
        if stop_after is not None and module.layer_idx >= stop_after:
            raise StopForward
    return ALL_ATTENTION_FUNCTIONS[inner_name](module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CAPTURE_IMPL, _capture_attention)


@contextlib.contextmanager
def capturing(model, sink: Sink, stop_after: int | None = None):
    """Within the block, every attention call of ``model`` is shown to ``sink``; restored afterwards."""
    inner = model.config._attn_implementation
    if inner == CAPTURE_IMPL:
        raise DumpError("capture is already active on this model")
    # Masks are built per implementation name; ours must get exactly the masks the inner one expects.
    AttentionMaskInterface.register(CAPTURE_IMPL, attention_masks(inner))
    token = _ACTIVE.set((sink, inner, stop_after))
    model.set_attn_implementation(CAPTURE_IMPL)
    try:
        yield
    finally:
        model.set_attn_implementation(inner)
        _ACTIVE.reset(token)
