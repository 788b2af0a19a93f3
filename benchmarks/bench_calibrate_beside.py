"""``--calibrate`` beside the prefill: a layer's probes on one one-thread worker (before) against its indexes spread
over the workers (``calibrate.calibrate(..., beside=True)``, the decoder's now).

    .venv/bin/python benchmarks/bench_calibrate_beside.py --dump /work/dumps/smollm2-text-8192 --mode ivf
    .venv/bin/python benchmarks/bench_calibrate_beside.py --dump /work/dumps/smollm2-text-8192 --mode roargraph

Each listed layer's store is built first (untimed), as the decoder builds it (``decode.builds.layer_store``, no
calibration). Then, per arm and repeat, a stand-in prefill runs on its own thread (float32 matmuls of a prefill
chunk's MLP shape through torch's default threads, counted) while the build thread calibrates every layer one after
another: ``one`` on a single one-thread worker below the prefill's priority (every index of the layer in turn: the
decoder's calibration up to this benchmark's commit), ``spread`` with the layer's indexes side by side on the
one-thread workers (:func:`threads.map_one_thread`, what the decoder does now). Printed: the calibration alone (wall,
process CPU seconds), and beside the stand-in its wall seconds, the stand-in's products per second while it ran as a
share of its rate alone (how much the calibration slows the prefill) and the process's CPU seconds. The two arms choose
the same values (checked).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np
import torch

import anns_lab
from anns_lab.decode import builds, calibrate
from anns_lab.decode.engine import Settings
from anns_lab.decode.placement import IndexPlan
from anns_lab.indexes.threads import map_one_thread
from bench_decoder_build import fake_model, layer_inputs


class StandIn:
    """A prefill stand-in on its own thread: (chunk × hidden) @ (hidden × 3·hidden) float32 products until stopped."""

    def __init__(self, chunk: int, hidden: int):
        gen = torch.Generator().manual_seed(0)
        self.a = torch.randn(chunk, hidden, generator=gen)
        self.b = torch.randn(hidden, 3 * hidden, generator=gen)
        self.stop, self.done, self.t = threading.Event(), 0, (0.0, 0.0)

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop.is_set():
            torch.mm(self.a, self.b)
            self.done += 1
        self.t = (t0, time.perf_counter())

    def __enter__(self) -> "StandIn":
        self.stop.clear()
        self.done = 0
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    @property
    def rate(self) -> float:
        return self.done / (self.t[1] - self.t[0])


def calibrate_all(stores, newest, target: float, scaling: list[float], spread: bool) -> tuple[float, list]:
    """Wall seconds of calibrating every store one after another from its search as built, and the values chosen."""
    t = time.perf_counter()  # readings only (change_store=False): every call starts from the search as built
    if spread:
        chosen = [calibrate.calibrate(s, q, target, c, beside=True, change_store=False)
                  for s, q, c in zip(stores, newest, scaling)]
    else:  # a worker's budget is one thread: calibrate's own map then runs every index in turn on it
        chosen = [map_one_thread(lambda st: calibrate.calibrate(st, q, target, c, change_store=False), [s],
                                 beside=True)[0] for s, q, c in zip(stores, newest, scaling)]
    wall = time.perf_counter() - t
    return wall, [(c.param, c.value) for c in chosen if c is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--layers", default="0:30:3", help="a list 2,15,28 or a range 0:30:3")
    ap.add_argument("--mode", default="ivf", help="the index (its defaults)")
    ap.add_argument("--target", type=float, default=calibrate.TARGET)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=2048, help="the stand-in's rows (a prefill chunk)")
    a = ap.parse_args()
    dump = anns_lab.open_dump(a.dump)
    layers = list(range(*map(int, a.layers.split(":")))) if ":" in a.layers else [int(x) for x in a.layers.split(",")]
    lm = fake_model(dump)
    settings = Settings(lists_on_device=False, calibrate=0.0)  # built uncalibrated: each arm calibrates from the default
    n_ids = int(dump.manifest["n_tokens"]["prefill"])
    stores, newest = [], []
    for layer in layers:
        cache, queries = layer_inputs(dump, layer)
        stores.append(builds.layer_store(lm, cache, n_ids, layer, IndexPlan(a.mode), settings, queries))
        newest.append(np.ascontiguousarray(queries[:, -calibrate.QUERIES:]))
    scaling = [dump.scaling(layer) for layer in layers]
    calibrate_all(stores, newest, a.target, scaling, True)  # compile the search kernels outside the timings
    stand_in = StandIn(a.chunk, lm.config.hidden_size)
    with stand_in:
        time.sleep(3.0)
    alone = stand_in.rate
    print(f"{a.dump}: {len(layers)} layers x {dump.n_heads} query heads, {a.mode}, target {a.target}; "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}; "
          f"stand-in alone {alone:.1f} products/s", flush=True)
    rows, chosen = {"one": [], "spread": []}, {}
    for r in range(a.repeats):
        for arm in ("one", "spread") if r % 2 == 0 else ("spread", "one"):
            cpu = time.process_time()
            solo, _ = calibrate_all(stores, newest, a.target, scaling, arm == "spread")
            solo_cpu, cpu = time.process_time() - cpu, time.process_time()
            with stand_in:
                wall, chosen[arm] = calibrate_all(stores, newest, a.target, scaling, arm == "spread")
            cpu = time.process_time() - cpu
            rows[arm].append((solo, solo_cpu, wall, stand_in.rate / alone, cpu))
            print(f"  {arm:6s} alone {solo:.2f} s wall, {solo_cpu:.2f} CPU s; beside the stand-in {wall:.2f} s wall, "
                  f"the stand-in at {stand_in.rate / alone:.2f} of its rate alone, {cpu:.2f} CPU s (process)", flush=True)
    assert chosen["one"] == chosen["spread"], chosen
    med = {arm: np.median(np.array(v), axis=0) for arm, v in rows.items()}
    for arm, (solo, solo_cpu, wall, share, cpu) in med.items():
        print(f"median {arm:6s}: alone {solo:.2f} s wall, {solo_cpu:.2f} CPU s; beside {wall:.2f} s wall, stand-in at "
              f"{share:.2f}, {cpu:.2f} CPU s")
    o, t = med["spread"], med["one"]
    print(f"spread / one: alone CPU s {o[1] / t[1]:.2f}x; beside: calibration wall {o[2] / t[2]:.2f}x, stand-in rate "
          f"{o[3] / t[3]:.2f}x; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
