"""Decode latency split per generated token, every mode in one run (issue 6; the prefills: runner.prefill_groups).

    .venv/bin/python benchmarks/bench_decode.py --model smollm2 --context 8192 --json bench-decode-smollm2.json

    .venv/bin/python benchmarks/bench_decode.py --model smollm2 --context 8192 --modes full,roargraph \
        --variant roargraph-exact=roargraph:list_stride=1 --new-tokens 8     # time to first token, old vs new build

Prints the paper's Table 5 shape (retrieval / CPU attention / accelerator attention / merge /
other per token) and the retrieval time of each index mode as a ratio to ``flat`` and ``ivf``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--modes", default="full,window,flat,ivf,roargraph")
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--window", default="128,512")
    ap.add_argument("--param", action="append", default=[])
    ap.add_argument("--train-queries", type=int, default=0)
    ap.add_argument("--add-batch", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="threads of the accelerator stand-in on CPU (default 1: the other core runs the CPU side)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=INDEX:NAME=VALUE,...",
                    help="one more mode: INDEX with these build parameters, shown as LABEL (e.g. "
                         "roargraph-exact=roargraph:list_stride=1, the build before issue 13, beside the defaults)")
    ap.add_argument("--calibrate", type=lambda v: v if v == "auto" else float(v), default=None,
                    help="calibration target of each layer's search: auto (default: anns-lab decode's, calibrate.auto_target) or a weight recall (0: off)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from anns_lab.decode import calibrate, runner
    from anns_lab.decode.engine import Mode, Settings
    from anns_lab.cli_types import parse_params
    from anns_lab.decode.modes import parse_modes
    from anns_lab.dumps.models import load_model
    from anns_lab.window import Window

    if a.device == "cpu":
        from anns_lab.indexes.threads import set_torch_threads

        set_torch_threads(a.torch_threads)  # as decode --torch-threads: it holds after numba starts its threads
    settings = Settings(Window.parse(a.window), topk=a.topk, add_batch=a.add_batch, chunk=2048,
                        train_queries=a.train_queries, calibrate=calibrate.AUTO if a.calibrate is None else a.calibrate)
    modes = parse_modes(a.modes, parse_params(a.param), {})
    for v in a.variant:  # same prefill, same search parameters, other build parameters
        label, spec = v.split("=", 1)
        index, _, build = spec.partition(":")
        base = parse_modes(index, parse_params(a.param), parse_params([b for b in build.split(",") if b], "--variant"))[0]
        modes.append(Mode(label, base.plan))
    t0 = time.perf_counter()
    lm = load_model(a.model, device=a.device)
    result = runner.run_task(lm, modes, settings, a.task, a.context, a.samples, 0, a.new_tokens,
                             progress=lambda s: print(s, flush=True))
    s = {name: m["summary"] for name, m in result["modes"].items()}
    print(f"\n{a.model} {a.task} context {a.context} device {a.device} threads {torch.get_num_threads()} "
          f"({platform.processor() or platform.machine()}), {time.perf_counter() - t0:.0f} s total")
    print(runner.table(result))
    ratios = {}
    for name, v in s.items():
        if v.get("retrieval_ms"):
            ratios[name] = {ref: v["retrieval_ms"] / s[ref]["retrieval_ms"] for ref in ("flat", "ivf")
                            if ref in s and s[ref].get("retrieval_ms")}
            print(f"retrieval {name}: " + ", ".join(f"{r:.2f}x {ref}" for ref, r in ratios[name].items()))
    result |= {"bench": vars(a), "retrieval_ratios": ratios}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=float)


if __name__ == "__main__":
    main()
