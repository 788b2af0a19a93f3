"""Causality of the evaluation: a query is only ever scored against keys at or before its own position.

A dump with 4 decode steps tops its 64 test queries up from the last 60 prompt positions, so
for every window, ``0,0`` included, the ground truth, the index input and the export must
leave out keys after a query; checked against a per-query causal mask in plain numpy.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from anns_lab.dumps.run import run_dump
from anns_lab.errors import AnnsLabError
from anns_lab.eval import export
from anns_lab.eval.heads import load_head
from anns_lab.eval.sweep import run_sweep
from anns_lab.testing import recall_at_k

N, DECODE, K = 400, 4, 10
WINDOWS = [(0, 0), (0, 16), (16, 16), (8, 60), (16, 100), (32, 64)]


@pytest.fixture(scope="module")
def few_steps(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("causal") / "d"
    return run_dump(str(tiny_llama), tokens=N, decode_tokens=DECODE, layers="1", dtype="float32", chunk=128, out=out,
                    progress=False).dump


def causal_reference(dump, head: int, window: tuple[int, int], test_pos: np.ndarray, held: np.ndarray, k: int):
    """Top-k scores per test query over the keys a query may see: at or before it, outside the static window,
    neither a held-out K→K key nor a held-out test position."""
    keys = dump.keys(1, dump.kv_head_of(head), "all").astype(np.float64)
    queries = dump.queries(1, head, "all").astype(np.float64)
    pos = np.arange(len(keys))
    w0, w1 = window
    outside = (pos >= w0) & (pos < N - w1) & ~np.isin(pos, held) & ~np.isin(pos, test_pos)
    out = []
    for p in test_pos:
        allowed = outside & (pos <= p)
        scores = keys[allowed] @ queries[p]
        out.append(np.sort(scores)[::-1][:k])
    return np.array(out)


@pytest.mark.parametrize("window", WINDOWS)
def test_ground_truth_and_index_input_are_causal_for_every_window(few_steps, window):
    d = load_head(few_steps, 1, 2, window)
    assert len(d.test_pos) == 64 and d.test_pos.min() == N + DECODE - 64
    assert d.key_pos.max() < d.test_pos.min(), "an index key comes after a test query"
    held = np.setdiff1d(np.arange(window[0], d.index_end), d.key_pos)
    assert len(held) == len(d.k2k_queries)
    ref = causal_reference(few_steps, 2, window, d.test_pos, held, K)
    lab = -np.sort(-d.exact("q2k"), axis=1)[:, :K]
    np.testing.assert_allclose(lab, ref, rtol=1e-5, atol=1e-5)
    # Each query's keys up to its own position are in exactly one place: the window, the index or the K→K hold-out.
    for p in d.test_pos:
        win = d.window_positions(int(p))
        assert win.max() <= p and not np.intersect1d(win, d.key_pos).size
        assert np.array_equal(np.union1d(np.union1d(win, d.key_pos[d.key_pos <= p]), held), np.arange(p + 1))


def test_quick_sweep_and_export_with_no_static_window(few_steps, tmp_path):
    res = run_sweep(few_steps.path, ["flat"], [1], [2], k=K, window=(0, 0), out=tmp_path / "s", jobs=1,
                    progress=False, quick=True)
    assert not res.failures and (res.table["recall"] == 1.0).all()
    full = run_sweep(few_steps.path, ["flat"], [1], [2], k=K, window=(0, 0), out=tmp_path / "f", jobs=1, progress=False)
    q2k = full.table[full.table["direction"] == "q2k"]
    assert not full.failures and (q2k["mass_recovered"] <= 1 + 1e-9).all()
    files = export.export_fbin(few_steps, 1, 2, tmp_path / "x", k=K, window=(0, 0))
    d = load_head(few_steps, 1, 2, (0, 0))
    ids, _ = export.read_gt(files["gt_q2k.bin"])
    assert (d.key_pos[ids.astype(np.int64)] < d.test_pos[:, None]).all()


def test_held_out_prefill_queries_leave_the_training_and_test_positions_cannot_be_held_out(few_steps):
    """``load_head(held_out=...)`` (the calibration queries a decoder keeps out of the training): the training set is
    every other query before the test positions, in order; a held-out position among the test queries is refused."""
    d = load_head(few_steps, 1, 2, (0, 0), train_group="head", train_positions="own")
    first = int(d.test_pos.min())
    queries = few_steps.queries(1, 2, "prefill")
    assert np.array_equal(d.train_queries, queries[:first])
    held = np.arange(first - 64, first)
    kept = load_head(few_steps, 1, 2, (0, 0), train_group="head", train_positions="own", held_out=held)
    assert np.array_equal(kept.train_queries, queries[: first - 64])
    assert np.array_equal(kept.test_queries, d.test_queries) and np.array_equal(kept.key_pos, d.key_pos)
    sparse = load_head(few_steps, 1, 2, (0, 0), train_group="head", held_out=np.array([3, 100]))
    assert len(sparse.train_queries) == first - 2
    with pytest.raises(ValueError, match="held-out positions must lie among the"):
        load_head(few_steps, 1, 2, (0, 0), held_out=np.array([first]))


def test_a_layer_whose_sliding_window_is_shorter_than_the_dump_is_never_evaluated(tiny_gemma3, tmp_path):
    """Before: a `--layers all` dump of Gemma-3 swept its sliding layers by default (2, 9, 16 on the real model),
    scoring them against full causal attention, which they never compute (output error 0.07-0.12 against full,
    1.06-1.40 against their own window), with no word of it; until session 45 `export` wrote such a layer's head.
    The tiny Gemma-3: layers 0 and 2 slide (8 tokens)."""
    import json
    import shutil

    from anns_lab.errors import AnnsLabError
    from anns_lab.eval.cli import _layers
    from anns_lab.eval.heads import evaluable_layers, sliding_layers

    dump = run_dump(str(tiny_gemma3), tokens=300, decode_tokens=2, layers="all", out=tmp_path / "d", progress=False).dump
    assert dump.layers == [0, 1, 2, 3] and sliding_layers(dump) == {0: 8, 2: 8}
    assert evaluable_layers(dump) == _layers("all", dump.path) == _layers("default", dump.path) == [1, 3]
    res = run_sweep(dump.path, ["flat"], heads=[0], k=K, window=(0, 0), out=tmp_path / "s", jobs=1, progress=False,
                    quick=True)
    assert sorted(res.table["layer"].unique()) == [1, 3]
    with pytest.raises(AnnsLabError, match=r"layer 0 of dump .* sliding window \(8 tokens\) .*full-attention layers \(1, 3\)"):
        run_sweep(dump.path, ["flat"], [0, 1], [0], k=K, window=(0, 0), out=tmp_path / "s0", jobs=1, progress=False)
    assert not (tmp_path / "s0").exists()
    with pytest.raises(AnnsLabError, match=r"layer 2 of dump .* sliding window \(8 tokens\) .*full-attention layers \(1, 3\)"):
        export.export_fbin(dump, 2, 0, tmp_path / "x2", k=K, window=(0, 0))  # session 45: export wrote it
    assert not (tmp_path / "x2").exists()
    assert export.read_fbin(export.export_fbin(dump, 3, 0, tmp_path / "x3", k=K, window=(0, 0))["base.fbin"]).shape[0] > K

    wide = shutil.copytree(tiny_gemma3, tmp_path / "wide")  # a window as long as the dump binds nowhere in it
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps(config | {"sliding_window": 302}))
    dump = run_dump(str(wide), tokens=300, decode_tokens=2, layers="all", out=tmp_path / "w", progress=False).dump
    assert dump.manifest["sliding_window"]["0"] == 302 and sliding_layers(dump) == {}
    assert evaluable_layers(dump) == [0, 1, 2, 3]

    every = shutil.copytree(tiny_gemma3, tmp_path / "every")
    (every / "config.json").write_text(json.dumps(config | {"layer_types": ["sliding_attention"] * 4}))
    dump = run_dump(str(every), tokens=300, decode_tokens=2, layers="all", out=tmp_path / "e", progress=False).dump
    with pytest.raises(AnnsLabError, match=r"every layer of dump .* sliding window \(8 tokens\) shorter than its 302 positions"):
        run_sweep(dump.path, ["flat"], heads=[0], k=K, window=(0, 0), out=tmp_path / "s1", jobs=1, progress=False)


def test_an_index_that_reads_queries_where_they_were_gets_them_unmoved(few_steps, tmp_path):
    """``Index.own_positions`` (snapkv): the sweep gives such an index the training queries at their prefill positions
    whatever ``--train-positions`` moved for the others."""
    from anns_lab.indexes import registry

    moved = load_head(few_steps, 1, 2, (4, 16), train_positions="serving", keep_own=True)
    own = load_head(few_steps, 1, 2, (4, 16), train_positions="own")
    assert not np.allclose(moved.train_queries, own.train_queries)
    np.testing.assert_array_equal(moved.train_queries_for(registry.get("snapkv")), own.train_queries)
    np.testing.assert_array_equal(moved.train_queries_for(registry.get("roargraph")), moved.train_queries)
    np.testing.assert_array_equal(own.train_queries_for(registry.get("snapkv")), own.train_queries)
    # moved and not kept (no swept index asked): never the moved ones in their place
    with pytest.raises(AnnsLabError, match="loaded without them"):
        load_head(few_steps, 1, 2, (4, 16), train_positions="serving").train_queries_for(registry.get("snapkv"))
    a = run_sweep(few_steps.path, ["snapkv"], [1], [2], k=K, window=(4, 16), out=tmp_path / "s", jobs=1, progress=False,
                  quick=True, train_positions="serving").table
    b = run_sweep(few_steps.path, ["snapkv"], [1], [2], k=K, window=(4, 16), out=tmp_path / "o", jobs=1, progress=False,
                  quick=True, train_positions="own").table
    cols = ["search_params", "direction", "recall", "scanned_fraction"]
    pd.testing.assert_frame_equal(a[cols].reset_index(drop=True), b[cols].reset_index(drop=True))


def test_an_index_that_reads_positions_is_given_the_keys_and_the_training_queries(few_steps, tmp_path):
    """``Index.reads_positions`` (infllm): the sweep gives it each index key's position (the held-out keys leave holes)
    and each training query's, and sweeps what a build given them by hand measures; a GQA group's interleaved
    queries have no positions of their own: refused before any work."""
    from anns_lab.indexes import registry

    infllm = registry.get("infllm")
    head = load_head(few_steps, 1, 2, (4, 16), train_positions="serving", keep_own=True)
    where = head.positions_for(infllm)
    np.testing.assert_array_equal(where["key_positions"], head.key_pos)
    assert head.key_pos[-1] - head.key_pos[0] + 1 > len(head.key_pos)  # holes where the held-out keys were
    np.testing.assert_array_equal(where["train_positions"], np.arange(len(head.own_train_queries)))
    assert head.positions_for(registry.get("roargraph")) == {}
    params = {"block": 8, "repr": 2, "local": 24}
    table = run_sweep(few_steps.path, ["infllm"], [1], [2], k=K, window=(4, 16), out=tmp_path / "s", jobs=1,
                      progress=False, quick=True, build_params={"infllm": params}).table
    ref = infllm(**params).build(head.keys, head.own_train_queries, **where)
    rows = table[table.direction == "q2k"]
    assert len(rows) == len(ref.grid()) > 3
    for row in rows.itertuples():
        res = ref.search(head.test_queries, K, **json.loads(row.search_params))
        assert row.scanned_fraction == pytest.approx(res.n_scanned.mean() / len(head.keys))
        assert row.recall == pytest.approx(recall_at_k(res.ids, head.test_queries, head.keys, K))
    other = infllm(**params).build(head.keys, head.own_train_queries, key_positions=head.key_pos + 40,
                                   train_positions=where["train_positions"])
    assert not np.array_equal(other._reps, ref._reps)  # the positions it was given decide its representatives
    with pytest.raises(AnnsLabError, match="infllm read each training query's position; --train-group group"):
        run_sweep(few_steps.path, ["infllm"], [1], [2], k=K, window=(4, 16), out=tmp_path / "g", jobs=1,
                  progress=False, quick=True, train_group="group")
    assert not (tmp_path / "g").exists()
    grouped = load_head(few_steps, 1, 2, (4, 16), train_group="group", train_positions="own")
    with pytest.raises(AnnsLabError, match="interleaved .* have none of their own"):
        grouped.positions_for(infllm)
