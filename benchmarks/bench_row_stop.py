"""roargraph's row stop (search parameters ``row_misses``, ``row_credit``) screened on real heads at today's build.

    python benchmarks/bench_row_stop.py --dump /work/dumps/smollm2-text-8192 --layers 2,15,28
    python benchmarks/bench_row_stop.py --dump /work/dumps/gemma3-270m-text-32768 --layers 5,11,17 --settings 6:0.3,4:0.3,6:0.2

The sweep's protocol in one process (``eval.heads.load_head``: window 128 + 512 out, decode queries as test queries,
training queries at the serving positions): each head is built once at the index's defaults, then every ``L`` of
roargraph's grid is searched at each ``MISSES:CREDIT`` setting; the scanned fraction at recall@100 ``--target`` is
interpolated between grid points (``bench_build_scale.scan_at``, as bench_query_aware.py's tables and, since session 47,
the report's). Prints, per setting, the median over heads and the median per-head ratio to the first setting
(the defaults unless told otherwise), same run.
"""

from __future__ import annotations

import argparse

import numba
import numpy as np

from anns_lab.dumps.store import open_dump
from anns_lab.eval.heads import load_head
from anns_lab.indexes.roargraph import RoarGraphIndex
from anns_lab.testing import recall_at_k
from bench_build_scale import scan_at

K = 100


def scanned_at(index: RoarGraphIndex, data, misses: int, credit: float, target: float) -> float:
    """Scanned fraction (%) at recall@K ``target`` over roargraph's L grid at one row-stop setting; NaN if never."""
    pts = []
    for L in RoarGraphIndex.search_grid["L"]:
        res = index.search(data.test_queries, K, L=L, row_misses=misses, row_credit=credit)
        pts.append((res.n_scanned.mean() / len(data.keys), recall_at_k(res.ids, data.test_queries, data.keys, K)))
    return 100 * scan_at(pts, target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--layers", required=True, help="comma-separated layers (every query head of each)")
    ap.add_argument("--settings", default="6:0.3,4:0.3,8:0.3,10:0.3,6:0.2,6:0.5,8:0.5",
                    help="MISSES:CREDIT,...; the first is the reference of the ratios")
    ap.add_argument("--target", type=float, default=0.95)
    a = ap.parse_args()
    numba.set_num_threads(1)
    settings = [(int(m), float(c)) for m, c in (s.split(":") for s in a.settings.split(","))]
    dump = open_dump(a.dump)
    got = {s: [] for s in settings}
    for layer in (int(x) for x in a.layers.split(",")):
        for head in range(dump.n_heads):
            data = load_head(dump, layer, head)
            index = RoarGraphIndex().build(data.keys, data.train_queries)
            for s in settings:
                got[s].append(scanned_at(index, data, *s, a.target))
    ref = np.array(got[settings[0]])
    for s in settings:
        v = np.array(got[s])
        print(f"{a.dump}: row_misses {s[0]}, row_credit {s[1]}: median {np.nanmedian(v):.3f}% scanned at recall "
              f"{a.target}, median per-head ratio {np.nanmedian(v / ref):.3f}", flush=True)


if __name__ == "__main__":
    main()
