"""roargraph ``add()`` as the decoder calls it: batches of new keys into an index built on the rest.

    .venv/bin/python benchmarks/bench_add.py --dump dumps/smollm2-text-8192 --heads 2/0,15/0,28/5 \\
        [--batch 64] [--adds 8] [--variant descent_links=0 ...]

Per head and build variant (the defaults, then each ``--variant NAME=VALUE[,NAME=VALUE]``): build on all
but the last ``adds × batch`` index keys (the prefill queries as training queries, numba on one thread,
as the decoder's add runs on the calling thread), then add them ``batch`` at a time; prints the median
CPU and wall ms per add, and recall@100 of the head's test queries at L = 100 after the last add
(exact reference, numpy). Variants run back to back on the same head, so their ratio holds under load.
"""

from __future__ import annotations

import argparse
import platform
import time

import numba
import numpy as np


def parse_variant(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        name, value = item.split("=")
        out[name] = float(value) if "." in value else int(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", default="dumps/smollm2-text-8192")
    ap.add_argument("--heads", default="2/0,15/0,28/5", help="LAYER/HEAD list")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adds", type=int, default=8)
    ap.add_argument("--variant", action="append", default=[], help="build parameters NAME=VALUE[,NAME=VALUE] (repeatable)")
    a = ap.parse_args()

    from anns_lab.dumps.store import open_dump
    from anns_lab.eval.heads import load_head
    from anns_lab.eval.metrics import exact_scores, recall_at_k
    from anns_lab.indexes.roargraph import RoarGraphIndex

    numba.set_num_threads(1)
    dump = open_dump(a.dump)
    variants = [("defaults", {})] + [(v, parse_variant(v)) for v in a.variant]
    print(f"machine: {platform.machine()}, {numba.config.NUMBA_NUM_THREADS} cores; {a.dump}; "
          f"{a.adds} adds of {a.batch} keys; numba 1 thread")
    print("| head | variant | keys after | add CPU ms | add wall ms | recall@100 at L=100 |")
    print("|---|---|---|---|---|---|")
    for spec in a.heads.split(","):
        layer, head = (int(x) for x in spec.split("/"))
        h = load_head(dump, layer, head)
        n0 = len(h.keys) - a.adds * a.batch
        scores = exact_scores(h.test_queries, h.keys)
        for label, params in variants:
            index = RoarGraphIndex(**params).build(h.keys[:n0], h.train_queries)
            index.add(h.keys[n0: n0 + 1])  # compile outside the timing
            index = RoarGraphIndex(**params).build(h.keys[:n0], h.train_queries)
            cpu, wall = [], []
            for s in range(n0, len(h.keys), a.batch):
                c0, w0 = time.process_time(), time.perf_counter()
                index.add(h.keys[s: s + a.batch])
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
            rec = recall_at_k(index.search(h.test_queries, 100, L=100).ids, scores, 100).mean()
            print(f"| {spec} | {label} | {index.n_keys} | {1e3 * np.median(cpu):.1f} | {1e3 * np.median(wall):.1f} | {rec:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
