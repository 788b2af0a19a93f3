"""HNSW-NGFix* (plugins/ngfix) beside roargraph on real dump heads: where its build goes, and two experiments.

    .venv/bin/python benchmarks/bench_ngfix.py phases  --dump /work/dumps/smollm2-text-8192 --heads 2/0,15/4,28/7
    .venv/bin/python benchmarks/bench_ngfix.py entries --dump /work/dumps/smollm2-text-8192 --heads 15/0,15/3,15/6,2/0,28/4
    .venv/bin/python benchmarks/bench_ngfix.py repairs --dump /work/dumps/smollm2-text-8192 --heads 15/0,15/6,2/3 [--behind]

Heads as the sweep reads them (window 128 + 512 left out, decode queries as test queries, training queries at the
serving positions); scanned fractions at recall@100 ``--target`` interpolated between grid points as
``bench_query_aware.py`` does; one thread (numba and faiss pinned to 1).

- ``phases``: an ngfix build's process CPU seconds split into hnswlib's base graph, the training queries' exact lists
  and the repairs, with the NGFix and RFix edges placed.
- ``entries``: ngfix searched from its one entry point, then from roargraph's (its hubs and recent keys, each
  counted): how much of ngfix's gap to roargraph its entry makes.
- ``repairs``: NGFix's two passes (``--mex`` slots, no RFix) on a built roargraph's own graph, in front of each row
  (``--behind``: after its links, which roargraph's row stop walks in order) against roargraph as built.

The medians and per-head ratios go to stdout as markdown. Results: BENCHMARKS "HNSW-NGFix* as a plugin".
"""

from __future__ import annotations

import argparse
import time

import faiss
import numba
import numpy as np
import pandas as pd

import anns_lab
from anns_lab.eval.heads import load_head
from anns_lab.indexes.graph import Graph
from anns_lab.indexes.graph.search import search_batch
from anns_lab.indexes.hnsw import HNSWIndex
from anns_lab.indexes.roargraph import RoarGraphIndex
from anns_lab.indexes.topk import topk_ip
from anns_lab.testing import recall_at_k
from bench_query_aware import at_target, markdown

import anns_lab_ngfix
from anns_lab_ngfix import NGFixIndex
from anns_lab_ngfix.fixing import RFIX_NQ, fix_graph


def scanned_at(search, data, grid, target: float) -> float:
    """Scanned fraction at ``target`` recall@100 over ``grid``, ``search(params) -> (ids, n_scanned)``."""
    rows = []
    for params in grid:
        ids, scanned = search(params)
        rows.append({"recall": recall_at_k(ids, data.test_queries, data.keys, 100),
                     "scanned_fraction": scanned.mean() / len(data.keys), "latency_us": 0.0})
    return at_target(pd.DataFrame(rows).sort_values("scanned_fraction"), target)[0]


def index_search(index, data):
    def run(params):
        r = index.search(data.test_queries, 100, **params)
        return r.ids, r.n_scanned
    return run


def phases(data, _args) -> dict:
    spent = {"base": 0.0, "lists": 0.0, "repairs": 0.0}

    def timed(name, f):
        def g(*a, **k):
            t = time.process_time()
            try:
                return f(*a, **k)
            finally:
                spent[name] += time.process_time() - t
        return g

    base, lists, repairs = HNSWIndex._build, anns_lab_ngfix.topk_ip, anns_lab_ngfix.fix_graph
    HNSWIndex._build, anns_lab_ngfix.topk_ip, anns_lab_ngfix.fix_graph = (
        timed("base", base), timed("lists", lists), timed("repairs", repairs))
    try:
        t = time.process_time()
        index = NGFixIndex().build(data.keys, data.train_queries)
        total = time.process_time() - t
    finally:
        HNSWIndex._build, anns_lab_ngfix.topk_ip, anns_lab_ngfix.fix_graph = base, lists, repairs
    return {**spent, "total": total, "ngfix_edges": index.n_fixed[0], "rfix_edges": index.n_fixed[1]}


def entries(data, args) -> dict:
    roar = RoarGraphIndex().build(data.keys, data.train_queries)
    ng = NGFixIndex().build(data.keys, data.train_queries)
    q, graph = data.test_queries, Graph(ng._keys, ng.nbrs, ng.degree)
    out = {"roargraph": scanned_at(index_search(roar, data), data, roar.grid(), args.target)}
    for name, e in (("ngfix", [ng.entry]), ("ngfix_from_roargraph_entries", roar.entries().tolist())):
        starts = np.ascontiguousarray(np.broadcast_to(np.array(e, np.int64), (len(q), len(e))))

        def run(params, starts=starts):
            ids, _, scanned, _ = search_batch(graph, q, starts, params["L"], 100, 1)
            return ids, scanned
        out[name] = scanned_at(run, data, ng.grid(), args.target)
    return out


def repairs(data, args) -> dict:
    index = RoarGraphIndex().build(data.keys, data.train_queries)
    out = {"roargraph": scanned_at(index_search(index, data), data, index.grid(), args.target)}
    rows = index.train_rows(len(data.keys), len(data.train_queries))
    queries = np.ascontiguousarray(data.train_queries if rows is None else data.train_queries[rows], np.float32)
    fixes = np.array([100, 10], np.int64)  # ngfix's defaults
    gt = np.ascontiguousarray(topk_ip(queries, data.keys, 200), np.int64)
    n, width = index._nbrs.shape
    nbrs = np.full((n, width + args.mex), -1, np.int32)
    nbrs[:, :width] = index._nbrs
    degree, nfix, eh = index._degree.copy(), np.zeros(n, np.int32), np.zeros((n, args.mex), np.int32)
    ws = (np.zeros(n, np.int32), np.empty(n + RFIX_NQ, np.float32), np.empty(n + RFIX_NQ, np.int64),
          np.empty(0, np.int64), np.empty(0, np.float32))
    placed = fix_graph(index._keys, nbrs, degree, nfix, eh, queries, gt, fixes, int(index.hubs[0]), 0, RFIX_NQ, ws)
    if args.behind:
        for u in np.flatnonzero(nfix):
            row = nbrs[u, :degree[u]].copy()
            nbrs[u, :degree[u]] = np.r_[row[nfix[u]:], row[:nfix[u]]]
    index._hold_graph(nbrs, degree, n)  # rows now MEX wider: the adjacency a copy or pickle of the index carries too
    index.__dict__.pop("_graph", None)  # graph_arrays() rebuilds its view of the new rows
    out["roargraph_repaired"] = scanned_at(index_search(index, data), data, index.grid(), args.target)
    out["ngfix_edges"] = placed[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("phases", "entries", "repairs"))
    ap.add_argument("--dump", default="dumps/smollm2-text-8192")
    ap.add_argument("--heads", required=True, help="LAYER/HEAD pairs, comma-separated, e.g. 2/0,15/4")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--mex", type=int, default=16, help="repairs: repair slots per roargraph row")
    ap.add_argument("--behind", action="store_true", help="repairs: after each row's links, not in front of them")
    args = ap.parse_args()
    numba.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    dump = anns_lab.open_dump(args.dump)
    NGFixIndex(M=4, ef_construction=16).build(*(np.random.default_rng(s).standard_normal((n, 16)).astype(np.float32)
                                               for s, n in ((0, 500), (1, 100))))  # compile outside the timings
    run = {"phases": phases, "entries": entries, "repairs": repairs}[args.what]
    rows = []
    for layer, head in (tuple(map(int, h.split("/"))) for h in args.heads.split(",")):
        rows.append({"layer": layer, "head": head, **run(load_head(dump, layer, head), args)})
        print(rows[-1], flush=True)
    table = pd.DataFrame(rows).set_index(["layer", "head"])
    print(markdown(table.round(4)))
    print("\nmedian:", {k: round(float(v), 4) for k, v in table.median().items()})
    if args.what != "phases":
        for col in table.columns.drop(["roargraph", "ngfix_edges"], errors="ignore"):
            print(f"per-head {col} / roargraph: median {float((table[col] / table['roargraph']).median()):.3f}")
    if args.what == "entries":
        r = table["ngfix_from_roargraph_entries"] / table["ngfix"]
        print(f"per-head ngfix from roargraph's entries / from its own: median {float(r.median()):.3f}")


if __name__ == "__main__":
    main()
