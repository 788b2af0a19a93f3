"""Where a roargraph search's inner products go, at the beam width where a head reaches recall@100 0.95.

    python benchmarks/diag_graph_search.py --dump /work/dumps/smollm2-text-8192 --layers 2,15,28 [--heads 0,2]
        [--build-param NAME=VALUE ...] [--target 0.95] [--json out.json]

Per head (the sweep's protocol: window 128 + 512 out, decode queries, ``eval.heads.load_head``): builds
roargraph, finds the first grid L whose mean recall@100 reaches ``--target``, and replays each test
query's search at that L in plain Python (the sorted-list reference of the kernels: the same nodes
expanded, ties aside; the returned keys are the best k of all scanned, as the kernel's L < k mode). The search
is the one with full rows (``row_misses=0``; the default's row stop, which ends a row's scan after misses, is not
replayed), so L is the first that reaches the target without it.
Every scanned key is attributed to where it came from: the entry points, the expansion of a key in the
query's exact top-100 ("in-region"), or the expansion of any other key. Also: how many inner products
the search spends before it first scans a top-100 key, after it scans the last one it will find (what a
perfect stop rule would save), the exact rank of the best entry point, and how many of the missed top-100
keys have no in-edge from any of the query's top-100 keys (reachable only through keys outside the region).
"""

from __future__ import annotations

import argparse
import json

import numba
import numpy as np

from anns_lab.dumps.store import open_dump
from anns_lab.eval.heads import load_head
from anns_lab.eval.metrics import kth_scores, recall_at_k
from anns_lab.indexes.roargraph import RoarGraphIndex

K = 100


def replay(g, query, entries, L, good):
    """One query's search in Python (sorted beam of L, expand its best unexpanded node until none is left),
    attributing each scanned node: returns a dict of counts and the list of scanned node ids."""
    data, nbrs, degree = g
    beam_ids, beam_s, done = [], [], []
    seen: set[int] = set()
    order: list[int] = []
    source: list[int] = []  # 0 entry, 1 from an in-region expansion, 2 from any other expansion
    n_exp = n_exp_good = 0

    def scan(node: int, src: int) -> None:
        seen.add(node)
        order.append(node)
        source.append(src)
        s = float(data[node] @ query)
        pos = len(beam_s)
        while pos > 0 and beam_s[pos - 1] < s:
            pos -= 1
        if pos < L:
            beam_ids.insert(pos, node), beam_s.insert(pos, s), done.insert(pos, False)
            del beam_ids[L:], beam_s[L:], done[L:]

    for e in entries:
        if int(e) not in seen:
            scan(int(e), 0)
    while False in done:
        cur = done.index(False)
        done[cur] = True
        node = beam_ids[cur]
        n_exp += 1
        in_region = bool(good[node])
        n_exp_good += in_region
        for nb in nbrs[node, : degree[node]]:
            if int(nb) not in seen:
                scan(int(nb), 1 if in_region else 2)
    order_a, source_a = np.array(order), np.array(source)
    hit = good[order_a]
    first = int(np.argmax(hit)) if hit.any() else len(order)
    last = int(np.flatnonzero(hit)[-1]) + 1 if hit.any() else len(order)
    return {"scanned": len(order), "entry": int((source_a == 0).sum()), "from_region": int((source_a == 1).sum()),
            "from_outside": int((source_a == 2).sum()), "useful": int(hit.sum()), "before_first_hit": first,
            "after_last_hit": len(order) - last, "expanded": n_exp, "expanded_in_region": n_exp_good}, order_a


def diagnose_head(dump, layer: int, head: int, build_params: dict, target: float) -> dict:
    """The attribution of one head's scans at its first grid L reaching ``target`` (means over test queries)."""
    data = load_head(dump, layer, head, (128, 512))
    index = RoarGraphIndex(**build_params)
    index.build(data.keys, data.train_queries)
    exact = data.exact("q2k")
    thresh = kth_scores(exact, K)
    n = len(data.keys)
    chosen = None
    for L in RoarGraphIndex.search_grid["L"]:
        res = index.search(data.test_queries, K, L=L, row_misses=0)  # full rows: the search replay() walks
        r = float(recall_at_k(res.ids, exact, K).mean())
        if r >= target:
            chosen = (L, r, float(res.n_scanned.mean()))
            break
    if chosen is None:
        return {"layer": layer, "head": head, "reached": False}
    L = chosen[0]
    g = tuple(index.graph_arrays())
    entries = index.entries()
    rows = []
    for qi, q in enumerate(data.test_queries):
        good = exact[qi] >= thresh[qi]
        stats, order = replay(g, q, entries, L, good)
        found = np.zeros(n, bool)
        found[order] = True
        missed = np.flatnonzero(good & ~found)
        linked = np.zeros(n, bool)  # keys with an in-edge from one of the query's top-100 keys
        for u in np.flatnonzero(good):
            linked[g[1][u, : g[2][u]]] = True
        stats["missed"] = len(missed)
        stats["missed_no_region_in_edge"] = int((~linked[missed]).sum())
        ranks = np.argsort(-exact[qi])
        rank_of = np.empty(n, np.int64)
        rank_of[ranks] = np.arange(n)
        stats["best_entry_rank"] = int(rank_of[entries].min())
        rows.append(stats)
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    mean["best_entry_rank"] = float(np.median([r["best_entry_rank"] for r in rows]))
    return {"layer": layer, "head": head, "reached": True, "L": L, "recall": chosen[1], "kernel_scanned": chosen[2],
            "n_keys": n, **mean}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--layers", required=True)
    ap.add_argument("--heads", default=None)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--build-param", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    numba.set_num_threads(1)
    dump = open_dump(args.dump)
    bp = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.build_param)}
    heads = [int(h) for h in args.heads.split(",")] if args.heads else range(dump.n_heads)
    out = []
    cols = ["scanned", "entry", "from_region", "from_outside", "useful", "before_first_hit", "after_last_hit",
            "expanded", "expanded_in_region", "missed", "missed_no_region_in_edge", "best_entry_rank"]
    print("layer/head L recall " + " ".join(cols))
    for layer in [int(x) for x in args.layers.split(",")]:
        for head in heads:
            d = diagnose_head(dump, layer, head, bp, args.target)
            out.append(d)
            if d["reached"]:
                print(f"{layer}/{head} {d['L']} {d['recall']:.3f} " + " ".join(f"{d[c]:.1f}" for c in cols), flush=True)
            else:
                print(f"{layer}/{head} never reaches {args.target}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
