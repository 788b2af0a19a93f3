"""Query-aware graphs (issue 4) against IVF and the key-only graphs on a SmolLM2 8K dump.

    anns-lab dump --model smollm2 --tokens 8192 --decode-tokens 64 --out dumps/smollm2-text-8192
    python benchmarks/bench_query_aware.py --dump dumps/smollm2-text-8192 \\
        [--indexes roargraph,robust-vamana,ivf,hnsw,vamana] [--layers 2,15,28] [--out results/bench-query-aware]
        [--quick] [--build-param roargraph.NAME=VALUE ...]

Runs the lab's own sweep (``anns_lab.eval.sweep.run_sweep``: static window 128 + 512
excluded, decode queries as test queries, one thread per head, ``--jobs`` heads at once),
then reads the results table: per (layer, head) and index, the fraction of keys scanned at
recall@100 = ``--target`` (linear interpolation between the frontier's grid points around it; "-" if never reached),
the batch-1 single-thread latency at the first grid point reaching the target, and build
time. Prints a markdown table and the medians over heads, and each index's ratio to IVF
(IVF's scanned fraction / the index's, same run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import numpy as np
import pandas as pd

from anns_lab.dumps import rope
from anns_lab.eval.metrics import at_recall
from anns_lab.eval.sweep import run_sweep
from anns_lab.indexes.group_queries import MODES


def at_target(rows: pd.DataFrame, target: float) -> tuple[float, float]:
    """(scanned fraction at ``target`` recall, between the grid points around it: ``metrics.at_recall``; latency µs
    of the first grid point reaching it); NaN if never."""
    fraction, _, reached, _ = at_recall(rows["recall"], rows["scanned_fraction"], target)
    return fraction, (float(rows["latency_us"].iloc[reached]) if reached >= 0 else np.nan)


def summarise(table: pd.DataFrame, target: float) -> pd.DataFrame:
    q2k = table[table.direction == "q2k"]
    out = []
    for (layer, head, index), rows in q2k.groupby(["layer", "head", "index"]):
        frac, lat = at_target(rows, target)
        out.append({"layer": layer, "head": head, "index": index, "scanned": frac, "latency_us": lat,
                    "build_s": rows.build_s.iloc[0], "best_recall": rows.recall.max(), "n_keys": rows.n_keys.iloc[0]})
    return pd.DataFrame(out)


def markdown(df: pd.DataFrame) -> str:
    """A DataFrame as a markdown table (no tabulate dependency)."""
    df = df.reset_index()
    fmt = lambda v: "-" if isinstance(v, float) and np.isnan(v) else (f"{v:g}" if isinstance(v, float) else str(v))
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + " --- |" * len(df.columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", default="dumps/smollm2-text-8192")
    ap.add_argument("--indexes", default="roargraph,robust-vamana,ivf,hnsw,vamana")
    ap.add_argument("--layers", default="2,15,28")
    ap.add_argument("--heads", default=None)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="results/bench-query-aware")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--quick", action="store_true", help="recall and cost only (no latency or attention-quality passes)")
    ap.add_argument("--build-param", action="append", default=[], metavar="INDEX.NAME=VALUE",
                    help="replace a build default, e.g. roargraph.descent_links=0 (repeatable)")
    ap.add_argument("--train-positions", default=rope.DEFAULT, choices=rope.PLACES, help=rope.HELP)
    ap.add_argument("--train-group", default="head", choices=MODES,
                    help="attention-aware indexes' training queries: the head's own or its GQA group's, or the head's own with "
                         "the group's other heads' for the keys its lists leave out (anns_lab.indexes.group_queries)")
    args = ap.parse_args()
    heads = [int(h) for h in args.heads.split(",")] if args.heads else None
    build_params: dict[str, dict] = {}
    for item in args.build_param:
        name, value = item.split("=", 1)
        index, param = name.split(".", 1)
        build_params.setdefault(index, {})[param] = json.loads(value)
    res = run_sweep(args.dump, indexes=args.indexes.split(","), layers=[int(x) for x in args.layers.split(",")],
                    heads=heads, out=args.out, jobs=args.jobs, overwrite=args.overwrite, build_params=build_params,
                    quick=args.quick, train_group=args.train_group,
                    train_positions=args.train_positions)
    for f in res.failures:
        print("FAILED", f)
    s = summarise(res.table, args.target)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores; sweep {res.seconds:.0f} s; "
          f"{res.path}")
    wide = s.pivot(index=["layer", "head"], columns="index", values="scanned")  # keeps an index that never reaches the target
    print(f"\nfraction of keys scanned at recall@100 = {args.target} (Q→K, decode queries):\n")
    print(markdown((wide * 100).round(1)))
    med = s.groupby("index").agg(scanned=("scanned", "median"), reached=("scanned", lambda x: int(x.notna().sum())),
                                 heads=("scanned", "size"), latency_us=("latency_us", "median"),
                                 build_s=("build_s", "median"), best_recall=("best_recall", "median"))
    if "ivf" in med.index:
        # Median of per-head ratios (a head an index never brings to the target counts as ratio 0).
        ratios = {}
        for name in med.index:
            r = (wide["ivf"] / wide[name]).fillna(0.0)
            ratios[name] = float(r.median())
        med["x_ivf"] = pd.Series(ratios)
    med["scanned"] = med["scanned"] * 100
    print("\nmedian over heads (scanned in %, NaN heads excluded from the median; latency at the first grid point ≥ target):\n")
    print(markdown(med.round(3)))
    Path(args.out, "summary.json").write_text(json.dumps({"per_head": s.to_dict("records"), "median": med.reset_index().to_dict("records")},
                                                         default=float, indent=1))


if __name__ == "__main__":
    main()
