"""Accuracy intervals of decode: Wilson and Newcombe's paired difference against published values and by coverage."""

from __future__ import annotations

import numpy as np
import pytest

from anns_lab.decode import runner, stats


def test_wilson_matches_newcombe_1998_examples():
    # Newcombe (1998) Stat Med 17:857, Table I: 81/263 -> 0.2553-0.3662; 0/10 -> 0-0.2775; 1/29 -> 0.0061-0.1718.
    assert stats.wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert stats.wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert stats.wilson(1, 29) == pytest.approx((0.0061, 0.1718), abs=1e-4)


def test_paired_difference_matches_newcombe_1998_method_10():
    # Newcombe (1998) Stat Med 17:2635, Table II, example (a): 36 both, 12 only first, 2 only second, 0 neither.
    a = [1] * 36 + [1] * 12 + [0] * 2
    b = [1] * 36 + [0] * 12 + [1] * 2
    d, lo, hi = stats.paired_difference(a, b)
    assert (d, lo, hi) == pytest.approx((0.2, 0.0569, 0.3404), abs=1e-4)
    assert stats.paired_difference(b, a) == pytest.approx((-0.2, -0.3404, -0.0569), abs=1e-4)


def test_paired_difference_covers_the_true_difference_about_95_percent():
    rng = np.random.default_rng(0)
    n, trials, hits = 60, 2000, 0
    # Correlated pairs: P(both)=0.6, P(only a)=0.15, P(only b)=0.05, P(neither)=0.2 -> true difference 0.10.
    cells = rng.choice(4, size=(trials, n), p=[0.6, 0.15, 0.05, 0.2])
    for c in cells:
        a = (c <= 1).astype(float)
        b = ((c == 0) | (c == 2)).astype(float)
        _, lo, hi = stats.paired_difference(list(a), list(b))
        hits += lo <= 0.10 <= hi
    assert 0.93 <= hits / trials <= 0.975


def test_summary_has_intervals_and_the_table_shows_them():
    acc = runner._accuracy([1, 1, 0, 1], [1, 1, 1, 1])
    assert acc["accuracy"] == 75.0 and acc["diff_vs_full"] == -25.0
    lo, hi = acc["accuracy_ci95"]
    assert lo < 75 < hi and acc["diff_vs_full_ci95"][0] < -25 < acc["diff_vs_full_ci95"][1]
    text = runner.table({"modes": {"flat": {"summary": acc}}})
    assert text.count("95% CI") >= 2 and f"[{lo:.1f}, {hi:.1f}]" in text
    dlo, dhi = acc["diff_vs_full_ci95"]
    assert f"[{dlo:+.1f}, {dhi:+.1f}]" in text


def test_a_modes_notes_over_samples_keep_each_samples_own_labelled():
    """A calibration note is the prompt's (its values differ by sample): only the notes every sample gave stand
    unlabelled; before, the last sample's notes were printed as the mode's."""
    common = "roargraph has no add()"
    merged = runner.merged_notes([[common, "calibrated L: 5: L=500 (0.95)"], [common, "calibrated L: 5: L=200 (0.96)"]])
    assert merged == [common, "sample 1: calibrated L: 5: L=500 (0.95)", "sample 2: calibrated L: 5: L=200 (0.96)"]
    assert runner.merged_notes([[common, "x"], [common, "x"]]) == [common, "x"]
    assert runner.merged_notes([["x"]]) == ["x"] and runner.merged_notes([]) == []


def test_pooled_per_token_times_leave_out_every_samples_first_step():
    """Each sample's run decodes from indexes of its own: its first step is its first search on them (and, in a fresh
    Ray worker, the kernels' compile), timed apart as ``first_step_s``. Pooled over samples, the per-token means leave
    out every run's first step, as a single run's summary does, not only the first sample's."""
    from anns_lab.decode.attention import StepTimes
    from anns_lab.decode.engine import ModeRun

    def run(first: float) -> ModeRun:
        steps = [StepTimes(retrieval=first)] + [StepTimes(retrieval=0.001) for _ in range(3)]
        return ModeRun("flat", [], [], 0.0, 0.0, steps, [first + 0.01] + [0.011] * 3)

    pooled = runner._pool([run(2.0), run(3.0), run(4.0)])
    assert pooled["retrieval_ms"] == pytest.approx(1.0) and pooled["token_ms"] == pytest.approx(11.0)
    assert pooled["steps"] == 9 and pooled["warmup_steps_excluded"] == 3
    assert pooled["first_step_s"] == pytest.approx(3.01)
    single = runner._pool([run(2.0)])  # one sample: as summarize leaves it
    assert single["token_ms"] == pytest.approx(11.0) and single["warmup_steps_excluded"] == 1
