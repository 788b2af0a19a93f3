"""The sweep's results table: its file names, its columns, and reading it back (no plotting, no index imports)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from anns_lab.errors import AnnsLabError

RESULTS = "results.parquet"
SETTINGS = "sweep.json"
COLUMNS = ["dump", "model", "layer", "head", "kv_head", "index", "build_params", "search_params", "direction", "k",
           "n_keys", "n_queries", "recall", "scanned_fraction", "mass_recovered", "output_rel_error", "latency_us",
           "qps", "build_s", "index_bytes"]


def load_results(path: str | Path) -> tuple[pd.DataFrame, dict]:
    """The results table and its sweep settings, from a results.parquet or its folder."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    file = folder / RESULTS if path.is_dir() else path
    if not file.is_file():
        raise AnnsLabError(f"no results table at {file}; run `anns-lab sweep` first")
    table = pd.read_parquet(file)
    missing = set(COLUMNS) - set(table.columns)
    if missing:
        raise AnnsLabError(f"{file} is not an anns-lab results table (missing columns {sorted(missing)})")
    settings = json.loads((folder / SETTINGS).read_text()) if (folder / SETTINGS).is_file() else {}
    return table, settings
