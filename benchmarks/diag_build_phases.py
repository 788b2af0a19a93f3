"""Where a decode layer's build goes, in wall seconds, on the machine's device: each long-range layer built one after
another as ``anns-lab decode``'s early builds build it (``decode.builds.layer_store`` beside other work: the layer's
heads and its calibration's searches on one-thread workers, :func:`indexes.threads.map_one_thread`; the heads in
worker processes, ``indexes.build_processes``, where ``--build-processes``, by default on an accelerator as decode's).

    python benchmarks/diag_build_phases.py --model smollm2 --context 8184 --device cuda
    python benchmarks/diag_build_phases.py --model gemma3-270m --context 32560 --device cuda

A passkey prompt is prefilled once (queries kept, the training lists on the device where it is CUDA, as the decoder
does), then every long-range layer of ``--mode`` (roargraph) is built with today's defaults and calibration. Printed per
layer: its wall seconds and the calibrated value; then each part's wall seconds summed over the layers (the parts are
the functions the build looks up, wrapped: the keys' copy and the rest is what no wrapper covers). On a many-core host
a layer's wall is the serial path the decoder's ``--build-layers`` overlaps across layers.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from anns_lab.decode import builds, calibrate, placement
from anns_lab.decode.cli import builds_in_processes
from anns_lab.decode.engine import Settings, kept_queries, prefill
from anns_lab.decode.modes import parse_modes
from anns_lab.decode.runner import MAX_NEW
from anns_lab.dumps import rope, tasks
from anns_lab.dumps.models import load_model
from anns_lab.indexes.threads import thread_budget

PARTS = [(rope, "placed", "queries' RoPE move"), (builds, "_device_lists", "training lists"),
         (placement.LayerStore, "build", "head builds"), (calibrate, "calibrate", "calibration"),
         (calibrate, "_scores", "  of it: exact scores"), (calibrate, "_checked", "  of it: searches (CPU s, summed)")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8184)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mode", default="roargraph")
    ap.add_argument("--build-processes", action=argparse.BooleanOptionalAction, default=None,
                    help="the head builds in worker processes (default as decode's: on an accelerator)")
    a = ap.parse_args()
    lm = load_model(a.model, device=a.device)
    sample = tasks.make_sample("passkey", lm.tokenizer, a.context, 0, 0.5)
    modes = parse_modes(a.mode, {}, {})
    # the CLI's defaults, nothing built yet, and decode's room for a passkey's answer (runner.run_prompts): the
    # steps decide the positions the training queries move to, and so the calibration's raises
    settings = Settings(calibrate=calibrate.AUTO, build_during_prefill=False, steps=MAX_NEW["passkey"],
                        build_processes=builds_in_processes(a.build_processes, a.device))
    builds.start_build_processes(modes, settings)  # as decode starts them, before its prefill
    pre = prefill(lm, sample.ids, settings, True, modes, newest_queries=kept_queries(modes, settings))
    print(f"{a.model} {len(sample.ids)} tokens on {a.device}: prefill {pre.seconds:.2f} s; thread budget "
          f"{thread_budget()}; head builds in {'worker processes' if settings.build_processes else 'threads'}",
          flush=True)
    spent: collections.Counter = collections.Counter()
    for owner, name, label in PARTS:
        setattr(owner, name, timed(spent, label, getattr(owner, name)))
    total = 0.0
    for layer in lm.long_range_layers:
        t0 = time.perf_counter()
        store = builds.layer_store(lm, pre.cache, len(sample.ids), layer, modes[0].plan_for(layer), settings,
                                   pre.queries[layer], pre.scaling.get(layer), beside=True)
        wall = time.perf_counter() - t0
        total += wall
        cal = store.calibration
        print(f"  layer {layer}: {wall:.3f} s" + (f", {cal.param} {cal.value} after {len(cal.tried)} probes" if cal else ""),
              flush=True)
    print(f"{len(lm.long_range_layers)} layers one after another: {total:.2f} s")
    for _, _, label in PARTS:
        print(f"  {label}: {spent[label]:.2f} s ({100 * spent[label] / total:.0f}%)")
    top = sum(spent[label] for _, _, label in PARTS if not label.startswith(" "))
    print(f"  the keys' copy and the rest: {total - top:.2f} s")


def timed(spent: collections.Counter, label: str, fn):
    """``fn``, its wall seconds added to ``spent[label]`` at each call (summed over threads where it runs on several)."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t0

    return wrapper


if __name__ == "__main__":
    main()
