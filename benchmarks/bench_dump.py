"""Capture overhead of ``anns-lab dump`` against the plain chunked prefill of the same tokens, in one run.

    python benchmarks/bench_dump.py --model smollm2 --tokens 8192
    python benchmarks/bench_dump.py --model gemma3-270m --tokens 32768 --decode-tokens 16

Prints one Markdown row: plain prefill time, dump prefill time (with capture), overhead ratio,
tokens/s, decode and write time, bytes written, peak RSS; wall-clock and CPU seconds (CPU time
is the steadier figure when other work shares the machine). Plain and capturing runs alternate
``--repeat`` times and the fastest of each is kept, so a busy machine biases neither side.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch

from anns_lab.dumps.models import attention_masks, forward_tokens, load_model
from anns_lab.dumps.prompts import build_prompt
from anns_lab.dumps.run import run_dump


def plain_prefill_seconds(model: str, tokens: int, chunk: int) -> tuple[float, float]:
    """The prefill without capture, with the masks the capture registers (``attention_masks``: transformers' own
    boolean ones cost SDPA a conversion per layer and chunk, which would count as a saving of the capture)."""
    from transformers import DynamicCache
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    lm = load_model(model)
    ids = build_prompt("text", lm.tokenizer, tokens).ids
    cache = DynamicCache(config=lm.model.config)
    inner = lm.model.config._attn_implementation
    own = ALL_MASK_ATTENTION_FUNCTIONS[inner]
    AttentionMaskInterface.register(inner, attention_masks(inner))
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            for start in range(0, len(ids), chunk):
                forward_tokens(lm, cache, ids, start, min(start + chunk, len(ids)))
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        AttentionMaskInterface.register(inner, own)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--layers", default="default")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice).")
    ap.add_argument("--keep", type=Path, default=None, help="Keep the dump in this folder instead of a temporary one.")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tmp = Path(tempfile.mkdtemp(prefix="bench-dump-"))
    out = args.keep or tmp / "dump"
    plains, runs = [], []
    for _ in range(args.repeat):
        plains.append(plain_prefill_seconds(args.model, args.tokens, args.chunk))
        runs.append(run_dump(args.model, tokens=args.tokens, decode_tokens=args.decode_tokens, layers=args.layers,
                             dtype=args.dtype, chunk=args.chunk, out=out, overwrite=True, progress=False))
    plain = min(p[0] for p in plains)
    plain_cpu = min(p[1] for p in plains)
    res = min(runs, key=lambda r: r.dump.manifest["timing"]["prefill_s"])
    m = res.dump.manifest
    t = m["timing"]
    nbytes = sum(e["bytes"] for e in m["files"].values())
    capture = t["prefill_s"] + t["write_s"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print("| model | tokens | layers | plain prefill s (CPU s) | dump prefill s (CPU s) | + write s | overhead wall | overhead CPU | tok/s (dump) | decode s | MiB written | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.model} | {args.tokens} + {args.decode_tokens} | {len(m['layers'])} | {plain:.1f} ({plain_cpu:.1f}) | "
          f"{t['prefill_s']:.1f} ({t['prefill_cpu_s']:.1f}) | {t['write_s']:.1f} | {capture / plain - 1:+.1%} | "
          f"{(t['prefill_cpu_s'] + t['write_s']) / plain_cpu - 1:+.1%} | {args.tokens / t['prefill_s']:.0f} | "
          f"{t['decode_s']:.1f} | {nbytes / 2**20:.0f} | {rss:.1f} |")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
