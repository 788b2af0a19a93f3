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

import pandas as pd
import pytest

from anns_lab.eval import failures
from anns_lab.eval.sweep import RESULTS, run_sweep

HERE = Path(__file__).parent
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


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory) -> Path:
    """A folder that registers the ``faulty`` index (tests/faulty_indexes.py) when on sys.path / PYTHONPATH."""
    d = tmp_path_factory.mktemp("faulty-plugin")
    shutil.copy(HERE / "faulty_indexes.py", d / "faulty_indexes.py")
    info = d / "anns_lab_faulty-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: anns-lab-faulty\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[anns_lab.indexes]\nfaulty = faulty_indexes:FaultyIndex\n")
    return d


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


def sweep(dump, out, **kw):
    args = dict(indexes=["flat", "ivf"], layers=[1, 3], heads=[0, 3], k=K, window=WINDOW, out=out, jobs=2,
                progress=False) | kw
    return run_sweep(dump.path, **args)


@pytest.fixture(scope="module")
def local_table(tiny_dump, tmp_path_factory):
    res = sweep(tiny_dump, tmp_path_factory.mktemp("local") / "res")
    assert not res.failures
    return res.table


# --- the local executor ----------------------------------------------------------------------------------------


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


def test_ctrl_c_stops_within_seconds_and_keeps_finished_parts(tiny_dump, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    out = tmp_path / "res"
    cmd = [str(Path(sys.executable).parent / "anns-lab"), "sweep", "--dump", str(tiny_dump.path), "--indexes", "faulty",
           "--layers", "1,3", "--heads", "0,1,2,3", "--k", str(K), "--window", "8,64", "--out", str(out), "--jobs", "1",
           "--build-param", f"faulty.pid_dir={pids}", "--build-param", "faulty.sleep_s=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: list((out / "parts").glob("*.parquet")) and len(list(pids.iterdir())) >= 2 or proc.poll() is not None,
                 "the first part to finish")
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
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


def _pid(build_file: Path) -> int:
    return int(build_file.name.split("-")[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/status").read_text().count("State:\tZ")
