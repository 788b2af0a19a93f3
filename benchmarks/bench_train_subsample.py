"""roargraph's training-query subsample (``max_train`` auto): the newest ``keep_queries`` rows whole (the default)
against the plain even stride over all rows, same run, per head.

    .venv/bin/python benchmarks/bench_train_subsample.py --dump /work/dumps/smollm2-text-8192 --heads 2/0,15/4,25/7

Per head: keys scanned for recall@100 0.95 (the first grid point reaching it; exact reference) and build CPU s
of each, and their ratio (whole / stride). Both builds run back to back on the same head, so the ratio holds
under load.
"""

from __future__ import annotations

import argparse
import time

from anns_lab.dumps.store import open_dump
from anns_lab.eval.heads import load_head
from anns_lab.indexes import roargraph as rg
from anns_lab.testing import recall_at_k


def scanned_at(index, data, target: float = 0.95) -> float:
    """Fraction of the keys scanned at the first grid point whose recall@100 reaches ``target`` (NaN if none)."""
    for params in index.grid():
        res = index.search(data.test_queries, 100, **params)
        if recall_at_k(res.ids, data.test_queries, data.keys, 100) >= target:
            return float(res.n_scanned.mean()) / len(data.keys)
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", required=True)
    ap.add_argument("--heads", default="2/0,15/4,25/7", help="LAYER/HEAD,...")
    a = ap.parse_args()
    dump = open_dump(a.dump)
    whole = rg.subsample
    variants = {"stride": lambda m, at_most, newest=0: whole(m, at_most, 0), "whole": whole}
    warm = None  # the kernels' first load, paid before any timed build (the first variant paid it before)
    for item in a.heads.split(","):
        layer, head = map(int, item.split("/"))
        data = load_head(dump, layer, head)
        if warm is None:
            warm = scanned_at(rg.RoarGraphIndex().build(data.keys, data.train_queries), data)
        out = {}
        for name, sub in variants.items():
            rg.subsample = sub
            t0 = time.process_time()
            index = rg.RoarGraphIndex().build(data.keys, data.train_queries)
            built = time.process_time() - t0  # the build alone: the grid's searches after it are not a build's
            out[name] = (scanned_at(index, data), built)
        rg.subsample = whole
        print(f"{layer}/{head} n={len(data.keys)} m={len(data.train_queries)} "
              + "  ".join(f"{k}: {100 * s:.3f}% build {c:.2f} s" for k, (s, c) in out.items())
              + f"  ratio {out['whole'][0] / out['stride'][0]:.3f}", flush=True)


if __name__ == "__main__":
    main()
