"""CPU memory of the decoder's key rows and the process after a decode with adds (keys owned once, issue 11).

    .venv/bin/python benchmarks/bench_decode_memory.py --context 4096 --new-tokens 192 --mode roargraph

Prefills SmolLM2 on ``--context`` tokens of the offline text, decodes ``--new-tokens`` greedy tokens in
one index mode (tokens leave the window and are added every ``--add-batch``), then reports the bytes of
distinct key buffers held by the layer stores and their indexes (each buffer counted once, however many
arrays view it), of the stores' value buffers, the CPU side as the decode table counts it (``cpu_bytes``), what
glibc's malloc holds in use (the prefill's cache and queries included: compare runs, not with the count), and the
process's resident set (VmRSS, after gc). Runs on
any commit of the lab that has ``decode.engine.prefill/run_mode``: point ``PYTHONPATH`` at an older tree to
measure it in the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import numpy as np
import torch


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def key_bytes(stores: dict) -> tuple[int, int]:
    """(bytes of the stores' own key buffers, bytes of distinct key buffers the indexes hold besides)."""
    own = {id(_root(s.keys)): _root(s.keys) for s in stores.values()}
    extra = {}
    for s in stores.values():
        for index in {id(ix): ix for ix in s.indexes}.values():
            store = getattr(index, "_rows", None)
            buf = getattr(getattr(store, "store", store), "buf", None)  # KeyRows → KeyStore, or the older KeyStore
            if isinstance(buf, np.ndarray) and id(_root(buf)) not in own:
                extra[id(_root(buf))] = _root(buf)
    return sum(a.nbytes for a in own.values()), sum(a.nbytes for a in extra.values())


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def heap_mib() -> float:
    """What glibc's malloc has handed out and not taken back (0 where it cannot tell: not glibc 2.33+)."""
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Mallinfo2
    except (OSError, AttributeError):
        return 0.0
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--mode", default="roargraph")
    ap.add_argument("--add-batch", type=int, default=64)
    a = ap.parse_args()

    import anns_lab
    from anns_lab.decode import engine
    from anns_lab.decode.placement import IndexPlan
    from anns_lab.dumps.models import load_model
    from anns_lab.dumps.prompts import build_prompt

    torch.set_num_threads(1)
    try:
        from anns_lab.window import Window

        window = {"window": Window(128, 512)}
    except ImportError:  # a tree from before the Window value
        window = {"sink": 128, "recent": 512}
    # Room for the run's tokens, as the decoder's runner reserves it (trees before that field: their own rule).
    steps = {"steps": a.new_tokens} if "steps" in {f.name for f in dataclasses.fields(engine.Settings)} else {}
    settings = engine.Settings(**window, topk=100, add_batch=a.add_batch, chunk=2048, **steps)
    lm = load_model("smollm2")
    ids = build_prompt("text", lm.tokenizer, a.context).ids
    t0 = time.perf_counter()
    pre = engine.prefill(lm, ids, settings, capture_queries=True)
    run = engine.run_mode(lm, pre, engine.Mode(a.mode, IndexPlan(a.mode)), settings, a.new_tokens)
    gc.collect()
    own, extra = key_bytes(run.stores)
    value_bytes = sum({id(_root(s.values)): _root(s.values).nbytes for s in run.stores.values()}.values())
    n_indexed = next(iter(run.stores.values())).n_indexed
    print(f"{anns_lab.__file__}\nSmolLM2 context {a.context} + {len(run.tokens)} new tokens, {a.mode}, "
          f"{n_indexed} keys indexed per layer, {time.perf_counter() - t0:.0f} s")
    counted = sum(s.cpu_bytes() for s in run.stores.values()) if hasattr(next(iter(run.stores.values())), "cpu_bytes") \
        else float("nan")
    print(f"key buffers: stores {own / 2**20:.1f} MiB, indexes' own copies {extra / 2**20:.1f} MiB; "
          f"value buffers {value_bytes / 2**20:.1f} MiB; CPU side as the decode table counts it {counted / 2**20:.1f} "
          f"MiB; malloc in use {heap_mib():.0f} MiB; VmRSS {rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
