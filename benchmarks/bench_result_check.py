"""Cost of the decoder's per-step protocol check (``indexes.protocol``) against the CPU side it guards.

    .venv/bin/python benchmarks/bench_result_check.py --dump dumps/smollm2-text-8192 --layer 15 --modes flat,roargraph

Builds one :class:`LayerStore` per mode on the dump's prefill keys outside the static window (128 + 512),
as the decoder does, then for each decode-phase query calls ``side()`` (search + protocol check +
attention) and, on that step's result, the per-step check alone (ids and counts, vectorised), alternating,
best of ``--repeat`` each; medians over queries. Both columns come from one run, so their
ratio holds on a loaded machine. ``full check ms`` times the check a first search after a build or insert gets
(every rule, scores recomputed against the keys, head by head). Threads as in the decoder's CPU worker: numba and faiss on one thread.
"""

from __future__ import annotations

import argparse
import platform
import statistics

import numpy as np
from bench_search_latency import best_of




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", default="dumps/smollm2-text-8192")
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--modes", default="flat,roargraph")
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    import faiss
    import numba

    from anns_lab import open_dump
    from anns_lab.decode.placement import IndexPlan, LayerStore
    from anns_lab.indexes import protocol

    faiss.omp_set_num_threads(1)
    numba.set_num_threads(1)
    dump = open_dump(args.dump)
    n = int(dump.manifest["n_tokens"]["prefill"])
    lo, hi = 128, n - 512
    g, h = dump.n_kv_heads, dump.n_heads
    keys = np.stack([dump.keys(args.layer, j, "prefill")[lo:hi] for j in range(g)])
    values = np.stack([dump.values(args.layer, j, "prefill")[lo:hi] for j in range(g)])
    train = np.stack([dump.queries(args.layer, j, "prefill")[::8] for j in range(h)])
    steps = np.stack([dump.queries(args.layer, j, "decode") for j in range(h)], axis=1)  # (steps, H, d)
    scale = dump.scaling(args.layer)
    print(f"machine: {platform.processor() or platform.machine()}, {dump.path.name} layer {args.layer}, "
          f"{hi - lo} keys per KV head, {h} heads, top-{args.topk}, {len(steps)} steps")
    print(f"{'mode':12s} {'side() µs':>10s} {'check µs':>9s} {'check/side':>10s} {'full check ms':>14s}")
    for mode in args.modes.split(","):
        store = LayerStore(args.layer, h, keys, values, args.topk, IndexPlan(mode), add_batch=1 << 30)
        store.build(train)
        store.side(steps[0], scale)  # the first call compiles the kernels and runs the full check
        side_t, check_t = [], []
        k = min(args.topk, store.n_indexed)
        for q in steps:
            side_t.append(best_of(lambda: store.side(q, scale), args.repeat))
            res = type(store.indexes[0]).search_group(store.indexes, q, k, **store.plan.search_params)
            check_t.append(best_of(lambda: protocol.check_result(mode, res, h, k, store.n_indexed, store._bound,
                                                                  check_scores=False), args.repeat))
        def full_check():
            store._bound = None
            store._check(res, steps[-1], k)

        full = best_of(full_check, args.repeat)
        s, c = statistics.median(side_t) * 1e6, statistics.median(check_t) * 1e6
        print(f"{mode:12s} {s:10.1f} {c:9.1f} {c / s:10.3f} {full * 1e3:14.2f}")


if __name__ == "__main__":
    main()
