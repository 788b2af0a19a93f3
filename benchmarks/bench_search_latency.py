"""Batch-1 search latency of roargraph at each head's recall-0.95 operating point (issue 4's ≤ 50 µs goal).

    .venv/bin/python benchmarks/bench_search_latency.py --dump dumps/smollm2-text-8192 --heads 2/0,15/4,15/5,28/0,28/5

Per head: build with the defaults (numba on 1 thread); for the default search (the row stop) and for
full rows (``row_misses=0``), pick the smallest L of the index's grid whose recall@100 on the head's
test queries reaches the target, then time one query at a time
through ``Index.search`` (the protocol: checks, the per-thread workspace and wrapping) and through
the bare kernel (``graph.search.search_one`` on a workspace and output arrays allocated once per
head), alternating per query, best of ``--repeat`` per query, median over queries. The two columns
come from the same run, so their ratio holds under load.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import time

import numba
import numpy as np


def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default="dumps/smollm2-text-8192")
    ap.add_argument("--heads", default="2/0,15/4,15/5,28/0,28/5", help="LAYER/HEAD list")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()

    from anns_lab.dumps.store import open_dump
    from anns_lab.eval.heads import load_head
    from anns_lab.eval.metrics import exact_scores, recall_at_k
    from anns_lab.indexes.graph.search import search_one
    from anns_lab.indexes.graph.utils import workspace
    from anns_lab.indexes import registry

    numba.set_num_threads(1)
    dump = open_dump(a.dump)
    cls = registry.get("roargraph")
    defaults = {name: p.default for name, p in cls.search_params.items()}
    variants = {"row stop": {}, "full rows": {"row_misses": 0}}  # the default search, and every row in full
    rows = []
    for spec in a.heads.split(","):
        layer, head = (int(x) for x in spec.split("/"))
        h = load_head(dump, layer, head)
        index = cls().build(h.keys, h.train_queries)
        scores = exact_scores(h.test_queries, h.keys)
        g = tuple(index.graph_arrays())  # a plain tuple: numba dispatches it in C
        entries = index.entries()
        for name, extra in variants.items():
            for L in cls.search_grid["L"]:
                res = index.search(h.test_queries, a.k, L=L, **extra)
                if recall_at_k(res.ids, scores, a.k).mean() >= a.target:
                    break
            p = {**defaults, **extra, "L": L}
            stop = (p["row_misses"], p["row_credit"], index.n_built)
            ws = workspace(len(g[0]), L, a.k)  # the kernel's workspace: epoch-stamped, reused
            epoch = itertools.count(1)
            out_ids, out_scores = np.empty(a.k, np.int64), np.empty(a.k, np.float32)
            proto, kernel = [], []
            for q in h.test_queries:
                q1 = np.ascontiguousarray(q[None])
                index.search(q1, a.k, L=L, **extra)  # warm
                proto.append(best_of(lambda: index.search(q1, a.k, L=L, **extra), a.repeat))
                kernel.append(best_of(lambda: search_one(g, q1[0], entries, L, ws, next(epoch), out_ids, out_scores, stop),
                                      a.repeat))
            scanned = float(np.mean(res.n_scanned))
            rows.append((spec, name, L, scanned, 1e6 * np.median(proto), 1e6 * np.median(kernel)))
            print(f"{spec} {name}: L={L} scanned {scanned:.0f} of {len(h.keys)}  Index.search {rows[-1][4]:.1f} µs  "
                  f"kernel {rows[-1][5]:.1f} µs", flush=True)
    for name in variants:
        sel = [r for r in rows if r[1] == name]
        p = np.median([r[4] for r in sel])
        k = np.median([r[5] for r in sel])
        print(f"\n{a.dump}, {name}, {len(sel)} heads, recall@{a.k} ≥ {a.target}, 1 thread ({platform.machine()}): "
              f"median scanned {np.median([r[3] for r in sel]):.0f}, Index.search {p:.1f} µs, kernel {k:.1f} µs, "
              f"protocol overhead {p - k:.1f} µs ({p / k:.2f}x)")

if __name__ == "__main__":
    main()
