"""``--until-built exact``: an index mode's first steps attend its layers over their whole cache while their indexes
still build, then each built store takes its layer over with the rows that left the window meanwhile."""

from __future__ import annotations

import dataclasses
import re
import threading

import numpy as np
import pytest
import torch

from conftest import TEST_DEVICE

from anns_lab.decode import builds, engine, runner
from anns_lab.decode.cache import WindowLayer, narrow_layer, window_cache
from anns_lab.decode.engine import Mode, Settings, prefill, run_mode, summarize
from anns_lab.decode.placement import IndexPlan
from anns_lab.dumps.models import load_model
from anns_lab.indexes import threads
from anns_lab.window import Window

PROMPT = 64
STEPS = 8  # 7 forwards: every row that leaves the window is a prompt token's, whatever a run generates
# a top-k well short of the keys: the index's output differs from full attention's, a whole layer's does not
SETTINGS = Settings(Window(4, 8), topk=6, add_batch=2, chunk=24, steps=STEPS, until_built="exact")


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_gemma3"])
def prefilled(request):
    """Llama: every layer long-range; Gemma-3: global layers among sliding ones (the mask of a whole layer differs)."""
    lm = load_model(str(request.getfixturevalue(request.param)), device=TEST_DEVICE)
    ids = np.random.default_rng(7).integers(3, 400, size=PROMPT).tolist()
    pre = prefill(lm, ids, SETTINGS, capture_queries=True)
    full = run_mode(lm, pre, Mode("full"), SETTINGS, STEPS, keep_logits=True)
    return lm, pre, full


def _hold_builds(monkeypatch, release_after: int) -> threading.Event:
    """Every layer's build waits until ``release_after`` decode forwards have returned (the step after them is the first
    whose poll can see a build end)."""
    go, forwards = threading.Event(), [0]
    real_store, real_forward = builds.layer_store, engine.forward_tokens

    def held_layer_store(*args, **kwargs):
        if not go.wait(30):
            raise RuntimeError("the builds were never released: the decode waited for them")
        return real_store(*args, **kwargs)

    def counting_forward(lm, cache, ids, start, end, *args, **kwargs):
        out = real_forward(lm, cache, ids, start, end, *args, **kwargs)
        forwards[0] += end - start == 1  # a decode step's (the prefill's chunks are longer)
        if forwards[0] >= release_after:
            go.set()
        return out

    monkeypatch.setattr(builds, "layer_store", held_layer_store)
    monkeypatch.setattr(engine, "forward_tokens", counting_forward)
    return go


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max() / b.abs().max()) < 1e-4


def test_steps_while_building_are_full_attention_and_the_built_stores_take_every_row(prefilled, monkeypatch):
    """Builds held through the whole decode: every step attends the layers over their whole cache (no search), so tokens
    and logits are full attention's although the top-k is far short of the keys; the built stores that take the layers
    over after the decode hold the prompt's rows and those that left the window meanwhile, as a run that waited for its
    builds, and the device keeps the window only."""
    lm, pre, full = prefilled
    mode = Mode("roargraph", IndexPlan("roargraph"))
    waited = run_mode(lm, pre, mode, dataclasses.replace(SETTINGS, until_built="wait"), STEPS, keep_logits=True)
    assert not all(_close(a, b) for a, b in zip(waited.logits, full.logits))  # the index alone is not full attention
    go = _hold_builds(monkeypatch, release_after=STEPS - 1)
    try:
        run = run_mode(lm, pre, mode, SETTINGS, STEPS, keep_logits=True, keep_cache=True)
    finally:
        go.set()
    assert run.tokens == full.tokens and all(_close(a, b) for a, b in zip(run.logits, full.logits))
    assert run.exact_steps == len(run.step_s) == STEPS - 1 and not any(s.scanned for s in run.steps)
    assert run.hand_over_steps == dict.fromkeys(lm.long_range_layers)  # no step was served by an index
    s = summarize(run)
    assert s["exact_steps"] == STEPS - 1 and s["exact_s"] == pytest.approx(run.setup_s + sum(run.step_s))
    assert all(isinstance(run.cache.layers[layer], WindowLayer) for layer in lm.long_range_layers)
    assert run.device_kv_bytes == waited.device_kv_bytes
    assert waited.exact_steps is None and "exact_steps" not in summarize(waited)
    assert set(run.stores) == set(run.build_layers) == set(lm.long_range_layers)
    for layer, store in run.stores.items():
        other = waited.stores[layer]
        assert store.plan is not None and len(store.indexes) == store.n_heads
        assert store.n_rows == other.n_rows == PROMPT - 12 + STEPS - 1
        np.testing.assert_array_equal(store.keys[:, :store.n_rows], other.keys[:, :other.n_rows])
        np.testing.assert_array_equal(store.values[:, :store.n_rows], other.values[:, :other.n_rows])
        assert store.indexes[0].n_keys == store.n_indexed >= store.n_rows - SETTINGS.add_batch + 1


def test_a_build_ending_mid_decode_hands_over_at_the_next_step_with_every_row(prefilled, monkeypatch):
    """Builds released after three forwards and polled at the fourth step once they have ended: three exact steps, then
    the index searches; with a top-k over every key the answer stays full attention's, which it would not if the
    rows that left the window during the exact steps were missing from the built store."""
    lm, pre, full = prefilled
    go = _hold_builds(monkeypatch, release_after=3)
    real_ready = builds.EarlyBuilds.ready

    def ready_once_ended(self, name):
        if go.is_set():
            for job in list(self.jobs[name].values()):
                job.exception(30)  # the first poll after the release sees every build ended
        return real_ready(self, name)

    monkeypatch.setattr(builds.EarlyBuilds, "ready", ready_once_ended)
    settings = dataclasses.replace(SETTINGS, topk=PROMPT + STEPS)
    try:
        run = run_mode(lm, pre, Mode("flat", IndexPlan("flat")), settings, STEPS, keep_logits=True)
    finally:
        go.set()
    assert run.exact_steps == 3 and run.hand_over_steps == dict.fromkeys(lm.long_range_layers, 3)
    assert [bool(s.scanned) for s in run.steps] == [False] * 3 + [True] * (STEPS - 4)
    assert run.tokens == full.tokens and all(_close(a, b) for a, b in zip(run.logits, full.logits))
    assert engine.warmup_steps(run) == 4  # the exact steps and the index's first
    for store in run.stores.values():
        assert store.n_rows == PROMPT - 12 + STEPS - 1 and store.indexes[0].n_keys == store.n_indexed


def test_narrow_layer_leaves_the_window_and_returns_the_rows_that_left_it(prefilled):
    """A whole layer cut to its window holds what a window cache of the same tokens holds, and hands back the keys
    and values of the positions that left the window after ``since``."""
    lm, pre, _ = prefilled
    w, layer = SETTINGS.window, lm.long_range_layers[0]
    with torch.inference_mode():
        whole = window_cache(pre.cache, lm.long_range_layers, w, None, whole={layer})
        windowed = window_cache(pre.cache, lm.long_range_layers, w, None)
        keys, values = narrow_layer(whole, layer, w, None, since=20)
    full_keys = pre.cache.layers[layer].keys
    assert isinstance(whole.layers[layer], WindowLayer) and whole.layers[layer].cumulative_length == PROMPT
    assert torch.equal(whole.layers[layer].keys, windowed.layers[layer].keys)
    assert torch.equal(whole.layers[layer].values, windowed.layers[layer].values)
    assert torch.equal(keys, full_keys[0, :, 20:PROMPT - w.recent])
    assert torch.equal(values, pre.cache.layers[layer].values[0, :, 20:PROMPT - w.recent])


@pytest.mark.parametrize("during", [True, False])
def test_a_build_failing_while_the_decode_runs_is_one_error_and_nothing_keeps_building(prefilled, monkeypatch, during,
                                                                                      broken_index):
    """A plugin whose build raises after the decode began: the step that sees it ends the mode's run with the error
    naming the index and its layer, and no build is left queued or running (during the prefill or after it)."""
    lm, pre, _ = prefilled
    monkeypatch.setattr(threads, "thread_budget", lambda: 2)
    go = _hold_builds(monkeypatch, release_after=2)
    settings = dataclasses.replace(SETTINGS, build_during_prefill=during)
    try:
        failed = runner.run_sample(lm, [Mode(broken_index, IndexPlan(broken_index))], settings, pre.ids, STEPS,
                                   set())["runs"][broken_index]
        assert re.match(r"^building layer \d+'s indexes: broken raised RuntimeError: no memory", failed.error), failed.error
    finally:
        go.set()
    assert all(pool._work_queue.empty() for pool in threads._POOLS.values())


def test_run_sample_decodes_before_the_builds_end_and_times_the_first_token_without_them(prefilled, monkeypatch):
    """With builds during the prefill, a mode's decode starts while they still run (a wait for them would time out the
    held builds); its time to first token counts the prefill and the first step, not the build."""
    lm, pre, full = prefilled
    go = _hold_builds(monkeypatch, release_after=2)
    try:
        res = runner.run_sample(lm, [Mode("flat", IndexPlan("flat"))], dataclasses.replace(SETTINGS, topk=PROMPT + STEPS),
                                pre.ids, STEPS, set())
    finally:
        go.set()
    run = res["runs"]["flat"]
    assert run.exact_steps >= 2 and run.tokens == full.tokens
    modes = {name: {"summary": runner._pool([r])} for name, r in (("full", full), ("flat", run))}
    runner.time_to_first_token(modes)
    s = modes["flat"]["summary"]
    assert s["ttft_s"] == pytest.approx(s["prefill_s"] + s["first_step_s"])
    assert s["build_s"] > 0 and s["exact_steps"] == run.exact_steps
    assert modes["flat"]["summary"]["ttft_x_full"] == pytest.approx(s["ttft_s"] / modes["full"]["summary"]["ttft_s"])


@pytest.mark.parametrize("until_built", ["wait", "exact"])
def test_the_memory_estimate_counts_the_whole_cache_held_while_building(prefilled, monkeypatch, until_built):
    """Before the prefill: an index mode alone holds a copy of the whole cache only with ``exact`` (its layers stay
    whole while they build), as ``full`` always does."""
    from anns_lab.dumps import memory

    lm, _, _ = prefilled
    seen = []
    monkeypatch.setattr(memory, "check_prefill", lambda *args, **kwargs: seen.append(kwargs))
    settings = dataclasses.replace(SETTINGS, until_built=until_built)
    runner.check_memory(lm, [Mode("flat", IndexPlan("flat"))], settings, PROMPT + STEPS)
    runner.check_memory(lm, [Mode("full")], settings, PROMPT + STEPS)
    assert [k["cache_copy"] for k in seen] == [until_built == "exact", True]
    assert seen[0]["index_layers"] == len(lm.long_range_layers)


def test_steps_leave_the_builds_a_core_while_layers_are_whole(prefilled, monkeypatch):
    """On the CPU, torch runs the steps with one thread fewer while a layer is whole (the builds take that core), and
    with all of them again from the hand-over on, and after the run."""
    lm, pre, full = prefilled
    if lm.model.device.type != "cpu":
        pytest.skip("the steps keep their threads where torch runs on an accelerator")
    go = _hold_builds(monkeypatch, release_after=3)
    real_ready, real_forward = builds.EarlyBuilds.ready, engine.forward_tokens
    seen = []

    def ready_once_ended(self, name):
        if go.is_set():
            for job in list(self.jobs[name].values()):
                job.exception(30)
        return real_ready(self, name)

    def forward(lm, cache, ids, start, end, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_forward(lm, cache, ids, start, end, *args, **kwargs)

    monkeypatch.setattr(builds.EarlyBuilds, "ready", ready_once_ended)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(engine, "forward_tokens", forward)
        run = run_mode(lm, pre, Mode("flat", IndexPlan("flat")), SETTINGS, STEPS)
        after = torch.get_num_threads()
    finally:
        go.set()
        torch.set_num_threads(before)
    assert run.exact_steps == 3 and seen == [1] * 3 + [2] * (STEPS - 4) and after == 2
