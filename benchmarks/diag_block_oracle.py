"""How many keys a block-level retriever must read, whatever represents its blocks (InfLLM, Quest: ``plugins/infllm``).

    python benchmarks/diag_block_oracle.py --dump /work/dumps/smollm2-text-8192 [--layers 2,15,28] [--heads all]
        [--block 128] [--target 0.95] [--k 100]

Per (layer, head), on the sweep's protocol (``eval.heads.load_head``: window 128 + 512 out, the dump's decode steps as
test queries): the index keys are cut into whole blocks of ``--block`` consecutive keys, as InfLLM's (the remainder
after the last is read by every query, as infllm reads it), and each test query reads its blocks in the order of (a) how many of its exact top-k keys each holds, the best order any choice of such
blocks can take, or (b) each block's largest product with the query, the order an exact upper bound would give (Quest's
ideal). Each order's cost is counted as infllm counts its own: one product per block plus the keys of the blocks
read, as a fraction of the keys; the fraction where the mean recall@k reaches ``--target`` is read between the
block counts around it (``metrics.at_recall``, as the sweep's tables). Printed: the median and range over the heads,
beside which the sweep's infllm row (its representatives choosing the blocks) can be read.
"""

from __future__ import annotations

import argparse

import numpy as np

from anns_lab.dumps.store import Dump
from anns_lab.eval.heads import default_layers, evaluable_layers, load_head
from anns_lab.eval.metrics import at_recall


def block_recalls(scores: np.ndarray, block: int, k: int, order: str) -> np.ndarray:
    """Mean recall@k (over the rows of ``scores``, queries × keys) after reading 1, 2, ... of the whole blocks in
    ``order``, the remainder after them read from the start."""
    n_blocks = scores.shape[1] // block
    which = np.arange(scores.shape[1]) // block  # n_blocks: the remainder
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    found = np.zeros(n_blocks)
    for row, best in zip(scores, top):
        held = np.bincount(which[best], minlength=n_blocks + 1)
        whole = row[:n_blocks * block].reshape(n_blocks, block)
        rank = held[:n_blocks] if order == "count" else whole.max(axis=1)
        found += (held[n_blocks] + np.cumsum(held[:n_blocks][np.argsort(-rank, kind="stable")])) / k
    return found / len(scores)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--layers", default=None, help="comma list (default: the sweep's three, spread over the depth)")
    ap.add_argument("--heads", default="all")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--k", type=int, default=100)
    args = ap.parse_args()
    dump = Dump(args.dump)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else default_layers(evaluable_layers(dump))
    heads = range(dump.n_heads) if args.heads == "all" else [int(x) for x in args.heads.split(",")]
    fractions: dict[str, list[float]] = {"count": [], "max": []}
    for layer in layers:
        for head in heads:
            data = load_head(dump, layer, head, (128, 512), train_positions="own")
            n = len(data.keys)
            n_blocks = n // args.block
            cost = (n_blocks + n % args.block + np.arange(1, n_blocks + 1) * args.block) / n
            scores = data.test_queries @ data.keys.T
            for order in fractions:
                recall = block_recalls(scores, args.block, args.k, order)
                fractions[order].append(at_recall(recall, cost, args.target)[0])
    labels = {"count": "blocks by how many of the top keys they hold", "max": "blocks by their largest product"}
    for order, values in fractions.items():
        v = 100 * np.asarray(values)
        print(f"{labels[order]}: {np.median(v):.2f}% of the keys at recall@{args.k} {args.target} (median of {len(v)} "
              f"heads; {v.min():.2f}-{v.max():.2f})")


if __name__ == "__main__":
    main()
