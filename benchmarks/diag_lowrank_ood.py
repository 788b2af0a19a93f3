"""Why Loki's partial products rank decode queries' keys worse than SparQ's: the keys' leading principal components
are chosen by the keys, and a decode query (out of the keys' distribution) puts more of its product elsewhere.

Per (layer, head) of a dump, for the decode (Q→K) queries and the held-out keys (K→K) as the sweep takes them, at r
of the d dimensions: the correlation over the keys of each partial product with the full one, and the share of the
exact top-100 among the ``--budget`` keys of largest partial product, for Loki's first r principal coordinates,
SparQ's query's r largest components, and the r principal coordinates a query weighs most (q_j² times the keys'
variance along j: what a query-aware choice of Loki's components would keep). Correlations: medians over queries and
heads; shares: means.

    .venv/bin/python benchmarks/diag_lowrank_ood.py --dump dumps/smollm2-text-8192 --layers 2,15,28
"""

from __future__ import annotations

import argparse

import numpy as np

from anns_lab.dumps.run import parse_layers
from anns_lab.dumps.store import open_dump
from anns_lab.eval.heads import default_layers, evaluable_layers, load_head
from anns_lab_lowrank.loki import principal_basis
from anns_lab_lowrank.partial import channels

K = 100


def partials(keys: np.ndarray, q: np.ndarray, basis: np.ndarray, coords: np.ndarray, spread: np.ndarray, r: int):
    """The three partial products of ``q`` with every key (float64)."""
    qc = basis.T @ q
    dims = np.argsort(-np.abs(q), kind="stable")[:r]
    weighed = np.argsort(-(qc ** 2) * spread, kind="stable")[:r]
    return {"loki": coords[:, :r] @ qc[:r], "sparq": keys[:, dims] @ q[dims], "pcs a query weighs": coords[:, weighed] @ qc[weighed]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", required=True)
    ap.add_argument("--layers", default=None, help="as anns-lab sweep's --layers (default: the sweep's)")
    ap.add_argument("--rank", type=float, default=0.25, help="r/d (default 0.25: both plugins' default)")
    ap.add_argument("--budget", type=int, default=1024, help="keys scored exactly (default 1024: both plugins' default)")
    a = ap.parse_args()
    dump = open_dump(a.dump)
    layers = parse_layers(a.layers or "default", int(dump.manifest["n_layers"]), default_layers(evaluable_layers(dump)))
    corr: dict[tuple[str, str], list[float]] = {}
    cover: dict[tuple[str, str], list[float]] = {}
    for layer in layers:
        for head in range(dump.n_heads):
            h = load_head(dump, layer, head)
            keys = h.keys.astype(np.float64)
            r = channels(a.rank, keys.shape[1])
            basis = principal_basis(h.keys).astype(np.float64)
            coords = keys @ basis
            spread = coords.var(axis=0)
            for direction, queries in (("Q→K", h.test_queries), ("K→K", h.k2k_queries)):
                for q in queries.astype(np.float64):
                    full = keys @ q
                    top = set(np.argsort(-full, kind="stable")[:K].tolist())
                    for name, p in partials(keys, q, basis, coords, spread, r).items():
                        corr.setdefault((name, direction), []).append(float(np.corrcoef(p, full)[0, 1]))
                        chosen = np.argsort(-p, kind="stable")[: a.budget]
                        cover.setdefault((name, direction), []).append(len(top.intersection(chosen.tolist())) / K)
    print(f"{a.dump}: layers {list(layers)}, r/d {a.rank}, budget {a.budget}; correlations: medians, shares: means")
    print(f"{'partial product':20s} {'corr Q→K':>9s} {'corr K→K':>9s} {'top-100 in budget Q→K':>22s} {'K→K':>6s}")
    for name in ("loki", "sparq", "pcs a query weighs"):
        print(f"{name:20s} {np.median(corr[name, 'Q→K']):9.3f} {np.median(corr[name, 'K→K']):9.3f} "
              f"{np.mean(cover[name, 'Q→K']):22.3f} {np.mean(cover[name, 'K→K']):6.3f}")


if __name__ == "__main__":
    main()
