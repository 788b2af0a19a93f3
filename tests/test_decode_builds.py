"""The decoder's early builds (decode.builds.EarlyBuilds) on failure: nothing keeps building after an error."""

from __future__ import annotations

import threading
import time

import pytest

from anns_lab.decode import builds
from anns_lab.decode.engine import Mode


def test_a_failed_build_cancels_the_queued_ones(monkeypatch):
    """``wait()`` re-raises a layer's build error and shuts the builder down: the layers still queued are cancelled,
    not built (they would hold the CPU and the prefill's cache until the process exits, which waits for them)."""
    go, started = threading.Event(), []

    def layer_store(lm, cache, n_ids, layer, plan, settings, queries, scaling=None, beside=False):
        started.append(layer)
        if layer == 0:
            go.wait(10)
            raise RuntimeError("build of layer 0 failed")
        time.sleep(1.0)  # layer 1 may start before the error is seen (wait() then waits for it); the ones after must not
        return object()

    monkeypatch.setattr(builds, "layer_store", layer_store)
    early = builds.EarlyBuilds(None, 0, [Mode("some-index")], None, None, lambda layer: None, {})
    for layer in range(4):
        early.layer_done(layer)
    go.set()
    with pytest.raises(RuntimeError, match="layer 0 failed"):
        early.wait()
    jobs = early.jobs["some-index"]
    assert jobs[2].cancelled() and jobs[3].cancelled()
    time.sleep(0.2)
    assert 2 not in started and 3 not in started


def test_builds_beside_the_prefill_are_marked_so_and_builds_after_it_are_not(monkeypatch):
    """A layer whose builds start while the prefill runs builds ``beside`` it (one thread per index, even for a layer of
    one index: indexes.threads.map_one_thread); a build that starts after the prefill ended keeps the full thread teams."""
    go, seen = threading.Event(), {}

    def layer_store(lm, cache, n_ids, layer, plan, settings, queries, scaling=None, beside=False):
        seen[layer] = beside
        if layer == 0:
            go.wait(10)
        return object()

    monkeypatch.setattr(builds, "layer_store", layer_store)
    early = builds.EarlyBuilds(None, 0, [Mode("some-index")], None, None, lambda layer: None, {})
    early.layer_done(0)
    early.layer_done(1)  # queued behind layer 0: it starts once layer 0 is built, after the prefill ended
    while 0 not in seen:
        time.sleep(0.01)
    early.prefill_done()
    go.set()
    early.wait()
    assert seen == {0: True, 1: False}
