"""Estimators in the decoder: an estimate covering every non-window key reproduces full attention, as top-k modes do."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from test_decode_exact import SETTINGS, STEPS, _rel, prefilled  # noqa: F401 - prefilled is a fixture
from test_decode_realmodel import SETTINGS as REAL_SETTINGS
from test_decode_realmodel import STEPS as REAL_STEPS
from test_decode_realmodel import smollm2_prefilled  # noqa: F401 - a fixture

from anns_lab.decode.engine import Mode, run_mode
from anns_lab.decode.placement import IndexPlan
from anns_lab.indexes import registry

# Per estimator plugin: build and search parameters whose estimate covers every key with weight 1.
COVERING = {
    "magicpig": ({}, {"min_collisions": 0}),             # every key sampled with probability 1
    "vattention": ({}, {"nprobe": 1, "epsilon": 1e-9}),  # the budget is the whole rest: weights |R|/|R| = 1
    "retroinfer": ({"nlist": 1 << 20, "estimation_budget": 1.0}, {"nprobe": 1}),  # a cluster per key, each estimated: exactly
}


def estimators() -> list[str]:
    return [n for n in COVERING if n in registry.available()]


@pytest.mark.parametrize("name", estimators())
def test_covering_estimate_equals_full_attention(prefilled, name):
    lm, pre, full = prefilled
    build, search = COVERING[name]
    run = run_mode(lm, pre, Mode(name, IndexPlan(name, build, search)), SETTINGS, STEPS, keep_logits=True)
    for step, (a, b) in enumerate(zip(run.logits, full.logits)):
        assert _rel(a, b) < 1e-4, (name, step)
    assert run.tokens == full.tokens


@pytest.mark.parametrize("name", estimators())
def test_partial_estimate_runs_and_stays_finite(prefilled, name):
    lm, pre, full = prefilled
    settings = dataclasses.replace(SETTINGS, topk=2)
    build, search = {"magicpig": ({}, {"min_collisions": 3}), "vattention": ({}, {"nprobe": 1, "epsilon": 0.5}),
                     "retroinfer": ({"nlist": 4}, {"nprobe": 1})}[name]
    run = run_mode(lm, pre, Mode(name, IndexPlan(name, build, search)), settings, STEPS, keep_logits=True)
    assert len(run.logits) == STEPS and all(np.isfinite(a.numpy()).all() for a in run.logits)
    if name == "retroinfer":  # centroids stand for 4 clusters' keys: an approximation, not full attention
        assert max(_rel(a, b) for a, b in zip(run.logits, full.logits)) > 1e-4


@pytest.mark.realmodel
@pytest.mark.parametrize("name", estimators())
def test_smollm2_covering_estimate_equals_full(smollm2_prefilled, name):
    lm, pre, full = smollm2_prefilled
    build, search = COVERING[name]
    settings = dataclasses.replace(REAL_SETTINGS, topk=100)
    run = run_mode(lm, pre, Mode(name, IndexPlan(name, build, search)), settings, REAL_STEPS, keep_logits=True)
    for a, b in zip(run.logits, full.logits):
        assert _rel(a, b) < 1e-4
    assert run.tokens == full.tokens


def test_the_decoder_gives_vattention_the_layers_softmax_scale(prefilled, monkeypatch):
    """Before: vattention's budget took 1/√d whatever the layer's softmax scale (the decoder passed no temperature);
    now every search gets the scale the layer's attention uses, and one given with --param stays."""
    if "vattention" not in registry.available():
        pytest.skip("the vattention plugin is not installed (make test installs it)")
    cls = registry.get("vattention")
    lm, pre, _ = prefilled
    seen = []
    real = cls._search

    def recording(self, queries, k, **params):
        seen.append(params["temperature"])
        return real(self, queries, k, **params)

    monkeypatch.setattr(cls, "_search", recording)
    run_mode(lm, pre, Mode("vattention", IndexPlan("vattention", {}, {})), SETTINGS, 3)
    scales = {layer: pre.scaling[layer] for layer in lm.long_range_layers}
    assert seen and set(seen) <= {float(s) for s in scales.values()} and 0.0 not in seen
    seen.clear()
    run_mode(lm, pre, Mode("vattention", IndexPlan("vattention", {}, {"temperature": 0.5})), SETTINGS, 3)
    assert seen and set(seen) == {0.5}
