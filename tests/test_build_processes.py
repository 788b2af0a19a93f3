"""Index builds in worker processes (indexes.build_processes): the same indexes as built here, errors raised here."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import CancelledError
from concurrent.futures.process import EXTRA_QUEUED_CALLS, BrokenProcessPool
from pathlib import Path

import numpy as np
import pytest

from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.errors import IndexResultError
from anns_lab.indexes import Index, build_processes, registry
from anns_lab.indexes.key_store import KeyStore
from anns_lab.indexes.threads import stopping_on
from anns_lab.testing import positions


@pytest.fixture(scope="module")
def workers(plugin_dir):
    """The process's pool of two workers, started with the ``faulty`` plugin importable (workers inherit the path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(plugin_dir))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")]))
        build_processes.shut_down()
        yield build_processes.pool(2, ("roargraph",))
        build_processes.shut_down()


def _rows(seed: int = 5, heads: int = 2, n: int = 700, d: int = 16):
    rng = np.random.default_rng(seed)
    store = KeyStore(rng.standard_normal((heads, n, d)).astype(np.float32), n + 40)
    return store, [store.head(g) for g in range(heads)], rng


EXACT = sorted(name for name, cls in registry.available().items() if build_processes.can_build(cls))


def test_the_indexes_built_in_workers_are_those_whose_restore_is_exact():
    assert {"roargraph", "robust-vamana", "vamana", "ivf", "flat"} <= set(EXACT)
    assert not build_processes.can_build(registry.get("hnsw"))  # hnswlib's reload restarts its level generator
    roar = registry.get("roargraph")

    class Mine(roar):  # a plugin's subclass with a build of its own has not said its restore is exact
        def _build(self, keys, train_queries, **kw):
            return super()._build(keys, train_queries, **kw)

    assert build_processes.can_build(type("Alias", (roar,), {"name": "alias"})) and not build_processes.can_build(Mine)


@pytest.mark.parametrize("name", EXACT)
def test_processes_build_the_indexes_a_thread_builds_on_the_callers_rows(workers, name):
    """Every array the index saves is equal, and so are searches before and after an add; an index that keeps its key
    rows reads them from the caller's store (no copy), as one built here does."""
    store, rows, rng = _rows()
    cls = registry.get(name)
    queries = rng.standard_normal((4, 300, 16)).astype(np.float32)
    where = positions(cls, rows[0].n, 300)  # the positions travel to the worker with the queries
    items = ([(h // 2, {"train_queries": queries[h], **where}) for h in range(4)] if cls.uses_train_queries
             else [(g, {}) for g in range(2)])
    got = workers.build(cls, {}, rows, items)
    want = [cls().build(rows[g], **arrays) for g, arrays in items]
    test = rng.standard_normal((6, 16)).astype(np.float32)
    for (g, _), a, b in zip(items, want, got):
        assert type(b) is cls and b.params == a.params and (b.n_keys, b.dim) == (a.n_keys, a.dim)
        saved_a, saved_b = a._arrays(), b._arrays()
        assert saved_a.keys() == saved_b.keys()
        for key in saved_a:
            np.testing.assert_array_equal(saved_a[key], saved_b[key], err_msg=key)
        if "_rows" in vars(a):
            assert b._rows.store is store and not b._rows.owned
        params = a.grid()[len(a.grid()) // 2]
        ra, rb = a.search(test, 10, **params), b.search(test, 10, **params)
        np.testing.assert_array_equal(ra.ids, rb.ids)
        np.testing.assert_array_equal(ra.n_scanned, rb.n_scanned)
    new = rng.standard_normal((2, 30, 16)).astype(np.float32)
    store.append(new)
    for (g, _), a, b in zip(items, want, got):
        if a.supports_add:
            a.add(new[g])
            b.add(new[g])
            np.testing.assert_array_equal(a.search(test, 10).ids, b.search(test, 10).ids)


def test_a_build_that_raises_in_a_worker_raises_here_and_the_workers_build_on(workers):
    _, rows, _ = _rows()
    faulty = registry.get("faulty")
    with pytest.raises(RuntimeError, match="no memory for its graph"):
        workers.build(faulty, {"build_fault": "raise"}, rows, [(0, {}), (1, {})])
    assert not workers.broken
    built = workers.build(faulty, {}, rows, [(1, {})])
    np.testing.assert_array_equal(built[0]._keys, rows[1].view(rows[1].n))


def test_an_index_writing_into_its_keys_in_a_worker_fails_as_on_a_thread(workers):
    """The worker's keys are a copy, and the caller serves its own: an index that wrote into them is refused."""
    _, rows, _ = _rows()
    with pytest.raises(IndexResultError, match="modified the keys or queries it was given"):
        workers.build(registry.get("faulty"), {"build_fault": "write"}, rows, [(0, {})])


def test_a_full_memory_file_system_spools_in_the_temporary_folder_instead(workers, monkeypatch, tmp_path):
    """Layers spooling at once can fill /dev/shm between the room check and the write: the spool moves, the build
    goes on, and no folder is left behind in either place."""
    real = build_processes._pack
    first = str(build_processes.MEMORY_DIR)

    def full(path, arrays):
        if path.startswith(first) and path.endswith("inputs"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, arrays)

    monkeypatch.setattr(build_processes, "_pack", full)
    monkeypatch.setattr(build_processes, "_spool_root", lambda nbytes: first)
    monkeypatch.setattr(build_processes.tempfile, "tempdir", str(tmp_path))
    _, rows, _ = _rows()
    built = workers.build(registry.get("flat"), {}, rows, [(0, {}), (1, {})])
    here = registry.get("flat")().build(rows[1])
    np.testing.assert_array_equal(built[1].search(rows[0].view(5), 10).ids, here.search(rows[0].view(5), 10).ids)
    mine = f"{build_processes.SPOOL_PREFIX}{build_processes.owner_tag()}-"
    assert not list(build_processes.MEMORY_DIR.glob(mine + "*")) and not list(tmp_path.glob(mine + "*"))
    with pytest.raises(OSError, match="Permission denied"):  # another error is not a full file system: raised
        monkeypatch.setattr(build_processes, "_pack", lambda path, arrays: (_ for _ in ()).throw(
            OSError(errno.EACCES, "Permission denied", path)))
        workers.build(registry.get("flat"), {}, rows, [(0, {})])


def test_packed_arrays_come_back_as_written(tmp_path):
    arrays = {"a": np.arange(7, dtype=np.int32), "b": np.ones((3, 5), np.float32), "s": np.array(2.5),
              "empty": np.zeros((0, 4), np.int64)}
    got = build_processes._unpack(str(tmp_path / "p"), build_processes._pack(str(tmp_path / "p"), arrays))
    assert got.keys() == arrays.keys()
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype and got[name].flags.writeable
        np.testing.assert_array_equal(got[name], a)
    with pytest.raises(TypeError, match="Python objects"):
        build_processes._pack(str(tmp_path / "q"), {"o": np.array([None])})


def test_a_worker_that_dies_fails_its_build_and_the_next_pool_is_a_new_one(workers, monkeypatch, tmp_path):
    """A plugin's os.abort() in a worker ends that worker, not this process: the build raises, the pool is broken, and
    :func:`build_processes.pool` then starts another. A new pool removes killed processes' spools in /dev/shm and in
    the temporary folder (the fallback), not a live process's, nor one of another PID namespace (a container sharing
    /tmp, whose live processes this /proc does not show)."""
    _, rows, _ = _rows()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    name = f"{build_processes.SPOOL_PREFIX}{build_processes.owner_tag(999999999)}-x"  # a killed process's spool
    stale = [build_processes.MEMORY_DIR / name, tmp_path / name]
    kept = [tmp_path / f"{build_processes.SPOOL_PREFIX}{build_processes.owner_tag()}-x",  # this process's
            tmp_path / f"{build_processes.SPOOL_PREFIX}1-999999999-x"]  # another namespace's
    for folder in [*stale, *kept]:
        folder.mkdir(parents=True, exist_ok=True)
    own = build_processes.BuildProcesses(1)
    assert not any(folder.exists() for folder in stale) and all(folder.exists() for folder in kept)
    try:
        with pytest.raises(BrokenProcessPool):
            own.build(registry.get("faulty"), {"build_fault": "abort"}, rows, [(0, {})])
        assert own.broken
        monkeypatch.setitem(build_processes._POOL, "pool", own)
        monkeypatch.setitem(build_processes._POOL, "pid", os.getpid())
        fresh = build_processes.pool()
        assert fresh is not own and not fresh.broken
        assert fresh.build(registry.get("flat"), {}, rows, [(0, {})])[0].n_keys == rows[0].n
        fresh.close()
    finally:
        own.close()


def test_the_callers_stop_cancels_the_builds_not_yet_started(workers, tmp_path):
    """Another layer's error or an interrupt (``threads.stopping_on``): the queued builds do not run; those running end."""
    _, rows, _ = _rows()
    stop = threading.Event()
    timer = threading.Timer(1.0, stop.set)
    timer.start()
    with stopping_on(stop), pytest.raises(CancelledError):
        workers.build(registry.get("faulty"), {"sleep_s": 2.0, "pid_dir": str(tmp_path)}, rows, [(0, {})] * 10)
    timer.join()
    started = len(list(tmp_path.iterdir()))
    # those running, and those already in the pool's call queue (its size: workers + EXTRA_QUEUED_CALLS), cannot be
    # cancelled: with 2 workers at most 5 of the 10 ever start
    assert 1 <= started <= 2 * workers.workers + EXTRA_QUEUED_CALLS < 10
    assert not workers.broken


def test_a_layer_store_builds_in_the_workers_where_the_index_saves_and_on_threads_where_it_cannot(workers, monkeypatch):
    """The decoder's per-layer build: an index class that saves comes back from the workers (the restored indexes read
    the store's rows); one that cannot (a class made here, which no worker could import either) builds on threads."""
    rng = np.random.default_rng(2)
    keys, values = (rng.standard_normal((2, 500, 16)).astype(np.float32) for _ in range(2))
    queries = rng.standard_normal((4, 200, 16)).astype(np.float32)
    by_threads = LayerStore(0, 4, keys, values, 20, IndexPlan("roargraph"), 8)
    by_threads.build(queries)
    store = LayerStore(0, 4, keys, values, 20, IndexPlan("roargraph"), 8)
    calls = []
    real = workers.spooled_build
    monkeypatch.setattr(workers, "spooled_build", lambda *a: calls.append(a[0].name) or real(*a))
    store.build(queries, processes=workers)
    assert calls == ["roargraph"]
    one_kv = LayerStore(0, 4, keys[:1], values[:1], 20, IndexPlan("ivf"), 8)
    one_kv.build(None, processes=workers)  # a lone index after the prefill: the libraries' full teams here
    assert calls == ["roargraph"]
    one_kv.build(None, processes=workers, beside=True)  # beside the prefill: in a worker
    assert calls == ["roargraph", "ivf"]
    for a, b in zip(by_threads.indexes, store.indexes):
        np.testing.assert_array_equal(a._nbrs, b._nbrs)
        assert b._rows.store is store.key_store
    class Unsaved(registry.get("flat")):
        name = "unsaved"
        _arrays = Index._arrays  # no save: no way back from a worker

    assert not Unsaved().supports_save
    real_get = registry.get
    monkeypatch.setattr(registry, "get", lambda name: Unsaved if name == "unsaved" else real_get(name))
    other = LayerStore(0, 4, keys, values, 20, IndexPlan("unsaved"), 8)
    other.build(None, processes=workers, beside=True)
    assert calls == ["roargraph", "ivf"] and all(type(ix) is Unsaved for ix in other.indexes)


def test_a_decode_builds_the_same_indexes_in_the_workers_as_on_threads(tiny_llama, workers, monkeypatch):
    """``Settings.build_processes`` (``--build-processes``): the same tokens and calibrated search values, the builds
    during the prefill and each layer's calibration in the workers (none in this process)."""
    from anns_lab.decode import calibrate, runner
    from anns_lab.decode.engine import Mode, Settings
    from anns_lab.dumps.models import load_model
    from anns_lab.window import Window

    lm = load_model(str(tiny_llama), device="cpu")
    ids = np.random.default_rng(7).integers(3, 400, size=96).tolist()
    mode = Mode("roargraph", IndexPlan("roargraph"))
    runs, here = {}, []
    real = calibrate.calibrate

    def counted(store, *a, **kw):  # the layers calibrated in this process (builds.warm_up's random layer is -1)
        if store.layer >= 0:
            here.append(store.layer)
        return real(store, *a, **kw)

    monkeypatch.setattr(calibrate, "calibrate", counted)
    for processes in (False, True):
        settings = Settings(Window(4, 8), topk=20, add_batch=4, chunk=32, calibrate=0.9, build_processes=processes)
        runs[processes] = runner.run_sample(lm, [mode], settings, ids, 6, set())["runs"]["roargraph"]
        assert sorted(here) == ([] if processes else sorted(lm.long_range_layers))
        here.clear()
    assert runs[True].tokens == runs[False].tokens
    assert runs[True].calibration == runs[False].calibration and runs[True].calibration


def test_a_layer_the_workers_calibration_scans_is_scanned_in_the_decoder_as_on_threads(tiny_gemma3, workers,
                                                                                       monkeypatch):
    """A calibration in the workers that decides an exact scan (IVF at a target only every list reaches, which reads
    more than a scan) is applied in the decoding process: the same layers served by flat, the same tokens and
    calibrations as the threads' builds, and no layer calibrated in this process."""
    from anns_lab.decode import calibrate
    from anns_lab.decode.engine import Mode, Settings, prefill, run_mode
    from anns_lab.dumps.models import load_model
    from anns_lab.window import Window

    lm = load_model(str(tiny_gemma3), device="cpu")
    ids = np.random.default_rng(3).integers(3, 400, size=160).tolist()
    mode = Mode("ivf", IndexPlan("ivf", {}, {"nprobe": 1}))
    here: list = []
    real = calibrate.calibrate
    monkeypatch.setattr(calibrate, "calibrate",
                        lambda store, *a, **kw: (here.append(store.layer) if store.layer >= 0 else None,
                                                 real(store, *a, **kw))[1])
    runs = {}
    for processes in (False, True):
        settings = Settings(Window(4, 8), topk=12, add_batch=4, chunk=24, calibrate=1.0, build_processes=processes)
        runs[processes] = run_mode(lm, prefill(lm, ids, settings, capture_queries=True), mode, settings, 4)
        assert sorted(here) == ([] if processes else sorted(lm.long_range_layers))
        here.clear()
    served = {p: {layer: s.plan.name for layer, s in run.stores.items()} for p, run in runs.items()}
    assert served[True] == served[False] and "flat" in served[True].values()
    assert runs[True].tokens == runs[False].tokens and runs[True].calibration == runs[False].calibration


def test_the_decode_command_builds_in_the_workers_with_build_processes(tiny_llama, workers, tmp_path):
    """``--build-processes`` on a CPU: the settings record it, and the answers are those of the threads' builds."""
    import json

    from click.testing import CliRunner

    from anns_lab.cli import main

    answers = {}
    for flag in ("--build-processes", "--build-threads"):
        out = tmp_path / f"{flag}.json"
        res = CliRunner().invoke(main, ["decode", "--model", str(tiny_llama), "--mode", "roargraph", "--task", "passkey",
                                        "--context", "200", "--window", "4,16", "--max-new-tokens", "4", flag,
                                        "--json", str(out)])
        assert res.exit_code == 0, res.output
        data = json.loads(out.read_text())
        assert data["settings"]["build_processes"] is (flag == "--build-processes")
        answers[flag] = [row["answer"] for row in data["modes"]["roargraph"]["samples"]]
    assert answers["--build-processes"] == answers["--build-threads"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat")
    return not (state.is_file() and state.read_text().split(") ")[-1].startswith("Z"))  # a zombie has ended


DRIVER = """
import sys, threading, numpy as np
from anns_lab.indexes import build_processes, registry
from anns_lab.indexes.key_store import KeyStore
rows = [KeyStore(np.random.default_rng(0).standard_normal((1, 300, 8)).astype(np.float32), 340).head(0)]
build = lambda: build_processes.pool(1).build(registry.get("faulty"), {"pid_dir": sys.argv[1], "sleep_s": 600.0},
                                              rows, [(0, {})])
if sys.argv[2] == "main":
    build()
else:  # the pool made and started by another thread (a decode's build thread)
    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("started_by", ["main", "thread"])
def test_workers_end_with_a_killed_decode_even_inside_a_build(plugin_dir, tmp_path, started_by):
    """Before: a decode killed by SIGKILL left its build workers running until their build ended (600 s here), and
    did so still where a build thread had started the pool (the signal follows the starting thread, not asked for)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(pids), started_by], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 120
        while not list(pids.iterdir()) and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        assert proc.poll() is None and list(pids.iterdir()), proc.stderr.read().decode()[-2000:] if proc.poll() else "no build"
        (worker,) = {int(p.name.split("-")[0]) for p in pids.iterdir()}
        proc.kill()
        proc.wait(timeout=30)
        end = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < end:
            time.sleep(0.2)
        assert not _alive(worker), f"worker {worker} still building 30 s after its decode was killed"
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in pids.iterdir():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p.name.split("-")[0]), signal.SIGKILL)
