"""Sweep executors: a part that crashes or exits fails alone, retries are bounded, Ctrl-C keeps finished parts,
and a Ray cluster (started here on 127.0.0.1: a head and a second node) gives the local executor's table."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from anns_lab.errors import AnnsLabError
from anns_lab.eval.executors import Part
from anns_lab.eval.executors.ray_cluster import Cluster
from anns_lab.eval.sweep import RESULTS, run_sweep
from ray_driver import RaySweep, ray_sweep

WINDOW = (8, 64)  # the recent window covers the prompt queries that top up the 8 decode queries
K = 10
SAME = ["layer", "head", "index", "build_params", "search_params", "direction", "n_keys", "n_queries", "recall",
        "scanned_fraction", "mass_recovered", "output_rel_error"]  # everything but timings


def wait_for(cond, what: str, timeout: float = 120.0, every: float = 0.2):
    """Poll ``cond`` until true; fail (not hang) after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(autouse=True)
def _faulty_registered(plugin_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_dir))  # spawned workers inherit sys.path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def tiny_dump(tiny_llama, tmp_path_factory):
    """A 4-layer, 4-head random-model dump: 400 prompt + 8 decode tokens (seconds to sweep)."""
    from anns_lab.dumps.run import run_dump

    out = tmp_path_factory.mktemp("tiny-dump") / "dump"
    return run_dump(str(tiny_llama), tokens=400, decode_tokens=8, layers="1,3", dtype="float32", out=out,
                    progress=False).dump


def ray_temp() -> Path:
    """The test cluster's --temp-dir (its logs: workers' stderr in worker-*.err); short: Ray's socket paths must stay
    under 108 characters."""
    return Path(f"/tmp/anns-ray-{os.getpid()}")


def sweep(dump, out, **kw):
    """The sweep of these tests; through Ray, driven from a subprocess (ray_driver.py says why)."""
    args = dict(indexes=["flat", "ivf"], layers=[1, 3], heads=[0, 3], k=K, window=WINDOW, out=out, jobs=2,
                progress=False) | kw
    if args.get("executor") != "ray":
        return run_sweep(dump.path, **args)
    log = args.pop("log", None)
    res, lines = ray_sweep(dump.path, **args)
    for line in lines if log else ():
        log(line)
    return res


@pytest.fixture(scope="module")
def local_table(tiny_dump, tmp_path_factory):
    res = sweep(tiny_dump, tmp_path_factory.mktemp("local") / "res")
    assert not res.failures
    return res.table


# --- the local executor ----------------------------------------------------------------------------------------


def test_a_stuck_plugin_is_killed_at_the_part_timeout_and_fails_its_own_parts_only(tiny_dump, local_table, tmp_path):
    """Before: a build that never returns held the sweep for ever (the bar at 0 of its parts)."""
    res = sweep(tiny_dump, tmp_path / "res", indexes=["faulty", "flat"], layers=[3], max_attempts=3,
                build_params={"faulty": {"sleep_s": 600.0}}, part_timeout=3.0)
    assert sorted((name, head) for name, _, head, _ in res.failures) == [("faulty", 0), ("faulty", 3)]
    assert all("ran past --part-timeout 3 s" in err for *_, err in res.failures)
    recs = [json.loads(p.read_text()) for p in sorted((tmp_path / "res" / "parts").glob("failed-*.json"))]
    assert [r["attempts"] for r in recs] == [1, 1]  # not retried in the run: it would hang again
    flat = local_table.query("index == 'flat' and layer == 3").reset_index(drop=True)
    pd.testing.assert_frame_equal(res.table[SAME].reset_index(drop=True), flat[SAME])
    for bad in (-1.0, float("nan")):
        with pytest.raises(AnnsLabError, match="--part-timeout"):
            sweep(tiny_dump, tmp_path / "bad", part_timeout=bad)
    assert not (tmp_path / "bad").exists()


def test_a_workers_first_compile_is_not_counted_against_the_part_timeout(tiny_dump, local_table, tmp_path):
    """Before: a part's kernels were warmed inside its timed evaluation, so a node whose numba cache was empty (a Ray
    node with a checkout of its own) spent minutes of compiling on its first part's --part-timeout. Here each index's
    warm-up takes 3 s against a 2 s timeout: the executors warm untimed, first, then run the parts on the clock."""
    from faulty_indexes import SlowWarmWork

    from anns_lab.eval.executors.local import LocalExecutor

    work = SlowWarmWork(str(tiny_dump.path), K, WINDOW, {}, False, warm_s=3.0)
    outcomes = []
    LocalExecutor(1, part_timeout=2.0).run(work, [(3, 0, ["flat", "ivf"])], {}, outcomes.append)
    assert [(o.part, o.error) for o in outcomes] == [(Part(3, 0, "flat"), None), (Part(3, 0, "ivf"), None)]
    want = local_table.query("layer == 3 and head == 0").sort_values(["index", "search_params", "direction"])
    got = pd.concat([o.table for o in outcomes]).sort_values(["index", "search_params", "direction"])
    pd.testing.assert_frame_equal(got[SAME].reset_index(drop=True), want[SAME].reset_index(drop=True))
    # a Ray task, run here in a process of its own: its watchdog (faulthandler, exit=True) is armed after the warm-up
    script = ("import sys, json; from faulty_indexes import SlowWarmWork; "
              "from anns_lab.eval.executors.ray_executor import _part_task; "
              f"work = SlowWarmWork({str(tiny_dump.path)!r}, {K}, {WINDOW!r}, {{}}, False, warm_s=3.0); "
              "table, error = _part_task(work, 3, 0, 'flat', timeout=2.0); "
              "print(json.dumps([error, None if table is None else table['recall'].tolist()]))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    error, recall = json.loads(proc.stdout.strip().splitlines()[-1])
    assert error is None and recall == want.query("index == 'flat'")["recall"].tolist()


def test_a_warm_up_that_crashes_or_hangs_costs_its_own_part_only(tiny_dump, monkeypatch):
    """A worker that dies readying one index's kernels fails that part only (the first version of the untimed warm-up
    readied a unit's every index while its worker was "loading", and the death failed them all); a warm-up that never
    ends is killed at base.warm_limit (here 3 s against a 1 s part timeout), its part failed as timed out."""
    from faulty_indexes import SlowWarmWork

    from anns_lab.eval.executors import base
    from anns_lab.eval.executors.local import LocalExecutor

    outcomes = []
    LocalExecutor(1).run(SlowWarmWork(str(tiny_dump.path), K, WINDOW, {}, False, abort_on="ivf"),
                         [(3, 0, ["flat", "ivf", "hnsw"])], {}, outcomes.append)
    assert [(o.part.index, o.error is None, o.crashed) for o in outcomes] == [("flat", True, False), ("ivf", False, True),
                                                                            ("hnsw", True, False)]
    assert "SIGABRT" in outcomes[1].error
    monkeypatch.setattr(base, "WARM_LIMIT", 3.0)  # the driver's clock: the bound is applied here
    outcomes = []
    t0 = time.monotonic()
    LocalExecutor(1, part_timeout=1.0).run(SlowWarmWork(str(tiny_dump.path), K, WINDOW, {}, False, warm_s=60.0),
                                           [(3, 0, ["flat"])], {}, outcomes.append)
    assert time.monotonic() - t0 < 45
    (out,) = outcomes
    assert out.table is None and "readying the index's kernels ran past 3 s" in out.error, out.error


def test_a_default_sweep_names_the_indexes_that_fail_to_load(tiny_dump, tmp_path, monkeypatch):
    """Before: a plugin claiming ``flat`` (a conflict) or one whose module is missing left the default sweep without
    a word: the table simply had no such index."""
    from importlib.metadata import EntryPoint

    from anns_lab.indexes import registry

    real = registry._entry_points()
    claim = EntryPoint("flat", "anns_lab.indexes.ivf:IVFIndex", registry.GROUP)
    missing = EntryPoint("missingmod", "no_such_module_xyz:Index", registry.GROUP)
    monkeypatch.setattr(registry, "_entry_points", lambda: {"flat": [*real["flat"], claim], "ivf": real["ivf"],
                                                            "missingmod": [missing]})
    lines: list[str] = []
    res = sweep(tiny_dump, tmp_path / "res", indexes=None, layers=[1], heads=[0], jobs=1, log=lines.append)
    assert set(res.table["index"]) == {"ivf"}
    said = "\n".join(lines)
    assert "flat is left out of the sweep: it fails to load" in said and "announced by 2 distributions" in said
    assert "missingmod is left out" in said and "ModuleNotFoundError" in said


def test_a_plugin_that_raises_keyboard_interrupt_fails_its_own_parts_once(tiny_dump, tmp_path):
    """Before: the worker died with a traceback, the part was retried as a death and recorded as "exit code 1"."""
    res = sweep(tiny_dump, tmp_path / "res", indexes=["faulty", "flat"], layers=[3],
                build_params={"faulty": {"fault": "interrupt"}}, max_attempts=2)
    assert sorted((name, head) for name, _, head, _ in res.failures) == [("faulty", 0), ("faulty", 3)]
    assert all("KeyboardInterrupt raised by the index" in err for *_, err in res.failures)
    recs = [json.loads(p.read_text()) for p in sorted((tmp_path / "res" / "parts").glob("failed-*.json"))]
    assert [r["attempts"] for r in recs] == [1, 1]  # an error of the index, not a death: not retried in the run
    assert set(res.table["index"]) == {"flat"}


def test_a_plugin_that_writes_into_its_queries_fails_alone_and_leaves_the_next_index_measured_right(tiny_dump,
                                                                                                 local_table, tmp_path):
    """Before: no error; its own rows and flat's (the same head's next index, on the normalised queries) were wrong."""
    res = sweep(tiny_dump, tmp_path / "res", indexes=["faulty", "flat"], layers=[3],
                build_params={"faulty": {"fault": "normalise"}})
    assert sorted((name, head) for name, _, head, _ in res.failures) == [("faulty", 0), ("faulty", 3)]
    assert all("modified the keys or queries it was given" in err for *_, err in res.failures)
    flat = local_table.query("index == 'flat' and layer == 3").reset_index(drop=True)
    pd.testing.assert_frame_equal(res.table[SAME].reset_index(drop=True), flat[SAME])



@pytest.mark.parametrize("fault, died", [("abort", True), ("exit", False)])
def test_local_crashing_plugin_fails_its_own_parts_and_reruns_stop_retrying(tiny_dump, local_table, tmp_path,
                                                                          fault, died):
    out = tmp_path / "res"
    kw = dict(indexes=["flat", "faulty"], layers=[3], build_params={"faulty": {"fault": fault}}, max_attempts=2)
    res = sweep(tiny_dump, out, **kw)
    # Every other part is finished and in the table, equal to a clean sweep's rows.
    flat = local_table.query("index == 'flat' and layer == 3").reset_index(drop=True)
    pd.testing.assert_frame_equal(res.table[SAME].reset_index(drop=True), flat[SAME])
    assert (out / RESULTS).is_file()
    assert sorted((name, layer, head) for name, layer, head, _ in res.failures) == [("faulty", 3, 0), ("faulty", 3, 3)]
    for _, _, head, err in res.failures:
        assert ("SIGABRT" in err) if died else ("SystemExit" in err)
    recs = [json.loads(p.read_text()) for p in sorted((out / "parts").glob("failed-*.json"))]
    assert [(r["index"], r["layer"], r["head"]) for r in recs] == [("faulty", 3, 0), ("faulty", 3, 3)]
    # A dead worker is retried at once up to the bound; an exception is not retried within the run.
    assert [r["attempts"] for r in recs] == ([2, 2] if died else [1, 1])
    assert all(r["worker_died"] is died for r in recs)
    again = sweep(tiny_dump, out, **kw)
    if died:  # bound reached: reported without running
        assert all("not retried" in err and "--retry-failed" in err for *_, err in again.failures)
    else:  # one attempt left: run again, then at the bound
        assert [json.loads(p.read_text())["attempts"] for p in sorted((out / "parts").glob("failed-*.json"))] == [2, 2]
        assert all("not retried" in err for *_, err in sweep(tiny_dump, out, **kw).failures)
    retried = sweep(tiny_dump, out, **kw, retry_failed=True)
    assert len(retried.failures) == 2 and all("not retried" not in err for *_, err in retried.failures)
    # The failures are named by the command line too, one line per part.
    from click.testing import CliRunner

    from anns_lab.cli import main

    r = CliRunner().invoke(main, ["sweep", "--dump", str(tiny_dump.path), "--indexes", "flat,faulty", "--layers", "3",
                                  "--heads", "0,3", "--k", K, "--window", "8,64", "--out", str(out),
                                  "--build-param", f"faulty.fault={fault}", "--max-attempts", 2])
    assert r.exit_code == 1
    assert "FAILED faulty on layer 3 head 0" in r.output and "FAILED faulty on layer 3 head 3" in r.output


def test_local_worker_killed_mid_sweep_is_retried_and_the_table_is_complete(tiny_dump, local_table, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    box = {}
    kw = dict(indexes=["flat", "faulty"], build_params={"faulty": {"pid_dir": str(pids), "sleep_s": 3.0}})
    thread = threading.Thread(target=lambda: box.setdefault("res", sweep(tiny_dump, tmp_path / "res", **kw)))
    thread.start()
    victim = wait_for(lambda: next(iter(pids.iterdir()), None), "a worker to start building")
    os.kill(_pid(victim), signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive()
    res = box["res"]
    assert not res.failures
    assert len(list(pids.iterdir())) >= 5  # 4 heads, one of them built twice
    flat = local_table.query("index == 'flat'").reset_index(drop=True)
    got = res.table.query("index == 'faulty'")[SAME].reset_index(drop=True)
    assert set(zip(got["layer"], got["head"])) == {(1, 0), (1, 3), (3, 0), (3, 3)}
    # faulty is exact: its recall and attention numbers equal flat's on every head.
    pd.testing.assert_series_equal(got["recall"], flat["recall"])
    pd.testing.assert_series_equal(got["mass_recovered"], flat["mass_recovered"])
    assert not list((tmp_path / "res" / "parts").glob("failed-*.json"))


def test_local_worker_that_dies_while_idle_is_replaced(tiny_dump, local_table, tmp_path, monkeypatch):
    from anns_lab.eval.executors import local

    real, killed = local.LocalExecutor._drain, []

    def drain_then_kill_the_idle_worker(self, slot, attempts, on_outcome):
        alive = real(self, slot, attempts, on_outcome)
        if alive and slot.unit is None and not killed:  # between two units, as the OOM killer may pick it
            os.kill(slot.proc.pid, signal.SIGKILL)
            slot.proc.join(timeout=30)
            killed.append(slot.proc.pid)
        return alive

    monkeypatch.setattr(local.LocalExecutor, "_drain", drain_then_kill_the_idle_worker)
    res = sweep(tiny_dump, tmp_path / "res", jobs=1)
    assert killed and not res.failures
    pd.testing.assert_frame_equal(res.table[SAME].reset_index(drop=True), local_table[SAME].reset_index(drop=True))


@pytest.mark.parametrize("executor, stop", [("local", signal.SIGINT), ("ray", signal.SIGINT), ("local", signal.SIGTERM),
                                            ("ray", signal.SIGTERM)])
def test_ctrl_c_stops_within_seconds_and_keeps_finished_parts(tiny_dump, tmp_path, executor, stop, request):
    """Ctrl-C, and SIGTERM (`kill`, `timeout`: before, it ended the driver alone, its workers printed BrokenPipe
    tracebacks and ran on), stop the sweep the same clean way."""
    pids = tmp_path / "pids"
    pids.mkdir()
    out = tmp_path / "res"
    cmd = [str(Path(sys.executable).parent / "anns-lab"), "sweep", "--dump", str(tiny_dump.path), "--indexes", "faulty",
           "--layers", "1,3", "--heads", "0,1,2,3", "--k", str(K), "--window", "8,64", "--out", str(out), "--jobs", "1",
           "--build-param", f"faulty.pid_dir={pids}", "--build-param", "faulty.sleep_s=2", "--executor", executor]
    if executor == "ray":
        cmd += ["--address", request.getfixturevalue("ray_cluster")]
    # A shell without job control starts `cmd &` with SIGINT ignored, which Python then keeps: give the sweep
    # the default disposition a terminal's Ctrl-C meets, whatever launched this test.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: list((out / "parts").glob("*.parquet")) and len(list(pids.iterdir())) >= 2 or proc.poll() is not None,
                 "the first part to finish")
        assert proc.poll() is None
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=60)  # the 6 heads still queued (2 s each) are not waited for
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "run the same command again to resume" in err and "Traceback" not in err
    kept = sorted((out / "parts").glob("*.parquet"))
    assert 1 <= len(kept) < 8
    assert len(pd.read_parquet(out / RESULTS)) == sum(len(pd.read_parquet(p)) for p in kept)
    for pid in {_pid(p) for p in pids.iterdir()}:  # no worker is left running
        wait_for(lambda: not _alive(pid), f"worker {pid} to end", timeout=30)


def test_workers_end_with_a_killed_driver_even_inside_a_hanging_index(tiny_dump, tmp_path):
    """Before: a driver killed by SIGKILL left its worker sleeping in the index's build for good."""
    pids = tmp_path / "pids"
    pids.mkdir()
    cmd = [str(Path(sys.executable).parent / "anns-lab"), "sweep", "--dump", str(tiny_dump.path), "--indexes", "faulty",
           "--layers", "1", "--heads", "0", "--k", str(K), "--window", "8,64", "--out", str(tmp_path / "res"),
           "--jobs", "1", "--build-param", f"faulty.pid_dir={pids}", "--build-param", "faulty.sleep_s=600"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: list(pids.iterdir()) or proc.poll() is not None, "the build to start")
        assert proc.poll() is None
        (worker,) = {_pid(p) for p in pids.iterdir()}
        proc.kill()
        proc.wait(timeout=30)
        wait_for(lambda: not _alive(worker), f"worker {worker} to end", timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_report_names_the_parts_its_sweep_lost(tiny_dump, tmp_path):
    """A failed part is in no table or figure: the report says which, rather than take its medians over fewer heads."""
    from anns_lab.eval.report import write_report

    out = tmp_path / "res"
    res = sweep(tiny_dump, out, indexes=["flat", "faulty"], layers=[3], build_params={"faulty": {"fault": "exit"}},
                max_attempts=1)
    assert len(res.failures) == 2
    md = write_report(out)
    for text in (md.read_text(), md.with_suffix(".html").read_text()):
        assert "faulty on layer 3 head 0" in text and "faulty on layer 3 head 3" in text
    lines = []  # resumed, its failed parts out of attempts: not "every part is finished" (a diff review)
    sweep(tiny_dump, out, indexes=["flat", "faulty"], layers=[3], build_params={"faulty": {"fault": "exit"}},
          max_attempts=1, log=lines.append)
    assert any(line.endswith("nothing left to run (the rest failed their attempts) (resumed: 2 of 4 finished parts "
                             "kept)") for line in lines), lines


def test_local_a_part_the_driver_cannot_write_stops_the_sweep(tiny_dump, tmp_path, monkeypatch):
    """An error writing a finished part (a full disk) is the driver's, not a dead worker's: the sweep stops with it
    instead of dropping the part unrecorded and reporting success."""
    from anns_lab.eval import sweep as sweep_module

    write = sweep_module.write_table

    def full_disk(path, table):
        if path.parent.name == "parts":
            raise OSError(28, "No space left on device", str(path))
        return write(path, table)

    monkeypatch.setattr(sweep_module, "write_table", full_disk)
    with pytest.raises(AnnsLabError, match="No space left.*0 of 1 parts are kept.*run the same command again"):
        sweep(tiny_dump, tmp_path / "res", indexes=["flat"], layers=[3], heads=[0], jobs=1, quick=True)


def test_a_sweep_whose_parts_folder_was_removed_runs_again(tiny_dump, local_table, tmp_path):
    out = tmp_path / "res"
    kw = dict(indexes=["flat"], layers=[3], heads=[0], jobs=1)
    sweep(tiny_dump, out, **kw)
    shutil.rmtree(out / "parts")  # sweep.json stays: the same settings, nothing finished
    res = sweep(tiny_dump, out, **kw)
    assert not res.failures and len(list((out / "parts").glob("*.parquet"))) == 1
    flat = local_table.query("index == 'flat' and layer == 3 and head == 0").reset_index(drop=True)
    pd.testing.assert_frame_equal(res.table[SAME].reset_index(drop=True), flat[SAME])


def _pid(build_file: Path) -> int:
    return int(build_file.name.split("-")[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/status").read_text().count("State:\tZ")


# --- Ray: a real two-node cluster on 127.0.0.1, one per test module ----------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_group(proc: subprocess.Popen) -> None:
    """End a `ray start --block` process and everything it started (its own session): TERM, then KILL."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    # Children of the group may outlive its leader for a moment; they are in the same group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def ray_cluster(plugin_dir, tmp_path_factory):
    """HOST:PORT of a Ray head (1 CPU) plus a second node (1 CPU) on 127.0.0.1, stopped at the module's end."""
    # Ray enables token authentication when ~/.ray/auth_token exists (any earlier `ray.init()` there writes
    # one); this loopback-only test cluster and its drivers run without, whatever the home folder holds.
    env_patch = pytest.MonkeyPatch()
    env_patch.setenv("RAY_AUTH_MODE", "disabled")
    pytest.importorskip("ray")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    temp = ray_temp()
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")]),
                        "RAY_USAGE_STATS_ENABLED": "0",
                        "RAY_AUTH_MODE": "disabled"}
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus", "1",
               "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    logs = tmp_path_factory.mktemp("ray-logs")
    procs = []
    try:
        procs.append(subprocess.Popen(ray_cli + ["--head", "--port", str(port), "--include-dashboard=false",
                                                 "--ray-client-server-port", str(_free_port()),
                                                 "--temp-dir", str(temp)], env=env, start_new_session=True,
                                      stdout=open(logs / "head.log", "w"), stderr=subprocess.STDOUT))
        wait_for(lambda: _reachable(port) or procs[0].poll() is not None, "the Ray head to listen", timeout=120)
        assert procs[0].poll() is None, (logs / "head.log").read_text()
        procs.append(subprocess.Popen(ray_cli + ["--address", address], env=env, start_new_session=True,
                                      stdout=open(logs / "node.log", "w"), stderr=subprocess.STDOUT))
        wait_for(lambda: _alive_nodes(address) == 2 or procs[1].poll() is not None, "the second node", timeout=120,
                 every=2)
        assert procs[1].poll() is None, (logs / "node.log").read_text()
        yield address
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        for proc in reversed(procs):
            _stop_group(proc)
        shutil.rmtree(temp, ignore_errors=True)
        env_patch.undo()


def test_the_progress_bar_names_the_index_each_worker_is_on(tiny_dump, tmp_path, capfd, monkeypatch):
    """A slow or stuck index is seen by name on the bar (before: only a count of finished parts)."""
    from anns_lab.eval.executors.local import LocalExecutor
    from anns_lab.eval.sweep import SweepWork
    from anns_lab.indexes import warmup

    work = SweepWork(str(tiny_dump.path), K, WINDOW, {"faulty": {"sleep_s": 0.5}}, False)
    seen, outcomes = [], []
    LocalExecutor(1).run(work, [(3, 0, ["faulty", "flat"]), (1, 3, ["flat"])], {}, outcomes.append,
                         on_running=seen.append)
    order = [Part(3, 0, "faulty"), Part(3, 0, "flat"), Part(1, 3, "flat")]
    assert [o.part for o in outcomes] == order
    # the slow part is seen; a fast one may start and end between two looks; a change only; nothing at the end
    named = [p for parts in seen for p in parts]
    assert seen[0] == [order[0]] and seen[-1] == [] and all(a != b for a, b in zip(seen, seen[1:]))
    assert named == sorted(named, key=order.index) and len(set(named)) == len(named)
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **k: 0.0)  # the kernels' compile is not what is tested
    sweep(tiny_dump, tmp_path / "res", indexes=["faulty"], layers=[3], heads=[0], jobs=1, progress=True,
          build_params={"faulty": {"sleep_s": 1.0}})
    assert "faulty 3/0" in capfd.readouterr().err


def test_more_workers_than_cpus_is_refused_before_any_work(tiny_dump, tmp_path, monkeypatch):
    """Before: --jobs 64 on 2 CPUs started 64 workers (their timings skewed, 64 heads in memory); a private Ray too
    small for --cpus-per-task was refused naming the node, not --jobs."""
    from anns_lab.eval import executors

    monkeypatch.setattr(executors, "machine_cpus", lambda: 2)
    with pytest.raises(AnnsLabError, match="--jobs 3: this machine gives this process 2 CPUs.*at most 2"):
        sweep(tiny_dump, tmp_path / "a", jobs=3)
    with pytest.raises(AnnsLabError, match="--jobs 3: this machine"):
        run_sweep(tiny_dump.path, ["flat"], [1], [0], k=K, window=WINDOW, out=tmp_path / "b", jobs=3, executor="ray")
    with pytest.raises(AnnsLabError, match=r"--cpus-per-task 2 is more than the private Ray's 1 CPUs \(--jobs\): raise "
                                           "--jobs to 2"):
        run_sweep(tiny_dump.path, ["flat"], [1], [0], k=K, window=WINDOW, out=tmp_path / "c", jobs=1, executor="ray",
                  cpus_per_task=2.0)
    assert not any((tmp_path / x).exists() for x in "abc")


def test_a_ray_connection_already_open_is_used_as_it_is(tiny_dump, tmp_path):
    """A driver that started Ray itself (here with 1 CPU) keeps it: --jobs, which sizes only a private Ray, is not
    checked against this machine's CPUs, and the sweep neither starts another Ray nor shuts the driver's down."""
    from anns_lab.eval.executors import machine_cpus

    with RaySweep(tiny_dump.path, tmp_path / "res", indexes=["flat"], layers=[1], heads=[0], k=K, window=WINDOW,
                  jobs=machine_cpus() + 1, executor="ray", connect_first={"num_cpus": 1}) as run:
        res = run.result()
    assert len(res.table) > 0 and set(res.table["index"]) == {"flat"} and not res.failures
    assert run.still_connected is True


@pytest.mark.parametrize("quota, cpus", [("150000 100000", 1), ("250000 100000", 2), ("max 100000", None),
                                         ("50000 100000", 1), ("garbled", None)])
def test_a_cgroup_cpu_quota_bounds_the_machines_cpus_in_whole_cpus(tmp_path, monkeypatch, quota, cpus):
    """A container's --cpus 1.5 runs one worker at full speed, not two; no quota, or one unreadable, leaves the
    affinity's count."""
    from anns_lab.eval import executors

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    (tmp_path / "cpu.max").write_text(quota + "\n")
    monkeypatch.setattr(executors, "CPU_MAX", str(tmp_path / "cpu.max"))
    assert executors.machine_cpus() == (cpus if cpus is not None else 8)
    monkeypatch.setattr(executors, "CPU_MAX", str(tmp_path / "absent"))
    assert executors.machine_cpus() == 8


def test_only_a_workers_or_nodes_death_is_a_crash_the_driver_retries():
    """A Ray error is a crash (retried, counted as a death) only where the worker or its node died; the task's own
    failure (an error raised outside the index, a result that would not load) is the part's error, once."""
    import types

    ray = pytest.importorskip("ray")
    from anns_lab.eval.executors.base import Part
    from anns_lab.eval.executors.ray_executor import RayExecutor

    def outcome(err):
        ex = object.__new__(RayExecutor)  # no cluster: only the classification of what ray.get raised
        ex.ray = types.SimpleNamespace(exceptions=ray.exceptions, get=lambda ref: (_ for _ in ()).throw(err))
        return ex._outcome(None, Part(1, 0, "flat"), 2)

    died = outcome(ray.exceptions.WorkerCrashedError())
    assert died.crashed and died.attempts == 2 and "its Ray worker died 2 time(s) (WorkerCrashedError" in died.error
    assert outcome(ray.exceptions.NodeDiedError("node gone")).crashed
    failed = outcome(ray.exceptions.RayTaskError("work", "Traceback ...", ValueError("no such column")))
    assert not failed.crashed and failed.error.startswith("its Ray task failed (")
    assert not outcome(ray.exceptions.GetTimeoutError("late")).crashed


def _reachable(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _alive_nodes(address: str) -> int:
    out = subprocess.run([sys.executable, "-c", "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                          "print(sum(n['Alive'] for n in ray.nodes()))", address],
                         capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0


@pytest.mark.parametrize("data", ["auto", "ship"])
def test_ray_table_equals_the_local_one(tiny_dump, local_table, ray_cluster, tmp_path, data):
    logs = []
    res = sweep(tiny_dump, tmp_path / "res", executor="ray", address=ray_cluster, ray_data=data, log=logs.append)
    assert not res.failures
    pd.testing.assert_frame_equal(res.table[SAME], local_table[SAME])
    assert any("2 node(s), 2 CPUs" in line for line in logs)
    assert any(("shared file system" if data == "auto" else "") in line for line in logs)


def test_a_sweep_moves_between_executors(tiny_dump, local_table, ray_cluster, tmp_path):
    for first, second in (("local", "ray"), ("ray", "local")):
        out = tmp_path / first
        sweep(tiny_dump, out, indexes=["flat"], executor=first, address=ray_cluster if first == "ray" else None)
        kept = {p: p.stat().st_mtime_ns for p in (out / "parts").glob("*.parquet")}
        assert len(kept) == 4
        res = sweep(tiny_dump, out, executor=second, address=ray_cluster if second == "ray" else None)
        assert all(p.stat().st_mtime_ns == t for p, t in kept.items())  # flat's parts were not redone
        assert len(list((out / "parts").glob("*.parquet"))) == 8
        pd.testing.assert_frame_equal(res.table[SAME], local_table[SAME])


def test_ray_worker_killed_mid_sweep_is_retried_and_the_table_is_complete(tiny_dump, local_table, ray_cluster,
                                                                         tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    with RaySweep(tiny_dump.path, tmp_path / "res", indexes=["faulty"], layers=[1, 3], heads=[0, 3], k=K,
                  window=WINDOW, jobs=2, progress=False, executor="ray", address=ray_cluster,
                  build_params={"faulty": {"pid_dir": str(pids), "sleep_s": 3.0}}) as driver:
        victim = wait_for(lambda: next(iter(pids.iterdir()), None), "a Ray worker to start building")
        os.kill(_pid(victim), signal.SIGKILL)
        res = driver.result()
    assert not res.failures
    assert len(list(pids.iterdir())) >= 5  # 4 parts, one of them built twice
    got = res.table[SAME].reset_index(drop=True)
    flat = local_table.query("index == 'flat'")[SAME].reset_index(drop=True)
    pd.testing.assert_series_equal(got["recall"], flat["recall"])
    assert set(zip(got["layer"], got["head"])) == {(1, 0), (1, 3), (3, 0), (3, 3)}


def test_ray_a_stuck_plugin_ends_its_worker_at_the_part_timeout_and_fails_its_own_parts_only(tiny_dump, local_table,
                                                                                            ray_cluster, tmp_path):
    """Before: --part-timeout was refused on Ray, where an index that never returned held the sweep for ever. This
    one hangs in C holding the GIL: only ending its worker stops it. The worker ends itself (faulthandler's watchdog,
    whose stack dump in the worker's log names the index's search), where the driver's force-cancel could meet a task
    finishing and abort the driver (Ray 2.60)."""
    logs = ray_temp()
    seen = {p: p.read_bytes().count(b"Timeout (0:00:03)!") for p in logs.rglob("worker-*.err")}
    pids = tmp_path / "pids"
    pids.mkdir()
    res = sweep(tiny_dump, tmp_path / "res", indexes=["faulty", "flat"], layers=[3], executor="ray",
                address=ray_cluster, build_params={"faulty": {"fault": "hang", "pid_dir": str(pids)}},
                part_timeout=3.0, max_attempts=3)
    assert sorted((name, head) for name, _, head, _ in res.failures) == [("faulty", 0), ("faulty", 3)]
    assert all("ran past --part-timeout 3 s" in err for *_, err in res.failures)
    recs = [json.loads(p.read_text()) for p in sorted((tmp_path / "res" / "parts").glob("failed-*.json"))]
    assert [(r["attempts"], r["worker_died"]) for r in recs] == [(1, True), (1, True)]
    assert len(list(pids.iterdir())) == 2  # one build per part: a timed-out part is not retried in the run
    flat = local_table.query("index == 'flat' and layer == 3").reset_index(drop=True)
    pd.testing.assert_frame_equal(res.table[SAME].reset_index(drop=True), flat[SAME])
    dumps = [p.read_text(errors="replace") for p in logs.rglob("worker-*.err")
             if p.read_bytes().count(b"Timeout (0:00:03)!") > seen.get(p, 0)]
    assert len(dumps) == 2 and all("faulty_indexes.py" in text for text in dumps), dumps  # each worker's own watchdog


def test_ray_a_retry_after_a_worker_death_has_a_clock_of_its_own(tiny_dump, local_table, ray_cluster, tmp_path):
    """Under --part-timeout the driver retries a dead worker's part itself, each attempt timed under its own key:
    when Ray retried it, the retry kept the dead attempt's start until its own load ended, and a review's run had
    it cancelled as "ran past --part-timeout" before it ran. Here the retry (a 6 s build) finishes within 8 s."""
    pids = tmp_path / "pids"
    pids.mkdir()
    with RaySweep(tiny_dump.path, tmp_path / "res", indexes=["faulty"], layers=[3], heads=[0], k=K, window=WINDOW,
                  jobs=2, progress=False, executor="ray", address=ray_cluster, part_timeout=8.0,
                  build_params={"faulty": {"pid_dir": str(pids), "sleep_s": 6.0}}) as driver:
        victim = wait_for(lambda: next(iter(pids.iterdir()), None), "a Ray worker to start building", every=0.1)
        time.sleep(2.0)
        os.kill(_pid(victim), signal.SIGKILL)
        res = driver.result()
    assert not res.failures, res.failures
    assert len(list(pids.iterdir())) == 2  # the killed build and its retry
    assert any("retrying (attempt 2 of 3)" in line for line in driver.logs), driver.logs  # the driver's own retry
    flat = local_table.query("index == 'flat' and layer == 3 and head == 0").reset_index(drop=True)
    pd.testing.assert_series_equal(res.table["recall"].reset_index(drop=True), flat["recall"])


@pytest.mark.parametrize("fault, needle", [("abort", "Ray worker died 2 time(s)"), ("exit", "SystemExit")])
def test_ray_crashing_plugin_fails_its_own_parts(tiny_dump, local_table, ray_cluster, tmp_path, fault, needle):
    out = tmp_path / "res"
    res = sweep(tiny_dump, out, indexes=["flat", "faulty"], layers=[1], heads=[3], executor="ray",
                address=ray_cluster, build_params={"faulty": {"fault": fault}}, max_attempts=2)
    assert [(n, layer, head) for n, layer, head, _ in res.failures] == [("faulty", 1, 3)]
    assert needle in res.failures[0][3]
    pd.testing.assert_frame_equal(res.table[SAME].reset_index(drop=True),
                                  local_table.query("index == 'flat' and layer == 1 and head == 3")[SAME]
                                  .reset_index(drop=True))
    rec = json.loads(next((out / "parts").glob("failed-*.json")).read_text())
    assert (rec["index"], rec["layer"], rec["head"], rec["attempts"]) == ("faulty", 1, 3, 2 if fault == "abort" else 1)


def test_ray_bad_input_is_one_error_and_writes_nothing(tiny_dump, ray_cluster, tmp_path, monkeypatch):
    from anns_lab.errors import AnnsLabError

    with pytest.raises(AnnsLabError, match="cannot reach a Ray cluster at 127.0.0.1:"):
        sweep(tiny_dump, tmp_path / "a", executor="ray", address=f"127.0.0.1:{_free_port()}")
    with pytest.raises(AnnsLabError, match=r"no node .* needing 8 CPU \(the largest node has 1 CPU\)"):
        sweep(tiny_dump, tmp_path / "b", executor="ray", address=ray_cluster, cpus_per_task=8)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if ray were not installed (so no driver is started here)
    with pytest.raises(AnnsLabError, match=r"pip install 'anns-lab\[ray\]'"):
        run_sweep(tiny_dump.path, ["flat"], [1], [0], k=K, window=WINDOW, out=tmp_path / "c", progress=False,
                  executor="ray")
    assert not any((tmp_path / x).exists() for x in "abc")


class _Ref:
    def __init__(self, value):
        self.value = value


class _FakeRay:
    """Just enough of Ray for RayExecutor.run, in this process: a task runs when submitted, refs resolve as Ray's do."""

    class exceptions:
        RayError = RuntimeError

    def put(self, value):
        return _Ref(value)

    def remote(self, fn):
        class Task:
            def options(self, **_):
                return self

            def remote(self, *args):
                return _Ref(fn(*(a.value if isinstance(a, _Ref) else a for a in args)))

        return Task()

    def wait(self, refs, num_returns=1, timeout=None):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref, timeout=None):
        return ref.value


class _OneUnreadableHead:
    """Work whose head (1, 3) cannot be read; every other part evaluates to a one-row table."""

    def setup_worker(self):
        pass

    def load(self, layer, head):
        if (layer, head) == (1, 3):
            raise OSError("a damaged layer file")
        return (layer, head)

    def warm(self, data, index):
        pass

    def evaluate(self, data, index):
        return pd.DataFrame({"layer": [data[0]], "head": [data[1]], "index": [index]})


def test_ray_shipping_a_head_that_cannot_be_read_fails_its_parts_not_the_sweep():
    from types import SimpleNamespace

    from anns_lab.eval.executors import Part
    from anns_lab.eval.executors.ray_executor import RayExecutor

    ex = RayExecutor.__new__(RayExecutor)
    ex.ray, ex.data, ex.cpus_per_task, ex.log, ex.part_timeout = _FakeRay(), "ship", 1.0, print, 0.0
    ex.cluster = SimpleNamespace(cpus=lambda: 2.0, abandon=lambda refs: None, ray=ex.ray, fits=lambda r: True)
    units = [(1, 0, ["flat", "ivf"]), (1, 3, ["flat", "ivf"]), (3, 0, ["flat"])]
    outcomes = []
    ex.run(_OneUnreadableHead(), units, {}, outcomes.append)
    by_part = {o.part: o for o in outcomes}
    assert len(outcomes) == len(by_part) == 5
    for name in ("flat", "ivf"):
        assert by_part[Part(1, 3, name)].table is None and "damaged layer file" in by_part[Part(1, 3, name)].error
        assert by_part[Part(1, 0, name)].table is not None
    assert by_part[Part(3, 0, "flat")].table is not None


def test_an_open_port_that_is_not_a_ray_head_is_refused_before_ray_init(monkeypatch):
    """A wrong --address whose port takes connections (here an HTTP server) passed the TCP check, and ``ray.init``
    then retried its GCS connection for ever (5 minutes and counting, a Ray failure fuzz): now the gRPC handshake a
    Ray head's GCS port answers is asked first (conftest refuses ``ray.init`` in this process)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from anns_lab.eval.executors import ray_cluster

    pytest.importorskip("grpc")
    monkeypatch.setattr(ray_cluster, "HANDSHAKE_S", 2.0)
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        assert ray_cluster._speaks_grpc(address, 2.0) is False
        with pytest.raises(AnnsLabError, match=f"{address} takes connections but is not a Ray head: no gRPC "
                                               "handshake within 2 s"):
            ray_cluster.Cluster(address, 1, log=lambda line: None)
    finally:
        server.shutdown()
        server.server_close()


class _Nodes:
    """A cluster whose alive nodes have ``cpus`` CPUs each (None: the GCS does not answer); Cluster's own ``fits`` and
    ``largest`` read them."""

    gcs = head = "10.0.0.1:6379"

    def __init__(self, *cpus, ray=None):
        self.alive, self.ray, self.head_up = list(cpus), ray or _FakeRay(), True

    def head_answers(self):
        return self.head_up

    def nodes(self):
        if self.alive is None:
            raise _FakeRay.exceptions.RayError("the GCS is gone")
        return [{"Alive": True, "Resources": {"CPU": c}} for c in self.alive]

    def abandon(self, refs):
        pass

    fits, largest, cpus = Cluster.fits, Cluster.largest, Cluster.cpus


def test_a_driver_whose_nodes_all_died_says_it_waits_once_and_says_when_one_joins():
    """The only node with CPUs lost mid-sweep: Ray holds the tasks until a node joins, and the driver waited without a
    word (a Ray failure fuzz). Asked every 10 s of the driver's clock; said once each way; a cluster that does not
    answer says nothing."""
    from anns_lab.eval.executors.ray_cluster import ClusterWatch

    now, lines, nodes = [0.0], [], _Nodes(0, 4)
    watch = ClusterWatch(nodes, {"CPU": 1.0}, "sweep", "Ctrl-C stops it.", lines.append, every=10.0,
                          clock=lambda: now[0])
    for t, cpus in ((5, [0, 4]), (10, [0, 4]), (11, [0]), (19, [0]), (20, [0]), (25, [0]), (30, [0]), (40, None),
                    (50, [0, 2]), (55, [0, 2]), (60, [0, 2])):
        now[0], nodes.alive = float(t), cpus
        watch()
        if t == 19:
            assert not lines  # not asked since t = 10
    assert lines == ["ray: no node alive can run a sweep task now (each needs 1 CPU; the alive nodes have at most 0 "
                     "CPU): the sweep waits for a node to join. Ctrl-C stops it.",
                     "ray: a node that can run sweep tasks has joined; going on"]


def test_a_head_silent_for_half_of_rays_reconnect_timeout_is_lost(monkeypatch):
    """A Ray head lost mid-sweep: Ray's own calls block, and Ray ends the driver after its reconnect timeout (60 s) with
    "Failed to connect to GCS", exit 1, no table, no word of what was kept (a Ray failure fuzz). The watch asks the
    head's port without Ray and gives up at half that: a head back within it is not lost."""
    from anns_lab.errors import ExecutorLost
    from anns_lab.eval.executors.ray_cluster import ClusterWatch

    monkeypatch.setenv("RAY_gcs_rpc_server_reconnect_timeout_s", "40")
    now, nodes = [0.0], _Nodes(2)
    watch = ClusterWatch(nodes, {"CPU": 1.0}, "sweep", "", lambda line: None, every=5.0, clock=lambda: now[0])
    for t, up in ((5, False), (10, False), (15, True), (20, False), (35, False)):  # silent 10 s, back, silent 15 s
        now[0], nodes.head_up = float(t), up
        watch()
    now[0] = 40.0
    with pytest.raises(ExecutorLost, match=r"lost the Ray head at 10.0.0.1:6379: it has not answered for 20 s"):
        watch()


def test_a_sweep_that_loses_its_ray_head_writes_the_table_of_its_finished_parts_and_says_how_to_go_on(
        tiny_dump, tmp_path, monkeypatch):
    from anns_lab.errors import ExecutorLost
    from anns_lab.eval import sweep as sweep_mod
    from anns_lab.eval.executors.local import LocalExecutor

    class HeadLost(LocalExecutor):
        def run(self, work, units, tries, on_outcome, on_running=None):
            super().run(work, units[:1], tries, on_outcome)
            raise ExecutorLost("lost the Ray head at 10.0.0.1:6379: it has not answered for 30 s")

    monkeypatch.setattr(sweep_mod, "open_executor", lambda *a, **kw: HeadLost(1, print, 0.0))
    with pytest.raises(AnnsLabError) as caught:
        run_sweep(tiny_dump.path, ["flat", "ivf"], [1], [0, 3], k=K, window=WINDOW, out=tmp_path / "res",
                  progress=False)
    assert str(caught.value) == (f"lost the Ray head at 10.0.0.1:6379: it has not answered for 30 s; 2 of 4 parts are "
                                 f"finished and kept in {tmp_path / 'res' / 'parts'}; run the same command again to "
                                 "resume")
    table = pd.read_parquet(tmp_path / "res" / RESULTS)
    assert set(zip(table["layer"], table["head"], table["index"])) == {(1, 0, "flat"), (1, 0, "ivf")}
    monkeypatch.undo()
    res = run_sweep(tiny_dump.path, ["flat", "ivf"], [1], [0, 3], k=K, window=WINDOW, out=tmp_path / "res",
                    progress=False, log=lambda line: None)
    assert set(zip(res.table["layer"], res.table["head"], res.table["index"])) == {
        (1, h, i) for h in (0, 3) for i in ("flat", "ivf")}


class _SlowRay(_FakeRay):
    """Ray whose tasks have no result for the driver's first three waits."""

    turns = 0

    def wait(self, refs, num_returns=1, timeout=None):
        self.turns += 1
        return ([], refs) if self.turns <= 3 else (refs[:num_returns], refs[num_returns:])


def test_the_heads_probe_is_a_direct_grpc_handshake_not_a_tcp_connect(monkeypatch):
    """A head whose process is stopped or hung still has its TCP connections taken by the kernel: the watch took it for
    alive and then blocked in Ray's own calls for ever (a review). The probe is a gRPC handshake, here against a real
    gRPC server, a socket that listens and never answers, and a closed port; direct, as Ray's channels are, whatever
    ``http_proxy`` says (a live head was refused under one)."""
    import socket
    from concurrent import futures

    grpc = pytest.importorskip("grpc")
    from anns_lab.eval.executors import ray_cluster

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)
    closed = _free_port()
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setattr(ray_cluster, "PROBE_S", 1.0)
    cluster = Cluster.__new__(Cluster)
    try:
        answers = {}
        for name, at in (("live", port), ("frozen", frozen.getsockname()[1]), ("closed", closed)):
            cluster.gcs = f"127.0.0.1:{at}"
            answers[name] = cluster.head_answers()
        assert answers == {"live": True, "frozen": False, "closed": False}
    finally:
        server.stop(0)
        frozen.close()
    cluster.gcs = "fe80::1:6379"  # an address of Ray's the parser refuses: Ray's own calls judge the head
    assert cluster.head_answers()
    assert ray_cluster._host_port("[::1]:6379") == ("::1", 6379)
    with pytest.raises(AnnsLabError, match=r"an IPv6 host in brackets: \[::1\]:6379"):
        ray_cluster._host_port("::1:6379")  # gRPC could not parse it: a live head was "not a Ray head"


def test_a_silent_head_is_not_asked_through_rays_calls_and_its_clock_is_left_alone(monkeypatch):
    """Under --part-timeout the driver's loop asked the clock actor at every turn, a call that blocked once the head was
    gone until Ray ended the driver (exit 1, no table; a review): while the head is silent the clock is not asked, and
    the run that loses it does not kill the clock on its way out."""
    from anns_lab.errors import ExecutorLost
    from anns_lab.eval.executors import ray_cluster, ray_executor
    from anns_lab.eval.executors.ray_executor import RayExecutor

    class NeverDone(_FakeRay):
        killed: list = []

        def wait(self, refs, num_returns=1, timeout=None):
            return (refs, []) if refs == ["clock's answer"] else ([], refs)

        def get(self, ref, timeout=None):
            return {} if ref == "clock's answer" else ref.value

        def kill(self, actor):
            self.killed.append(actor)

    asked = []
    clock = type("Clock", (), {"running_for": type("Call", (), {
        "remote": staticmethod(lambda: asked.append(1) or "clock's answer")})})()
    monkeypatch.setattr(ray_cluster, "WATCH_EVERY_S", 0.0)
    monkeypatch.setenv("RAY_gcs_rpc_server_reconnect_timeout_s", "1e-6")
    monkeypatch.setattr(ray_executor, "_part_task", lambda *args: (None, "not run"))
    ex = RayExecutor.__new__(RayExecutor)
    ex.ray, ex.data, ex.cpus_per_task, ex.log, ex.part_timeout = NeverDone(), "ship", 1.0, print, 5.0
    ex.cluster = _Nodes(1, ray=ex.ray)
    ex.cluster.head_up = False
    monkeypatch.setattr(ex, "_clock", lambda: clock)
    with pytest.raises(ExecutorLost, match="lost the Ray head at 10.0.0.1:6379"):
        ex.run(_OneUnreadableHead(), [(1, 0, ["flat"])], {}, lambda outcome: None)
    assert asked == [] and NeverDone.killed == [] and ex.cluster.lost


def test_a_head_lost_as_a_part_finishes_keeps_the_part_and_the_cluster_is_left_unshut(monkeypatch):
    """The watch is asked after the turn's finished parts are handed on (asked before them, a part Ray had returned
    was dropped with the lost head); a lost cluster is not shut down (Ray's shutdown waited 16 s on the gone head, the
    run's last words at risk); a short Ray patience makes the watch ask more often (a review)."""
    from anns_lab.errors import ExecutorLost
    from anns_lab.eval.executors import ray_cluster
    from anns_lab.eval.executors.ray_executor import RayExecutor

    class Shut(_FakeRay):
        shut = 0

        def is_initialized(self):
            return True

        def shutdown(self):
            Shut.shut += 1

    monkeypatch.setenv("RAY_gcs_rpc_server_reconnect_timeout_s", "6")
    assert ray_cluster.ClusterWatch(_Nodes(1), {"CPU": 1.0}, "sweep", "", print).every == 1.0  # a third of 3 s
    monkeypatch.setattr(ray_cluster, "WATCH_EVERY_S", 0.0)
    monkeypatch.setenv("RAY_gcs_rpc_server_reconnect_timeout_s", "0")
    ex = RayExecutor.__new__(RayExecutor)
    ex.ray, ex.data, ex.cpus_per_task, ex.log, ex.part_timeout = Shut(), "ship", 1.0, print, 0.0
    ex.cluster = Cluster.__new__(Cluster)
    ex.cluster.ray, ex.cluster.owned, ex.cluster.lost, ex.cluster.gcs = ex.ray, True, False, "127.0.0.1:1"
    ex.cluster.head = ex.cluster.gcs
    ex.cluster.nodes = lambda: [{"Alive": True, "Resources": {"CPU": 1}}]
    outcomes = []
    with pytest.raises(ExecutorLost):
        ex.run(_OneUnreadableHead(), [(1, 0, ["flat"])], {}, outcomes.append)
    assert [o.part for o in outcomes] == [Part(1, 0, "flat")] and outcomes[0].table is not None
    ex.close()
    assert ex.cluster.lost and Shut.shut == 0
    ex.cluster.lost = False
    ex.close()
    assert Shut.shut == 1


def test_the_sweeps_waiting_loop_asks_whether_a_node_can_still_run_its_parts(monkeypatch):
    """The watch above is asked while the Ray executor waits on its parts (here three turns without a result)."""
    from anns_lab.eval.executors import ray_cluster
    from anns_lab.eval.executors.ray_executor import RayExecutor

    monkeypatch.setattr(ray_cluster, "WATCH_EVERY_S", 0.0)
    lines = []
    ex = RayExecutor.__new__(RayExecutor)
    ex.ray, ex.data, ex.cpus_per_task, ex.log, ex.part_timeout = _SlowRay(), "ship", 1.0, lines.append, 0.0
    ex.cluster = _Nodes(0, ray=ex.ray)
    outcomes = []
    ex.run(_OneUnreadableHead(), [(1, 0, ["flat"])], {}, outcomes.append)
    assert len(outcomes) == 1 and outcomes[0].table is not None
    assert [line for line in lines if "waits for a node to join" in line] == [
        "ray: no node alive can run a sweep task now (each needs 1 CPU; the alive nodes have at most 0 CPU): the sweep "
        "waits for a node to join. Ctrl-C stops it; the same command then goes on from the parts written"]


def test_a_ray_decode_waiting_on_its_sample_asks_whether_a_node_can_still_run_it(monkeypatch):
    """The same watch in a Ray decode's wait for its next sample (a node with its GPU lost, here)."""
    from anns_lab.decode.ray_samples import RaySamples
    from anns_lab.eval.executors import ray_cluster

    class Slow(_SlowRay):
        def remote(self, fn):
            return super().remote(lambda *args: {"runs": {"full": "ran"}})

    monkeypatch.setattr(ray_cluster, "WATCH_EVERY_S", 0.0)
    lines = []
    samples = RaySamples.__new__(RaySamples)
    samples.ray, samples.log, samples.model, samples.device = Slow(), lines.append, "m", "cuda"
    samples.rope_scaling, samples.torch_threads, samples.resources = None, 0, {"CPU": 1.0, "GPU": 1.0}
    samples.cluster = _Nodes(4, ray=samples.ray)
    got = list(samples.map_samples(lambda: ["full"], {}, [([1, 2], 0)], 2, set()))
    assert got == [{"runs": {"full": "ran"}}]
    assert [line for line in lines if "waits for a node" in line] == [
        "ray: no node alive can run a decode task now (each needs 1 CPU, 1 GPU; the alive nodes have at most 4 CPU, "
        "0 GPU): the decode waits for a node to join. Ctrl-C stops it"]


def test_a_plugin_that_raises_keyboard_interrupt_on_ray_fails_its_part_once(tiny_dump, ray_cluster, tmp_path):
    """Before: Ray took the index's KeyboardInterrupt for a cancelled task: one attempt ran, and its record said three
    deaths of its worker (never tried again), its error a Ray task name in terminal colours."""
    res = sweep(tiny_dump, tmp_path / "res", indexes=["faulty", "flat"], layers=[3], heads=[0], executor="ray",
                address=ray_cluster, build_params={"faulty": {"fault": "interrupt"}}, max_attempts=3)
    assert [(name, head) for name, _, head, _ in res.failures] == [("faulty", 0)]
    rec = json.loads(next((tmp_path / "res" / "parts").glob("failed-*.json")).read_text())
    assert rec["attempts"] == 1 and not rec["worker_died"] and rec["error"].startswith("KeyboardInterrupt raised by")
    assert set(res.table["index"]) == {"flat"}


def test_a_sweep_without_address_starts_a_private_ray_whatever_ray_address_says(tiny_dump, ray_cluster, tmp_path):
    """Before: with RAY_ADDRESS set (or a `ray start` head on this machine), the private Ray's start joined that
    cluster instead and failed: "cannot join the Ray cluster at None: ... num_cpus and num_gpus must not be provided"."""
    logs = []
    res = sweep(tiny_dump, tmp_path / "res", indexes=["flat"], layers=[1], heads=[0], jobs=1, executor="ray",
                env={"RAY_ADDRESS": ray_cluster}, log=logs.append)
    assert not res.failures and len(res.table) > 0
    assert any("a private Ray on this machine: 1 node(s), 1 CPUs" in line for line in logs), logs


def test_more_cpus_per_task_than_the_machine_has_is_not_answered_by_more_jobs(monkeypatch):
    """Before: the advice was to raise --jobs past the machine's CPUs, which --jobs then refused."""
    from anns_lab.eval import executors

    monkeypatch.setattr(executors, "machine_cpus", lambda: 2)
    with pytest.raises(AnnsLabError, match="more than the 2 CPUs this machine gives this process.*lower --cpus-per-task, "
                                           "or join a larger cluster with --address"):
        executors._check_jobs(2, 3)


def test_a_node_without_the_dump_evaluates_the_heads_it_is_sent(tiny_dump, tmp_path):
    """Before: a Ray node sent a head's arrays (--ray-data ship, for nodes that do not share the dump's folder)
    opened the dump for its label and failed every part there: "... is not a dump: it has no manifest.json". An index
    that writes into its inputs there fails its part as anywhere (its arrays were the task's own: nothing to restore)."""
    from anns_lab.eval.heads import load_head
    from anns_lab.eval.sweep import SweepWork
    from anns_lab.indexes import protocol

    data = load_head(tiny_dump, 1, 0, WINDOW)
    work = SweepWork(str(tmp_path / "elsewhere"), K, WINDOW, {"faulty": {"build_fault": "write"}}, True,
                     label=str(tiny_dump.path), model=tiny_dump.model)
    table = work.evaluate(data, "flat")
    assert (table["dump"] == str(tiny_dump.path)).all() and (table["model"] == tiny_dump.model).all()
    with pytest.raises(protocol.IndexResultError, match="modified the keys or queries"):
        work.evaluate(data, "faulty")
    with pytest.raises(AnnsLabError, match="not measured: faulty wrote into this head's arrays"):  # nothing restores them
        work.evaluate(data, "flat")


def test_arrays_shipped_through_the_object_store_are_given_writable():
    """numba types an array by whether it is writable: the object store's read-only arrays compiled the kernels
    again inside the first build's timing (22-33 s against 0.3 s)."""
    from types import SimpleNamespace

    from anns_lab.eval.executors.ray_executor import _writable

    ro = np.arange(6, dtype=np.float32)
    ro.setflags(write=False)
    rw = np.ones(3, np.float32)
    got = _writable(SimpleNamespace(keys=ro, queries=rw, layer=3))
    assert got.keys.flags.writeable and np.array_equal(got.keys, ro) and got.queries is rw and got.layer == 3


def test_nothing_of_ray_is_imported_unless_asked(tiny_dump, tmp_path):
    code = ("import sys; from anns_lab.cli import main; from anns_lab.eval.sweep import run_sweep; "
            f"run_sweep({str(tiny_dump.path)!r}, ['flat'], [1], [0], k=10, window=(8, 64), out={str(tmp_path)!r}, "
            "jobs=1, progress=False); assert 'ray' not in sys.modules, 'ray imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


# --- decode through Ray ------------------------------------------------------------------------------------------


def test_ray_decode_gives_the_local_answers(tiny_llama, ray_cluster, tmp_path):
    from click.testing import CliRunner

    from anns_lab.cli import main

    args = ["decode", "--model", str(tiny_llama), "--mode", "full,flat", "--task", "passkey", "--context", "200",
            "--samples", "2", "--window", "4,16", "--topk", "20", "--max-new-tokens", "4",
            "--question-after-prefill"]  # each prompt's question crosses to its task beside its ids
    r = CliRunner().invoke(main, args + ["--json", str(tmp_path / "local.json")])
    assert r.exit_code == 0, r.output
    # Through Ray, the command runs as a user's does, in a process of its own (ray_driver.py says why); each task builds
    # its indexes in worker processes of its own (spawned from the Ray worker), the local run on threads
    r = subprocess.run([str(Path(sys.executable).parent / "anns-lab")] + args +
                       ["--executor", "ray", "--address", ray_cluster, "--build-processes",
                        "--json", str(tmp_path / "ray.json")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("local", "ray")}
    local, ray_ = runs["local"], runs["ray"]
    assert ray_["executor"] == "ray" and ray_["device"] == "cpu"
    assert ray_["settings"]["build_processes"] is True and local["settings"]["build_processes"] is False
    assert ray_["settings"]["question_after_prefill"] is True
    assert set(ray_["modes"]) == {"full", "flat"}
    for mode in ("full", "flat"):
        # when each layer's builds ran (wall times) and how many at once (the task's CPUs set it): not answers
        timed = ("build_layers", "layers_at_once")
        rows = [[{k: v for k, v in row.items() if k not in timed} for row in run["modes"][mode]["samples"]]
                for run in (ray_, local)]
        assert rows[0] == rows[1]  # answers, scores, depths, seeds
        assert all(row["build_layers"].keys() == ref["build_layers"].keys()
                   for row, ref in zip(ray_["modes"][mode]["samples"], local["modes"][mode]["samples"])
                   if "build_layers" in ref)
        for key in ("accuracy", "accuracy_ci95", "diff_vs_full", "diff_vs_full_ci95", "steps"):
            assert ray_["modes"][mode]["summary"][key] == local["modes"][mode]["summary"][key]
        assert ray_["modes"][mode]["summary"]["steps"] > 2 * 3  # the questions' steps too, not 3 a sample alone


def test_ray_decode_bad_input(tiny_llama, tmp_path):
    from click.testing import CliRunner

    from anns_lab.cli import main

    base = ["decode", "--model", str(tiny_llama), "--mode", "full,window", "--task", "passkey", "--context", "200",
            "--window", "4,16", "--max-new-tokens", "2", "--executor", "ray"]
    r = CliRunner().invoke(main, base + ["--address", f"127.0.0.1:{_free_port()}"])
    assert r.exit_code == 2 and "cannot reach a Ray cluster" in r.output
    r = CliRunner().invoke(main, base + ["--eval", "fidelity"])
    assert r.exit_code == 2 and "--eval fidelity is one prefill" in r.output


@pytest.mark.parametrize("cpus", [0.0, -1.0, float("nan"), float("inf"), 1e-9])
def test_ray_cpus_per_task_must_be_a_positive_number_before_any_cluster_is_touched(cpus):
    from anns_lab.decode.ray_samples import RaySamples
    from anns_lab.errors import AnnsLabError
    from anns_lab.eval.executors.ray_executor import RayExecutor

    with pytest.raises(AnnsLabError, match="--cpus-per-task must be a number of CPUs of at least 0.0001"):
        RayExecutor(None, 1, cpus)
    with pytest.raises(AnnsLabError, match="--cpus-per-task must be a number of CPUs of at least 0.0001"):
        RaySamples(None, "smollm2", cpus)


@pytest.mark.parametrize("executor", ["local", "ray"])
def test_a_failed_parts_record_keeps_where_the_index_raised(tiny_dump, tmp_path, executor, request):
    """A plugin's error was one line ("RuntimeError: ...") in its failed part's record and on the command line: an
    author could not tell where in their code it came from. The record keeps the traceback, from a worker process or a
    Ray task alike."""
    where = {"address": request.getfixturevalue("ray_cluster")} if executor == "ray" else {}
    res = sweep(tiny_dump, tmp_path / "res", indexes=["faulty"], layers=[3], heads=[0], executor=executor,
                build_params={"faulty": {"build_fault": "raise"}}, max_attempts=1, **where)
    assert [(name, head) for name, _, head, _ in res.failures] == [("faulty", 0)]
    rec = json.loads(next((tmp_path / "res" / "parts").glob("failed-*.json")).read_text())
    assert rec["error"].startswith("RuntimeError") and "\n" not in rec["error"]
    assert "faulty_indexes.py" in rec["traceback"] and "in _build" in rec["traceback"], rec["traceback"]


def test_a_part_evaluated_again_is_kept_aside_until_its_new_one_is_written(tiny_dump, tmp_path, monkeypatch):
    """A resume deleted a part it evaluated again (its index's code changed) before the new one existed: an edit that
    broke the plugin then cost the finished parts (a hostile-input audit). The old part waits in parts/stale/, out of
    the table, until its new one is written."""
    from anns_lab.indexes import registry

    out, lines = tmp_path / "res", []
    sweep(tiny_dump, out, indexes=["faulty", "flat"], layers=[3], heads=[0])
    part = out / "parts" / "L003_H00_faulty.parquet"
    first = part.read_bytes()
    real = registry.code_stamp
    monkeypatch.setattr(registry, "code_stamp", lambda name: real(name) | (
        {"source_sha256": "edited"} if name == "faulty" else {}))
    monkeypatch.setenv("ANNS_LAB_TEST_FAULTY_BROKEN", "1")
    res = sweep(tiny_dump, out, indexes=["faulty", "flat"], layers=[3], heads=[0], log=lines.append, max_attempts=1)
    assert [name for name, *_ in res.failures] == ["faulty"] and not part.exists()
    assert (out / "parts" / "stale" / part.name).read_bytes() == first
    assert set(res.table["index"]) == {"flat"}
    assert any("1 earlier part(s) whose new evaluation failed wait in" in line for line in lines), lines
    monkeypatch.delenv("ANNS_LAB_TEST_FAULTY_BROKEN")
    res = sweep(tiny_dump, out, indexes=["faulty", "flat"], layers=[3], heads=[0], retry_failed=True)
    assert not res.failures and part.exists() and not (out / "parts" / "stale" / part.name).exists()
    assert set(res.table["index"]) == {"faulty", "flat"}


def test_a_node_lost_during_the_dump_probe_is_said_and_the_arrays_shipped(tiny_dump):
    """A worker node killed while `--ray-data auto` probed it (Ray's TaskUnschedulableError) ended the sweep with a
    traceback, exit 1 (a Ray failure fuzz): its probe is said to have failed, and the arrays go through the object store,
    which every node still alive can read."""
    from anns_lab.eval.executors.ray_executor import RayExecutor
    from anns_lab.eval.sweep import SweepWork

    class Lost(_FakeRay):
        calls = 0

        def get(self, ref, timeout=None):
            Lost.calls += 1
            if Lost.calls == 2:
                raise self.exceptions.RayError("TaskUnschedulableError: the node died")
            return ref.value

    class Nodes:
        def nodes(self):
            return [{"NodeManagerAddress": f"10.0.0.{i}", "NodeID": f"{i}" * 56} for i in (1, 2)]

    lines = []
    ex = RayExecutor.__new__(RayExecutor)
    ex.ray, ex.data, ex.log, ex.cluster = Lost(), "auto", lines.append, Nodes()
    work = SweepWork(str(tiny_dump.path), K, WINDOW, {}, False, "head", "own", str(tiny_dump.path), tiny_dump.model,
                     "stamp", False)
    assert ex.data_mode(work) == "ship"
    assert any("node 10.0.0.2 22222222 did not answer the dump probe (RuntimeError)" in line for line in lines), lines
