"""Why is IVF's Q→K / K→K gap reversed on SmolLM2 8K? One factor at a time, measured per head.

The paper (Fig. 3a) has IVF needing 30–50% of the keys for recall@100 0.95 on Q→K and 1–5% on
K→K. For each (layer, head) this script gives the least fraction of keys scanned (centroids
included) for mean recall@100 ≥ 0.95, from IVF's exact curve at every nprobe
(anns_lab.eval.ivf_gap), under:

- ``q2k`` / ``k2k``: the sweep's settings at every nprobe (decode queries / 64 random held-out
  keys, inner product, nlist auto, window 128,512); ``*_grid``: the first point of the sweep's
  doubling nprobe grid reaching the target (what the report read before session 47; it now reads between the two
  grid points around the target);
- ``k2k_recent``: the keys of the last 64 prefill positions as queries (decode-like positions);
- ``k2k_l2``: held-out keys, L2 ground truth and L2 lists (in-distribution search as ANN
  benchmarks define it); ``k2k_cos``: unit-normalised keys and queries (inner product without norms);
- ``*_share``: top-k with k the paper's share of the keys (top-100 of 128K = top-6 of 7.5K);
- ``*_nlist=N``: other list counts; ``*_window0``: no static window.

It also reports the key-norm spread and how many of the exact top-100 fall among the 10%
largest-norm keys. Usage::

    python benchmarks/bench_ivf_gap.py /work/dumps/smollm2-text-8192 --layers 2,15,28 --json /tmp/ivf_gap.json
"""

from __future__ import annotations

import argparse
import json
import time

import faiss
import numpy as np

from anns_lab.dumps.store import open_dump
from anns_lab.eval import ivf_gap
from anns_lab.eval.heads import load_head
from anns_lab.indexes.ivf import IVFIndex

K, TARGET = 100, 0.95


def at(keys, queries, k=K, metric="ip", nlist=None) -> float:
    return ivf_gap.fraction_at(*ivf_gap.curve(keys, queries, k, metric, nlist), TARGET)


def measure(dump, layer: int, head: int) -> dict:
    d = load_head(dump, layer, head, (128, 512))
    keys, q, held = d.keys, d.test_queries, d.k2k_queries
    row = ivf_gap.diagnose(d, K)
    grid = IVFIndex.search_grid["nprobe"]
    row["q2k_grid"] = ivf_gap.grid_steps(*ivf_gap.curve(keys, q, K), grid, TARGET)[1]
    row["k2k_grid"] = ivf_gap.grid_steps(*ivf_gap.curve(keys, held, K), grid, TARGET)[1]
    row["k2k_recent"] = at(keys, dump.keys(layer, d.kv_head, "prefill")[d.n_prefill - 64:])
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    row["k2k_cos"] = at(unit(keys), unit(held))
    for nlist in (32, 512):
        row[f"q2k_nlist={nlist}"] = at(keys, q, nlist=nlist)
        row[f"k2k_nlist={nlist}"] = at(keys, held, nlist=nlist)
    d0 = load_head(dump, layer, head, (0, 0))
    row["q2k_window0"] = at(d0.keys, d0.test_queries)
    row["k2k_window0"] = at(d0.keys, d0.k2k_queries)
    norms = np.linalg.norm(keys, axis=1)
    row["key_norm_cv"] = float(norms.std() / norms.mean())
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
            r = {"layer": layer, "head": head} | measure(dump, layer, head)
            rows.append(r)
            print(f"L{layer} H{head}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                   for k, v in r.items() if k not in ("layer", "head")), flush=True)
    cols = [c for c in rows[0] if c not in ("layer", "head", "n_keys", "k_share")]
    print(f"\nmedian over {len(rows)} heads (least fraction of keys scanned for recall@{K} {TARGET} unless named; "
          f"CPU {time.process_time() - t0:.0f} s):")
    for c in cols:
        v = np.array([r[c] for r in rows], dtype=float)
        print(f"  {c:20s} {np.median(v):.3f}   (range {np.min(v):.3f}–{np.max(v):.3f}, not reached on "
              f"{int((~np.isfinite(v)).sum())})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
