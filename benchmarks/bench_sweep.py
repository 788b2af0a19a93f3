"""Time of the full default sweep and report on a dump (issue 5's goal: ≤ 20 minutes for SmolLM2 8K).

    python benchmarks/bench_sweep.py --dump dumps/smollm2-text-8192 --jobs 2

Runs ``anns-lab sweep`` with its defaults (every registered index, 3 layers × all heads, both
directions) into a fresh folder, then ``anns-lab report``, and prints the time of each stage
and each index's share of the build time, as Markdown.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from anns_lab.eval.report import fmt_fraction, pareto, write_report
from anns_lab.eval.sweep import run_sweep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", default="dumps/smollm2-text-8192")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-sweep-")) / "results"

    res = run_sweep(args.dump, out=out, jobs=args.jobs)
    t0 = time.perf_counter()
    write_report(res.path)
    report_s = time.perf_counter() - t0
    t = res.table
    heads = t.groupby(["layer", "head"]).ngroups
    print(f"sweep: {len(t)} rows, {heads} heads × {t['index'].nunique()} indexes, both directions; "
          f"{res.seconds:.0f} s with --jobs {args.jobs}; report {report_s:.0f} s; results in {out}")
    print("\n| index | grid points | build s per head (median) | build s total |")
    print("|---|---|---|---|")
    for name, g in t.groupby("index"):
        per_head = g.groupby(["layer", "head"])["build_s"].first()
        print(f"| {name} | {g['search_params'].nunique()} | {per_head.median():.2f} | {per_head.sum():.1f} |")
    print("\n| index | direction | scanned for recall 0.90 | 0.95 | 0.99 (median over heads) |")
    print("|---|---|---|---|---|")
    for r in pareto(t).to_dict("records"):
        cells = " | ".join(fmt_fraction(r[f"scan@{x:.2f}"]) for x in (0.90, 0.95, 0.99))
        print(f"| {r['index']} | {r['direction']} | {cells} |")
    if res.failures:
        print("failures:", res.failures)


if __name__ == "__main__":
    main()
