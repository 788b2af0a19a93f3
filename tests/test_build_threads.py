"""Builds side by side on one-core threads (indexes.threads): the same indexes as one after another."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import faiss
import numba
import numpy as np
import pytest
import torch

from anns_lab.decode.builds import EarlyBuilds
from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.indexes import registry, threads
from anns_lab.indexes.threads import map_one_thread


def test_workers_run_their_kernels_on_one_thread_and_the_caller_keeps_its_own(monkeypatch):
    monkeypatch.setattr(threads, "thread_budget", lambda: 2)  # workers even on a one-core runner
    monkeypatch.setattr(threads, "_POOLS", {})
    before = numba.get_num_threads(), faiss.omp_get_max_threads(), torch.get_num_threads()
    got = map_one_thread(lambda i: (i, threading.current_thread().name, numba.get_num_threads(),
                                    faiss.omp_get_max_threads(), torch.get_num_threads()), range(5))
    assert [g[0] for g in got] == list(range(5))  # in order
    assert all(g[1].startswith("anns-lab-build") for g in got)
    assert all(g[2:4] == (1, 1) for g in got)
    if any(threads.Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*")):
        assert all(g[4] == 1 for g in got)
    assert (numba.get_num_threads(), faiss.omp_get_max_threads(), torch.get_num_threads()) == before
    for pool in threads._POOLS.values():
        pool.shutdown()


def test_the_decoder_runs_numpys_blas_on_one_thread_and_leaves_torch_and_faiss_theirs(tiny_llama):
    """numpy's OpenBLAS count is the process's: the decoder sets it to one (its team spun beside the prefill in the
    build and search threads); torch's threads and every other library's (faiss's own OpenBLAS, OpenMP) are not
    touched."""
    from threadpoolctl import ThreadpoolController

    from anns_lab.decode import cli

    own = threads.numpy_blas()
    if not own:
        pytest.skip("this numpy has no BLAS of its own (a system or conda one)")
    assert all("numpy" in Path(c.filepath).parent.name or ".dylibs" in c.filepath for c in own)
    original = [c.num_threads for c in own]
    for c in own:
        c.set_num_threads(2)
    mine = {c.filepath for c in own}
    others = [(c.filepath, c.num_threads) for c in ThreadpoolController().lib_controllers if c.filepath not in mine]
    torch_threads = torch.get_num_threads()
    try:
        cli._load(str(tiny_llama), "cpu", 0)
        assert [c.num_threads for c in threads.numpy_blas()] == [1] * len(own)
        after = {c.filepath: c.num_threads for c in ThreadpoolController().lib_controllers}
        assert [(path, after[path]) for path, _ in others] == others
        assert torch.get_num_threads() == torch_threads
    finally:
        for c, n in zip(threads.numpy_blas(), original):
            c.set_num_threads(n)


def test_one_item_runs_on_the_calling_thread():
    assert map_one_thread(lambda _: threading.current_thread().name, [0]) == [threading.current_thread().name]


def test_a_budget_of_one_runs_every_item_on_the_calling_thread():
    """The budget is the calling thread's numba count at call time (``NUMBA_NUM_THREADS`` or ``set_num_threads``), not
    the machine's cores: a process given one thread starts no others."""
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        assert threads.thread_budget() == 1
        names = map_one_thread(lambda _: threading.current_thread().name, range(4))
    finally:
        numba.set_num_threads(before)
    assert names == [threading.current_thread().name] * 4


_BUDGET = """
import sys
import threading
import numba
from anns_lab.indexes import threads

budget, meet = int(sys.argv[1]), sys.argv[2] == "meet"
lock, active, peak = threading.Lock(), [0], [0]
barrier = threading.Barrier(budget)
def item(_):
    with lock:
        active[0] += 1
        peak[0] = max(peak[0], active[0])
    if meet:
        barrier.wait(60)  # ``budget`` items meet here: they ran at once
    with lock:
        active[0] -= 1
    return threading.current_thread().name

numba.set_num_threads(budget)  # of the 5 NUMBA_NUM_THREADS: the calling thread's count is the budget
names = threads.map_one_thread(item, range(3 * budget))
print("budget", threads.thread_budget(), "peak", peak[0], "workers", len(set(names)), "caller", threading.current_thread().name in names)
"""


@pytest.mark.parametrize("budget, omp, expect", [(2, "5", "budget 2 peak 2 workers 2 caller False"),
                                                 (3, "5", "budget 3 peak 3 workers 3 caller False"),
                                                 (3, "1", "budget 1 peak 1 workers 1 caller True")])
def test_the_budget_bounds_the_items_at_once(budget, omp, expect):
    """numba allows 5 threads, the calling thread ``budget`` (``set_num_threads``), whatever the machine's cores: that
    many items run at once (they meet at a barrier), never more; with ``OMP_NUM_THREADS=1`` (what Ray sets for a task
    of one CPU) every item runs on the calling thread (then nothing waits at the barrier: one thread would wait for ever)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_NUM_THREADS": "5", "OMP_NUM_THREADS": omp}
    r = subprocess.run([sys.executable, "-c", _BUDGET, str(budget), "meet" if omp != "1" else "alone"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert expect in r.stdout, r.stdout


_TORCH_THREADS = """
import os
import sys
import threading
import time
import numba
import numpy as np
import torch
from anns_lab.decode.cli import _load
from anns_lab.indexes import threads

_load(sys.argv[1], "cpu", 1)  # decode --torch-threads 1
first = threads.thread_budget()  # the builds after the prefill (--eval fidelity) on this thread


@numba.njit(parallel=True)
def total(a):
    s = 0.0
    for i in numba.prange(len(a)):
        s += a[i]
    return s


total(np.ones(64))  # numba's first parallel kernel on the decode thread (--eval fidelity: the builds run there)
x = torch.randn(4_000_000)
time.sleep(0.2)  # numba's team stops spinning
ticks = lambda: sum(sum(map(int, open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()[11:13]))
                    for t in os.listdir("/proc/self/task") if int(t) != threading.get_native_id())
before = ticks()
for _ in range(10):
    torch.softmax(torch.exp(x), 0)  # torch's OpenMP loops: on this thread only
others = ticks() - before
other = []
worker = threading.Thread(target=lambda: other.append(threads.thread_budget()))  # as the decoder's early-build thread
worker.start()
worker.join()
print("torch", torch.get_num_threads(), "others' CPU", "none" if others == 0 else others,
      "budget", first, threads.thread_budget(), "other", other[0])
"""


def test_torch_threads_hold_and_leave_the_build_budget_alone(tiny_llama):
    """``--torch-threads 1`` holds after numba starts its thread pool on the decode thread (numba's OpenMP layer sets the
    OpenMP count of the thread that starts it, in the runtime torch reads its own from: torch's loops then ran on 3
    threads, the other threads' CPU ticks counted), and leaves the build budget at the process's (numba's 3, OpenMP's 3)
    on that thread, before and after, as on a fresh one, as docs/decoder.md says."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_NUM_THREADS": "3", "OMP_NUM_THREADS": "3"}
    r = subprocess.run([sys.executable, "-c", _TORCH_THREADS, str(tiny_llama)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "torch 1 others' CPU none budget 3 3 other 3" in r.stdout, r.stdout


def test_a_single_build_beside_other_work_runs_on_one_thread(monkeypatch):
    """Beside the prefill (``beside``) even one item runs its kernels on one thread, on a worker; otherwise one item
    runs on the calling thread with the libraries' full teams."""
    monkeypatch.setattr(threads, "thread_budget", lambda: 2)
    probe = lambda _: (threading.current_thread().name, numba.get_num_threads(), faiss.omp_get_max_threads())  # noqa: E731
    name, n_numba, n_omp = map_one_thread(probe, [0], beside=True)[0]
    assert name.startswith("anns-lab-build") and (n_numba, n_omp) == (1, 1)
    assert map_one_thread(probe, [0])[0] == (threading.current_thread().name, numba.get_num_threads(),
                                             faiss.omp_get_max_threads())


def test_a_layer_store_builds_beside_the_prefill_only_when_asked(monkeypatch):
    """One KV head (Gemma-3-270M: 4 query heads, 1 KV head), a key-only index: one build; beside the prefill it runs on
    one thread, after it with the calling thread's teams."""
    monkeypatch.setattr(threads, "thread_budget", lambda: 2)
    seen = []

    class Probe(registry.get("flat")):
        def _build(self, keys, train_queries=None):
            seen.append((threading.current_thread().name, numba.get_num_threads()))
            super()._build(keys, train_queries)

    monkeypatch.setattr("anns_lab.decode.placement.registry.get", lambda name: Probe)
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((1, 300, 16)).astype(np.float32)
    for beside in (True, False):
        LayerStore(0, 4, keys, keys, topk=10, plan=IndexPlan("flat"), add_batch=64).build(None, beside=beside)
    assert seen[0][0].startswith("anns-lab-build") and seen[0][1] == 1
    assert seen[1] == (threading.current_thread().name, numba.get_num_threads())


def _priority() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_builds_beside_other_work_run_below_its_priority_and_the_others_at_the_callers(monkeypatch):
    """Beside the prefill every build thread (and the early-build worker that runs the rest of a layer's work) is at
    the lowest priority, so the prefill keeps the cores it can use; builds with nothing beside them run at the caller's."""
    monkeypatch.setattr(threads, "thread_budget", lambda: 2)
    monkeypatch.setattr(threads, "_POOLS", {})
    mine = _priority()
    if mine >= threads.LOWEST_PRIORITY:
        pytest.skip("the tests run at the lowest priority already (nice 19): nothing to lower")
    try:
        beside = map_one_thread(lambda _: (threading.current_thread().name, _priority()), range(3), beside=True)
        after = map_one_thread(lambda _: (threading.current_thread().name, _priority()), range(3))
    finally:
        for pool in threads._POOLS.values():
            pool.shutdown()
    assert all(name.startswith("anns-lab-build") and p == threads.LOWEST_PRIORITY for name, p in beside)
    assert all(name.startswith("anns-lab-build") and p == mine for name, p in after)
    assert _priority() == mine  # the caller keeps its own

    early = EarlyBuilds(None, 0, [], None, None, None, {})
    try:
        assert early._pool.submit(_priority).result() == threads.LOWEST_PRIORITY
    finally:
        early.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_a_caller_at_its_own_priority_never_gets_the_threads_a_lowered_caller_started(monkeypatch):
    """A pool's threads start on its first submits and take the submitting thread's priority: builds run with nothing
    beside them (``beside=False``) from a thread at the lowest priority (an early-build worker after the prefill) must
    not leave a caller at its own priority, later, a pool of lowered threads."""
    monkeypatch.setattr(threads, "thread_budget", lambda: 2)
    monkeypatch.setattr(threads, "_POOLS", {})
    mine = _priority()
    if mine >= threads.LOWEST_PRIORITY:
        pytest.skip("the tests run at the lowest priority already (nice 19): nothing to lower")
    seen = {}

    def lowered():
        threads.lower_priority()
        seen["lowered"] = map_one_thread(lambda _: _priority(), range(4))

    try:
        worker = threading.Thread(target=lowered)
        worker.start()
        worker.join()
        seen["mine"] = map_one_thread(lambda _: _priority(), range(4))
    finally:
        for pool in threads._POOLS.values():
            pool.shutdown()
    assert seen["lowered"] == [threads.LOWEST_PRIORITY] * 4  # its own work at its own priority
    assert seen["mine"] == [mine] * 4


@pytest.mark.parametrize("name, params", [("roargraph", {}), ("roargraph", {"list_stride": 4}), ("ivf", {})])
def test_a_layers_indexes_built_side_by_side_equal_those_built_one_by_one(name, params, monkeypatch):
    """list_stride 4: the anchored lists' re-rank (a parallel kernel) runs in both builds at once."""
    monkeypatch.setattr(threads, "thread_budget", lambda: 2)
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((2, 900, 16)).astype(np.float32)
    values = rng.standard_normal((2, 900, 16)).astype(np.float32)
    queries = (rng.standard_normal((4, 700, 16)) + 0.5).astype(np.float32)
    store = LayerStore(0, 4, keys, values, topk=10, plan=IndexPlan(name, params), add_batch=64)
    store.build(queries)
    cls = registry.get(name)
    for h, index in enumerate(store.indexes):
        alone = cls(**params).build(keys[h // 2], queries[h]) if cls.uses_train_queries else cls().build(keys[h // 2])
        got, ref = index._arrays(), alone._arrays()
        assert got.keys() == ref.keys()
        for k in ref:
            assert np.array_equal(got[k], ref[k]), (h, k)


_WORKQUEUE_BUILD = """
import numpy as np
from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.indexes import threads
threads.thread_budget = lambda: 2  # side by side even on a one-core runner
rng = np.random.default_rng(5)
keys = rng.standard_normal((2, 1500, 16)).astype(np.float32)
queries = (rng.standard_normal((4, 1200, 16)) + 0.5).astype(np.float32)
for _ in range(3):  # list_stride 4: the anchored lists' re-rank, a parallel=True kernel, in every build
    store = LayerStore(0, 4, keys, keys, topk=10, plan=IndexPlan("roargraph", {"list_stride": 4}), add_batch=64)
    store.build(queries)
print("built", len(store.indexes))
"""


def test_side_by_side_builds_survive_numbas_workqueue_layer():
    """numba's ``workqueue`` threading layer (where neither TBB nor OpenMP loads) aborts the process when two threads
    run parallel kernels at once: there a layer's builds run one after another instead of side by side."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue"}
    r = subprocess.run([sys.executable, "-c", _WORKQUEUE_BUILD], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "built 4" in r.stdout, r.stderr[-2000:]


_WORKQUEUE_LAYERS = """
import numpy as np
from anns_lab.decode import builds
from anns_lab.decode.engine import Mode
from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.indexes import threads
builds.thread_budget = threads.thread_budget = lambda: 2  # two layers at once elsewhere, even on a one-core runner
rng = np.random.default_rng(5)
keys = rng.standard_normal((2, 1500, 16)).astype(np.float32)
queries = (rng.standard_normal((4, 1200, 16)) + 0.5).astype(np.float32)

def layer_store(lm, cache, n_ids, layer, plan, settings, q, scaling=None, beside=False):
    store = LayerStore(layer, 4, keys, keys, topk=10, plan=plan, add_batch=64)
    store.build(queries, beside=beside)  # list_stride 4: a parallel=True kernel in every build
    return store

builds.layer_store = layer_store
builds.store_notes = lambda stores, settings: []
early = builds.EarlyBuilds(None, 0, [Mode("rg", IndexPlan("roargraph", {"list_stride": 4}))], None, None,
                           lambda layer: None, {})
early.prefill_done()
for layer in range(3):
    early.layer_done(layer)
early.wait()
print("built", len(early.take("rg")[0]), "workers", early.workers)
"""


def test_the_early_builds_take_a_layer_at_a_time_under_numbas_workqueue_layer():
    """Two layers at once run numba's parallel kernels from two threads, which the ``workqueue`` layer answers by
    aborting the process ("Concurrent access has been detected"): there the early builds take one layer at a time."""
    import subprocess

    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue"}
    r = subprocess.run([sys.executable, "-c", _WORKQUEUE_LAYERS], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "built 3 workers 1" in r.stdout, r.stderr[-2000:]


def test_an_items_error_stops_the_calls_other_items(monkeypatch):
    """An item that raises while others run: the items not started never start, the running ones have ended when the
    error reaches the caller (the shared pool's threads would build on for nothing, and the next layer's or decode's
    builds would queue behind them), and the error is the first failed item's in order."""
    monkeypatch.setattr(threads, "thread_budget", lambda: 2)
    monkeypatch.setattr(threads, "_POOLS", {})
    lock, started, running, second = threading.Lock(), set(), [0], threading.Event()

    def item(i):
        with lock:
            started.add(i)
            running[0] += 1
        try:
            if i == 0:
                second.wait(10)  # item 1 is running when item 0 fails
                raise RuntimeError("item 0 failed")
            second.set()
            threading.Event().wait(0.3 if i == 1 else 0.05)
            return i
        finally:
            with lock:
                running[0] -= 1

    try:
        with pytest.raises(RuntimeError, match="item 0 failed"):
            map_one_thread(item, range(12), beside=True)
        with lock:
            at_error = running[0], set(started)
        threading.Event().wait(0.5)  # what was still queued would have run by now
        assert at_error[0] == 0 and started == at_error[1] and len(started) < 12, (at_error, started)
        assert map_one_thread(lambda i: i * i, range(4), beside=True) == [0, 1, 4, 9]  # the pool still serves
    finally:
        for pool in threads._POOLS.values():
            pool.shutdown()


def test_two_threads_calling_at_once_share_one_pool(monkeypatch):
    """The decoder's two early-build workers reach their first layer's builds at once: one pool of the budget's threads
    for both, not one each (the second, made beside the first, doubled the threads on the cores)."""
    monkeypatch.setattr(threads, "thread_budget", lambda: 2)
    monkeypatch.setattr(threads, "_POOLS", {})
    made = []

    class Slow(threads.ThreadPoolExecutor):
        def __init__(self, *args, **kwargs):
            made.append(self)
            threading.Event().wait(0.3)  # the other caller arrives meanwhile
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(threads, "ThreadPoolExecutor", Slow)
    threads.numba_threadsafe()  # numba's layer picked before the race (it takes a while the first time)
    both = threading.Barrier(2, timeout=10)

    out: list = []

    def caller() -> None:  # as an early-build worker
        both.wait()
        out.append(map_one_thread(lambda i: i, range(3), beside=True))

    workers = [threading.Thread(target=caller) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    try:
        assert out == [[0, 1, 2]] * 2 and len(made) == 1, len(made)
    finally:
        for pool in made:
            pool.shutdown()
