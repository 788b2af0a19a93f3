"""How much a roargraph head build waits for the GIL beside a thread that runs Python: the decoder's builds share the
process with its prefill (on a GPU the prefill's thread mostly runs Python, launching kernels) and with each other.

    .venv/bin/python benchmarks/diag_gil_convoy.py --dump /work/dumps/smollm2-text-8192 --layer 11 --head 0
    .venv/bin/python benchmarks/diag_gil_convoy.py --dump /work/dumps/smollm2-text-8192 --switch 0.0002
    .venv/bin/python benchmarks/diag_gil_convoy.py --dump /work/dumps/smollm2-text-8192 --processes

The head's build runs on one thread (as the decoder's workers run it), alone and then beside a second thread that
counts in pure Python (on a machine of two cores or more each has a core: only the GIL is shared). The build releases
the GIL inside its numba and faiss kernels and takes it back between them; each take beside a Python-bound thread waits
up to the interpreter's switch interval (``sys.getswitchinterval``, 5 ms by default, ``--switch`` sets it). Printed per
repeat: the build's wall seconds alone and beside the counter, and the counter's rate beside the build as a share of
its rate alone. ``--processes``: the layer's heads (every query head of ``--layer``) build instead in one worker process
(``indexes.build_processes``, as ``decode --build-processes`` builds them), and the same heads on one thread here are
timed beside it for the ratio: the worker takes its own GIL, only the spooling and the restore here take this one's.
``--calibrate`` (with ``--processes``): the layer's store as the decoder builds it, the builds then its calibration
(``decode.calibrate``, auto target, the layer's newest 64 training queries), on this process's threads against in the
worker (``decode --build-processes``).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from functools import partial

import numpy as np
import torch

import anns_lab
from anns_lab.decode import builds as builds_module
from anns_lab.decode import calibrate
from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.eval.heads import load_head
from anns_lab.indexes import build_processes, registry
from anns_lab.indexes.key_store import KeyStore
from anns_lab.indexes.threads import one_thread


class Counter:
    """A thread counting in pure Python (it holds the GIL but for the interpreter's forced switches) until stopped."""

    def __init__(self):
        self.stop, self.count = threading.Event(), 0

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            for _ in range(1000):
                n += 1
            self.count = n

    def rate_during(self, work) -> tuple[float, float]:
        """(counts per second, wall seconds) while ``work()`` runs on the calling thread."""
        self.stop.clear()
        self.count = 0
        thread = threading.Thread(target=self._run)
        thread.start()
        t0 = time.perf_counter()
        work()
        wall = time.perf_counter() - t0
        self.stop.set()
        thread.join()
        return self.count / wall, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--layer", type=int, default=11)
    ap.add_argument("--head", type=int, default=0)
    ap.add_argument("--index", default="roargraph")
    ap.add_argument("--switch", type=float, default=0.0, help="sys.setswitchinterval seconds (0: Python's, 0.005)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--processes", action="store_true", help="the layer's heads in a worker process, and on this thread")
    ap.add_argument("--calibrate", action="store_true",
                    help="with --processes: the layer's store as decode builds it, its calibration (auto target) after "
                         "the builds, here or in the worker")
    a = ap.parse_args()
    if a.switch > 0:
        sys.setswitchinterval(a.switch)
    dump = anns_lab.open_dump(a.dump)
    cls = registry.get(a.index)
    one_thread()
    torch.set_num_threads(1)  # on the main thread one_thread() leaves torch's bfloat16 product a team of the cores
    heads = [load_head(dump, a.layer, h) for h in (range(dump.n_heads) if a.processes else [a.head])]
    arrays = [{"train_queries": d.train_queries} if cls.uses_train_queries else {} for d in heads]

    def here() -> None:
        for d, kw in zip(heads, arrays):
            cls().build(d.keys, **kw)

    builds = [("on this thread", here)]
    if a.processes:
        workers = build_processes.BuildProcesses(1, (a.index,))
        workers.start()
        rows = [KeyStore(d.keys).head(0) for d in heads]
        builds.append(("in a worker process", lambda: workers.build(cls, {}, rows, list(enumerate(arrays)))))
    if a.calibrate:
        per_kv = dump.n_heads // dump.n_kv_heads
        keys = np.stack([heads[g * per_kv].keys for g in range(dump.n_kv_heads)])
        queries = np.stack([d.train_queries for d in heads])
        newest, scale = np.ascontiguousarray(queries[:, -calibrate.QUERIES:]), dump.head_dim ** -0.5

        def layer(processes) -> None:
            store = LayerStore(a.layer, dump.n_heads, keys, keys, 100, IndexPlan(a.index), 64)
            done: list = []
            then = partial(builds_module._calibrate_in_worker, processes, store, newest, calibrate.AUTO, scale, done)
            store.build(queries, beside=True, processes=processes, then=then if processes else None)
            if not done:
                calibrate.calibrate(store, newest, calibrate.AUTO, scale, beside=True)

        builds = [("store and calibration here", lambda: layer(None)),
                  ("store and calibration in a worker", lambda: layer(workers))]
    for _, build in builds:
        build()  # the kernels loaded (or compiled) outside the timings
    counter = Counter()
    alone_rate, _ = counter.rate_during(lambda: time.sleep(2.0))
    what = f"layer {a.layer}'s {len(heads)} heads" if a.processes else f"layer {a.layer} head {a.head}"
    print(f"{a.dump} {what}, {a.index}, {len(heads[0].keys)} keys; switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms", flush=True)
    for _ in range(a.repeats):
        for where, build in builds:
            t0 = time.perf_counter()
            build()
            alone = time.perf_counter() - t0
            rate, beside = counter.rate_during(build)
            print(f"  {where}: build alone {alone:.3f} s, beside the counting thread {beside:.3f} s "
                  f"({beside / alone:.1f}x); the counter at {rate / alone_rate:.2f} of its rate alone", flush=True)


if __name__ == "__main__":
    main()
