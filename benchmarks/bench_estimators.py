"""Output error at equal bytes read: estimators against top-k indexes, per head and median over heads.

For each (layer, head) of a dump, every index is built once and searched at every grid point with
the decode-step queries (the sweep's Q→K protocol, k = 100, window 128 + 512); each point gives the
mean ``bytes_read`` per query and the sweep's ``output_rel_error`` (exact part plus the estimate for
estimators). Per head and index: the least error at a byte budget, read like the report's cost at a recall
target (``metrics.within_budget``: the last frontier point within the budget, or the mix of it and the next
whose expected bytes are the budget, each query searched at one of the two), budgets being fractions of one
full key scan (n_keys × dim × 4 bytes, what ``flat`` reads). Prints the
median over heads per index and budget (a head with no point within the budget: not reached) and
writes every point to ``--csv``.

    python benchmarks/bench_estimators.py --dump /work/dumps/smollm2-text-8192 --layers 2,15,28 --heads 0,4 --csv out.csv
    python benchmarks/bench_estimators.py --results results/smollm2-text-8192     # the points an `anns-lab sweep` measured

``--results`` reads the same points from sweep folders instead of measuring them: the sweep's Q→K rows are
this protocol (same heads, grids and metric), so one sweep of every index gives these tables and the
report's figures from one run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from anns_lab.dumps.store import open_dump
from anns_lab.errors import AnnsLabError
from anns_lab.eval.heads import load_head
from anns_lab.eval.metrics import within_budget
from anns_lab.eval.table import load_results
from anns_lab.indexes import registry

INDEXES = "flat,roargraph,magicpig,vattention,retroinfer"
BUDGETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0)


def measure(dump, layer: int, head: int, names: list[str], k: int = 100) -> list[dict]:
    """Every grid point of every index on one head: bytes read per query, output error, mass, scanned fraction."""
    import faiss
    import numba

    faiss.omp_set_num_threads(1)
    numba.set_num_threads(1)
    data = load_head(dump, layer, head)
    rows = []
    for name in names:
        index = registry.create(name)
        t0 = time.process_time()
        index.build(data.keys, data.train_queries if index.uses_train_queries else None)
        build_cpu = time.process_time() - t0
        for params in index.grid():
            res = index.search(data.test_queries, k, **params)
            mass, err = data.attention_quality(res.ids, res.estimate, index.summaries())
            rows.append({"layer": layer, "head": head, "index": name, "params": str(params), "n_keys": len(data.keys),
                         "full_scan_bytes": len(data.keys) * 4 * data.keys.shape[1],
                         "bytes_read": float(res.bytes_read.mean()), "scanned": float(res.n_scanned.mean()) / len(data.keys),
                         "mass": mass, "output_rel_error": err, "build_cpu_s": build_cpu})
    return rows


def from_sweep(folders: list[str], names: list[str]) -> pd.DataFrame:
    """The points of ``names`` from sweep results (Q→K rows), in :func:`measure`'s columns (build time: wall, not CPU)."""
    t = pd.concat([load_results(f)[0] for f in folders], ignore_index=True)
    t = t[(t["direction"] == "q2k") & t["index"].isin(names)]
    if t.empty or t["output_rel_error"].isna().any():
        raise AnnsLabError(f"{folders}: no Q→K rows of {names} with output error (a --quick sweep has none)")
    dim = t["dump"].map({p: open_dump(p).head_dim for p in t["dump"].unique()})
    return pd.DataFrame({"layer": t["layer"], "head": t["head"], "index": t["index"], "params": t["search_params"],
                         "n_keys": t["n_keys"], "full_scan_bytes": t["n_keys"] * 4 * dim, "bytes_read": t["bytes_read"],
                         "scanned": t["scanned_fraction"], "mass": t["mass_recovered"],
                         "output_rel_error": t["output_rel_error"], "build_s": t["build_s"]}).reset_index(drop=True)


def within_budgets(points: pd.DataFrame, budgets=BUDGETS) -> pd.DataFrame:
    """Per (layer, head, index, budget): the least output error at an expected byte read of at most budget × one full
    key scan (:func:`metrics.within_budget`: between the two frontier points around the budget; inf if none)."""
    frac = points["bytes_read"] / points["full_scan_bytes"]
    out = []
    for (layer, head, index), g in points.assign(fraction=frac).groupby(["layer", "head", "index"]):
        for b in budgets:
            best = -within_budget(-g["output_rel_error"].to_numpy(), g["fraction"].to_numpy(), b * (1 + 1e-9))
            # none within the budget: inf, so the median over heads counts that head as worse than any it can serve
            out.append({"layer": layer, "head": head, "index": index, "budget": b,
                        "error": best if np.isfinite(best) else np.inf})
    return pd.DataFrame(out)


def markdown(best: pd.DataFrame, what: str = "median") -> list[str]:
    """One row per index, one column per budget: the median over heads (– = not reached by half the heads)."""
    med = best.groupby(["index", "budget"])["error"].median().unstack("budget")
    lines = ["| index | " + " | ".join(f"≤ {b:g}× scan" for b in med.columns) + " |", "|---|" + "---|" * len(med.columns)]
    for index, row in med.iterrows():
        lines.append(f"| {index} | " + " | ".join("–" if not np.isfinite(v) else f"{v:.4f}" for v in row) + " |")
    return lines


def per_head_markdown(best: pd.DataFrame, exact: str = "flat") -> list[str]:
    """Markdown, one row per head: the exact top-k's error, each top-k index's least error within 0.1× of a scan,
    each estimator's within 0.25× / 0.5×, and the estimators' best over the exact top-k's error at 0.25×."""
    cell = lambda v: "–" if not np.isfinite(v) else f"{v:.4f}"  # noqa: E731
    err = best.set_index(["layer", "head", "index", "budget"])["error"].to_dict()
    names = sorted(best["index"].unique())
    est = [n for n in names if registry.get(n).estimates]
    topk = [n for n in names if n != exact and n not in est]
    lines = [f"| layer, head | {exact} (top-k error) | " + " | ".join(f"{n} ≤ 0.1×" for n in topk) + " | "
             + " | ".join(f"{n} ≤ 0.25× / 0.5×" for n in est) + " | best estimator ≤ 0.25× / top-k error |",
             "|---|---|" + "---|" * (len(topk) + len(est) + 1)]
    for (layer, head), _ in best.groupby(["layer", "head"], sort=True):
        e = lambda n, b: err.get((layer, head, n, b), np.nan)  # noqa: E731  (NaN: not swept on this head)
        ref = e(exact, 1.0)
        cells = [cell(e(n, 0.1)) for n in topk]
        cells += [f"{cell(e(n, 0.25))} / {cell(e(n, 0.5))}" for n in est]
        low = min((e(n, 0.25) for n in est), default=np.nan)
        lines.append(f"| {layer}, {head} | {ref:.4f} | " + " | ".join(cells) + f" | {low / ref:.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump")
    ap.add_argument("--layers")
    ap.add_argument("--heads")
    ap.add_argument("--results", nargs="+", help="sweep folders to read the points from instead of measuring")
    ap.add_argument("--indexes", default=INDEXES)
    ap.add_argument("--csv")
    args = ap.parse_args()
    names = args.indexes.split(",")
    if args.results:
        points = from_sweep(args.results, names)
    elif args.dump and args.layers and args.heads:
        dump = open_dump(args.dump)
        rows = []
        for layer in map(int, args.layers.split(",")):
            for head in map(int, args.heads.split(",")):
                rows += measure(dump, layer, head, names)
                print(f"layer {layer} head {head} done", flush=True)
        points = pd.DataFrame(rows)
    else:
        ap.error("give --results, or --dump with --layers and --heads")
    if args.csv:
        points.to_csv(args.csv, index=False)
    best = within_budgets(points)
    print(f"\nleast output rel. error within bytes read per query (× one full key scan), median over "
          f"{best.groupby(['layer', 'head']).ngroups} heads:")
    print("\n".join(markdown(best)))
    print("\nper head, the least error within 0.1× (top-k indexes) and 0.25× / 0.5× (estimators) of a full scan:")
    print("\n".join(per_head_markdown(best)))


if __name__ == "__main__":
    main()
