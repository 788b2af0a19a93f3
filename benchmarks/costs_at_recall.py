"""Print, as markdown, each index's cheapest operating point at a recall target per head (scanned fraction,
bytes read per query, output error), from one or more sweep results folders.

    python benchmarks/costs_at_recall.py results/smollm2-text-8192 [more folders] [--target 0.95] [--indexes ivf,quest]

The numbers come from the sweep tables as they are (``anns_lab.eval.costs``); folders are concatenated, so
indexes swept in separate runs of the same dump appear side by side.
"""

from __future__ import annotations

import argparse

import pandas as pd

from anns_lab.eval import costs
from anns_lab.eval.table import load_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--indexes", help="comma-separated indexes to show [default: every index in the tables]")
    a = ap.parse_args()
    table = pd.concat([load_results(r)[0] for r in a.results], ignore_index=True)
    if a.indexes:
        table = table[table["index"].isin(a.indexes.split(","))]
    for dump, t in table.groupby("dump"):
        print(f"### {dump}: keys per head {int(t['n_keys'].median())}\n")
        print("\n".join(costs.markdown_at_target(costs.at_target(t, a.target), a.target)))
        print()


if __name__ == "__main__":
    main()
