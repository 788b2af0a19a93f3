"""Indexes' ``add()`` as the decoder calls it: batches of new keys into an index built on the rest.

    .venv/bin/python benchmarks/bench_add.py --dump dumps/smollm2-text-8192 --heads 2/0,15/0,28/5 \\
        [--index roargraph] [--batch 64] [--adds 8] [--variant descent_links=0 ...]
    .venv/bin/python benchmarks/bench_add.py --dump dumps/gemma3-270m-text-32768 --heads 5/0 \\
        --index sparq,double-sparsity,loki,hnsw,quest,shadowkv

Per head, index and build variant (the defaults, then each ``--variant NAME=VALUE[,NAME=VALUE]``, for one index):
the index is built on all but the last ``adds × batch`` index keys, held in a key store as the decoder's layer store
holds them (an index reads its rows there; the prefill queries as training queries; numba on one thread, as the
decoder's add runs on the calling thread), then each batch is appended to the store and added, as the decoder does.
Prints the median CPU and wall ms per add, the index's own bytes per key after the last add (its ``nbytes`` less
the store's rows it reads: what the decoder's CPU B/key adds per query head), and recall@100 of the head's test
queries at the index's default search (the layer's softmax scale where one is read; exact reference, numpy; nan
for an estimator, whose ids are its exact part only). Indexes and variants run back to back on the same
head, so their ratios hold under load.
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


def own_bytes(index, store) -> int:
    """The index's bytes beyond the store's rows it reads (as the decoder's ``cpu_bytes`` counts an index)."""
    shared = sum(a.nbytes for a in index.held_arrays() if np.may_share_memory(a, store.buf))
    return int(index.nbytes) - shared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", default="dumps/smollm2-text-8192")
    ap.add_argument("--heads", default="2/0,15/0,28/5", help="LAYER/HEAD list")
    ap.add_argument("--index", default="roargraph", help="index names, comma-separated")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adds", type=int, default=8)
    ap.add_argument("--variant", action="append", default=[],
                    help="build parameters NAME=VALUE[,NAME=VALUE] (repeatable; one --index only)")
    a = ap.parse_args()

    from anns_lab.dumps.store import open_dump
    from anns_lab.eval.heads import load_head
    from anns_lab.eval.metrics import exact_scores, recall_at_k
    from anns_lab.indexes import registry
    from anns_lab.indexes.key_store import KeyStore

    names = a.index.split(",")
    if a.variant and len(names) > 1:
        ap.error("--variant takes one --index")
    numba.set_num_threads(1)
    dump = open_dump(a.dump)
    variants = [("defaults", {})] + [(v, parse_variant(v)) for v in a.variant]
    print(f"machine: {platform.machine()}, {numba.config.NUMBA_NUM_THREADS} cores; {a.dump}; "
          f"{a.adds} adds of {a.batch} keys; numba 1 thread")
    print("| head | index | variant | keys after | add CPU ms | add wall ms | own B/key | recall@100 |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in a.heads.split(","):
        layer, head = (int(x) for x in spec.split("/"))
        h = load_head(dump, layer, head, keep_own=True)
        n0 = len(h.keys) - a.adds * a.batch
        scores = exact_scores(h.test_queries, h.keys)
        for name in names:
            cls = registry.get(name)
            train = {}
            if cls.uses_train_queries:
                positions = {k: (v[:n0] if k == "key_positions" else v) for k, v in h.positions_for(cls).items()}
                train = {"train_queries": h.train_queries_for(cls), **positions}
            for label, params in variants:
                def built():
                    store = KeyStore(h.keys[None, :n0].copy())
                    return store, cls(**params).build(store.head(0), **train)

                store, index = built()
                if index.supports_add:  # compile outside the timing
                    store.append(h.keys[None, n0:n0 + 1])
                    index.add(h.keys[n0:n0 + 1])
                    store, index = built()
                cpu, wall = [], []
                for s in range(n0, len(h.keys), a.batch):
                    if not index.supports_add:
                        break
                    new = h.keys[s: s + a.batch]
                    store.append(new[None])
                    c0, w0 = time.process_time(), time.perf_counter()
                    index.add(new)
                    cpu.append(time.process_time() - c0)
                    wall.append(time.perf_counter() - w0)
                if not cpu:
                    print(f"| {spec} | {name} | {label} | {index.n_keys} | (no add) | | | |", flush=True)
                    continue
                res = index.search(h.test_queries, 100, **cls.scaled({}, h.scaling))  # vattention: the layer's scale
                # an estimator's ids are its exact part only: its recall says nothing of its output (docs/estimators.md)
                rec = float("nan") if cls.estimates else recall_at_k(res.ids, scores, 100).mean()
                per_key = own_bytes(index, store) / index.n_keys
                print(f"| {spec} | {name} | {label} | {index.n_keys} | {1e3 * np.median(cpu):.1f} | "
                      f"{1e3 * np.median(wall):.1f} | {per_key:,.0f} | {rec:.3f} |", flush=True)


if __name__ == "__main__":
    main()
