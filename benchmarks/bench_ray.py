"""The same sweep on the local executor and on Ray, on this machine: Ray's overhead, and a per-part cost.

    python benchmarks/bench_ray.py --dump /work/dumps/smollm2-text-8192 --layers 15 --indexes flat,ivf,roargraph
    python benchmarks/bench_ray.py --dump /work/dumps/gemma3-270m-text-32768 --layers 11 --heads 0,1,2,3 --quick

Runs ``run_sweep`` into fresh folders with ``--executor local --jobs J`` and then with a private Ray
started here with J CPUs (its start-up timed apart), checks that both tables have the same recall and
scanned fraction, and prints wall seconds, the Ray/local ratio, and the cost of one (layer, head)
part in worker-seconds (wall × J / parts of the local run), as Markdown. ``--address`` runs the Ray
leg on an existing cluster instead (a scaling ratio when it has more CPUs than J).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import pandas as pd

from anns_lab.eval.sweep import run_sweep


def _ints(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",")] if text else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", default="dumps/smollm2-text-8192")
    ap.add_argument("--indexes", default="flat,ivf,roargraph")
    ap.add_argument("--layers", default="15")
    ap.add_argument("--heads", default=None, help="comma list [default: all]")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--address", default=None, help="an existing Ray cluster for the Ray leg")
    args = ap.parse_args()
    import ray

    root = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    common = dict(indexes=args.indexes.split(","), layers=_ints(args.layers), heads=_ints(args.heads),
                  jobs=args.jobs, quick=args.quick, progress=False)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    local = run_sweep(args.dump, out=root / "local", **common)
    local_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if args.address:
        ray.init(address=args.address, logging_level="WARNING", log_to_driver=False)
    else:
        ray.init(num_cpus=args.jobs, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    start_s = time.perf_counter() - t0
    cpus = ray.cluster_resources().get("CPU", 0)
    t0 = time.perf_counter()
    remote = run_sweep(args.dump, out=root / "ray", executor="ray", **common)  # joins the connection opened above
    ray_s = time.perf_counter() - t0
    ray.shutdown()
    load1 = os.getloadavg()[0]
    same = ["layer", "head", "index", "build_params", "search_params", "direction", "recall", "scanned_fraction"]
    pd.testing.assert_frame_equal(local.table[same], remote.table[same])
    assert not local.failures and not remote.failures, (local.failures, remote.failures)
    heads = local.table.groupby(["layer", "head"]).ngroups
    per_head = local_s * args.jobs / heads
    print(f"dump {args.dump}: {heads} (layer, head) × {len(common['indexes'])} indexes ({args.indexes}), "
          f"{'quick' if args.quick else 'full'} protocol, {len(local.table)} rows, identical recall and scanned "
          f"fraction on both executors; load average {load0:.1f} → {load1:.1f}\n")
    print("| executor | workers | wall s | ratio to local |")
    print("|---|---:|---:|---:|")
    print(f"| local (processes) | {args.jobs} | {local_s:.1f} | 1.00 |")
    print(f"| Ray, tasks per (layer, head, index) | {cpus:g} CPUs | {ray_s:.1f} | {ray_s / local_s:.2f} |")
    print(f"| Ray start-up (`ray.init`, apart) | | {start_s:.1f} | |")
    print(f"\nper (layer, head): {per_head:.1f} worker-seconds ({args.jobs} × local wall / {heads} heads); "
          f"keys per head {int(local.table['n_keys'].iloc[0])}")
    print(build_split(local.table, per_head))


def build_split(table: pd.DataFrame, per_head: float) -> str:
    """Median build seconds per head of each index, and the rest of a part's cost (searches, ground truth, quality)."""
    builds = table.groupby(["index", "layer", "head"])["build_s"].first().groupby("index").median()
    rest = per_head - float(builds.sum())
    return ("build s per head (median): " + ", ".join(f"{name} {s:.2f}" for name, s in builds.items())
            + f"; rest of the part {rest:.1f} s")


if __name__ == "__main__":
    main()
