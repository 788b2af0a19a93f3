"""The window-only device cache of retrieval decoding: ring eviction, true positions, masks, exactness, bytes."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from conftest import TEST_DEVICE

from anns_lab.decode.attention import Retrieval, retrieving
from anns_lab.decode.cache import WindowLayer, device_kv_bytes, window_cache
from anns_lab.decode.engine import Mode, Settings, prefill, run_mode, summarize
from anns_lab.decode.placement import IndexPlan
from anns_lab.dumps.models import load_model
from anns_lab.dumps.models import forward_tokens
from anns_lab.errors import DecodeError
from anns_lab.window import Window


def _tokens(positions, g=2, d=3) -> torch.Tensor:
    """Keys (1, g, t, d) whose every entry is the token's position, so slots can be read back as positions."""
    pos = torch.as_tensor(list(positions), dtype=torch.float32)
    return pos.reshape(1, 1, -1, 1).expand(1, g, -1, d).clone()


def _positions(t: torch.Tensor) -> list[int]:
    return sorted(int(x) for x in t[0, 0, :, 0])


# -- the layer on its own --------------------------------------------------------------------------


@pytest.mark.parametrize("sink, recent", [(4, 8), (0, 5), (3, 1)])
def test_ring_holds_exactly_the_window_and_evicts_in_order(sink, recent):
    evicted = []
    layer = WindowLayer(7, Window(sink, recent), lambda i, k, v: evicted.append((i, int(k[0, 0, 0, 0]), int(v[0, 1, 0, 2]))))
    n = sink + 3 * recent + 5  # the ring wraps several times
    for p in range(n):
        keys, values = layer.update(_tokens([p]), _tokens([p]))
        assert layer.get_seq_length() == p + 1  # the true length, not what is stored
        want = sorted(set(range(min(sink, p + 1))) | set(range(max(sink, p + 1 - recent), p + 1)))
        assert _positions(keys) == _positions(values) == want
        assert layer.stored == len(want) <= sink + recent
    assert evicted == [(7, p, p) for p in range(sink, n - recent)]  # each non-sink token once, oldest first


def test_cut_from_a_full_layer_then_decode():
    sink, recent, n = 4, 8, 30
    full = DynamicLayer()
    full.update(_tokens(range(n)), _tokens(range(n)))
    evicted = []
    layer = WindowLayer.from_layer(full, 0, Window(sink, recent), lambda i, k, v: evicted.append(int(k[0, 0, 0, 0])))
    assert layer.get_seq_length() == n and layer.stored == sink + recent
    assert _positions(layer.keys) == list(range(sink)) + list(range(n - recent, n))
    assert full.keys.shape[-2] == n  # the full cache is left as it was
    for p in range(n, n + 2 * recent):
        keys, _ = layer.update(_tokens([p]), _tokens([p]))
        assert _positions(keys) == list(range(sink)) + list(range(p + 1 - recent, p + 1))
    assert evicted == list(range(n - recent, n + recent))
    # A short cache (nothing outside the window yet) is copied as it is and fills up by appending.
    short = DynamicLayer()
    short.update(_tokens(range(5)), _tokens(range(5)))
    layer = WindowLayer.from_layer(short, 0, Window(sink, recent))
    assert layer.get_seq_length() == 5 and _positions(layer.keys) == list(range(5))
    keys, _ = layer.update(_tokens(range(5, 12)), _tokens(range(5, 12)))
    assert _positions(keys) == list(range(12))


def test_mask_sizes_describe_the_stored_window():
    layer = WindowLayer(0, Window(2, 3))
    assert layer.get_mask_sizes(4) == (4, 0)
    layer.update(_tokens(range(4)), _tokens(range(4)))
    assert layer.get_mask_sizes(1) == (5, 0)
    assert layer.get_mask_sizes(torch.arange(4, 5)) == (5, 0)  # older transformers pass cache_position
    layer.update(_tokens([4]), _tokens([4]))
    layer.update(_tokens([5]), _tokens([5]))
    assert layer.stored == 5 and layer.get_mask_sizes(1) == (5, 0) and layer.get_seq_length() == 6


def test_bad_use_is_refused():
    with pytest.raises(DecodeError, match="sink must be"):
        WindowLayer(0, Window(2, 0))
    layer = WindowLayer(3, Window(2, 3))
    layer.update(_tokens(range(5)), _tokens(range(5)))
    with pytest.raises(DecodeError, match="one token per forward"):
        layer.update(_tokens([5, 6]), _tokens([5, 6]))
    with pytest.raises(DecodeError, match="cropped"):
        layer.crop(-1)
    with pytest.raises(DecodeError, match="batch 1"):
        layer.batch_repeat_interleave(2)


def test_device_kv_bytes_counts_keys_and_values():
    layer = WindowLayer(0, Window(2, 3))
    layer.update(_tokens(range(4)), _tokens(range(4)))
    cache = type("C", (), {"layers": [layer, DynamicLayer()]})()
    assert device_kv_bytes(cache) == 2 * (1 * 2 * 4 * 3) * 4


# -- in the model ----------------------------------------------------------------------------------

PROMPT = 48
STEPS = 40  # 3.5 rotations of the recent ring: a wrong slot or position would show
SETTINGS = Settings(Window(4, 8), topk=PROMPT + STEPS - 12, add_batch=4, chunk=16)


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_gemma3"])
def prefilled(request):
    lm = load_model(str(request.getfixturevalue(request.param)), device=TEST_DEVICE)
    ids = np.random.default_rng(5).integers(3, 400, size=PROMPT).tolist()
    pre = prefill(lm, ids, SETTINGS, capture_queries=False)
    full = run_mode(lm, pre, Mode("full"), SETTINGS, STEPS, keep_logits=True, keep_cache=True)
    return lm, pre, full


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_device_holds_the_window_only_and_decoding_stays_exact(prefilled):
    lm, pre, full = prefilled
    run = run_mode(lm, pre, Mode("flat", IndexPlan("flat")), SETTINGS, STEPS, keep_logits=True, keep_cache=True)
    # Logits equal full attention at every step, long after the first tokens left the window:
    # a position (RoPE) offset or a token attended twice or lost would break this.
    assert len(run.logits) == STEPS
    for step, (a, b) in enumerate(zip(run.logits, full.logits)):
        assert _rel(a, b) < 1e-4, step
    assert run.tokens == full.tokens
    seen = PROMPT + STEPS - 1  # tokens through the model by the last forward
    window = SETTINGS.window.size
    for i, layer in enumerate(run.cache.layers):
        assert layer.get_seq_length() == seen  # true length, which transformers' masks and positions rely on
        if i in lm.long_range_layers:
            assert isinstance(layer, WindowLayer) and layer.keys.shape[-2] == window
            assert run.stores[i].n_rows + window == seen  # every other token is in the CPU store, none twice
            assert layer.keys.device == full.cache.layers[i].keys.device
        else:  # Gemma-3's sliding layers are what the model made of them
            assert type(layer) is type(full.cache.layers[i]) is DynamicSlidingWindowLayer
            torch.testing.assert_close(layer.keys, full.cache.layers[i].keys, rtol=1e-4, atol=1e-5)
    assert full.cache.layers[lm.long_range_layers[0]].keys.shape[-2] == seen
    # The prefill's own cache is not cut: every mode starts from all of it.
    assert pre.cache.layers[lm.long_range_layers[0]].keys.shape[-2] == PROMPT


def test_window_mode_drops_what_leaves_and_reports_device_bytes(prefilled):
    from test_decode_exact import _masked_reference, _window_keys

    lm, pre, full = prefilled
    run = run_mode(lm, pre, Mode("window"), SETTINGS, STEPS, keep_logits=True, keep_cache=True)
    # The ring keeps exactly the window, step after step (a token kept too long or evicted too soon would show).
    for step, (a, b) in enumerate(zip(run.logits, _masked_reference(lm, pre, STEPS, _window_keys(SETTINGS)))):
        assert _rel(a, b.to("cpu")) < 1e-4, step
    window = SETTINGS.window.size
    for i in lm.long_range_layers:
        assert run.cache.layers[i].keys.shape[-2] == window
    assert run.device_kv_bytes == device_kv_bytes(run.cache)
    long_full = sum(full.cache.layers[i].keys.nbytes + full.cache.layers[i].values.nbytes for i in lm.long_range_layers)
    long_window = sum(run.cache.layers[i].keys.nbytes + run.cache.layers[i].values.nbytes for i in lm.long_range_layers)
    assert long_window * (PROMPT + STEPS - 1) == long_full * window  # O(window), not O(context)
    assert full.device_kv_bytes - run.device_kv_bytes == long_full - long_window  # other layers are the same
    assert summarize(run)["device_kv_bytes"] == run.device_kv_bytes
    assert summarize(full)["device_kv_bytes"] == full.device_kv_bytes


def test_model_attention_on_the_window_cache_sees_the_window(prefilled):
    """The masks transformers builds from the window cache fit it: eager attention over it is window attention."""
    lm, pre, _ = prefilled
    run = run_mode(lm, pre, Mode("window"), SETTINGS, 2, keep_logits=True)
    cache = window_cache(pre.cache, lm.long_range_layers, SETTINGS.window)
    ids = list(pre.ids) + [int(pre.logits.argmax())]
    inner = lm.model.config._attn_implementation
    lm.model.set_attn_implementation("eager")  # materialises the masks (sdpa may skip them on one token)
    try:
        with torch.inference_mode():
            logits = forward_tokens(lm, cache, ids, len(ids) - 1, len(ids))[0, -1].float()
    finally:
        lm.model.set_attn_implementation(inner)
    assert _rel(logits.to("cpu"), run.logits[1]) < 1e-4


def test_retrieval_step_refuses_a_full_device_cache(prefilled):
    lm, pre, _ = prefilled
    ctl = Retrieval(lm.long_range_layers, "window", SETTINGS.window, False)
    ctl.phase = "decode"
    ids = list(pre.ids) + [5]
    with torch.inference_mode(), retrieving(lm.model, ctl), pytest.raises(DecodeError, match="window cache"):
        forward_tokens(lm, copy.deepcopy(pre.cache), ids, len(ids) - 1, len(ids))
