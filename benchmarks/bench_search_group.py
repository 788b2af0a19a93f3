"""Cost of the decoder's index hook: ``RoarGraphIndex.search_group`` against a held ``GraphGroup``, CPU µs per call.

    .venv/bin/python benchmarks/bench_search_group.py --dump dumps/smollm2-text-8192 --layer 15

The decoder searches a layer's 9 per-head roargraphs through the protocol's ``search_group`` (which finds
the cached group of those indexes itself); before, its layer store held the ``GraphGroup`` and called
its kernel directly. Both are timed here, interleaved, on the dump's decode queries, in thread CPU time
(unaffected by other jobs on a shared machine): at k = 1, L = 1 (the kernel does almost nothing, so the
difference is the hook's own cost) and at the decoder's k = 100, L = 100.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", default="dumps/smollm2-text-8192")
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()

    import numba

    from anns_lab.decode.builds import subsample
    from anns_lab.dumps.store import open_dump
    from anns_lab.indexes.graph.multi import GraphGroup
    from anns_lab.indexes.key_store import KeyStore
    from anns_lab.indexes.roargraph import RoarGraphIndex

    numba.set_num_threads(1)
    d = open_dump(a.dump)
    n, H, G = int(d.manifest["n_tokens"]["prefill"]), d.n_heads, d.n_kv_heads
    store = KeyStore(np.stack([d.keys(a.layer, g, "prefill")[128: n - 512] for g in range(G)]))
    indexes = [RoarGraphIndex().build(store.head(h // (H // G)), subsample(d.queries(a.layer, h, "prefill")[None], 1024)[0])
               for h in range(H)]
    queries = [np.ascontiguousarray(q) for q in np.stack([d.queries(a.layer, h, "decode") for h in range(H)], 1)]
    group = GraphGroup(indexes)
    for k, L in ((1, 1), (100, 100)):
        calls = {"search_group": lambda q: RoarGraphIndex.search_group(indexes, q, k, L=L),
                 "held GraphGroup": lambda q: group.search(q, k, L)}  # both: the index's default row stop
        times = {name: [] for name in calls}
        for _ in range(a.rounds):
            for name, fn in calls.items():
                t0 = time.thread_time_ns()
                for q in queries:
                    fn(q)
                times[name].append((time.thread_time_ns() - t0) / len(queries) / 1e3)
        print(f"layer {a.layer}, {H} heads, {store.n} keys, k={k}, L={L}: " + ", ".join(
            f"{name} {np.median(v):.1f} µs CPU" for name, v in times.items()))


if __name__ == "__main__":
    main()
