"""Each index's cost at a recall target, per head (between the grid points around it): scanned fraction,
bytes read and output error.

The per-head view behind the Pareto medians: where an index does not reach the target on a head, its best
recall there is shown instead, so a median never hides a head that failed.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from anns_lab.eval import markdown, metrics


def at_target(table: pd.DataFrame, target: float = 0.95, direction: str = "q2k") -> pd.DataFrame:
    """Per (index, layer, head): the bytes read at recall ``target`` (:func:`metrics.at_recall`: between
    the two grid points around it, its scanned fraction and output error mixed alike; ``reached`` True), or, where
    no point reaches it, the point of best recall (``reached`` False)."""
    rows = []
    t = table[table["direction"] == direction]
    for (index, layer, head), g in t.groupby(["index", "layer", "head"], sort=True):
        _, below, hit, w = metrics.at_recall(g["recall"], g["bytes_read"], target)
        reached, one = hit >= 0, hit < 0 or below == hit  # one: the cost is a grid point's own
        if reached:
            lo, hi = g.iloc[below], g.iloc[hit]
        else:
            lo = hi = g.loc[g["recall"].idxmax()]

        def mix(column: str) -> float:
            return float(hi[column]) if one else float(lo[column] + w * (hi[column] - lo[column]))

        rows.append({"index": index, "layer": int(layer), "head": int(head), "reached": reached,
                     "recall": mix("recall"), "scanned_fraction": mix("scanned_fraction"), "bytes_read": mix("bytes_read"),
                     "output_rel_error": mix("output_rel_error"),
                     "search_params": hi["search_params"] if one else f"{lo['search_params']} – {hi['search_params']}"})
    return pd.DataFrame(rows)


def summary_at_target(points: pd.DataFrame) -> pd.DataFrame:
    """Per index: heads reaching the target, and the medians over those heads of scanned fraction, KiB read and
    output error (NaN when no head reaches it)."""
    out = []
    for index, g in points.groupby("index", sort=True):
        r = g[g["reached"]]
        out.append({"index": index, "heads": len(g), "reached": len(r),
                    "scanned_fraction": float(r["scanned_fraction"].median()) if len(r) else np.nan,
                    "kib_read": float(r["bytes_read"].median() / 1024) if len(r) else np.nan,
                    "output_rel_error": float(r["output_rel_error"].median()) if len(r) else np.nan,
                    "best_recall_unreached": float(g.loc[~g["reached"], "recall"].max()) if (~g["reached"]).any() else np.nan})
    return pd.DataFrame(out)


def markdown_at_target(points: pd.DataFrame, target: float = 0.95) -> list[str]:
    """Markdown lines: the per-index summary, then every head (cells "KiB read / scanned % / output error", or
    "best r" where the target is not reached)."""
    lines = [f"| index | heads reaching {target:.2f} | scanned (median of those heads) | KiB read (median of those) "
             "| output rel. error (median of those) | best recall where not reached |", "|---|---|---|---|---|---|"]
    fmt = markdown.number
    for r in summary_at_target(points).itertuples(index=False):
        lines.append(f"| {markdown.cell(r.index)} | {r.reached}/{r.heads} | {fmt(100 * r.scanned_fraction, '{:.2f}%')} | "
                     f"{fmt(r.kib_read, '{:.1f}')} | {fmt(r.output_rel_error, '{:.4f}')} | {fmt(r.best_recall_unreached, '{:.3f}')} |")
    names = sorted(points["index"].unique())
    lines += ["", "Per head (KiB read / scanned / output rel. error at "
              f"{target:.2f}; *best r* = not reached, best recall r):", "",
              "| layer | head | " + " | ".join(map(markdown.cell, names)) + " |", "|---|---|" + "---|" * len(names)]
    for (layer, head), g in points.groupby(["layer", "head"], sort=True):
        cells = []
        for name in names:
            p = g[g["index"] == name]
            if p.empty:
                cells.append("")
            elif p["reached"].iloc[0]:
                cells.append(f"{p['bytes_read'].iloc[0] / 1024:.0f} / {100 * p['scanned_fraction'].iloc[0]:.1f}% / "
                             f"{fmt(p['output_rel_error'].iloc[0], '{:.3f}')}")
            else:
                cells.append(f"*best {p['recall'].iloc[0]:.3f}*")
        lines.append(f"| {layer} | {head} | " + " | ".join(cells) + " |")
    return lines
