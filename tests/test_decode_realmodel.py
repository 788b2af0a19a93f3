"""Retrieval decoding on the real SmolLM2-135M: with top-k covering every key it is full attention."""

from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE

from anns_lab.decode.engine import Mode, Settings, prefill, run_mode
from anns_lab.decode.placement import IndexPlan
from anns_lab.indexes import registry
from anns_lab.window import Window

pytestmark = pytest.mark.realmodel

PROMPT, STEPS = 320, 10
SETTINGS = Settings(Window(16, 64), topk=PROMPT + STEPS - 80, add_batch=4, chunk=128)


@pytest.fixture(scope="module")
def smollm2_prefilled():
    from anns_lab.dumps.models import load_model
    from anns_lab.dumps.prompts import build_prompt

    lm = load_model("smollm2", device=TEST_DEVICE)
    ids = build_prompt("text", lm.tokenizer, PROMPT).ids
    pre = prefill(lm, ids, SETTINGS, capture_queries=True)
    full = run_mode(lm, pre, Mode("full"), SETTINGS, STEPS, keep_logits=True)
    return lm, pre, full


@pytest.mark.parametrize("name, params", [("flat", {}), ("roargraph", {"L": 400})])
def test_smollm2_covering_topk_equals_full(smollm2_prefilled, name, params):
    if name not in registry.available():
        pytest.skip(f"{name} is not registered")
    lm, pre, full = smollm2_prefilled
    run = run_mode(lm, pre, Mode(name, IndexPlan(name, {}, params)), SETTINGS, STEPS, keep_logits=True)
    for a, b in zip(run.logits, full.logits):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-4
    assert run.tokens == full.tokens
    assert len(run.stores) == 30


def test_smollm2_small_window_changes_the_output(smollm2_prefilled):
    lm, pre, full = smollm2_prefilled
    run = run_mode(lm, pre, Mode("window"), SETTINGS, STEPS, keep_logits=True)
    gap = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(run.logits, full.logits))
    assert gap > 1e-3
    top100 = run_mode(lm, pre, Mode("flat", IndexPlan("flat")), Settings(Window(16, 64), 100, 4, 128), STEPS, keep_logits=True)
    gap_top = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(top100.logits, full.logits))
    assert gap_top < gap  # retrieving the top-100 keys gets closer to full attention than the window alone
    assert torch.isfinite(torch.stack(top100.logits)).all()


def test_smollm2_until_built_exact_stays_full_attention_across_the_hand_over(smollm2_prefilled):
    """``--until-built exact`` on the real model, top-k over every key: whichever step each of the 30 layers' built
    store takes over at (the builds race the decode), every logit is full attention's, and every layer ends indexed."""
    import dataclasses

    lm, pre, full = smollm2_prefilled
    settings = dataclasses.replace(SETTINGS, until_built="exact", steps=STEPS)
    run = run_mode(lm, pre, Mode("roargraph", IndexPlan("roargraph", {}, {"L": 400})), settings, STEPS, keep_logits=True)
    for a, b in zip(run.logits, full.logits):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-4
    assert run.tokens == full.tokens and 0 <= run.exact_steps <= STEPS - 1
    assert len(run.stores) == 30 and all(s.indexes and s.n_rows == PROMPT + STEPS - 1 - 80 for s in run.stores.values())
