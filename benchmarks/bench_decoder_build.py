"""The decoder's per-layer index build, end to end, in CPU seconds split into its parts (issue 13's TTFT goal).

    .venv/bin/python benchmarks/bench_decoder_build.py --dump /work/dumps/smollm2-text-8192
    .venv/bin/python benchmarks/bench_decoder_build.py --dump /work/dumps/smollm2-text-8192 --layers 0:30:3 --threads 2
    .venv/bin/python benchmarks/bench_decoder_build.py --dump /work/dumps/smollm2-text-8192 --train-group group
    .venv/bin/python benchmarks/bench_decoder_build.py --dump /work/dumps/gemma3-270m-text-32768 --given-lists
    .venv/bin/python benchmarks/bench_decoder_build.py --dump /work/dumps/gemma3-270m-text-131072 --layers 5,11 --held

For each layer, what ``anns-lab decode`` does once the prompt's last chunk has passed it (``decode.builds.layer_store``,
called as the decoder calls it): the layer's keys and values out of a cache (the dump's prefill K and V in float32
tensors, as the model's CPU cache holds them), the prefill queries subsampled and moved by RoPE to the decode steps'
positions, the :class:`LayerStore`, and its indexes' builds (``roargraph`` at its defaults unless ``--mode``; every
query head of the layer). Timed: process CPU seconds of the whole call and of its parts (the functions below, wrapped
where the build looks them up; ``rest`` is what no wrapper covers: Python between the parts, input checks, copies).
Threads: numba, faiss and torch pinned to ``--threads`` (``--torch-threads``) on the calling thread, as the decoder's build
thread has their defaults (2 each on the 2-core machine); the layer's index builds then run as the decoder runs them, at
most ``--threads`` side by side on one-core threads (``indexes.threads.map_one_thread``: its budget is the calling thread's;
with 1, one after another on the calling thread, the same CPU seconds), whose CPU the parts and the total count.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import time
from types import SimpleNamespace

import faiss
import numba
import numpy as np
import torch

import anns_lab
from anns_lab.decode import builds
from anns_lab.decode.engine import Settings
from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.dumps import rope
from anns_lab.indexes import base, group_queries
from bench_build_scale import PIECES, time_pieces
from bench_decode_memory import heap_mib

DECODER_TIMED = [(rope, "to_serving", "rope move"), (builds, "subsampled_positions", "subsample"),
                 (LayerStore, "__init__", "store"), (base, "as_matrix", "input checks"),
                 (builds, "_device_lists", "given lists")]


def fake_model(dump) -> SimpleNamespace:
    """What ``layer_store`` reads of a loaded model: its config (heads, RoPE) and the device (CPU)."""
    from transformers import AutoConfig

    fields = dict(dump.manifest["model"]["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return SimpleNamespace(config=config, model=SimpleNamespace(device=torch.device("cpu")))


def layer_inputs(dump, layer: int) -> tuple[SimpleNamespace, np.ndarray]:
    """(a cache whose ``layers[layer]`` holds (1, G, n, d) float32 keys and values, the (H, n, d) prefill queries)."""
    G = range(dump.n_kv_heads)
    keys = torch.from_numpy(np.stack([dump.keys(layer, g, "prefill") for g in G]).astype(np.float32))[None]
    values = torch.from_numpy(np.stack([dump.values(layer, g, "prefill") for g in G]).astype(np.float32))[None]
    queries = np.stack([dump.queries(layer, h, "prefill") for h in range(dump.n_heads)]).astype(np.float32)
    return SimpleNamespace(layers={layer: SimpleNamespace(keys=keys, values=values)}), queries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--layers", default="all", help="all, a list 2,15,28 or a range 0:30:3")
    ap.add_argument("--mode", default="roargraph", help="the index (its defaults)")
    ap.add_argument("--build-param", action="append", default=[], help="NAME=VALUE for the index's build")
    ap.add_argument("--threads", type=int, default=1, help="numba's and faiss's threads")
    ap.add_argument("--torch-threads", type=int, default=0, help="torch's (the bfloat16 products); 0 = --threads")
    ap.add_argument("--train-queries", type=int, default=0, help="the decoder's --train-queries (0 = all)")
    ap.add_argument("--given-lists", action="store_true",
                    help="the training lists given to the build as a CUDA host's decoder gives them (decode.device_lists, "
                         "here by torch on the CPU: their own part, 'given lists')")
    ap.add_argument("--held", action="store_true",
                    help="keep every layer's store and print, after each, what malloc holds since the first layer "
                         "(glibc) against the stores' CPU side as the decode table counts it")
    ap.add_argument("--train-group", default=group_queries.DEFAULT, choices=group_queries.MODES,
                    help="the decoder's --train-group (head: an index per query head; group, strided: one per KV head)")
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    faiss.omp_set_num_threads(a.threads)
    torch.set_num_threads(a.torch_threads or a.threads)
    time_pieces()
    time_pieces(DECODER_TIMED)
    dump = anns_lab.open_dump(a.dump)
    if a.layers == "all":
        layers = list(dump.layers)
    elif ":" in a.layers:
        layers = list(range(*[int(x) for x in a.layers.split(":")]))
    else:
        layers = [int(x) for x in a.layers.split(",")]
    lm = fake_model(dump)
    params = {k: float(v) if "." in v else int(v) for k, v in (p.split("=") for p in a.build_param)}
    plan = IndexPlan(a.mode, build_params=params)
    settings = Settings(lists_on_device=a.given_lists, train_queries=a.train_queries, train_group=a.train_group, calibrate=0.0)  # the builds alone
    n_ids = int(dump.manifest["n_tokens"]["prefill"])
    cache, queries = layer_inputs(dump, layers[0])  # compile the kernels outside the timings
    builds.layer_store(lm, cache, n_ids, layers[0], plan, settings, queries)
    del cache, queries  # not in --held's count
    print(f"{a.dump}: {len(layers)} layers x {dump.n_heads} query heads, {a.mode}{params or ''}, n_ids {n_ids}; "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; CPU s, {a.threads} thread(s), torch {torch.get_num_threads()}", flush=True)
    totals = collections.defaultdict(float)
    per_layer, kept = [], []
    gc.collect()
    heap0 = heap_mib()
    for layer in layers:
        cache, queries = layer_inputs(dump, layer)
        PIECES.clear()
        t = time.process_time()
        store = builds.layer_store(lm, cache, n_ids, layer, plan, settings, queries)
        secs = time.process_time() - t
        if a.held:
            kept.append(store)
            del cache, queries, store
            gc.collect()
            print(f"  held after layer {layer}: malloc {heap_mib() - heap0:.1f} MiB, the stores' CPU side "
                  f"{sum(s.cpu_bytes() for s in kept) / 2**20:.1f} MiB", flush=True)
        per_layer.append(secs)
        rest = secs - sum(PIECES.values())
        for k, v in [*PIECES.items(), ("rest", rest)]:
            totals[k] += v
        print(f"  layer {layer}: {secs:.2f} s = " + ", ".join(f"{k} {v:.3f}" for k, v in PIECES.items())
              + f", rest {rest:.3f}", flush=True)
    heads = len(layers) * dump.n_heads
    total = sum(per_layer)
    print(f"\n{len(layers)} layers: {total:.2f} CPU s, {total / len(layers):.3f} per layer (median "
          f"{np.median(per_layer):.3f}), {total / heads:.4f} per query head; per head by part:")
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {k:14s} {v / heads:.4f} s  ({100 * v / total:.0f}%)")


if __name__ == "__main__":
    main()
