"""Ray sweeps for the tests, each driven from an interpreter of its own (``python ray_driver.py SETTINGS RESULT``).

A driver's ``ray.init`` ... ``ray.shutdown`` leaves Ray's gRPC threads running (ten of them on Ray 2.60, more after
each cycle); a test process that drove a dozen sweeps through Ray carried them all to its exit, where one CI run died
of a segmentation fault after every test had passed. A user's driver, the CLI, starts and stops Ray once per process:
so does each of these. conftest.py refuses ``ray.init`` in the test process itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from anns_lab.errors import AnnsLabError
from anns_lab.eval.sweep import RESULTS, SweepResult


class RaySweep:
    """``run_sweep(dump_path, out=out, **settings)`` started in a subprocess (``env``: variables it gets besides
    this process's); ``result()`` waits for it."""

    def __init__(self, dump_path: str | Path, out: str | Path, env: dict | None = None, **settings) -> None:
        fd, name = tempfile.mkstemp(prefix="ray-driver-", suffix=".json")
        os.close(fd)
        self.result_file, self.out = Path(name), Path(out)
        settings = settings | {"dump_path": str(dump_path), "out": str(out)}
        self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(settings), name], env=os.environ | (env or {}),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.logs: list[str] = []

    def __enter__(self) -> "RaySweep":
        return self

    def __exit__(self, *exc) -> None:
        """A test that fails before ``result()`` leaves no driver running against the module's cluster."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.result_file.unlink(missing_ok=True)

    def result(self, timeout: float = 300.0) -> SweepResult:
        """The sweep's result (its table read back from ``out``); the driver's AnnsLabError is raised here."""
        try:
            output, _ = self.proc.communicate(timeout=timeout)
            done = json.loads(self.result_file.read_text() or "{}")
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.result_file.unlink(missing_ok=True)
        assert self.proc.returncode == 0 and done, f"the Ray driver exited {self.proc.returncode}:\n{output}"
        self.logs, self.still_connected = done["logs"], done.get("still_connected")
        if "error" in done:
            raise AnnsLabError(done["error"])
        failures = [tuple(f) for f in done["failures"]]
        return SweepResult(pd.read_parquet(self.out / RESULTS), self.out / RESULTS, failures, done["seconds"])


def ray_sweep(dump_path: str | Path, out: str | Path, **settings) -> tuple[SweepResult, list[str]]:
    """Run a sweep through Ray in a subprocess: its result and the lines it logged."""
    run = RaySweep(dump_path, out, **settings)
    return run.result(), run.logs


def _main(settings: str, result_file: str) -> None:
    from anns_lab.eval.sweep import run_sweep

    kw, logs = json.loads(settings), []
    if "window" in kw:
        kw["window"] = tuple(kw["window"])
    connect = kw.pop("connect_first", None)  # a Ray the driver started itself, before the sweep: {"num_cpus": N}
    if connect is not None:
        import ray

        ray.init(include_dashboard=False, logging_level="WARNING", log_to_driver=False, **connect)
    try:
        res = run_sweep(**kw, log=logs.append)
        done = {"failures": [list(f) for f in res.failures], "seconds": res.seconds}
    except AnnsLabError as err:
        done = {"error": str(err)}
    if connect is not None:
        import ray

        done["still_connected"] = ray.is_initialized()  # the sweep used the connection, and left it to its owner
        ray.shutdown()
    Path(result_file).write_text(json.dumps(done | {"logs": logs}))


if __name__ == "__main__":
    _main(*sys.argv[1:])
