"""The decoder's early builds (decode.builds.EarlyBuilds) on failure: nothing keeps building after an error."""

from __future__ import annotations

import re
import threading
import time
from concurrent import futures
from types import SimpleNamespace

import pytest

from anns_lab.decode import builds
from anns_lab.decode.engine import Mode
from anns_lab.errors import DecodeError


def test_a_failed_build_cancels_the_queued_ones(monkeypatch):
    """``wait()`` re-raises a layer's build error and shuts the builder down: the layers still queued are cancelled,
    not built (they would hold the CPU and the prefill's cache until the process exits, which waits for them)."""
    go, started = threading.Event(), []

    def layer_store(lm, cache, n_ids, layer, plan, settings, queries, scaling=None, beside=False):
        started.append(layer)
        if layer == 0:
            go.wait(10)
            raise RuntimeError("build of layer 0 failed")
        time.sleep(1.0)  # on two workers layers 1 and 2 may start before the error is seen (wait() then waits for
        return object()  # them); the ones after must not

    monkeypatch.setattr(builds, "thread_budget", lambda: 2)
    monkeypatch.setattr(builds, "layer_store", layer_store)
    early = builds.EarlyBuilds(None, 0, [Mode("some-index")], None, None, lambda layer: None, {})
    for layer in range(6):
        early.layer_done(layer)
    go.set()
    with pytest.raises(DecodeError, match="layer 0 failed"):
        early.wait()
    jobs = early.jobs["some-index"]
    # cancelled in the queue, or stopped as a worker took them (the failed build set the stop): never built
    assert all(jobs[layer].cancelled() or isinstance(jobs[layer].exception(), futures.CancelledError) for layer in (3, 4, 5))
    time.sleep(0.2)
    assert not {3, 4, 5} & set(started)


def test_a_later_layers_error_stops_the_builds_while_an_earlier_layer_still_builds(monkeypatch):
    """Layer 1 fails while layer 0 still builds (two layers at once): the builds stop at once, not after layer 0 has
    ended (the other worker meanwhile built layer after layer for nothing), the layers queued are never built, and
    layer 1's error is raised (by the next ``layer_done``, or by ``wait()``)."""
    monkeypatch.setattr(builds, "thread_budget", lambda: 2)
    lock, started, running = threading.Lock(), set(), [0]
    early = builds.EarlyBuilds(None, 0, [Mode("some-index")], None, None, lambda layer: None, {})
    jobs = early.jobs["some-index"]

    def layer_store(lm, cache, n_ids, layer, plan, settings, queries, scaling=None, beside=False):
        with lock:
            started.add(layer)
            running[0] += 1
        try:
            if layer == 1:
                raise RuntimeError("build of layer 1 failed")
            for _ in range(200 if layer == 0 else 100):  # until the builds are stopped (at most 2 s, 1 s)
                if early._stop.is_set():
                    break
                time.sleep(0.01)
            return object()
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(builds, "layer_store", layer_store)
    early.prefill_done()
    with pytest.raises(DecodeError, match="layer 1 failed"):
        for layer in range(12):
            early.layer_done(layer)  # raises once layer 1 has failed (the prefill would end there) ...
        early.wait()  # ... or here, when every layer was queued before
    early.close()  # as the prefill's except clause does (again after wait's: nothing left to stop or wait for)
    assert running[0] == 0 and started <= {0, 1, 2}, started  # the other worker took one layer at most after the error
    assert all(f.cancelled() or isinstance(f.exception(), futures.CancelledError) for layer, f in jobs.items() if layer > 2)


def test_a_build_failing_during_the_prefill_ends_it_at_the_next_layer(monkeypatch):
    """A layer's build that fails while the prefill still runs stops the builds at once (the stop is set: a layer
    building stops at its running heads), and the next layer the prefill completes raises that error on the prefill's
    thread: the prefill ends there, not after its last chunk (at 128K, minutes), and no later layer starts building."""
    started = []

    def layer_store(lm, cache, n_ids, layer, plan, settings, queries, scaling=None, beside=False):
        started.append(layer)
        if layer == 0:
            raise RuntimeError("build of layer 0 failed")
        return object()

    monkeypatch.setattr(builds, "thread_budget", lambda: 2)
    monkeypatch.setattr(builds, "layer_store", layer_store)
    early = builds.EarlyBuilds(None, 0, [Mode("some-index")], None, None, lambda layer: None, {})
    early.layer_done(0)
    futures.wait([early.jobs["some-index"][0]])
    assert early._stop.is_set()
    with pytest.raises(DecodeError, match="building layer 0's indexes: .*layer 0 failed"):
        early.layer_done(1)
    early.close()
    assert started == [0] and 1 not in early.jobs["some-index"]


def test_several_modes_build_a_layer_at_a_time_beside_the_prefill_then_with_full_teams(monkeypatch):
    """Several modes: one layer at a time (each mode's seconds its own). A layer whose builds start while the prefill
    runs builds ``beside`` it (one thread per index, even for a layer of one index: indexes.threads.map_one_thread); a
    build that starts after the prefill ended, alone then, keeps the full thread teams."""
    monkeypatch.setattr(builds, "thread_budget", lambda: 2)
    go, seen = threading.Event(), {}

    def layer_store(lm, cache, n_ids, layer, plan, settings, queries, scaling=None, beside=False):
        seen[layer, plan] = beside
        if layer == 0:
            go.wait(10)
        return object()

    monkeypatch.setattr(builds, "layer_store", layer_store)
    early = builds.EarlyBuilds(None, 0, [Mode("a", "pa"), Mode("b", "pb")], None, None, lambda layer: None, {})
    assert early.workers == 1
    early.layer_done(0)
    early.layer_done(1)  # queued behind layer 0: it starts once layer 0 is built, after the prefill ended
    while (0, "pa") not in seen:
        time.sleep(0.01)
    early.prefill_done()
    go.set()
    early.wait()
    assert seen == {(0, "pa"): True, (0, "pb"): False, (1, "pa"): False, (1, "pb"): False}


def test_one_mode_builds_as_many_layers_at_once_as_its_budget_each_beside_the_others(monkeypatch):
    """One mode (the decoder's): two layers build at once on a budget of two, each ``beside`` (one thread per kernel)
    even after the prefill, since the other layer's builds share the cores; its seconds are the union of the layers'
    spans, not their sum."""
    monkeypatch.setattr(builds, "thread_budget", lambda: 2)
    both, seen, lock = threading.Barrier(2, timeout=10), {}, threading.Lock()

    def layer_store(lm, cache, n_ids, layer, plan, settings, queries, scaling=None, beside=False):
        with lock:
            seen[layer] = beside
        both.wait()  # would time out (BrokenBarrierError) were the layers built one at a time
        time.sleep(0.3)
        return _Store()

    monkeypatch.setattr(builds, "layer_store", layer_store)
    monkeypatch.setattr(builds, "store_notes", lambda stores, settings: [])
    from anns_lab.decode.engine import Settings
    from anns_lab.decode.placement import IndexPlan
    from anns_lab.window import Window

    def model(heads, kv=1):  # what EarlyBuilds reads of a loaded model: its heads and long-range layers
        return SimpleNamespace(config=SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv),
                               long_range_layers=[0, 1])

    def workers(heads, settings=None, index="roargraph", kv=1):
        early = builds.EarlyBuilds(model(heads, kv), 0, [Mode(index, IndexPlan(index))], settings, None,
                                   lambda layer: None, {})
        early.close()
        return early.workers

    assert workers(9) == 2 and workers(4) == 2  # auto on two threads: at least two layers
    monkeypatch.setattr(builds, "thread_budget", lambda: 16)
    # auto: an index per thread (16 threads: four layers of four heads, two of nine, two of 32 at least)
    assert (workers(4), workers(9), workers(32), workers(1)) == (4, 2, 2, 16)
    # an index per KV head: a key-only index, or an attention-aware one trained on its group's queries
    assert workers(9, index="ivf", kv=3) == 5 and workers(9, Settings(train_group="group"), kv=3) == 5
    assert workers(9, Settings(train_group="unlisted"), kv=3) == 2  # one per query head

    for asked, n in ((8, 8), (32, 16), (1, 1), (0, 4)):  # decode --build-layers, within the threads' budget
        assert workers(4, Settings(Window(4, 16), build_layers=asked)) == n
    monkeypatch.setattr(builds, "thread_budget", lambda: 1)
    assert workers(4) == 1
    monkeypatch.setattr(builds, "thread_budget", lambda: 2)
    early = builds.EarlyBuilds(model(4), 0, [Mode("some-index", IndexPlan("roargraph"))], None, None, lambda layer: None,
                               {})
    early.prefill_done()
    early.layer_done(0)
    early.layer_done(1)
    stores, _, seconds, hidden = early.take("some-index")
    early.close()
    assert seen == {0: True, 1: True} and set(stores) == {0, 1}
    assert 0.3 <= seconds < 0.55 and hidden == 0.0  # two 0.3 s spans side by side: once, not 0.6


class _Store:
    calibration = None


def test_covered_counts_overlapping_spans_once_and_only_before_the_end():
    spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.8)]
    assert builds.covered(spans) == pytest.approx(4.0)
    assert builds.covered(spans, end=2.5) == pytest.approx(2.5)
    assert builds.covered(spans, end=5.5) == pytest.approx(3.5)
    assert builds.covered([]) == 0.0


def test_an_index_failing_in_the_early_builds_is_one_error_and_the_next_decode_works(tiny_llama, monkeypatch,
                                                                                      broken_index):
    """A plugin whose build raises (here every build: the layer named is one that failed first, the other layer then
    building stopped): its mode fails with one error naming the index and the layer, and the same process's next
    decode builds and decodes as a decode alone does (nothing left queued in the build pools)."""
    import numpy as np

    from anns_lab.decode import runner
    from anns_lab.decode.engine import Settings, prefill, run_mode
    from anns_lab.decode.placement import IndexPlan
    from anns_lab.dumps.models import load_model
    from anns_lab.indexes import threads
    from anns_lab.window import Window

    monkeypatch.setattr(threads, "thread_budget", lambda: 2)  # two layers at once, heads side by side, on any runner
    lm = load_model(str(tiny_llama), device="cpu")
    settings = Settings(Window(4, 8), topk=40, add_batch=4, chunk=24)
    ids = np.random.default_rng(3).integers(3, 400, size=64).tolist()
    failed = runner.run_sample(lm, [Mode("broken", IndexPlan("broken"))], settings, ids, 6, set())["runs"]["broken"]
    assert re.match(r"^building layer \d+'s indexes: broken raised RuntimeError: no memory", failed.error), failed.error
    assert failed.tokens == [] and int(failed.error.split()[2].split("'")[0]) in lm.long_range_layers
    assert all(pool._work_queue.empty() for pool in threads._POOLS.values())
    mode = Mode("flat", IndexPlan("flat"))
    after = runner.run_sample(lm, [mode], settings, ids, 6, set())["runs"]["flat"]
    alone = run_mode(lm, prefill(lm, ids, settings, capture_queries=False), mode, settings, 6)
    assert after.tokens == alone.tokens and set(after.build_layers) == set(lm.long_range_layers)


@pytest.mark.parametrize("interrupt", ["close", "wait"])
def test_an_interrupt_stops_the_layers_building_at_their_running_heads(monkeypatch, interrupt):
    """Ctrl-C in the prefill (``close()``) or in ``wait()`` while two layers build: the call returns once the heads
    then running have ended, not after every head of both layers (a Llama-3-8B layer at 128K: 32 heads of seconds
    each), and nothing of theirs starts later."""
    from anns_lab.indexes import threads

    monkeypatch.setattr(builds, "thread_budget", lambda: 2)
    monkeypatch.setattr(threads, "thread_budget", lambda: 2)
    monkeypatch.setattr(threads, "_POOLS", {})
    lock, started, running = threading.Lock(), [], [0]

    def head(h):
        with lock:
            started.append(h)
            running[0] += 1
        time.sleep(0.2)
        with lock:
            running[0] -= 1

    def layer_store(lm, cache, n_ids, layer, plan, settings, queries, scaling=None, beside=False):
        threads.map_one_thread(head, range(8), beside=True)
        return object()

    monkeypatch.setattr(builds, "layer_store", layer_store)
    early = builds.EarlyBuilds(None, 0, [Mode("some-index")], None, None, lambda layer: None, {})
    for layer in range(4):
        early.layer_done(layer)
    while len(started) < 2:
        time.sleep(0.01)
    if interrupt == "close":  # the prefill's except clause
        early.close()
    else:  # an interrupt of the waiting thread, as Ctrl-C raises it there
        with pytest.MonkeyPatch.context() as mp, pytest.raises(KeyboardInterrupt):
            mp.setattr(threads, "wait", _interrupted_once(threads.wait))
            early.wait()
    with lock:
        at_end = running[0], len(started)
    time.sleep(0.5)
    assert at_end[0] == 0 and len(started) == at_end[1] <= 4, (interrupt, at_end, len(started))
    for pool in threads._POOLS.values():
        pool.shutdown()


def _interrupted_once(wait):
    """``concurrent.futures.wait`` whose first call on the main thread raises KeyboardInterrupt (where Ctrl-C meets the
    thread waiting for the builds)."""
    calls = []

    def interrupted(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            calls.append(1)
            if len(calls) == 1:
                raise KeyboardInterrupt
        return wait(*args, **kwargs)

    return interrupted


@pytest.mark.parametrize("where", ["build", "search"])
@pytest.mark.parametrize("fault", ["raise", "exit"])
def test_a_plugin_that_raises_or_exits_is_one_error_naming_it_and_its_layer(tiny_llama, monkeypatch, where, fault):
    """A plugin index whose build or search raises, or calls sys.exit (which would end the decode without a word):
    one DecodeError that names the index, the layer and what it raised, from the builds as from a decode step's CPU
    side."""
    import sys

    import numpy as np

    from anns_lab.decode import runner
    from anns_lab.decode.engine import Settings
    from anns_lab.decode.placement import IndexPlan
    from anns_lab.dumps.models import load_model
    from anns_lab.indexes import registry
    from anns_lab.window import Window

    flat = registry.get("flat")

    def fail():
        if fault == "exit":
            sys.exit(3)
        raise RuntimeError("no memory for its graph")

    class Broken(flat):
        def _build(self, keys, train_queries=None):
            if where == "build":
                fail()
            return super()._build(keys, train_queries)

        def _search(self, queries, k):
            if where == "search":
                fail()
            return super()._search(queries, k)

    real_get = registry.get
    monkeypatch.setattr(registry, "get", lambda name: Broken if name == "broken" else real_get(name))
    lm = load_model(str(tiny_llama), device="cpu")
    settings = Settings(Window(4, 8), topk=40, add_batch=4, chunk=24)  # no calibration: the first search is a step's
    ids = np.random.default_rng(3).integers(3, 400, size=64).tolist()
    said = "SystemExit\\(3\\): the index tried to end the process" if fault == "exit" else "RuntimeError: no memory"
    pattern = (rf"^building layer \d+'s indexes: broken raised {said}" if where == "build"
               else rf"^layer \d+: broken's search raised {said}")
    failed = runner.run_sample(lm, [Mode("broken", IndexPlan("broken"))], settings, ids, 6, set())["runs"]["broken"]
    assert re.match(pattern, failed.error), failed.error  # the mode's failure, in its run: the others' stand


WARM_CHECK = """
import gc, json, sys
import numpy as np
from numba.core.dispatcher import Dispatcher
from anns_lab.decode import runner
from anns_lab.decode.engine import Mode, Settings
from anns_lab.decode.placement import IndexPlan
from anns_lab.dumps.models import load_model
from anns_lab.window import Window

def loaded():
    return {(d.py_func.__qualname__, str(sig)) for d in gc.get_objects() if isinstance(d, Dispatcher) for sig in d.overloads}

at_prefill = []
real_prefill = runner.prefill
def prefill(*args, **kwargs):  # what the process holds when the timed part begins
    at_prefill.append(loaded())
    return real_prefill(*args, **kwargs)

runner.prefill = prefill
if sys.argv[2] == "without":
    runner.warm_up = lambda *args, **kwargs: 0.0
lm = load_model(sys.argv[1], device="cpu")
settings = Settings(Window(4, 8), topk=40, add_batch=4, chunk=24)
modes = [Mode(name, IndexPlan(name)) for name in ("roargraph", "ivf")]
ids = np.random.default_rng(3).integers(3, 400, size=64).tolist()
runs = runner.run_sample(lm, modes, settings, ids, 12, set())["runs"]
print(json.dumps({"new": sorted(q for q, _ in loaded() - at_prefill[0]),
                  "tokens": {name: run.tokens for name, run in runs.items()}}))
"""


def test_the_warm_up_leaves_no_kernel_for_the_timed_decode_to_compile_or_load(tiny_llama):
    """A fresh install compiled the index kernels inside its first decode (SmolLM2 8K, 2 cores: the builds ~28 s
    longer, the first step ~6 s), which its time to first token counted. ``run_sample`` now calls ``warm_up`` before
    the prefill, which readies every kernel the builds, the calibration and the steps use, at the layer's shape (the
    step's kernel takes the heads as a tuple: a one-group warm-up left it to the first step). In a fresh interpreter,
    nothing is compiled or loaded from numba's cache after the prefill starts; without the warm-up, the builds and
    steps load their kernels then (so this can fail)."""
    import json
    import subprocess
    import sys

    def check(how: str) -> dict:
        out = subprocess.run([sys.executable, "-c", WARM_CHECK, str(tiny_llama), how], capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    warm, cold = check("with"), check("without")
    assert warm["new"] == []
    assert {"search_heads", "attend_rows_and_range", "_project_chunk"} <= set(cold["new"])  # inside the timed part
    assert warm["tokens"] == cold["tokens"]  # the warm-up changes no index the decode builds
