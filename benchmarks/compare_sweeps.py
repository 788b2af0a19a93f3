"""Are two sweep tables the same results? Row by row on (layer, head, index, parameters, direction): recall and
scanned_fraction must be equal (exactly, or within ``--tol``); timing columns are reported, not compared.

    .venv/bin/python benchmarks/compare_sweeps.py /tmp/old/results.parquet /tmp/new/results.parquet

Exit status 1 when a row is missing on one side or differs.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

KEY = ["layer", "head", "index", "build_params", "search_params", "direction"]
SAME = ["recall", "scanned_fraction", "n_keys", "n_queries"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--tol", type=float, default=0.0, help="allowed absolute difference (0: bit-identical)")
    a = ap.parse_args()
    old, new = pd.read_parquet(a.old), pd.read_parquet(a.new)
    both = old.merge(new, on=KEY, how="outer", suffixes=("_old", "_new"), indicator=True)
    missing = both[both["_merge"] != "both"]
    both = both[both["_merge"] == "both"]
    bad = np.zeros(len(both), bool)
    for col in SAME:
        bad |= ~np.isclose(both[f"{col}_old"], both[f"{col}_new"], rtol=0, atol=a.tol, equal_nan=True)
    for name, g in both.groupby("index"):
        build = g.groupby(["layer", "head"])[["build_s_old", "build_s_new"]].first()
        print(f"{name:14s} {len(g):4d} rows  differing: {int(bad[both['index'] == name].sum())}  "
              f"build s old/new (median over heads): {build['build_s_old'].median():.2f} / {build['build_s_new'].median():.2f}")
    if len(missing):
        print(f"{len(missing)} rows on one side only:\n{missing[KEY + ['_merge']].to_string()}")
    if bad.any():
        print(both.loc[bad, KEY + [f"{c}_{s}" for c in SAME[:2] for s in ("old", "new")]].to_string())
    print("identical" if not bad.any() and not len(missing) else "DIFFERENT")
    return int(bad.any() or len(missing) > 0)


if __name__ == "__main__":
    sys.exit(main())
