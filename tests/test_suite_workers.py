"""`make test` runs the suite on pytest-xdist's workers: a worker that dies at its exit, after its last test, must
fail the run as one process's crash does (xdist alone returned 0, the traceback buried in a green log)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

CRASH_AT_EXIT = """
import atexit, faulthandler

def test_passes_then_its_worker_dies_at_exit():
    atexit.register(faulthandler._sigsegv)
"""


def _run(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadfile", str(folder)], cwd=folder, capture_output=True, text=True, timeout=300)


def test_a_worker_that_dies_at_its_exit_fails_the_run(tmp_path):
    (tmp_path / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (tmp_path / "test_fine.py").write_text("def test_fine():\n    assert True\n")
    quiet = _run(tmp_path)
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    (tmp_path / "test_crash.py").write_text(CRASH_AT_EXIT)
    crashed = _run(tmp_path)
    assert "2 passed" in crashed.stdout  # every test passed: only the exit crashed
    assert crashed.returncode == 1 and "ended abnormally after their tests" in crashed.stderr, crashed.stderr
    assert "Segmentation fault" in crashed.stderr  # and faulthandler says where
