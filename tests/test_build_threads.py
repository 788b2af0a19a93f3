"""Builds side by side on one-core threads (indexes.threads): the same indexes as one after another."""

from __future__ import annotations

import threading

import faiss
import numba
import numpy as np
import pytest
import torch

from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.indexes import registry, threads
from anns_lab.indexes.threads import map_one_thread


def test_workers_run_their_kernels_on_one_thread_and_the_caller_keeps_its_own(monkeypatch):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)  # workers even on a one-core runner
    monkeypatch.setattr(threads, "_POOL", [None, 0])
    before = numba.get_num_threads(), faiss.omp_get_max_threads(), torch.get_num_threads()
    got = map_one_thread(lambda i: (i, threading.current_thread().name, numba.get_num_threads(),
                                    faiss.omp_get_max_threads(), torch.get_num_threads()), range(5))
    assert [g[0] for g in got] == list(range(5))  # in order
    assert all(g[1].startswith("anns-lab-build") for g in got)
    assert all(g[2:4] == (1, 1) for g in got)
    if any(threads.Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*")):
        assert all(g[4] == 1 for g in got)
    assert (numba.get_num_threads(), faiss.omp_get_max_threads(), torch.get_num_threads()) == before
    threads._POOL[0].shutdown()


def test_one_item_runs_on_the_calling_thread():
    assert map_one_thread(lambda _: threading.current_thread().name, [0]) == [threading.current_thread().name]


@pytest.mark.parametrize("name, params", [("roargraph", {}), ("roargraph", {"list_stride": 4}), ("ivf", {})])
def test_a_layers_indexes_built_side_by_side_equal_those_built_one_by_one(name, params, monkeypatch):
    """list_stride 4: the anchored lists' re-rank (a parallel kernel) runs in both builds at once."""
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
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
threads.os.cpu_count = lambda: 2  # side by side even on a one-core runner
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
