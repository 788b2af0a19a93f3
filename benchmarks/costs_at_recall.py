"""Print, as markdown, each index's cost at a recall target per head (between the grid points around it:
scanned fraction, bytes read per query, output error), from one or more sweep results folders.

    python benchmarks/costs_at_recall.py results/smollm2-text-8192 [more folders] [--target 0.95] [--indexes ivf,quest]
        [--versus roargraph]     # per head, compact: KiB read by each index, roargraph's against the least other's

The numbers come from the sweep tables as they are (``anns_lab.eval.costs``); folders are concatenated, so
indexes swept in separate runs of the same dump appear side by side, and an index in a later folder replaces
its rows from earlier ones (``old-sweep rerun-of-one-index``).
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from anns_lab.eval import costs, findings
from anns_lab.eval.table import load_results


def versus(points: pd.DataFrame, name: str) -> pd.DataFrame:
    """Per head: ``name``'s bytes read at the target and the least bytes of any other index reaching it there.

    ``ratio`` = other / ``name`` (> 1: ``name`` reads fewer); inf where no other index reaches the target, NaN
    where ``name`` does not.
    """
    rows = []
    for (layer, head), g in points.groupby(["layer", "head"], sort=True):
        me, others = g[g["index"] == name], g[(g["index"] != name) & g["reached"]]
        mine = float(me["bytes_read"].iloc[0]) if len(me) and me["reached"].iloc[0] else np.nan
        best = others.loc[others["bytes_read"].idxmin()] if len(others) else None
        rows.append({"layer": layer, "head": head, f"{name} KiB": mine / 1024,
                     "least other": best["index"] if best is not None else "none",
                     "its KiB": float(best["bytes_read"]) / 1024 if best is not None else np.inf,
                     "ratio": (float(best["bytes_read"]) if best is not None else np.inf) / mine})
    return pd.DataFrame(rows)


def compact(points: pd.DataFrame, name: str) -> list[str]:
    """Markdown, one row per head: KiB read at the target per index (*best r* where not reached), ``name``'s
    scanned fraction and output error, and the least other index's bytes over ``name``'s."""
    names = sorted(points["index"].unique(), key=lambda n: (n != name, n))
    v = versus(points, name).set_index(["layer", "head"])
    lines = ["| layer, head | " + " | ".join(names) + f" | {name} scanned / error | least other / {name} |",
             "|---|" + "---|" * (len(names) + 2)]
    for (layer, head), g in points.groupby(["layer", "head"], sort=True):
        cells = []
        for n in names:
            p = g[g["index"] == n]
            cells.append("" if p.empty else f"{p['bytes_read'].iloc[0] / 1024:,.0f}" if p["reached"].iloc[0]
                         else f"*best {p['recall'].iloc[0]:.3f}*")
        me = g[g["index"] == name]
        mine = (f"{100 * me['scanned_fraction'].iloc[0]:.1f}% / {me['output_rel_error'].iloc[0]:.3f}"
                if len(me) and me["reached"].iloc[0] else "–")
        r = v.loc[(layer, head)]
        lines.append(f"| {layer}, {head} | " + " | ".join(cells) + f" | {mine} | {r['ratio']:.2f} ({r['least other']}) |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--indexes", help="comma-separated indexes to show [default: every index in the tables]")
    ap.add_argument("--versus", help="an index to set against the least bytes of every other, head by head")
    a = ap.parse_args()
    table = pd.DataFrame()
    for folder in a.results:  # an index of a later folder replaces its rows of earlier ones (a re-sweep of one index)
        t = findings.label_builds(load_results(folder)[0])  # several builds of an index: each apart
        if len(table):
            table = table[~table.set_index(["dump", "index"]).index.isin(t.set_index(["dump", "index"]).index)]
        table = pd.concat([table, t], ignore_index=True)
    if a.indexes:
        table = table[table["index"].isin(a.indexes.split(","))]
    for dump, t in table.groupby("dump"):
        print(f"### {dump}: keys per head {int(t['n_keys'].median())}\n")
        points = costs.at_target(t, a.target)
        print("\n".join(costs.markdown_at_target(points, a.target)))
        print()
        if a.versus:
            v = versus(points, a.versus)
            won = int((v["ratio"] > 1).sum())
            print(f"{a.versus} reads fewer bytes than every other index at {a.target} on {won} of {len(v)} heads; "
                  f"ratio (least other / {a.versus}) min {v['ratio'].min():.2f}, median {v['ratio'].median():.2f}\n")
            print("\n".join(compact(points, a.versus)))
            print()


if __name__ == "__main__":
    main()
