"""Why is IVF's Q→K / K→K gap reversed on SmolLM2 8K? One factor at a time, measured per head.

The paper (Fig. 3a) has IVF needing 30–50% of the keys for recall@100 0.95 on Q→K and 1–5% on
K→K. The lab's sweep finds the reverse on SmolLM2 8K. For each (layer, head) this script
measures the least fraction of keys scanned (centroids included) for mean recall 0.95 under:

- ``q2k``: decode queries, inner product (the sweep's Q→K);
- ``k2k``: 64 random held-out keys as queries, inner product (the sweep's K→K);
- ``k2k_recent``: the keys of the last 64 prefill positions (never indexed) as queries, inner product;
- ``k2k_l2``: held-out keys, L2 ground truth and an L2 IVF (in-distribution search as
  ANN benchmarks define it);
- ``k2k_cos``: held-out keys against unit-normalised keys, inner product (IP without norms);
- ``q2k_nlist=N`` / ``k2k_nlist=N``: other list counts; ``*_window0``: no static window.

It also reports the key-norm spread (coefficient of variation of ‖k‖) and how many of a held-out
key's inner-product top-100 are among its own L2 top-100. Usage::

    python benchmarks/bench_ivf_gap.py /work/dumps/smollm2-text-8192 --layers 2,15,28 --json /tmp/ivf_gap.json
"""

from __future__ import annotations

import argparse
import json
import time

import faiss
import numpy as np

from anns_lab.dumps.store import open_dump
from anns_lab.eval import metrics
from anns_lab.eval.heads import load_head
from anns_lab.indexes.ivf import auto_nlist

K = 100
TARGET = 0.95
NPROBE = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def least_scan(keys: np.ndarray, queries: np.ndarray, metric: str, nlist: int, seed: int = 1234) -> float:
    """Least mean fraction scanned (nlist + probed lists) at which faiss IVF-Flat reaches mean recall@K ≥ TARGET."""
    d = keys.shape[1]
    if metric == "ip":
        quantizer, mt = faiss.IndexFlatIP(d), faiss.METRIC_INNER_PRODUCT
        truth = metrics.exact_scores(queries, keys)
    else:
        quantizer, mt = faiss.IndexFlatL2(d), faiss.METRIC_L2
        truth = -((queries[:, None, :] - keys[None, :, :]) ** 2).sum(-1)  # higher is nearer
    index = faiss.IndexIVFFlat(quantizer, d, nlist, mt)
    index.cp.seed = seed
    index.train(keys)
    index.add(keys)
    sizes = np.array([index.invlists.list_size(i) for i in range(nlist)])
    for nprobe in sorted({min(p, nlist) for p in NPROBE} | {nlist}):
        index.nprobe = nprobe
        coarse, probed = quantizer.search(queries, nprobe)
        _, ids = index.search_preassigned(queries, K, probed, coarse)
        if metrics.recall_at_k(ids, truth, K).mean() >= TARGET:
            return float((nlist + sizes[probed].sum(axis=1)).mean() / len(keys))
    return float("inf")


def measure(dump, layer: int, head: int) -> dict:
    d = load_head(dump, layer, head, (128, 512))
    keys, q, held = d.keys, d.test_queries, d.k2k_queries
    n = len(keys)
    nl = auto_nlist(n)
    n_prefill = d.n_prefill
    recent = dump.keys(layer, d.kv_head, "prefill")[n_prefill - 64:]
    unit = keys / np.linalg.norm(keys, axis=1, keepdims=True)
    held_unit = held / np.linalg.norm(held, axis=1, keepdims=True)
    row = {"layer": layer, "head": head, "n_keys": n, "nlist": nl,
           "q2k": least_scan(keys, q, "ip", nl), "k2k": least_scan(keys, held, "ip", nl),
           "k2k_recent": least_scan(keys, recent, "ip", nl), "k2k_l2": least_scan(keys, held, "l2", nl),
           "k2k_cos": least_scan(unit, held_unit, "ip", nl)}
    for nlist in (32, 512):
        row[f"q2k_nlist={nlist}"] = least_scan(keys, q, "ip", nlist)
        row[f"k2k_nlist={nlist}"] = least_scan(keys, held, "ip", nlist)
    d0 = load_head(dump, layer, head, (0, 0))
    row["q2k_window0"] = least_scan(d0.keys, d0.test_queries, "ip", auto_nlist(len(d0.keys)))
    row["k2k_window0"] = least_scan(d0.keys, d0.k2k_queries, "ip", auto_nlist(len(d0.keys)))
    norms = np.linalg.norm(keys, axis=1)
    row["key_norm_cv"] = float(norms.std() / norms.mean())
    ip_top = metrics.exact_topk(metrics.exact_scores(held, keys), K)
    l2_top = metrics.exact_topk(-((held[:, None, :] - keys[None]) ** 2).sum(-1), K)
    row["k2k_ip_l2_overlap"] = float(np.mean([len(np.intersect1d(a, b)) / K for a, b in zip(ip_top, l2_top)]))
    # How concentrated the IP answers are: share of the K→K top-100 ids that fall among the 10% largest-norm keys.
    big = norms >= np.quantile(norms, 0.9)
    row["k2k_top_in_big_norm10"] = float(big[ip_top].mean())
    row["q2k_top_in_big_norm10"] = float(big[metrics.exact_topk(metrics.exact_scores(q, keys), K)].mean())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump")
    ap.add_argument("--layers", default="2,15,28")
    ap.add_argument("--heads", default=None, help="comma-separated query heads [default: all]")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    faiss.omp_set_num_threads(1)
    dump = open_dump(args.dump)
    heads = [int(h) for h in args.heads.split(",")] if args.heads else range(dump.n_heads)
    rows, t0 = [], time.process_time()
    for layer in (int(x) for x in args.layers.split(",")):
        for head in heads:
            rows.append(measure(dump, layer, head))
            r = rows[-1]
            print(f"L{layer} H{head}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                   for k, v in r.items() if k not in ("layer", "head")), flush=True)
    cols = [c for c in rows[0] if c not in ("layer", "head", "n_keys", "nlist")]
    print(f"\nmedian over {len(rows)} heads (fractions of keys scanned for recall@{K} {TARGET}; CPU {time.process_time() - t0:.0f} s):")
    for c in cols:
        v = np.array([r[c] for r in rows], dtype=float)
        print(f"  {c:24s} {np.median(v):.3f}   (not reached on {int((~np.isfinite(v)).sum())})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
