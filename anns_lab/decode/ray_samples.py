"""Decode samples on a Ray cluster: one task per sample (its prefills and all its modes).

A task asks for ``cpus_per_task`` CPUs (the CPU side: index builds and searches), and one GPU as well when the
cluster has GPUs (the model then runs on CUDA there). Each worker process loads the model once and keeps it for its next samples;
the model name must resolve on every node (an alias, a Hugging Face id in the node's cache, or a
folder at the same path). Results come back to the driver, which scores and merges them exactly as
a local run does (:func:`anns_lab.decode.runner._run_prompts`).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator

from anns_lab import stops as stop_requests  # `stops` here are the stop tokens' ids
from anns_lab.errors import DecodeError
from anns_lab.eval.executors.ray_cluster import Cluster, ClusterWatch, check_cpus_per_task, ray_error_text

_MODELS: dict = {}  # per Ray worker process: (model, device, RoPE scaling) → loaded model


def _sample_task(model: str, device: str, rope_scaling, torch_threads: int, modes, settings, prompt: tuple[list[int], int],
                 max_new: int, stops: set[int]) -> dict:
    from anns_lab.decode.runner import run_sample
    from anns_lab.dumps.models import load_model
    from anns_lab.indexes.threads import numpy_blas_one_thread, set_torch_threads

    if torch_threads > 0:  # --torch-threads holds on the workers as on the driver
        set_torch_threads(torch_threads)
    numpy_blas_one_thread()  # as on the driver
    key = (model, device, rope_scaling)
    if key not in _MODELS:
        _MODELS.clear()  # one model per worker: a second would double its memory
        _MODELS[key] = load_model(model, device=device, rope_scaling=rope_scaling)
    ids, question = prompt
    return run_sample(_MODELS[key], modes, settings, ids, max_new, stops, question=question)


class RaySamples:
    """``map_samples`` for :func:`anns_lab.decode.runner.run_task` on a Ray cluster."""

    in_flight = 2  # samples submitted and not yet handed back, at most (set from the cluster's size)

    def __init__(self, address: str | None, model: str, cpus_per_task: float = 1.0, local_cpus: int = 2,
                 log=print, rope_scaling=None, torch_threads: int = 0) -> None:
        check_cpus_per_task(cpus_per_task)
        self.cluster = Cluster(address, local_cpus, log)
        self.log = log
        self.ray = self.cluster.ray
        self.model, self.rope_scaling, self.torch_threads = model, rope_scaling, torch_threads
        self.resources, self.device = {"CPU": float(cpus_per_task)}, "cpu"
        if self.cluster.gpus() >= 1:
            self.resources, self.device = self.resources | {"GPU": 1.0}, "cuda"
        self.cluster.require(self.resources, "decode")
        slots = self.cluster.gpus() if self.device == "cuda" else self.cluster.cpus() / self.resources["CPU"]
        self.in_flight = 2 * max(1, int(slots))  # every slot busy, and its next sample waiting beside it
        log(f"ray: one task per sample, each with {', '.join(f'{v:g} {k}' for k, v in self.resources.items())} "
            f"(model on {self.device})")

    def map_samples(self, modes, settings, prompts: Iterable[tuple[list[int], int]], max_new: int,
                    stops: set[int]) -> Iterator[dict]:
        """Yield the samples' results in sample order, each prompt (its ids, and how many of the last ask the question:
        ``runner.run_sample``'s ``question``) taken from ``prompts`` (made there as its turn comes)
        and submitted once fewer than ``in_flight`` wait: --samples 10^6 made and sent every prompt first. ``modes()``:
        the modes a sample runs, asked as it is submitted (a mode the driver has given up on is left out from then); a
        sample with none left is not sent (its result has no runs). Ctrl-C cancels what is left."""
        task = self.ray.remote(_sample_task).options(num_cpus=self.resources["CPU"], num_gpus=self.resources.get("GPU", 0),
                                                   max_retries=2)
        source, pending = iter(prompts), collections.deque()
        watch = None  # made at the first wait
        try:
            while True:
                for prompt in itertools.islice(source, max(0, self.in_flight - len(pending))):
                    now = modes()
                    pending.append(task.remote(self.model, self.device, self.rope_scaling, self.torch_threads, now,
                                               settings, prompt, max_new, stops) if now else None)
                if not pending:
                    return
                if pending[0] is None:  # every mode left out: nothing ran
                    pending.popleft()
                    yield {"runs": {}}
                    continue
                while not self.ray.wait([pending[0]], timeout=1.0)[0]:  # wakes up for Ctrl-C
                    stop_requests.check()
                    watch = watch or ClusterWatch(self.cluster, self.resources, "decode", "Ctrl-C stops it", self.log)
                    watch()
                try:
                    yield self.ray.get(pending.popleft())
                except self.ray.exceptions.RayError as err:
                    raise DecodeError(f"a decode sample failed on Ray: {ray_error_text(err)}") from None
        except KeyboardInterrupt:
            self.cluster.abandon([ref for ref in pending if ref is not None])
            raise

    def close(self) -> None:
        self.cluster.close()
