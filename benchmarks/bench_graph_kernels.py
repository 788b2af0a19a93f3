"""Old commit vs new of the graph kernels in one run: build time per head and batch-1 search latency.

    .venv/bin/python benchmarks/bench_graph_kernels.py --old /tmp/kernels-old --new . \
        --dump /work/dumps/smollm2-text-8192 --heads 2/0,15/4,28/0 --rounds 2

Each (round, head, tree) runs in a fresh process of that tree's ``.venv`` (the trees alternate, the
order flipping every round, so load drifts hit both alike). Per head: build each graph index with its
defaults (wall and process CPU seconds, all threads), then roargraph's batch-1 latency through
``Index.search`` at ``L`` (best of 3 per query, median over the head's test queries) and its mean
``n_scanned`` (which must agree between the trees). Prints one table with new/old ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

INDEXES = ("vamana", "robust-vamana", "roargraph", "hnsw")


def worker(dump: str, spec: str, L: int, k: int) -> dict:
    """One head in this process's tree: build seconds (wall, CPU) per index, roargraph's batch-1 latency."""
    from anns_lab.dumps.store import open_dump
    from anns_lab.eval.heads import load_head
    from anns_lab.indexes import registry

    layer, head = (int(x) for x in spec.split("/"))
    h = load_head(open_dump(dump), layer, head)
    out = {}
    for name in INDEXES:
        t0, c0 = time.perf_counter(), time.process_time()
        index = registry.get(name)().build(h.keys, h.train_queries)
        out[name] = (time.perf_counter() - t0, time.process_time() - c0)
        if name == "roargraph":
            lat = []
            for q in h.test_queries:
                q1 = np.ascontiguousarray(q[None])
                index.search(q1, k, L=L)
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    index.search(q1, k, L=L)
                    best = min(best, time.perf_counter() - t)
                lat.append(best)
            out["latency_us"] = 1e6 * float(np.median(lat))
            out["scanned"] = float(index.search(h.test_queries, k, L=L).n_scanned.mean())
    return out


def run(tree: Path, args, spec: str) -> dict:
    cmd = [str(tree / ".venv/bin/python"), str(Path(__file__).resolve()), "--worker", spec, "--dump", args.dump,
           "--L", str(args.L), "--k", str(args.k)]
    env = {**os.environ, "NUMBA_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{tree}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, help="the old commit's worktree (with its .venv)")
    ap.add_argument("--new", type=Path, default=Path("."))
    ap.add_argument("--dump", default="dumps/smollm2-text-8192")
    ap.add_argument("--heads", default="2/0,15/4,28/0", help="LAYER/HEAD list")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--L", type=int, default=100)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--worker", default=None)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.dump, args.worker, args.L, args.k)))
        return
    res = {"old": [], "new": []}
    for r in range(args.rounds):
        for spec in args.heads.split(","):
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                res[side].append(run(getattr(args, side).resolve(), args, spec))
                print(f"round {r} {spec} {side}: {res[side][-1]}", file=sys.stderr, flush=True)
    print("| measure | old | new | new/old |\n|---|---|---|---|")
    for name in INDEXES:
        for i, what in ((0, "wall"), (1, "CPU")):
            o = np.median([x[name][i] for x in res["old"]])
            n = np.median([x[name][i] for x in res["new"]])
            print(f"| {name} build, {what} s (median) | {o:.2f} | {n:.2f} | {n / o:.2f} |")
    o, n = (np.median([x["latency_us"] for x in res[s]]) for s in ("old", "new"))
    print(f"| roargraph batch-1 search, L={args.L}, µs (median) | {o:.1f} | {n:.1f} | {n / o:.2f} |")
    so, sn = ([x["scanned"] for x in res[s]] for s in ("old", "new"))
    print(f"| roargraph n_scanned (mean per head) | {np.mean(so):.1f} | {np.mean(sn):.1f} | "
          f"{'equal' if so == sn else 'DIFFERENT'} |")


if __name__ == "__main__":
    main()
