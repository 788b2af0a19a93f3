"""Loading a saved index trusts nothing: random edits of index.json fields, array shapes, dtypes, ids and
flipped bytes (fixed seeds, 36 cases per index) each end in one IndexConfigError or a correct load: the same
search as the saved index, or, for a deliberate edit (a build parameter, or an array with its checksum redone),
a valid search of what the edited files say (ids in range and unique, scores their inner products).
Every case runs in a subprocess per index, so a crash is a failing test that names the case."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("load_fuzz_worker.py")


@pytest.mark.parametrize("name", ["flat", "ivf", "hnsw", "vamana", "robust-vamana", "roargraph", "simhash"])
def test_every_edit_of_a_saved_index_is_refused_or_loads_correctly(name, tmp_path):
    proc = subprocess.run([sys.executable, str(WORKER), name, str(tmp_path)], capture_output=True, text=True, timeout=600)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    last = lines[-1] if lines else None
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("done"), (
        f"{name}: the worker died (exit {proc.returncode}) in {last}\n{proc.stderr[-2000:]}")
    done = [x for x in lines if x["outcome"] != "started"]
    wrong = [x for x in done if not x["outcome"].startswith(("refused", "same", "valid"))]
    assert not wrong, wrong
    assert len(done) == 36 and sum(x["outcome"].startswith("refused") for x in done) >= 18  # the edits bite
    assert all("cannot load" in x["outcome"] for x in done if x["outcome"].startswith("refused:"))  # names the folder
