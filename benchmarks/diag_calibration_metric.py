"""What a calibration criterion would choose per layer, and what the decode steps get there (``--calibrate``).

    python benchmarks/diag_calibration_metric.py --dump /work/dumps/smollm2-passkey-8184 --heads 0,4,8 \
        [--layers all] [--targets 0.9,0.95] [--hold-out 0,64] [--json out.json]

Per (layer, head), on the sweep's protocol (``eval.heads.load_head``: window 128 + 512 out, the dump's decode steps as
test queries, every prefill query before them as training queries, at the serving positions): roargraph is built with
its defaults, and at each value of its ``L`` grid the head's newest 64 prefill queries (own positions: what
``anns-lab decode --calibrate`` probes) and the decode steps are searched. Reported per layer (mean over the heads):
the newest queries' set recall@100 and weight recall@100 (``metrics.weight_recall_at_k``: the exact top-100's softmax
weight found), the decode steps' the same (and the newest 64 prefill queries the build left out, ``unt``, where it subsamples: the
training set holds every fourth query from 8K keys on, ``roargraph.auto_train``), their attention mass kept and output error with the window
(``HeadData.attention_quality``, against full attention) and the scanned fraction. Then, per criterion and target,
the ``L`` each layer would get (the cheapest grid value from the default 100 up reaching the target, as the decoder
raises; ``--over``: the layer's heads judged by their mean, as the decoder does, by their worst, or each head given its
own ``L``) and the decode steps' scanned fraction and output error there (mean over the heads). ``--hold-out 0,64``: a
table each, the index trained without each head's newest 0 or 64 prefill queries (``anns-lab decode --calibrate`` reads
its 64 from inside the training set; held out they read lower, but the index serves the decode steps worse: BENCHMARKS
"A target of 0.95"). JSON rows with ``--json``; tables on stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from anns_lab.decode import calibrate
from anns_lab.dumps.store import open_dump
from anns_lab.eval import metrics
from anns_lab.eval.heads import load_head
from anns_lab.indexes import registry
from anns_lab.io import atomic_write_bytes
from anns_lab.window import Window

K = 100


def head_rows(dump, layer: int, head: int, hold_out: int = 0) -> list[dict]:
    """One row per grid value of roargraph's ``L`` for this (layer, head), trained without each head's newest
    ``hold_out`` prefill queries."""
    n = int(dump.manifest["n_tokens"]["prefill"])
    data = load_head(dump, layer, head, Window(128, 512), min_test=1, held_out=np.arange(n - hold_out, n))
    index = registry.get("roargraph")().build(data.keys, data.train_queries)
    prefill = dump.queries(layer, head, "prefill")
    newest = np.ascontiguousarray(prefill[n - calibrate.QUERIES:], dtype=np.float32)
    probes = {"new": (newest, metrics.exact_scores(newest, data.keys)), "dec": (data.test_queries, data.exact("q2k"))}
    kept = index.train_rows(len(data.keys), len(data.train_queries))
    if kept is not None:  # the newest prefill queries the build left out (train_queries' row i is position i here)
        untrained = np.setdiff1d(np.arange(len(data.train_queries)), kept)[-calibrate.QUERIES:]
        unt = np.ascontiguousarray(prefill[untrained], dtype=np.float32)
        probes["unt"] = (unt, metrics.exact_scores(unt, data.keys))
    weights = {name: metrics.softmax_weights(scores.copy(), data.scaling) for name, (_, scores) in probes.items()}
    rows = []
    for L in registry.get("roargraph").search_grid["L"]:
        row = {"layer": layer, "head": head, "hold_out": hold_out, "L": L}
        for name, (queries, scores) in probes.items():
            res = index.search(queries, K, L=L)
            row[f"{name}_set"] = float(metrics.recall_at_k(res.ids, scores, K).mean())
            row[f"{name}_weight"] = float(metrics.weight_recall_at_k(res.ids, weights[name], K).mean())
            row[f"{name}_scanned"] = float(res.n_scanned.mean() / len(data.keys))
            if name == "dec":
                row["dec_mass_kept"], row["dec_out_err"] = data.attention_quality(res.ids)
        rows.append(row)
    return rows


OVER = ("mean", "min", "head")  # how a layer's heads are judged: their mean (the decoder's), the worst head, each head


def choices(table: pd.DataFrame, criterion: str, target: float, over: str = "mean", floor: int = 100) -> pd.DataFrame:
    """The least ``L`` >= ``floor`` whose ``criterion`` reaches ``target`` (else the grid's largest), with the decode steps'
    figures there, one row per head: the layer's heads judged by their mean (``over="mean"``, as ``--calibrate`` does)
    or by their worst (``"min"``), both one ``L`` per layer, or each head on its own (``"head"``: an ``L`` per head)."""
    keys = ["layer", "head"] if over == "head" else ["layer"]
    judged = table[table.L >= floor].groupby([*keys, "L"])[criterion].agg("min" if over == "min" else "mean").reset_index()
    largest = judged.groupby(keys).L.max()
    least = judged[judged[criterion] >= target].groupby(keys).L.min()
    at = least.reindex(largest.index).fillna(largest).astype(int).rename("L").reset_index()
    return table.merge(at, on=[*keys, "L"])[["layer", "head", "L", criterion, "dec_set", "dec_weight", "dec_scanned",
                                               "dec_out_err"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--layers", default="all", help="all, or a list 2,15,28")
    ap.add_argument("--heads", default="all", help="all, or a list 0,4,8")
    ap.add_argument("--targets", default="0.9,0.95")
    ap.add_argument("--over", default="mean", help="how a layer's heads are judged, a list of " + ", ".join(OVER))
    ap.add_argument("--hold-out", default="0", help="a list: each head's newest so many prefill queries left out of the "
                                                     f"training (decode --calibrate: {calibrate.QUERIES})")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if set(a.over.split(",")) - set(OVER):
        ap.error(f"--over takes a list of {', '.join(OVER)}, not {a.over!r}")
    dump = open_dump(a.dump)
    layers = dump.layers if a.layers == "all" else [int(x) for x in a.layers.split(",")]
    heads = range(dump.n_heads) if a.heads == "all" else [int(x) for x in a.heads.split(",")]
    held = [int(x) for x in a.hold_out.split(",")]
    rows = []
    for layer, head, hold_out in tqdm([(la, h, o) for la in layers for h in heads for o in held], desc="heads"):
        rows += head_rows(dump, layer, head, hold_out)
        if a.json:  # rewritten after each head: a stopped run keeps what it measured
            atomic_write_bytes(Path(a.json), json.dumps(rows).encode("utf-8"))
    pd.set_option("display.width", 200)
    for hold_out, table in pd.DataFrame(rows).groupby("hold_out"):
        print(f"\n== trained without each head's newest {hold_out} prefill queries ==")
        print(table.groupby(["layer", "L"]).mean(numeric_only=True).drop(columns=["head", "hold_out"]).round(4).to_string())
        for target in map(float, a.targets.split(",")):
            for criterion in [c for c in ("new_set", "new_weight", "unt_weight") if c in table]:
                for over in a.over.split(","):
                    pick = choices(table, criterion, target, over)
                    per_layer = pick.groupby("layer").L.agg(lambda x: "/".join(map(str, x if over == "head" else x[:1])))
                    print(f"\n{criterion} >= {target} ({over} over heads): L per layer {per_layer.tolist()}; decode "
                          f"steps: scanned {pick.dec_scanned.mean():.2%}, output error {pick.dec_out_err.mean():.4f}, "
                          f"set recall {pick.dec_set.mean():.3f}, weight recall {pick.dec_weight.mean():.3f}")


if __name__ == "__main__":
    main()
