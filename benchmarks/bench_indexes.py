"""Benchmark every registered index on one SmolLM2 8K head: build time, batch-1 latency, batched throughput.

    anns-lab dump --model smollm2 --tokens 8128 --decode-tokens 64 --layers 15 --out dumps/smollm2-text-8192-l15
    python benchmarks/bench_indexes.py [--dump dumps/smollm2-text-8192-l15] [--layer 15] [--head 0]

The head as a sweep's part sees it (``eval.heads.load_head`` at the default window): the index keys outside the
static window, less the held-out K→K keys; an attention-aware index also gets its training queries (and an index
that reads positions, theirs and the keys'), as the sweep builds it. Latency: the Q→K test queries (the decode steps')
one at a time, one thread (faiss and numba), median over queries and repeats. Throughput: the last ``--batch``
prefill queries in one call, all cores. Every index runs at its default search parameters; recall@100 and fraction
scanned are for the test queries. Flat is the in-run baseline: ``x flat`` columns are flat's time divided by the
index's (higher is faster).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import faiss
import numba
import numpy as np

from anns_lab import indexes, open_dump
from anns_lab.eval.heads import load_head
from anns_lab.eval.metrics import recall_at_k

K = 100


def set_threads(n: int) -> None:
    """Pin both thread pools the indexes use (faiss's OpenMP, numba's)."""
    faiss.omp_set_num_threads(n)
    numba.set_num_threads(n)


def build(cls, data) -> object:
    """``cls`` at its defaults, built on the head as the sweep builds it (``eval.sweep``'s part)."""
    index = cls()
    group = data.group_queries if index.accepts_group_queries else None
    return index.build(data.keys, data.train_queries_for(cls) if index.uses_train_queries else None,
                       group_queries=group, **data.positions_for(cls))


def bench(name: str, data, batch_q: np.ndarray, repeats: int) -> dict:
    cls = indexes.get(name)
    decode_q = data.test_queries
    search = cls.scaled({}, data.scaling)  # the defaults, with the layer's softmax scale where one is read (vattention)
    build(cls, data).search(decode_q[:2], 10, **search)  # warm-up: JIT caches, imports
    t0 = time.perf_counter()
    index = build(cls, data)
    build_s = time.perf_counter() - t0
    res = index.search(decode_q, K, **search)
    out = {
        "name": name,
        "build_s": build_s,
        "nbytes": index.nbytes,
        "params": {n: p.default for n, p in cls.search_params.items()} | search,  # the layer's scale, where read
        # an estimator's ids are its exact part only: its recall says nothing of its output (docs/estimators.md)
        "recall": float("nan") if cls.estimates else float(recall_at_k(res.ids, data.exact("q2k"), K).mean()),
        "scanned": float(res.n_scanned.mean()) / len(data.keys),
    }
    set_threads(1)
    lat = []
    for _ in range(repeats):
        for q in decode_q:
            t0 = time.perf_counter()
            index.search(q[None], K, **search)
            lat.append(time.perf_counter() - t0)
    out["latency_ms"] = 1e3 * float(np.median(lat))
    set_threads(os.cpu_count() or 1)
    index.search(batch_q[:8], K, **search)
    t0 = time.perf_counter()
    for _ in range(repeats):
        index.search(batch_q, K, **search)
    out["qps"] = repeats * len(batch_q) / (time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", default="dumps/smollm2-text-8192-l15")
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--head", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--index", action="append", help="only these indexes (default: every registered one)")
    args = ap.parse_args()
    if not (Path(args.dump) / "manifest.json").is_file():
        print(f"No finished dump at {args.dump}. Make it first:\n"
              "  anns-lab dump --model smollm2 --tokens 8128 --decode-tokens 64 --layers 15 "
              f"--out {args.dump}", file=sys.stderr)
        return 2
    d = open_dump(args.dump)
    data = load_head(d, args.layer, args.head, keep_own=True)
    keys, decode_q = data.keys, data.test_queries
    batch_q = np.ascontiguousarray(d.queries(args.layer, args.head, phase="prefill")[-args.batch :], dtype=np.float32)
    names = args.index or ["flat"] + sorted(n for n in indexes.available() if n != "flat")
    broken = indexes.broken()
    print(f"# {args.dump}: layer {args.layer}, head {args.head} (KV head {d.kv_head_of(args.head)}), "
          f"{len(keys)} index keys, {len(decode_q)} test queries, batch {len(batch_q)}, k={K}")
    print(f"# machine: {platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.platform()}; "
          f"faiss {faiss.__version__}, numba {numba.__version__}, numpy {np.__version__}")
    if broken:
        print(f"# not loadable, skipped: {', '.join(broken)}")
    rows = [bench(n, data, batch_q, args.repeats) for n in names]
    base = next((r for r in rows if r["name"] == "flat"), None)
    print("\n| index | default search params | build s | MiB | recall@100 | scanned | batch-1 latency ms | x flat | batched q/s | x flat |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        lat_x = base["latency_ms"] / r["latency_ms"] if base else float("nan")
        qps_x = r["qps"] / base["qps"] if base else float("nan")
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items()) or "-"
        recall = "estimator" if np.isnan(r["recall"]) else f"{r['recall']:.3f}"
        print(f"| {r['name']} | {params} | {r['build_s']:.2f} | {r['nbytes'] / 2**20:.1f} | {recall} | "
              f"{100 * r['scanned']:.1f}% | {r['latency_ms']:.3f} | {lat_x:.2f} | {r['qps']:.0f} | {qps_x:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
