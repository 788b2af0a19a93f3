"""``--until-built exact``: an index mode's first steps attend its layers' keys exactly while their indexes still build,
then each built store takes over with the rows that left the window meanwhile."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from conftest import TEST_DEVICE

from anns_lab.decode import builds, engine, runner
from anns_lab.decode.engine import Mode, Settings, prefill, run_mode, summarize, swap_in
from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.dumps.models import load_model
from anns_lab.errors import DecodeError
from anns_lab.indexes import threads
from anns_lab.window import Window

PROMPT = 64
STEPS = 8  # 7 forwards: every row that leaves the window is a prompt token's, whatever a run generates
# a top-k well short of the keys: the index's output differs from full attention's, an exact store's does not
SETTINGS = Settings(Window(4, 8), topk=6, add_batch=2, chunk=24, steps=STEPS, until_built="exact")


@pytest.fixture(scope="module")
def prefilled(tiny_llama):
    lm = load_model(str(tiny_llama), device=TEST_DEVICE)
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
    """Builds held through the whole decode: every step attends the layers' keys exactly (no search), so tokens and
    logits are full attention's although the top-k is far short of the keys; the built stores swapped in after the
    decode hold the prompt's rows and those that left the window meanwhile, as a run that waited for its builds."""
    lm, pre, full = prefilled
    mode = Mode("roargraph", IndexPlan("roargraph"))
    waited = run_mode(lm, pre, mode, dataclasses.replace(SETTINGS, until_built="wait"), STEPS, keep_logits=True)
    assert not all(_close(a, b) for a, b in zip(waited.logits, full.logits))  # the index alone is not full attention
    go = _hold_builds(monkeypatch, release_after=STEPS - 1)
    try:
        run = run_mode(lm, pre, mode, SETTINGS, STEPS, keep_logits=True)
    finally:
        go.set()
    assert run.tokens == full.tokens and all(_close(a, b) for a, b in zip(run.logits, full.logits))
    assert run.exact_steps == len(run.step_s) == STEPS - 1 and not any(s.scanned for s in run.steps)
    s = summarize(run)
    assert s["exact_steps"] == STEPS - 1 and s["exact_s"] == pytest.approx(sum(run.step_s)) and s["held_s"] >= 0.0
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
    assert run.exact_steps == 3
    assert [bool(s.scanned) for s in run.steps] == [False] * 3 + [True] * (STEPS - 4)
    assert run.tokens == full.tokens and all(_close(a, b) for a, b in zip(run.logits, full.logits))
    assert engine.warmup_steps(run) == 4  # the exact steps and the index's first
    for store in run.stores.values():
        assert store.n_rows == PROMPT - 12 + STEPS - 1 and store.indexes[0].n_keys == store.n_indexed


def test_swap_in_appends_the_rows_the_exact_store_took():
    rng = np.random.default_rng(2)
    keys, values = rng.standard_normal((2, 30, 8), np.float32), rng.standard_normal((2, 30, 8), np.float32)
    held = LayerStore(5, 4, keys, values, topk=4, plan=None, add_batch=3)
    built = LayerStore(5, 4, keys, values, topk=4, plan=IndexPlan("flat"), add_batch=3)
    built.build(None)
    new_k, new_v = rng.standard_normal((2, 4, 8), np.float32), rng.standard_normal((2, 4, 8), np.float32)
    for t in range(4):
        held.extend(new_k[:, t:t + 1], new_v[:, t:t + 1])
    stores = {5: held}
    swap_in(stores, {5: built})
    assert stores[5] is built and built.n_rows == 34 and held.n_indexed == 0
    np.testing.assert_array_equal(built.keys[:, :34], np.concatenate([keys, new_k], axis=1))
    np.testing.assert_array_equal(built.values[:, :34], np.concatenate([values, new_v], axis=1))
    assert built.n_indexed == 34 and built.indexes[0].n_keys == 34  # four rows at once: a full batch of 3 and more


@pytest.mark.parametrize("during", [True, False])
def test_a_build_failing_while_the_decode_runs_is_one_error_and_nothing_keeps_building(prefilled, monkeypatch, during,
                                                                                      broken_index):
    """A plugin whose build raises after the decode began: the step that sees it ends the run with the error naming
    the index and its layer, and no build is left queued or running (during the prefill or after it)."""
    lm, pre, _ = prefilled
    monkeypatch.setattr(threads, "thread_budget", lambda: 2)
    go = _hold_builds(monkeypatch, release_after=2)
    settings = dataclasses.replace(SETTINGS, build_during_prefill=during)
    try:
        with pytest.raises(DecodeError, match=r"^building layer \d+'s indexes: broken raised RuntimeError: no memory"):
            runner.run_sample(lm, [Mode(broken_index, IndexPlan(broken_index))], settings, pre.ids, STEPS, set())
    finally:
        go.set()
    assert all(pool._work_queue.empty() for pool in threads._POOLS.values())


def test_run_sample_decodes_before_the_builds_end_and_times_the_first_token_without_them(prefilled, monkeypatch):
    """With builds during the prefill, a mode's decode starts while they still run (a wait for them would time out the
    held builds); its time to first token counts the copy of the keys, not the build."""
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
    assert s["ttft_s"] == pytest.approx(s["prefill_s"] + s["held_s"] + s["first_step_s"])
    assert s["build_s"] > 0 and s["exact_steps"] == run.exact_steps
    assert modes["flat"]["summary"]["ttft_x_full"] == pytest.approx(s["ttft_s"] / modes["full"]["summary"]["ttft_s"])
