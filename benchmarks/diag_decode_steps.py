"""Recall per decode step on a task dump: does an index find what each answer token's query needs?

    python benchmarks/diag_decode_steps.py --dump dumps/gemma3-270m-niah-131072-rope4 --layers 5,11,17 \
        [--heads 0,1] [--variant rs: --variant full:row_misses=0 --variant L400:L=400] [--ivf-nprobe 128] \
        [--copy-hints 8]

A task dump (``anns-lab dump --source niah ...``) holds full attention's own answer as its decode steps, so
its decode queries are the ones that must retrieve the needle. Per (layer, head), on the sweep's protocol
(``eval.heads.load_head``: window 128 + 512 out, training = the prefill queries before the first test query):
builds roargraph once, searches the dump's decode queries with each ``--variant`` (NAME:PARAM=V,...) and
IVF, and reports mean recall@100, the share of each step's exact top-10 keys found (the keys that carry a
copying step's attention), the same over the steps ``--answer-steps`` (default: the answer's digits of a
niah dump, steps 1-8) and the scanned fraction. With ``--copy-hints N`` each variant runs again (NAME+hints) entering
also at the decoder's copy hints of each step (``decode.copy_hints``, from the dump's tokens), as ``anns-lab decode``
does. JSON lines on stdout, a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from anns_lab.decode.copy_hints import CopyHints
from anns_lab.cli_types import parse_params
from anns_lab.dumps.store import open_dump
from anns_lab.eval.heads import load_head
from anns_lab.eval.metrics import exact_scores, exact_topk, recall_at_k
from anns_lab.indexes import registry

K = 100


def variants(items: list[str]) -> list[tuple[str, dict]]:
    """``NAME:P=V,P=V`` → (name, search params), parsed as ``anns-lab decode --param`` is (one clear error)."""
    out = []
    for item in items:
        name, _, spec = item.partition(":")
        out.append((name, parse_params([p for p in spec.split(",") if p], "--variant")))
    return out


def step_report(ids: np.ndarray, scores: np.ndarray, steps: slice, n_keys: int, n_scanned: np.ndarray) -> dict:
    """Recall@100, top-10 share per step, its mean over the answer ``steps``, scanned %."""
    top10 = exact_topk(scores, 10)
    share = np.array([np.isin(top10[i], ids[i]).mean() for i in range(len(ids))])
    return {"recall": round(float(recall_at_k(ids, scores, K).mean()), 3), "top10": round(float(share.mean()), 3),
            "answer_top10": round(float(share[steps].mean()), 3), "top10_by_step": share.round(2).tolist(),
            "scanned_pct": round(100 * float(n_scanned.mean()) / n_keys, 3)}


def hint_ids(tokens: np.ndarray, n_prefill: int, n_dec: int, key_pos: np.ndarray, cap: int) -> list[np.ndarray]:
    """Per decode step, the copy hints the decoder would give (positions → key ids of this head's key set)."""
    out, hints = [], CopyHints(cap)
    for t in range(n_dec):
        hints.update(tokens[:n_prefill + t + 1].tolist())
        pos = hints.positions
        at = np.searchsorted(key_pos, pos)
        ok = at < len(key_pos)
        ok[ok] = key_pos[at[ok]] == pos[ok]  # positions in the window or held out are not keys of the index
        out.append(at[ok].astype(np.int64))
    return out


def search_steps(graph, q: np.ndarray, params: dict, hints: list[np.ndarray] | None):
    """The variant's search of every step: as one batch, or step by step with that step's hints."""
    if hints is None:
        r = graph.search(q, K, **params)
        return r.ids, r.n_scanned
    rs = [type(graph).search_group([graph], q[t:t + 1], K, hints=hints[t], **params) for t in range(len(q))]
    return np.concatenate([r.ids for r in rs]), np.concatenate([r.n_scanned for r in rs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", required=True)
    ap.add_argument("--layers", required=True, help="comma list")
    ap.add_argument("--heads", default="", help="comma list (default: all)")
    ap.add_argument("--variant", action="append", default=[], help="NAME:PARAM=V,... roargraph search params")
    ap.add_argument("--ivf-nprobe", type=int, default=128)
    ap.add_argument("--answer-steps", default="1:9", help="START:STOP of the decode steps that copy the answer")
    ap.add_argument("--copy-hints", type=int, default=0, help="also run each variant with this many copy hints per step")
    args = ap.parse_args()
    dump = open_dump(args.dump)
    tokens = dump.tokens() if args.copy_hints else None
    n_dec = int(dump.manifest["n_tokens"]["decode"])
    heads = [int(h) for h in args.heads.split(",")] if args.heads else list(range(int(dump.manifest["n_heads"])))
    start, stop = (int(x) for x in args.answer_steps.split(":"))
    steps = slice(start, stop)
    runs = variants(args.variant or ["rs:", "full:row_misses=0", "L400:L=400"])
    for layer in (int(x) for x in args.layers.split(",")):
        for head in heads:
            hd = load_head(dump, layer, head)
            q = hd.test_queries[-n_dec:]  # the decode steps only (the held-out prefill queries are not answer steps)
            scores = exact_scores(q, hd.keys)
            graph = registry.get("roargraph")().build(hd.keys, hd.train_queries)
            ivf = registry.get("ivf")().build(hd.keys)
            row = {"layer": layer, "head": head}
            hints = (hint_ids(tokens, int(dump.manifest["n_tokens"]["prefill"]), n_dec, hd.key_pos, args.copy_hints)
                     if args.copy_hints else None)
            for name, params in runs:
                for tag, h in [("", None)] + ([("+hints", hints)] if hints is not None else []):
                    ids, scanned = search_steps(graph, q, params, h)
                    row[name + tag] = step_report(ids, scores, steps, len(hd.keys), scanned)
            r = ivf.search(q, K, nprobe=args.ivf_nprobe)
            row[f"ivf{args.ivf_nprobe}"] = step_report(r.ids, scores, steps, len(hd.keys), r.n_scanned)
            print(json.dumps(row), flush=True)
            cells = [f"{n}: recall {v['recall']:.3f} answer top-10 {v['answer_top10']:.2f} scanned {v['scanned_pct']:.2f}%"
                     for n, v in row.items() if isinstance(v, dict)]
            print(f"{layer}/{head}  " + " | ".join(cells), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
