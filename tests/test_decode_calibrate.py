"""``--calibrate``: each layer's search raised at build time, where its present value falls short, to the cheapest grid
value reaching a weight recall (the exact top-k's softmax weight the search returns) on the newest prefill queries,
checked against every grid value's weight recall computed here with numpy in float64."""

from __future__ import annotations

import dataclasses
import json

import sys

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import TEST_DEVICE

from anns_lab.cli import main
from anns_lab.decode import calibrate
from anns_lab.decode.options import calibrates
from anns_lab.decode.engine import Mode, Settings, prefill, run_mode
from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.dumps.models import load_model
from anns_lab.indexes import registry
from anns_lab.window import Window


def _clustered(rng, n, d, centers=12, spread=0.3):
    c = rng.normal(size=(centers, d))
    return (c[rng.integers(0, centers, n)] + spread * rng.normal(size=(n, d))).astype(np.float32)


def _store(name: str, build: dict, seed: int = 0, value_mean: float = 0.0):
    """A layer of 4 query heads on 2 KV heads, 600 keys each, built (roargraph: on each head's own queries); a plugin's
    index (simhash, vattention, magicpig) skips the test where its package is not installed."""
    if name not in registry.available():
        pytest.skip(f"the {name} plugin is not installed (make test installs it)")
    rng = np.random.default_rng(seed)
    h, g, n, d = 4, 2, 600, 16
    keys = np.stack([_clustered(rng, n, d) for _ in range(g)])
    values = (value_mean + rng.normal(size=(g, n, d))).astype(np.float32)
    store = LayerStore(5, h, keys, values, 30, IndexPlan(name, build, {}), add_batch=8)
    queries = np.stack([_clustered(rng, 500, d) for _ in range(h)])
    store.build(queries if registry.get(name).uses_train_queries else None)
    return store, queries[:, -calibrate.QUERIES:]


SCALING = 0.25  # the layer's softmax scale (1/sqrt(d) for these 16-dim heads)


def _reference_recall(store, queries, param, value, scaling: float | None = SCALING) -> float:
    """Mean over heads and queries of the softmax weight (float64, at ``scaling``) of the distinct returned keys over
    that of the exact top-k, each head's index searched alone, exact top-k by a full numpy sort; ``scaling`` None: set
    recall (the share of the exact top-k returned: no ties in random float data)."""
    return float(np.mean(_reference_per_head(store, queries, param, value, scaling)))


def _reference_per_head(store, queries, param, value, scaling: float | None = SCALING) -> list[float]:
    """:func:`_reference_recall` of each query head (the heads have as many queries each: their mean is the layer's)."""
    k = store.topk
    per_head = []
    for h in range(store.n_heads):
        out = []
        keys = store.keys[h // store.group, : store.n_indexed].astype(np.float64)
        logits = queries[h].astype(np.float64) @ keys.T
        weights = np.exp((scaling or 0.0) * (logits - logits.max(axis=1, keepdims=True)))
        exact = np.argsort(-logits, axis=1)[:, :k]
        got = store.indexes[h].search(queries[h], k, **{param: value}).ids
        if scaling is None:
            out += [len(set(a[a >= 0]) & set(b)) / k for a, b in zip(got, exact)]
        else:
            out += [w[np.unique(a[a >= 0])].sum() / w[b].sum() for w, a, b in zip(weights, got, exact)]
        per_head.append(float(np.mean(out)))
    return per_head


def _raised(name: str) -> str:
    """The grid parameter calibration raises: the grid's one, or the one the class names among several."""
    cls = registry.get(name)
    return cls.calibrated_by or next(iter(cls.search_grid))


def _over_scan(store, queries, param, value, scaling: float = SCALING) -> float:
    """Mean bytes read per query at ``param`` = ``value`` (each head's index searched alone, as its own count says; an
    estimator sizing its sample by the softmax's spread at the layer's ``scaling``) over an exact scan's: every indexed
    key, 4·d bytes."""
    search = type(store.indexes[0]).scaled({param: value}, scaling)
    read = [store.indexes[h].search(queries[h], store.topk, **search).bytes_read for h in range(store.n_heads)]
    return float(np.concatenate(read).mean()) / (store.n_indexed * 4 * store.keys.shape[2])


def _expected(values, recalls, floor, target, over=None) -> tuple[int, bool]:
    """The rule, written out: the floor where it reaches the target, else the cheapest value above it that reaches it or
    reads more than a scan (``over``: each value's bytes over a scan's), else the most thorough; and whether the layer
    is then scanned exactly (a raise that read more than a scan)."""
    over = over or [0.0] * len(values)
    if recalls[floor] >= target:
        return floor, False
    if over[floor] > 1:  # a search given that falls short and reads more than a scan: scanned at once
        return floor, True
    want = next((i for i in range(floor + 1, len(values)) if recalls[i] >= target or over[i] > 1), len(values) - 1)
    return want, over[want] > 1


@pytest.mark.parametrize("name,build,target,present", [
    ("roargraph", dict(M=8, R=16, n_hubs=4, keep_queries=64), 0.9, None),
    ("roargraph", dict(M=8, R=16, n_hubs=4, keep_queries=64), 0.99, None),
    ("roargraph", dict(M=8, R=16, n_hubs=4, keep_queries=64), 0.5, 55),  # between grid values: 55 itself is probed
    ("roargraph", dict(M=8, R=16, n_hubs=4, keep_queries=64), 0.99, 55),
    ("roargraph", dict(M=8, R=16, n_hubs=4, keep_queries=64), 0.99, 50),
    ("roargraph", dict(M=8, R=16, n_hubs=4, keep_queries=64), 0.999, 1500),  # beyond the grid's 1200: kept, not lowered
    ("simhash", {"K": 2, "L": 8}, 0.01, None),  # a descending grid (8, 6, ..., 1): the default 2 is kept, not cut to 8
    ("simhash", {"K": 2, "L": 8}, 0.01, 5),
    ("simhash", {"K": 4, "L": 8}, 0.99, 5),
    ("ivf", {"nlist": 32}, 0.9, None),
    ("ivf", {"nlist": 32}, 0.3, 1),
    ("ivf", {"nlist": 32}, 1.01, None),  # unreachable: every list reads the centroids and every key, more than a scan
    ("ivf", {"nlist": 32}, 0.5, 32),  # every list given and reaching: kept, though it reads more than a scan
    ("ivf", {"nlist": 32}, 1.01, 31),  # given, short and reading more than a scan: scanned, nothing raised
    ("roargraph", dict(M=8, R=16, n_hubs=4, keep_queries=64), 1.01, None),
    ("sparq", {}, 0.9, None),  # two grid parameters: budget raised at the default rank (1/4)
    ("sparq", {}, 0.999, 128),
    ("loki", {}, 0.999, 128)])
def test_calibration_raises_the_search_to_the_cheapest_grid_value_reaching_the_target(name, build, target, present):
    store, newest = _store(name, build)
    param = _raised(name)
    if present is not None:  # as --param gives it
        store.plan = dataclasses.replace(store.plan, search_params={param: present})
    # the built index's grid (IVF: clipped to its nlist; sparq's budgets, each once)
    values = list(dict.fromkeys(point[param] for point in store.indexes[0].grid()))
    start = present if present is not None else registry.get(name).search_params[param].default
    order = 1 if values[-1] > values[0] else -1  # cheapest first: simhash's fewest collisions is its most thorough
    if start not in values:  # the value given, in its place by the grid's order
        values = sorted([*values, start], key=lambda v: order * v)
    recalls = [_reference_recall(store, newest, param, v) for v in values]
    over = [_over_scan(store, newest, param, v) for v in values]
    per_head = [_reference_per_head(store, newest, param, v) for v in values]
    floor = values.index(start)
    want, scanned = _expected(values, recalls, floor, target, over)
    cal = calibrate.calibrate(store, newest, target, SCALING)
    assert order * values[want] >= order * start  # never below the search it was given
    assert (cal.param, cal.value) == (param, values[want])
    if scanned:  # a raise past a scan's bytes: the layer is scanned exactly instead, told by the exact top-k's reading
        assert cal.exact_scan == pytest.approx(over[want]) and store.plan.name == "flat"
        assert cal.weight_recall == 1.0 and cal.per_head == (1.0,) * store.n_heads
        if want == floor:
            assert list(cal.tried) == [values[floor]]  # the search given read more already: no raise probed
    else:
        assert cal.exact_scan is None
        assert cal.weight_recall == pytest.approx(recalls[want])
        # and each head's (IVF: one index per KV head, its two query heads' readings told apart)
        assert cal.per_head == pytest.approx(per_head[want])
        assert store.plan.search_params[param] == values[want]  # the layer's searches use it from now on
    assert all(tried == pytest.approx(recalls[values.index(v)]) for v, tried in cal.tried.items())
    if recalls[floor] >= target:
        assert list(cal.tried) == [values[floor]]  # one probe where the search given suffices


def test_calibration_counts_each_key_by_its_weight_at_the_layers_scale():
    """Where set recall, or weight recall at a wrong scale (1.0: the raw inner products), would choose another value
    than weight recall at the layer's scale, calibration chooses the latter's (float64 references over the grid)."""
    store, newest = _store("ivf", {"nlist": 32})
    store.plan = dataclasses.replace(store.plan, search_params={"nprobe": 1})  # below the default: room to choose
    values = [point["nprobe"] for point in store.indexes[0].grid()]
    target = 0.92
    want = {scaling: _expected(values, [_reference_recall(store, newest, "nprobe", v, scaling) for v in values], 0,
                               target)[0] for scaling in (SCALING, None, 1.0)}
    assert want[SCALING] != want[None] and want[SCALING] != want[1.0]  # the data tell the three apart
    cal = calibrate.calibrate(store, newest, target, SCALING)
    assert cal.value == values[want[SCALING]]
    assert cal.weight_recall == pytest.approx(_reference_recall(store, newest, "nprobe", cal.value))


def test_calibration_does_not_lower_a_search_that_reaches_the_target():
    store, newest = _store("roargraph", dict(M=8, R=16, n_hubs=4, keep_queries=64))
    low = _reference_recall(store, newest, "L", 50)
    cal = calibrate.calibrate(store, newest, low / 2, SCALING)  # L 50 would do; the default 100 stays
    assert cal.value == registry.get("roargraph").search_params["L"].default == 100
    assert list(cal.tried) == [100]


def test_unreachable_target_takes_the_most_thorough_value(monkeypatch):
    cls = registry.get("roargraph")
    monkeypatch.setattr(cls, "search_grid", {"L": (1, 2)})  # a beam of 1-2 cannot find 30 keys
    store, newest = _store("roargraph", dict(M=8, R=16, n_hubs=4, keep_queries=64))
    store.plan = dataclasses.replace(store.plan, search_params={"L": 1})  # on the grid (the default 100 lies beyond it)
    cal = calibrate.calibrate(store, newest, 0.9, SCALING)
    assert cal.value == 2 and cal.weight_recall < 0.9
    assert cal.weight_recall == pytest.approx(_reference_recall(store, newest, "L", 2))
    # the note says so, even where the recall prints as the target (0.8996 as 0.900)
    shy = dataclasses.replace(cal, weight_recall=0.8996)
    assert "); short of the target at the most thorough value tried: layer 5" in calibrate.describe([shy], 0.9)
    assert "short" not in calibrate.describe([dataclasses.replace(cal, weight_recall=0.9)], 0.9)
    assert "L=2 (0.900; heads " in calibrate.describe([shy], 0.9)  # each head's reading beside the mean
    assert f"heads {min(cal.per_head):.3f}-{max(cal.per_head):.3f})" in calibrate.describe([cal], 0.9)
    # a --from-sweep mode's layers may use different indexes: the note names each parameter
    ivf = calibrate.Calibration(7, "nprobe", 16, 0.95, {16: 0.95})
    assert calibrate.describe([cal, ivf], 0.9).startswith("calibrated L / nprobe per layer")


@pytest.mark.parametrize("name,build,target", [("simhash", {"K": 2, "L": 4}, 0.01), ("ivf", {"nlist": 20}, 0.999)])
def test_calibration_searches_only_the_values_the_built_index_takes(name, build, target):
    """simhash's grid lists min_collisions up to 8, which an index of L=4 tables refuses; IVF's lists nprobe up to 1024,
    which an index of 20 lists searches as 20: the bisection tries, and the note names, only the built index's values."""
    store, newest = _store(name, build)
    cal = calibrate.calibrate(store, newest, target, SCALING)
    values = [point[cal.param] for point in store.indexes[0].grid()]
    assert set(cal.tried) <= set(values) and cal.value in values
    assert cal.weight_recall == pytest.approx(_reference_recall(store, newest, cal.param, cal.value))


def test_index_without_a_single_grid_parameter_is_left_alone():
    store, newest = _store("flat", {})
    assert calibrate.calibrate(store, newest, 0.9, SCALING) is None and store.plan.search_params == {}


def test_decode_searches_each_layer_at_its_calibrated_value(tiny_gemma3, monkeypatch):
    """A decode with Settings.calibrate: every long-range layer's store carries its calibration, each step's search
    gets that layer's value, and the mode's notes name it."""
    lm = load_model(str(tiny_gemma3), device=TEST_DEVICE)
    settings = Settings(Window(4, 8), topk=12, add_batch=4, chunk=24, calibrate=0.9)
    ids = np.random.default_rng(3).integers(3, 400, size=160).tolist()
    pre = prefill(lm, ids, settings, capture_queries=True)
    # the softmax scale each long-range layer's attention was called with, recorded by the prefill for calibration
    assert pre.scaling == {layer: lm.model.model.layers[layer].self_attn.scaling for layer in lm.long_range_layers}
    cls = registry.get("roargraph")
    seen = []
    original = cls.search_group.__func__

    def spy(klass, indexes, queries, k, **params):
        seen.append((id(indexes[0]), params.get("L")))
        return original(klass, indexes, queries, k, **params)

    monkeypatch.setattr(cls, "search_group", classmethod(spy))
    run = run_mode(lm, pre, Mode("roargraph", IndexPlan("roargraph", {}, {})), settings, 4)
    by_index = {id(s.indexes[0]): s.calibration.value for s in run.stores.values()}
    assert set(by_index) == {i for i, _ in seen} and all(by_index[i] == L for i, L in seen)
    assert run.calibration == {layer: {"param": "L", "value": s.calibration.value, "weight_recall": s.calibration.weight_recall,
                                       "tried": {str(v): r for v, r in s.calibration.tried.items()},
                                       "per_head": list(s.calibration.per_head), "target": 0.9}
                               for layer, s in run.stores.items()}
    assert any("calibrated L per layer" in n for n in run.notes)
    # without calibration every layer searches at the default
    seen.clear()
    run_mode(lm, pre, Mode("roargraph", IndexPlan("roargraph", {}, {})), dataclasses.replace(settings, calibrate=0.0), 2)
    assert {L for _, L in seen} == {None}  # the index's own default


def test_the_auto_target_grows_by_a_hundredth_per_doubling_of_the_keys_above_32k():
    """0.95 up to 32K keys (every 8K and 32K figure was measured there), then 0.01 per doubling: 0.96 at 64K, 0.97 at
    128K, at most 0.99; a layer is calibrated to its own keys' target."""
    at = calibrate.auto_target
    assert at(600) == at(8192) == at(32768) == calibrate.TARGET == 0.95
    assert at(65536) == pytest.approx(0.96) and at(131072) == pytest.approx(0.97) and at(130368) == pytest.approx(0.9699, abs=1e-4)
    assert at(1 << 30) == calibrate.MAX_TARGET == 0.99
    assert calibrate.layer_target(calibrate.AUTO, 131072) == at(131072) and calibrate.layer_target(0.9, 131072) == 0.9
    assert calibrates(calibrate.AUTO) and calibrates(0.5) and not calibrates(0.0)
    store, newest = _store("roargraph", dict(M=8, R=16, n_hubs=4, keep_queries=64))
    auto = calibrate.calibrate(store, newest, calibrate.AUTO, SCALING)
    assert auto.target == at(store.n_indexed) == 0.95
    store, newest = _store("roargraph", dict(M=8, R=16, n_hubs=4, keep_queries=64))
    fixed = calibrate.calibrate(store, newest, 0.95, SCALING)
    assert (auto.value, auto.weight_recall, auto.tried) == (fixed.value, fixed.weight_recall, fixed.tried)


def test_cli_calibration_target_and_json(tiny_llama, tmp_path):
    base = ["decode", "--model", tiny_llama, "--task", "passkey", "--context", 200]
    res = CliRunner().invoke(main, [*map(str, base), "--calibrate", "1.5"])
    assert res.exit_code == 2 and "--calibrate takes a weight recall target in (0, 1] (0: off), got 1.5" in res.output
    for args, got in ((["--calibrate", "-1"], "-1.0"), (["--calibrate=-0.5"], "-0.5"), (["--calibrate", "nan"], "nan")):
        res = CliRunner().invoke(main, [*map(str, base), *args])  # a negative target is not read as an option "-1"
        assert res.exit_code == 2 and f"--calibrate takes a weight recall target in (0, 1] (0: off), got {got}" in res.output
    res = CliRunner().invoke(main, [*map(str, base), "--calibrate", "abc"])
    assert res.exit_code == 2 and "'abc' is neither 'auto' nor a number" in res.output
    out = tmp_path / "r.json"
    run = [*map(str, base), "--mode", "full,ivf", "--window", "4,16", "--topk", "20", "--max-new-tokens", "2",
           "--chunk", "64", "--json", str(out), "--overwrite"]  # one file, run after run
    for bare in ([], ["--calibrate"]):  # on by default, at the auto target (a bare --calibrate asks the same)
        res = CliRunner().invoke(main, [*run, *bare])
        assert res.exit_code == 0, res.output
        data = json.loads(out.read_text())
        assert data["settings"]["calibrate"] == calibrate.AUTO
        assert {c["target"] for c in data["modes"]["ivf"]["samples"][0]["calibration"].values()} == {calibrate.TARGET}
        assert any(n.startswith("calibrated nprobe per layer to weight recall@k >= 0.95 (auto: by the keys held)")
                   for n in data["modes"]["ivf"]["notes"])
    # each sample records the values its prompt's calibration chose, per long-range layer
    cal = data["modes"]["ivf"]["samples"][0]["calibration"]
    assert cal and all(c["param"] == "nprobe" and c["value"] in registry.get("ivf").search_grid["nprobe"]
                       and 0 <= c["weight_recall"] <= 1 and c["tried"][str(c["value"])] == c["weight_recall"]
                       for c in cal.values())
    assert "calibration" not in data["modes"]["full"]["samples"][0]
    # a --param value is the floor it starts from (the default, 8 or the lists' count, would reach this target too)
    res = CliRunner().invoke(main, [*run, "--calibrate", "0.01", "--param", "nprobe=1"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["settings"]["calibrate"] == 0.01
    assert {c["value"] for c in data["modes"]["ivf"]["samples"][0]["calibration"].values()} == {1}
    res = CliRunner().invoke(main, [*run, "--calibrate", "0"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["settings"]["calibrate"] is None and "calibration" not in data["modes"]["ivf"]["samples"][0]


def test_a_key_only_mode_keeps_only_the_newest_queries_calibration_reads(tiny_gemma3, monkeypatch):
    """Under --calibrate a key-only index (IVF) keeps each head's newest calibrate.QUERIES prefill queries per
    long-range layer, the very ones a prefill keeping all would end with; an attention-aware index (roargraph) keeps
    every one (it trains on them). The memory estimate before the prefill counts what is kept."""
    from anns_lab.decode import runner

    lm = load_model(str(tiny_gemma3), device=TEST_DEVICE)
    settings = Settings(Window(4, 8), topk=12, add_batch=4, chunk=24, calibrate=0.9, steps=4)
    ids = np.random.default_rng(3).integers(3, 400, size=160).tolist()  # 7 chunks: the newest 64 span 3 of them
    every = prefill(lm, ids, settings, capture_queries=True).queries
    held = {}

    def spy(*args, **kwargs):
        pre = runner_prefill(*args, **kwargs)
        held[args[4][0].name] = pre.queries
        return pre

    runner_prefill = runner.prefill
    monkeypatch.setattr(runner, "prefill", spy)
    ivf, roar = Mode("ivf", IndexPlan("ivf", {"nlist": 8}, {})), Mode("roargraph", IndexPlan("roargraph", {}, {}))
    res = runner.run_sample(lm, [ivf, roar], settings, ids, 4, set())  # each index mode after a prefill of its own
    assert set(held) == {"ivf", "roargraph"} and set(held["ivf"]) == set(every) == set(lm.long_range_layers)
    for layer, q in every.items():
        assert q.shape == (4, len(ids), 16)
        assert held["ivf"][layer].shape == (4, calibrate.QUERIES, 16)
        assert np.array_equal(held["ivf"][layer], q[:, -calibrate.QUERIES:])
        assert np.array_equal(held["roargraph"][layer], q)
    assert set(res["runs"]["ivf"].calibration) == set(lm.long_range_layers)  # calibrated on what was kept

    asked = []
    monkeypatch.setattr("anns_lab.dumps.memory.check_prefill", lambda *a, **kw: asked.append(kw))
    runner.check_memory(lm, [Mode("full"), ivf], settings, 200)
    runner.check_memory(lm, [ivf, roar], settings, 200)
    runner.check_memory(lm, [ivf], dataclasses.replace(settings, calibrate=0.0), 200)
    assert [(kw["query_layers"], kw["query_tokens"]) for kw in asked] == [(2, calibrate.QUERIES), (2, None),
                                                                          (0, calibrate.QUERIES)]
    # only an attention-aware mode moves training queries per layer in flight (--build-layers, at most the layers)
    assert [kw["building_layers"] for kw in asked] == [0, 2, 0]
    runner.check_memory(lm, [roar], dataclasses.replace(settings, build_layers=8), 200)
    assert asked[-1]["building_layers"] == len(lm.long_range_layers) == 2


def test_calibration_searches_a_layers_indexes_side_by_side_on_one_thread_workers(tiny_gemma3, monkeypatch):
    """A layer's calibration searches its indexes side by side, each on a one-thread worker (a probe on one thread was
    the serial tail of a layer's build on a many-core host); beside the prefill those workers run below its priority,
    after it at the calling thread's."""
    import os
    import threading

    import faiss
    import numba

    from anns_lab.decode import builds
    from anns_lab.indexes import threads

    monkeypatch.setattr(threads, "thread_budget", lambda: 2)  # two workers even on a one-core runner
    monkeypatch.setattr(threads, "_POOLS", {})  # the test's own pools, shut down at its end
    lm = load_model(str(tiny_gemma3), device=TEST_DEVICE)
    settings = Settings(Window(4, 8), topk=12, add_batch=4, chunk=24, calibrate=0.9, steps=4)
    ids = np.random.default_rng(3).integers(3, 400, size=160).tolist()
    pre = prefill(lm, ids, settings, capture_queries=True)
    seen = []
    original = calibrate._checked
    together = threading.Barrier(2, timeout=30)  # a search that waits for another one: they run at once or time out

    def spy(store, head, queries, k, search):
        me = threading.get_native_id()
        seen.append((threading.current_thread().name, numba.get_num_threads(), faiss.omp_get_max_threads(),
                     os.getpriority(os.PRIO_PROCESS, me) if hasattr(os, "getpriority") else 0))
        together.wait()
        return original(store, head, queries, k, search)

    monkeypatch.setattr(calibrate, "_checked", spy)
    layer = lm.long_range_layers[0]
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if hasattr(os, "getpriority") else 0
    for beside in (True, False):
        seen.clear()
        store = builds.layer_store(lm, pre.cache, len(ids), layer, IndexPlan("ivf", {"nlist": 8}, {}), settings,
                                   pre.queries[layer], pre.scaling[layer], beside=beside)
        assert store.calibration is not None and store.calibration.param == "nprobe"
        groups = len(store._groups())  # ivf: an index per KV head
        assert groups == 2 and len(seen) == groups * len(store.calibration.tried)  # each probe searched every index
        assert all(name.startswith("anns-lab-build") and (nb, omp) == (1, 1) for name, nb, omp, _ in seen), seen
        assert len({name for name, *_ in seen}) == 2
        nice = {n for *_, n in seen}
        if sys.platform.startswith("linux"):
            assert nice == ({max(caller, threads.LOWEST_PRIORITY)} if beside else {caller}), (beside, nice)
    for pool in threads._POOLS.values():  # the test's own pools: their threads end here, not at the process's exit
        pool.shutdown(wait=True)


@pytest.mark.parametrize("during", [True, False])
def test_each_layer_is_calibrated_at_the_scale_its_attention_was_called_with(tiny_gemma3, monkeypatch, during):
    """The softmax scale the prefill records reaches each layer's calibration, with the builds during the prefill
    (builds.EarlyBuilds) and after it (builds.build_stores)."""
    lm = load_model(str(tiny_gemma3), device=TEST_DEVICE)
    settings = Settings(Window(4, 8), topk=12, add_batch=4, chunk=24, calibrate=0.9, build_during_prefill=during)
    ids = np.random.default_rng(3).integers(3, 400, size=160).tolist()
    mode = Mode("ivf", IndexPlan("ivf", {"nlist": 8}, {}))
    seen = {}
    original = calibrate.calibrate

    def spy(store, queries, target, scaling, beside=False):
        seen[store.layer] = scaling
        return original(store, queries, target, scaling, beside)

    monkeypatch.setattr(calibrate, "calibrate", spy)
    pre = prefill(lm, ids, settings, capture_queries=True, build_modes=[mode])
    assert (pre.early is not None) == during
    run_mode(lm, pre, mode, settings, 2)
    scale = {layer: lm.model.model.layers[layer].self_attn.scaling for layer in lm.long_range_layers}
    assert seen == scale and all(s != 1.0 for s in scale.values())


@pytest.mark.parametrize("last", [1, 2, 5, 15, 16])
def test_first_reaching_finds_the_least_index_reaching_and_probes_cheaply(last):
    """Against every threshold of a monotone predicate on (short, last]: the least index where it holds, else last;
    never probing beyond twice the distance to the answer (the thorough end of the grid costs most)."""
    for short in range(last):
        for at in range(short + 1, last + 2):  # at = last + 1: never holds
            probed = []

            def reaches(i, at=at):
                probed.append(i)
                return i >= at

            assert calibrate.first_reaching(reaches, short, last) == min(at, last)
            assert all(short < i <= last for i in probed)
            if at <= last:
                assert max(probed) - short <= 2 * (at - short)


def test_the_notes_name_an_index_calibration_cannot_set_and_say_nothing_of_one_without_a_grid(monkeypatch):
    """With calibration on (the CLI's default): an index of several grid parameters naming none to raise (vattention
    without its ``calibrated_by``: nprobe and epsilon) gets the note that it was not calibrated; one without any (flat's
    exact scan) none, as without calibration."""
    from anns_lab.decode.builds import store_notes

    if "vattention" not in registry.available():
        pytest.skip("the vattention plugin is not installed (make test installs it)")
    monkeypatch.setattr(registry.get("vattention"), "calibrated_by", None)
    settings = Settings(Window(4, 8), calibrate=calibrate.AUTO)
    for name, said in (("vattention", True), ("flat", False)):
        store, newest = _store(name, {})
        store.calibration = calibrate.calibrate(store, newest, settings.calibrate, SCALING)
        assert store.calibration is None
        notes = store_notes({store.layer: store}, settings)
        assert any("several search grid parameters and names none to raise (Index.calibrated_by): not calibrated" in n
                   for n in notes) == said, (name, notes)
        assert not any("calibrat" in n for n in store_notes({store.layer: store}, dataclasses.replace(settings, calibrate=0.0)))


def test_calibration_reaches_the_most_thorough_value_of_every_heads_grid():
    """Heads whose built grids end at different values (IVF of 32 lists on one KV group, 64 on the other: RetroInfer's
    nprobe ends at its head's non-empty clusters alike): an unreachable target takes the top of the union, exhaustive on
    every head (weight recall 1), not the first head's top, which leaves the other group's search half its lists."""
    store, newest = _store("ivf", {"nlist": 32})
    wide = registry.get("ivf")(nlist=64)
    wide.build(store.keys[1, : store.n_indexed])
    store.indexes = [*store.indexes[:2], wide, wide]  # query heads 2 and 3 read KV head 1
    assert _reference_recall(store, newest, "nprobe", 32) < 1.0  # the first head's top would not do
    whole = _reference_recall(store, newest, "nprobe", 64)
    assert calibrate.store_grid(store.indexes) == ("nprobe", [1, 2, 4, 8, 16, 32, 64])
    over = {v: _over_scan(store, newest, "nprobe", v) for v in (32, 64)}
    assert over[32] < 1 < over[64]  # at 32 the wide group reads half its lists: less than a scan
    cal = calibrate.calibrate(store, newest, 1.01, SCALING)
    assert cal.value == 64 and set(cal.tried) <= {1, 2, 4, 8, 16, 32, 64}
    assert cal.weight_recall == pytest.approx(1.0) == pytest.approx(whole)
    assert cal.exact_scan == pytest.approx(over[64])  # and there, more than a scan: scanned instead
    assert calibrate.store_grid([wide, registry.get("flat")()]) is None  # flat has no grid parameter


@pytest.mark.parametrize("bad_id", [-7, 10**6])
def test_calibration_refuses_a_search_that_breaks_the_index_protocol(monkeypatch, bad_id):
    """Calibration searches every probed grid value before the decode's first step checks the protocol: a plugin's
    id below -1 counted as padding (its recall silently picked the value), one past the keys ended in a raw IndexError.
    Either is that index's IndexResultError, naming it and the rule."""
    from anns_lab.errors import IndexResultError
    from anns_lab.indexes.ivf import IVFIndex

    class BadIds(IVFIndex):
        def _search(self, queries, k, nprobe):
            ids, scores, scanned, n_bytes = super()._search(queries, k, nprobe)
            ids[:, 0] = bad_id
            return ids, scores, scanned, n_bytes

    monkeypatch.setattr("anns_lab.decode.placement.registry.get", lambda name: BadIds)
    store, queries = _store("ivf", {"nlist": 16})  # the plan's name, ivf, names the index
    with pytest.raises(IndexResultError, match=r"ivf \(layer 5\) at \{'nprobe': \d+\}.*ids outside"):
        calibrate.calibrate(store, queries, 0.9, SCALING)


def _output_errors(store, newest, param, value, scaling: float = SCALING) -> list[np.ndarray]:
    """Per query head, each newest query's output error as the decoder's step would give it at ``param`` = ``value``
    (:meth:`LayerStore.side`: its search, attention kernel and estimate merge, nothing past the indexed keys) against
    exact attention over the indexed keys by a numpy softmax in float64."""
    saved = store.plan
    store.plan = dataclasses.replace(store.plan, search_params={**store.plan.search_params, param: value})
    try:
        errors = [[] for _ in range(store.n_heads)]
        for i in range(newest.shape[1]):
            side = store.side(newest[:, i], scaling)
            for h in range(store.n_heads):
                keys = store.keys[h // store.group, : store.n_indexed].astype(np.float64)
                values = store.values[h // store.group, : store.n_indexed].astype(np.float64)
                w = np.exp(scaling * (keys @ newest[h, i].astype(np.float64)))
                exact = (w / w.sum()) @ values
                errors[h].append(np.linalg.norm(side.out[h] - exact) / np.linalg.norm(exact))
        return [np.array(e) for e in errors]
    finally:
        store.plan = saved


def _cut_topk_error(store, newest, target: float, scaling: float = SCALING) -> float:
    """The bound, written out: per query the exact top-k by a full sort, its heaviest keys kept until their softmax
    weight reaches ``target`` of the top-k's, attention over those against attention over every indexed key."""
    errors = []
    for h in range(store.n_heads):
        keys = store.keys[h // store.group, : store.n_indexed].astype(np.float64)
        values = store.values[h // store.group, : store.n_indexed].astype(np.float64)
        for q in newest[h].astype(np.float64):
            w = np.exp(scaling * (keys @ q))
            top = np.argsort(-w)[: store.topk]
            n_kept = next(n for n in range(1, store.topk + 1) if w[top[:n]].sum() >= target * w[top].sum())
            kept = top[:n_kept]
            exact = (w / w.sum()) @ values
            part = (w[kept] / w[kept].sum()) @ values[kept]
            errors.append(np.linalg.norm(part - exact) / np.linalg.norm(exact))
    return float(np.mean(errors))


PEAKED = 2.0  # a softmax scale at which a few keys hold most of a query's weight, as in real attention heads


@pytest.mark.parametrize("name,build,target,present", [
    ("retroinfer", {"nlist": 24}, 0.9, 1),  # raised past 1 and 2 (their estimates off by 0.43 and 0.21)
    ("retroinfer", {"nlist": 24}, 0.99, 1),
    ("retroinfer", {}, 0.99, None),  # its default suffices: one probe
    ("magicpig", {}, 0.9, None),  # its samples at the default fall short: raised until it reads more than a scan
    ("magicpig", {}, 0.3, None),
    ("vattention", {}, 0.9, None),  # two grid parameters: epsilon tightened, nprobe as given
    ("vattention", {}, 0.99, 0.3)])
def test_an_estimator_is_raised_until_its_output_is_as_close_as_the_exact_top_k_cut_to_the_target(name, build, target,
                                                                                                  present):
    """An estimator returns its exact part and an estimate of the rest: the weight recall of its ids undersold it
    (RetroInfer's estimated clusters carry weight its ids do not) or could not read it at all (MagicPIG returns no exact
    ids: at every probe 0, and every layer went to sampling every key). It is read by its output instead: the
    decoder's step output against exact attention over the indexed keys, to reach the error of the exact top-k cut to
    the target's weight; the value the rule picks over the grid, with both errors computed here."""
    if name not in registry.available():
        pytest.skip(f"the {name} plugin is not installed (make test installs it)")
    store, newest = _store(name, build, value_mean=0.5)
    param = _raised(name)
    if present is not None:
        store.plan = dataclasses.replace(store.plan, search_params={param: present})
    bound = _cut_topk_error(store, newest, target, PEAKED)
    values = list(dict.fromkeys(point[param] for point in store.indexes[0].grid()))
    per_head = {v: [e.mean() for e in _output_errors(store, newest, param, v, PEAKED)] for v in values}
    errors = {v: np.mean(e) for v, e in per_head.items()}  # the heads have as many queries each
    over = [_over_scan(store, newest, param, v, PEAKED) for v in values]
    floor = values.index(present if present is not None else registry.get(name).search_params[param].default)
    want, scanned = _expected(values, [-errors[v] for v in values], floor, -bound, over)  # errors fall as recalls rise
    topk_error = _cut_topk_error(store, newest, 1.0, PEAKED)  # the whole exact top-k's
    cal = calibrate.calibrate(store, newest, target, PEAKED)
    assert cal.bound == pytest.approx(bound, rel=1e-6)
    assert (cal.param, cal.value) == (param, values[want]) and cal.weight_recall is None
    if scanned:  # MagicPIG sampling every key reads its hash codes and every key: the layer is scanned instead
        assert cal.exact_scan == pytest.approx(over[want]) and cal.reached and store.plan.name == "flat"
        assert cal.output_error == pytest.approx(topk_error, rel=1e-4)  # what serves it now
        assert topk_error <= bound
        assert f"the exact top-k: output error {cal.output_error:.4f} <= {bound:.4f})" in cal.describe()
    else:
        assert cal.output_error == pytest.approx(errors[values[want]], rel=1e-4, abs=1e-9)
        assert cal.per_head == pytest.approx(per_head[values[want]], rel=1e-4, abs=1e-9)
        assert cal.exact_scan is None and cal.reached == (errors[values[want]] <= bound)
        assert store.plan.search_params[param] == values[want]
    if errors[values[floor]] <= bound:
        assert list(cal.tried) == [values[floor]]


def test_an_estimators_calibration_is_told_as_its_output_error_in_the_notes():
    from anns_lab.decode.builds import store_notes

    if "retroinfer" not in registry.available():
        pytest.skip("the retroinfer plugin is not installed (make test installs it)")
    settings = Settings(Window(4, 8), calibrate=0.97)
    store, newest = _store("retroinfer", {}, value_mean=0.5)
    store.calibration = calibrate.calibrate(store, newest, settings.calibrate, PEAKED)
    notes = " ".join(store_notes({store.layer: store}, settings))
    assert "to output error <= the exact top-k's cut to weight 0.97 (an estimator)" in notes, notes
    assert f"5: nprobe={store.calibration.value} (output error {store.calibration.output_error:.4f}" in notes, notes




def test_a_layer_scanned_instead_returns_the_exact_top_k_and_reads_a_scans_bytes():
    """Where a raise would read more than a scan (IVF at every list: its centroids and every key), the layer is served
    by an exact scan: each step's output is attention over the exact top-k (numpy, float64), it reads n·4·d bytes per
    query head, tokens added later are scanned too, and the notes and JSON say so."""
    store, newest = _store("ivf", {"nlist": 32})
    cal = calibrate.calibrate(store, newest, 1.01, SCALING)
    assert cal.exact_scan > 1 and cal.reached and store.plan.name == "flat"
    assert "5: exact scan (nprobe=32 read " in calibrate.describe([cal], 1.01)
    assert "a scan's bytes; the exact top-k: weight recall 1)" in calibrate.describe([cal], 1.01)
    assert "short of the target" not in calibrate.describe([cal], 1.01)
    rng = np.random.default_rng(1)
    later = rng.normal(size=(2, store.add_batch, 16)).astype(np.float32)
    store.extend(later, rng.normal(size=later.shape).astype(np.float32))  # a full batch: added to the scans
    assert store.n_indexed == store.n_rows == 600 + store.add_batch
    n, k = store.n_indexed, store.topk
    for q in newest[:, -3:].transpose(1, 0, 2):
        side = store.side(q, SCALING)
        assert side.bytes_read == store.n_heads * n * 4 * 16 and side.scanned == 1.0
        for h in range(store.n_heads):
            keys = store.keys[h // store.group, :n].astype(np.float64)
            values = store.values[h // store.group, :n].astype(np.float64)
            logits = keys @ q[h].astype(np.float64)
            top = np.argsort(-logits)[:k]
            w = np.exp(SCALING * (logits[top] - logits[top].max()))
            np.testing.assert_allclose(side.out[h], (w / w.sum()) @ values[top], rtol=1e-4, atol=1e-5)


def test_a_decode_tells_each_layer_scanned_instead_in_its_json_and_notes(tiny_gemma3):
    """A decode whose target only every list reaches (weight recall 1 of IVF on a short prompt): each layer is scanned
    instead, served by flat, and the run's calibration and notes record the ratio that decided it."""
    lm = load_model(str(tiny_gemma3), device=TEST_DEVICE)
    settings = Settings(Window(4, 8), topk=12, add_batch=4, chunk=24, calibrate=1.0)
    ids = np.random.default_rng(3).integers(3, 400, size=160).tolist()
    pre = prefill(lm, ids, settings, capture_queries=True)
    run = run_mode(lm, pre, Mode("ivf", IndexPlan("ivf", {}, {"nprobe": 1})), settings, 3)
    scanned = {layer for layer, s in run.stores.items() if s.calibration.exact_scan is not None}
    assert scanned, {layer: s.calibration for layer, s in run.stores.items()}
    for layer, s in run.stores.items():
        assert run.calibration[layer].get("exact_scan") == s.calibration.exact_scan
        assert (s.plan.name == "flat") == (layer in scanned)
    assert any(f"{layer}: exact scan (nprobe=" in n for n in run.notes for layer in scanned)
