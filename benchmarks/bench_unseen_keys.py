"""Keys no training query ranks high: how many of the test queries' true top-k they are, and how many roargraph misses.

roargraph's edges come from the training (prefill) queries' exact top-k lists; a key that is in no such list
has few ways in. Per (layer, head): the share of the decode queries' exact top-k keys that are in no training
query's exact top-k ("unseen"), and the share of those and of the others that roargraph's most thorough grid
point does not return. Explains a head where roargraph's recall levels off below a key-only index's.

    python benchmarks/bench_unseen_keys.py --dump /work/dumps/smollm2-text-8192 --heads 15/2,15/1,28/0
"""

from __future__ import annotations

import argparse

import numpy as np

from anns_lab.dumps.store import open_dump
from anns_lab.eval import metrics
from anns_lab.eval.heads import load_head
from anns_lab.indexes import registry


def unseen(dump, layer: int, head: int, k: int = 100) -> dict:
    """Unseen share of the test queries' top-k, and roargraph's miss rate on unseen and on seen top-k keys."""
    d = load_head(dump, layer, head)
    seen = np.zeros(len(d.keys), bool)
    seen[metrics.exact_topk(metrics.exact_scores(d.train_queries, d.keys), k).ravel()] = True
    top = metrics.exact_topk(d.exact("q2k"), k)
    index = registry.create("roargraph")
    index.build(d.keys, d.train_queries)
    params = index.grid()[-1]
    res = index.search(d.test_queries, k, **params)
    found = np.array([np.isin(top[i], res.ids[i]) for i in range(len(top))])
    hidden = ~seen[top]
    return {"layer": layer, "head": head, "unseen": hidden.mean(), "keys in a training top-k": seen.mean(),
            "roargraph": str(params), "missed unseen": (~found & hidden).sum() / max(hidden.sum(), 1),
            "n unseen": int(hidden.sum()), "missed seen": (~found & ~hidden).sum() / max((~hidden).sum(), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", required=True)
    ap.add_argument("--heads", required=True, help="LAYER/HEAD pairs, comma-separated")
    args = ap.parse_args()
    import pandas as pd

    dump = open_dump(args.dump)
    rows = [unseen(dump, *map(int, pair.split("/"))) for pair in args.heads.split(",")]
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.4f}"))


if __name__ == "__main__":
    main()
