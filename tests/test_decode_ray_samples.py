"""decode --executor ray: what the driver is given reaches each sample's task (Ray itself replaced by an in-process
stand-in that runs the task where it is submitted)."""

from __future__ import annotations

from click.testing import CliRunner

from anns_lab.cli import main
from anns_lab.decode import ray_samples
from anns_lab.dumps import tasks
from anns_lab.indexes import threads


class _InProcessRay:
    """``ray.remote(fn).options(...).remote(*args)`` runs ``fn(*args)`` at once; ``wait``/``get`` hand back its result."""

    class exceptions:  # noqa: N801 (ray's name)
        RayError = RuntimeError

    def remote(self, fn):
        submit = self.submit

        class Task:
            def options(self, **_):
                return self

            def remote(self, *args):
                return submit(fn, args)

        return Task()

    def submit(self, fn, args):
        return fn(*args)

    def wait(self, refs, timeout=None):
        return refs, []

    def get(self, ref):
        return ref


def test_torch_threads_reach_every_ray_task(tiny_llama, monkeypatch):
    """``--torch-threads`` set torch's threads on the driver only: each task's worker ran torch with its own count. A
    private Ray gets the machine's CPUs (it had 2 on any machine: two samples on one CPU, or two of 64)."""
    from anns_lab.eval import executors

    made, set_to = [], []
    monkeypatch.setattr(executors, "machine_cpus", lambda: 5)

    def fake_init(self, address, model, cpus_per_task=1.0, local_cpus=2, log=print, rope_scaling=None, **kw):
        made.append(kw | {"local_cpus": local_cpus})
        self.ray, self.model, self.rope_scaling, self.device = _InProcessRay(), model, rope_scaling, "cpu"
        self.resources, self.torch_threads = {"CPU": 1.0}, kw.get("torch_threads", 0)

    monkeypatch.setattr(ray_samples.RaySamples, "__init__", fake_init)
    monkeypatch.setattr(ray_samples.RaySamples, "close", lambda self: None)
    monkeypatch.setattr(ray_samples, "_MODELS", {})
    monkeypatch.setattr(threads, "set_torch_threads", lambda n: set_to.append(n))  # the driver's and the tasks' calls
    made_samples, make = [], tasks.make_sample
    monkeypatch.setattr(tasks, "make_sample", lambda *a, **k: made_samples.append(a) or make(*a, **k))
    res = CliRunner().invoke(main, ["decode", "--model", str(tiny_llama), "--task", "passkey", "--context", "200",
                                    "--mode", "full,window", "--window", "4,16", "--max-new-tokens", "2", "--chunk", "64",
                                    "--samples", "2", "--executor", "ray", "--torch-threads", "1"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert [m.get("torch_threads") for m in made] == [1] and made[0]["local_cpus"] == 5
    assert set_to == [1, 1, 1]  # the driver's load, then each of the 2 samples' tasks
    assert len(made_samples) == 2  # each prompt made once (twice before: for the tasks, then for the scores)


def test_ray_samples_take_their_prompts_as_the_window_frees(monkeypatch):
    """Before: every prompt was made and submitted before the first result (--samples 10^6 held all of them)."""
    samples = object.__new__(ray_samples.RaySamples)
    samples.ray, samples.resources, samples.in_flight = _InProcessRay(), {"CPU": 1.0}, 3
    samples.model, samples.device, samples.rope_scaling, samples.torch_threads = "m", "cpu", None, 0
    monkeypatch.setattr(ray_samples, "_sample_task", lambda *args: {"ids": args[6]})
    drawn = []

    def prompts():
        for i in range(10):
            drawn.append(i)
            yield [i], 0

    for i, res in enumerate(samples.map_samples(lambda: ["full"], None, prompts(), 2, set())):
        assert res == {"ids": ([i], 0)}  # in sample order: each prompt's ids and its question's length
        assert len(drawn) <= i + 3  # at most the window ahead of what came back
    assert drawn == list(range(10))


def test_a_samples_error_on_ray_reaches_the_driver_in_its_own_words(monkeypatch):
    """A sample's task that raised (a layer's build failed on the worker) comes back from ``ray.get`` as a
    ``RayTaskError``, whose first line only says where it ran: the driver's one error carries the task's own."""
    import traceback

    import pytest

    ray_exceptions = pytest.importorskip("ray.exceptions")
    from anns_lab.errors import DecodeError

    class FailingRay(_InProcessRay):
        exceptions = ray_exceptions

        def submit(self, fn, args):
            return lambda: fn(*args)  # run at get(), as a worker would have

        def get(self, ref):
            try:
                return ref()
            except Exception as err:  # as Ray hands a task's exception to the driver
                raise ray_exceptions.RayTaskError("_sample_task", traceback.format_exc(), err, pid=1,
                                              ip="127.0.0.1").as_instanceof_cause() from None

    def sample_task(*args):
        raise DecodeError("building layer 1's indexes: broken raised RuntimeError: no memory for its graph")

    monkeypatch.setattr(ray_samples, "_sample_task", sample_task)
    samples = object.__new__(ray_samples.RaySamples)
    samples.ray, samples.resources = FailingRay(), {"CPU": 1.0}
    samples.model, samples.device, samples.rope_scaling, samples.torch_threads = "m", "cpu", None, 0
    with pytest.raises(DecodeError) as err:
        next(samples.map_samples(lambda: ["full"], None, [([1, 2, 3], 0)], 2, set()))
    assert str(err.value) == ("a decode sample failed on Ray: building layer 1's indexes: broken raised RuntimeError: "
                              "no memory for its graph")


def test_each_sample_runs_the_modes_live_when_it_is_handed_out(monkeypatch):
    """decode --give-up-after on Ray: ``modes()`` is asked as each sample is submitted (the window's samples keep the
    modes they were sent with), and a sample with no mode left is not sent at all (a task loads the model and
    prefills: the cost giving up saves)."""
    samples = object.__new__(ray_samples.RaySamples)
    samples.ray, samples.resources, samples.in_flight = _InProcessRay(), {"CPU": 1.0}, 3
    samples.model, samples.device, samples.rope_scaling, samples.torch_threads = "m", "cpu", None, 0
    sent = []
    monkeypatch.setattr(ray_samples, "_sample_task", lambda *args: sent.append(args[6]) or {"modes": args[4]})
    live = [["full", "broken"]]
    got = []
    for i, res in enumerate(samples.map_samples(lambda: list(live[0]), None, (([i], 0) for i in range(7)), 2, set())):
        got.append(res)
        live[0] = ["full"] if i == 0 else [] if i == 3 else live[0]  # as the driver gives up, after results 0 and 3
    assert [r.get("modes") for r in got] == [["full", "broken"]] * 3 + [["full"]] * 3 + [None]
    assert got[-1] == {"runs": {}} and sent == [([i], 0) for i in range(6)]  # the last sample never sent
