"""Roargraph build cost against scanned fraction, old build vs new, in one run on real dump heads (issue 13).

    .venv/bin/python benchmarks/bench_build_scale.py --dump /work/dumps/gemma3-270m-text-32768
    .venv/bin/python benchmarks/bench_build_scale.py --dump /work/dumps/smollm2-text-8192 --layers 2,15,28
    .venv/bin/python benchmarks/bench_build_scale.py --synthetic 131072 --dump /work/dumps/gemma3-270m-text-32768

Per head (window 128 + 512 excluded, decode queries as test queries, as the sweep): each variant's build CPU
seconds (one thread: numba, faiss and torch pinned to 1) and its fraction of keys scanned at recall@100 = 0.95
(interpolated over roargraph's search grid). Variants are ``;``-separated: build parameters ``NAME=VALUE``,
module constants ``rg.NAME=VALUE`` and the training queries ``group=head|group|strided|unlisted`` (the head's own, or its
GQA group's: ``anns_lab.indexes.group_queries``; one graph then serves the group; ``unlisted``: the head's own, with the
group's other heads' newest for the keys its lists leave out) joined by ``,``; the default pair is **old** (every training list
exact, the stranded-key pool of 8192: the build before issue 13) and **new** (the defaults). Prints the
per-head rows, the medians and the same-run ratios new/old.

``--pieces``: also split each build's CPU seconds into its parts (exact anchor lists, re-rank between anchors,
key occurrences, projection, reverse edges, min_cooc's filter, descent links, hubs, stranded keys, reachability, the
rows' co-occurrence order, the kept lists).

``--synthetic N``: time the build (no recall) at N keys and N training queries of the dump's dimension, made
by tiling a real head's keys and prefill queries N / n times with a 5% perturbation (a stand-in for a
128K-token dump: the structure of real attention, repeated).
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
import time

import faiss
import numba
import numpy as np
import pandas as pd
import torch

import anns_lab
from anns_lab.dumps import rope
from anns_lab.eval.heads import default_layers, load_head
from anns_lab.indexes import roargraph as rg
from anns_lab.indexes import train_lists as tl
from anns_lab.indexes.graph import roar
from anns_lab.indexes.roargraph import RoarGraphIndex
from anns_lab.eval.metrics import exact_scores, recall_at_k
from bench_query_aware import at_target

VARIANTS = "old:list_stride=1,coarse_bf16=0,rg.STRANDED_POOL=8192,rg.STRANDED_SHARE=1,rg.FAR_POOL=0;new:"
CONSTANTS = ("STRANDED_POOL", "STRANDED_SHARE", "STRANDED_MIN", "STRANDED_MARGIN", "FAR_POOL", "LIST_SPAN", "KEYS_PER_ANCHOR", "MIN_TRAIN",
             "MAX_STRIDE")


def parse(variant: str) -> tuple[str, dict, dict]:
    name, _, spec = variant.partition(":")
    params, consts = {}, {}
    for item in filter(None, spec.split(",")):
        k, v = item.split("=")
        if k == "group":
            consts[k] = v
            continue
        (consts if k.startswith("rg.") else params)[k.removeprefix("rg.")] = int(v) if v.lstrip("-").isdigit() else float(v)
    return name, params, consts


PIECES = collections.defaultdict(float)  # CPU seconds per part of the builds timed since the last clear
TIMED = [(tl, "topk_ip_fast", "anchors"), (tl, "_rerank_gaps", "rerank"), (roar, "bipartite", "occurrences"),
         (roar, "project_rows", "projection"), (rg, "add_reverse_edges", "reverse"), (roar, "drop_rare_edges", "min_cooc"),
         (roar, "link_descent", "descent"),
         (rg, "query_hubs", "hubs"), (rg, "link_stranded", "stranded"), (rg, "link_unreachable", "reachability"),
         (roar, "order_rows_by_cooc", "row order"),
         (RoarGraphIndex, "_cache_lists", "kept lists")]


_PIECES_LOCK = threading.Lock()


def time_pieces(parts=TIMED) -> None:
    """Wrap the build's ``parts`` (module attributes the build looks up at call time) with CPU timers into PIECES: the
    calling thread's CPU seconds (builds may run side by side, each on one thread: ``indexes.threads``)."""
    for owner, attr, label in parts:
        def timed(*args, _f=getattr(owner, attr), _label=label, **kwargs):
            t = time.thread_time()
            try:
                return _f(*args, **kwargs)
            finally:
                with _PIECES_LOCK:
                    PIECES[_label] += time.thread_time() - t
        setattr(owner, attr, timed)


def scan_at(pts, target):
    """Scanned fraction at ``target`` recall, interpolated as ``bench_query_aware`` does (NaN if never reached)."""
    return at_target(pd.DataFrame(pts, columns=["scanned_fraction", "recall"]).assign(latency_us=np.nan), target)[0]


def build(keys, queries, params, consts, group=None):
    saved = {k: getattr(rg, k) for k in CONSTANTS}
    try:
        for k, v in consts.items():
            if k == "group":
                continue
            setattr(rg, k, v)
        # The calling thread's CPU (every library pinned to one thread runs there), as the parts count it: the process's
        # would add the ~0.1 s that numpy's OpenBLAS threads spin after the truth's product (to the first variant of each
        # head: session 34 found it; ratios against a first variant measured before then carry it)
        t = time.thread_time()
        index = RoarGraphIndex(**params).build(keys, queries, group_queries=group)
        return index, time.thread_time() - t
    finally:
        for k, v in saved.items():
            setattr(rg, k, v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--layers", default=None, help="default: three spread over the dump's layers")
    ap.add_argument("--heads", default=None, help="query heads (default all)")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--synthetic", type=int, default=0, help="time builds at this many keys (tiled real heads)")
    ap.add_argument("--train-positions", default=rope.DEFAULT, choices=rope.PLACES, help=rope.HELP)
    ap.add_argument("--pieces", action="store_true", help="split each build's CPU seconds into its parts")
    a = ap.parse_args()
    if a.pieces:
        time_pieces()
    numba.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    torch.set_num_threads(1)  # coarse_bf16's product
    dump = anns_lab.open_dump(a.dump)
    layers = [int(x) for x in a.layers.split(",")] if a.layers else default_layers(dump.layers)
    heads = [int(x) for x in a.heads.split(",")] if a.heads else list(range(dump.n_heads))
    variants = [parse(v) for v in a.variants.split(";")]
    if a.synthetic and any(v[2].get("group", "head") != "head" for v in variants):
        raise SystemExit("--synthetic tiles one head's queries: group= variants are not supported with it")
    RoarGraphIndex(list_stride=4).build(*[np.random.default_rng(0).standard_normal((s, dump.head_dim), dtype=np.float32)
                                          for s in (3000, 800)])  # compile outside the timings
    print(f"{a.dump}: layers {layers}, heads {heads}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          "build = CPU s on one thread", flush=True)
    rows = []
    for layer in layers:
        for head in heads:
            hd = load_head(dump, layer, head, train_positions=a.train_positions)
            keys, queries = hd.keys, hd.train_queries
            grouped = {v[2]["group"]: load_head(dump, layer, head, train_group=v[2]["group"], train_positions=a.train_positions)
                       for v in variants if v[2].get("group", "head") != "head"}
            if a.synthetic:
                rng = np.random.default_rng(layer * 100 + head)
                reps = -(-a.synthetic // len(keys))
                tile = lambda x, n: np.ascontiguousarray(np.concatenate(  # noqa: E731
                    [x + 0.05 * x.std(0) * rng.standard_normal(x.shape, dtype=np.float32) for _ in range(reps)])[:n])
                keys, queries = tile(keys, a.synthetic), tile(queries, a.synthetic)
            truth = None if a.synthetic else exact_scores(hd.test_queries, keys)
            row = {"head": f"{layer}/{head}"}
            for name, params, consts in variants:
                PIECES.clear()
                given = grouped.get(consts.get("group"))
                index, secs = (build(keys, queries, params, consts) if given is None else
                               build(keys, given.train_queries, params, consts, given.group_queries))
                row[f"{name} build s"] = secs
                if a.pieces:
                    print(f"  {layer}/{head} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in PIECES.items())
                          + f", rest {secs - sum(PIECES.values()):.3f}", flush=True)
                if truth is not None:
                    pts = []
                    for g in index.grid():
                        r = index.search(hd.test_queries, 100, **g)
                        rec = float(recall_at_k(r.ids, truth, 100).mean())  # ties at the 100th score count, as in the sweep
                        pts.append((r.n_scanned.mean() / len(keys), rec))
                    row[f"{name} scanned %"] = 100 * scan_at(pts, a.target)
            rows.append(row)
            print("  ".join(f"{k} {v:.3f}" if "scanned" in k else f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in row.items()), flush=True)
    cols = [c for c in rows[0] if c != "head"]
    print(f"\nmedian over {len(rows)} heads (n = {len(keys)} keys, m = {len(queries)} training queries):")
    for c in cols:
        print(f"  {c}: {np.nanmedian([r[c] for r in rows]):.3f}")
    names = [v[0] for v in variants]
    for other in names[1:]:
        for what in ("build s", "scanned %"):
            a_, b_ = f"{names[0]} {what}", f"{other} {what}"
            if a_ in rows[0]:
                print(f"  median per-head ratio {other}/{names[0]} {what}: "
                      f"{np.nanmedian([r[b_] / r[a_] for r in rows]):.3f}")


if __name__ == "__main__":
    main()
