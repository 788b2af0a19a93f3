"""``decode --question-after-prefill``: the context prefilled and indexed alone, the question fed as decode steps through
each mode; full attention answers as it does with the question in the prompt, and a static selection made before the
question (snapkv's) no longer sees it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from conftest import TEST_DEVICE

from anns_lab.cli import main
from anns_lab.decode import runner
from anns_lab.decode.engine import Mode, Settings, first_step_seconds, prefill, run_mode
from anns_lab.decode.placement import IndexPlan
from anns_lab.dumps.models import load_model
from anns_lab.window import Window

PROMPT, QUESTION, NEW = 96, 7, 5
SETTINGS = Settings(Window(4, 8), topk=PROMPT + QUESTION + NEW, add_batch=2, chunk=32, steps=QUESTION + NEW,
                    build_during_prefill=False)


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_gemma3"])
def lm_ids(request):
    lm = load_model(str(request.getfixturevalue(request.param)), device=TEST_DEVICE)
    return lm, np.random.default_rng(3).integers(3, 400, size=PROMPT).tolist()


def test_full_attention_answers_the_question_fed_after_the_prefill_as_with_it_in_the_prompt(lm_ids):
    lm, ids = lm_ids
    whole = run_mode(lm, prefill(lm, ids, SETTINGS, capture_queries=False), Mode("full"), SETTINGS, NEW, keep_logits=True)
    context = prefill(lm, ids[:-QUESTION], SETTINGS, capture_queries=False)
    late = run_mode(lm, context, Mode("full"), SETTINGS, NEW, keep_logits=True, forced=ids[-QUESTION:])
    assert late.tokens == whole.tokens and len(late.tokens) == NEW  # the question's tokens are not the answer's
    assert len(late.step_s) == QUESTION + NEW - 1  # one step per question token, then the answer's
    # the answer's first token comes from the last question step: the time to it holds every question step
    assert late.forced_steps == QUESTION and whole.forced_steps == 0
    assert first_step_seconds(late) == pytest.approx(late.setup_s + sum(late.step_s[:QUESTION]))
    assert first_step_seconds(whole) == pytest.approx(whole.setup_s + whole.step_s[0])
    for a, b in zip(whole.logits, late.logits[QUESTION:]):  # each answer token's logits: the same attention
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_an_exact_index_mode_answers_as_full_and_its_steps_search_for_the_question(lm_ids):
    """flat at a top-k of every key: the question's steps go through the index (the mode's per-token figures count
    them) and the answer is full attention's."""
    lm, ids = lm_ids
    settings = dataclasses.replace(SETTINGS, question_after_prefill=True)
    res = runner.run_sample(lm, [Mode("full"), Mode("flat", IndexPlan("flat"))], settings, ids, NEW, set(),
                            question=QUESTION)["runs"]
    assert res["flat"].tokens == res["full"].tokens and len(res["flat"].tokens) == NEW
    assert len(res["flat"].steps) == QUESTION + NEW - 1
    off = runner.run_sample(lm, [Mode("full")], dataclasses.replace(settings, question_after_prefill=False), ids, NEW,
                            set(), question=QUESTION)["runs"]["full"]
    assert len(off.step_s) == NEW - 1 and off.tokens == res["full"].tokens  # the flag alone moves the question


def test_the_indexes_are_built_before_the_question_exists(lm_ids, monkeypatch):
    """The queries an attention-aware index learns from are the context's: snapkv's observation window ends where the
    question begins."""
    from anns_lab.indexes import registry

    lm, ids = lm_ids
    cls = registry.get("snapkv")
    seen = []
    real = cls._build

    def spy(self, keys, train_queries):
        seen.append((len(keys), len(train_queries)))
        return real(self, keys, train_queries)

    monkeypatch.setattr(cls, "_build", spy)
    settings = dataclasses.replace(SETTINGS, question_after_prefill=True, calibrate=0.0)
    pre_rows = []
    real_prefill = runner.prefill
    monkeypatch.setattr(runner, "prefill", lambda lm, ids, *a, **k: pre_rows.append(len(ids)) or real_prefill(lm, ids, *a, **k))
    runner.run_sample(lm, [Mode("snapkv", IndexPlan("snapkv", {"window": 8}))], settings, ids, NEW, set(),
                      question=QUESTION)
    held = PROMPT - QUESTION - SETTINGS.window.size  # the context's keys outside the window (the warm-up builds others)
    assert pre_rows == [PROMPT - QUESTION] and {s for s in seen if s[0] == held} == {(held, 8)}


def test_the_option_is_refused_where_no_question_can_wait(tiny_llama):
    for args, why in ((["--prompt", "hello there"], "--prompt decodes that text once"),
                      (["--eval", "fidelity", "--context", "300"], "--eval fidelity teacher-forces")):
        res = CliRunner().invoke(main, ["decode", "--model", str(tiny_llama), "--mode", "full", "--question-after-prefill",
                                        *args])
        assert res.exit_code != 0 and "--question-after-prefill" in res.output and why in res.output, res.output


def test_a_context_no_longer_than_the_window_before_the_question_is_refused(lm_ids):
    lm, ids = lm_ids
    settings = dataclasses.replace(SETTINGS, question_after_prefill=True, window=Window(4, 86))
    from anns_lab.errors import DecodeError

    with pytest.raises(DecodeError, match="before the question holds 89 tokens"):
        runner.run_sample(lm, [Mode("full"), Mode("flat", IndexPlan("flat"))], settings, ids, NEW, set(), question=QUESTION)


def test_an_index_that_cannot_hold_the_context_before_the_question_is_refused_up_front(tiny_llama):
    """The build-parameter check counts the keys of the context without its question: an IVF with one list per key of
    the whole context would fail on every sample, after a prefill each."""
    from anns_lab.dumps import tasks
    from transformers import AutoTokenizer

    asked = tasks.make_sample("passkey", AutoTokenizer.from_pretrained(tiny_llama), 300, 0, 0.5).question
    held = 300 - asked - 20  # --window 4,16
    args = ["decode", "--model", str(tiny_llama), "--mode", "full,ivf", "--task", "passkey", "--context", "300",
            "--window", "4,16", "--topk", "5", "--build-param", f"nlist={held + 1}", "--samples", "1"]
    res = CliRunner().invoke(main, args + ["--question-after-prefill"])
    assert res.exit_code != 0 and f"cannot index the {held} keys outside the window" in res.output, res.output
    assert "prefill" not in res.output  # refused before any sample ran


def test_the_flag_reaches_each_sample_from_the_command_line(tiny_llama, tmp_path):
    """The CLI's flag through run_task to each sample: the JSON records it and each mode's steps hold the question's."""
    import json

    args = ["decode", "--model", str(tiny_llama), "--mode", "full,flat", "--task", "passkey", "--context", "200",
            "--samples", "1", "--window", "4,16", "--topk", "20", "--max-new-tokens", "3", "--chunk", "64"]
    for late in (False, True):
        out = tmp_path / f"{late}.json"
        res = CliRunner().invoke(main, args + ["--json", str(out)] + (["--question-after-prefill"] if late else []))
        assert res.exit_code == 0, res.output
        result = json.loads(out.read_text())
        assert result["settings"]["question_after_prefill"] is late
        steps = result["modes"]["flat"]["summary"]["steps"] + result["modes"]["flat"]["summary"]["warmup_steps_excluded"]
        assert (steps > 2) is late  # 2 steps for 3 new tokens; the question's besides with the flag


def test_the_searches_are_raised_again_on_the_questions_steps_before_its_last(lm_ids, monkeypatch):
    """--calibrate-question: each layer's search is calibrated once more, on the queries its searches had at the
    question's steps but the last (as the steps gave them to the store), before that last step, whose output is the
    answer's first token; from it on the layer searches as raised. (The build's calibration is left out here, so that
    the search starts at nprobe 1 of 4 and there is something to raise.)"""
    from anns_lab.decode import engine
    from anns_lab.decode.placement import LayerStore

    lm, ids = lm_ids
    settings = dataclasses.replace(SETTINGS, topk=4, question_after_prefill=True, calibrate=0.999,
                                   calibrate_question=True)
    searched, asked = [], []
    real_side, real_calibrate = LayerStore.side, engine.calibration.calibrate

    def side(self, q, *args, **kwargs):
        if self.layer >= 0:  # not the kernels' warm-up (builds.warm_up)
            searched.append((self.layer, q.copy(), self.plan.describe()))
        return real_side(self, q, *args, **kwargs)

    def calibrate(store, queries, *args, **kwargs):
        if store.layer < 0:
            return real_calibrate(store, queries, *args, **kwargs)
        asked.append((store.layer, queries.copy(), len(searched)))
        return real_calibrate(store, queries, *args, **kwargs) if searched else None  # none at build time

    monkeypatch.setattr(LayerStore, "side", side)
    monkeypatch.setattr(engine.calibration, "calibrate", calibrate)
    mode = Mode("ivf", IndexPlan("ivf", {"nlist": 4}, {"nprobe": 1}))
    run = runner.run_sample(lm, [mode], settings, ids, NEW, set(), question=QUESTION)["runs"]["ivf"]
    layers = lm.long_range_layers
    probes = QUESTION - 1
    on_steps = [a for a in asked if a[2] > 0]
    assert [a[0] for a in on_steps] == sorted(layers) and {a[2] for a in on_steps} == {probes * len(layers)}
    for layer, queries, _ in on_steps:
        given = [q for l, q, _ in searched[:probes * len(layers)] if l == layer]
        assert queries.shape == (lm.config.num_attention_heads, probes, given[0].shape[1])
        assert np.array_equal(queries, np.stack(given, axis=1))  # the steps' own queries, in order
    assert set(run.question_calibration) == set(layers)
    # raised (a top-4 at 0.999 of its weight needs more than one list of four), or where that reads more than a scan,
    # the layer scanned exactly (calibrate's rule at build time too)
    raised = {layer: "flat" if "exact_scan" in c else f"ivf(nlist=4, nprobe={c['value']})"
              for layer, c in run.question_calibration.items()}
    assert set(raised.values()) != {"ivf(nlist=4, nprobe=1)"}
    for step, (layer, _, plan) in enumerate(searched):
        assert plan == ("ivf(nlist=4, nprobe=1)" if step < probes * len(layers) else raised[layer])
    assert len(searched) == (QUESTION + NEW - 1) * len(layers)
    assert any(note.startswith("again, before the answer: calibrated nprobe per layer") and
               "on the queries of the question's first 6 steps (raised" in note for note in run.notes)

    asked.clear()
    searched.clear()
    plain = runner.run_sample(lm, [mode], dataclasses.replace(settings, calibrate_question=False), ids, NEW, set(),
                              question=QUESTION)["runs"]["ivf"]
    assert not plain.question_calibration and not [a for a in asked if a[2] > 0]


def test_calibrating_on_the_question_needs_a_late_question_a_target_and_the_builds_waited_for(tiny_llama):
    args = ["decode", "--model", str(tiny_llama), "--mode", "full,flat", "--task", "passkey", "--context", "200",
            "--calibrate-question"]
    for extra, why in (([], "add --question-after-prefill"),
                       (["--question-after-prefill", "--calibrate", "0"], "--calibrate 0 sets none"),
                       (["--question-after-prefill", "--until-built", "exact"], "use --until-built wait")):
        res = CliRunner().invoke(main, args + extra)
        assert res.exit_code != 0 and why in res.output, res.output
    # runs with no question to defer are told so once (before: "add --question-after-prefill", which they refuse too)
    for run in (["--prompt", "hello"], ["--eval", "fidelity", "--context", "200"]):
        res = CliRunner().invoke(main, ["decode", "--model", str(tiny_llama), "--mode", "full,flat", *run,
                                        "--calibrate-question"])
        assert res.exit_code != 0 and "--calibrate-question: not used by this run" in res.output, res.output
