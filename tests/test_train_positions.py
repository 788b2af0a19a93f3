"""Training queries moved by RoPE to the positions an index serves (``dumps.rope``, ``--train-positions``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import TEST_DEVICE

from anns_lab.dumps import rope
from anns_lab.errors import AnnsLabError
from anns_lab.dumps.models import RopeScaling, load_model


def _model_rope(lm, x: np.ndarray, positions: np.ndarray, layer: int) -> np.ndarray:
    """``x`` (n, d) turned to ``positions`` by the model's own rotary embedding and transformers' apply_rotary_pos_emb."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = lm.model.model.rotary_emb
    t = torch.tensor(x, dtype=torch.float32)[None, None]
    pos = torch.tensor(positions)[None]
    types = getattr(lm.config, "layer_types", None)
    cos, sin = rotary(t, pos, types[layer]) if types else rotary(t, pos)
    scale = getattr(rotary, f"{types[layer]}_attention_scaling", None) if types else getattr(rotary, "attention_scaling", 1.0)
    return (apply_rotary_pos_emb(t, t, cos / (scale or 1.0), sin / (scale or 1.0))[0][0, 0]).numpy()


@pytest.mark.parametrize("arch, layer, scaling", [("tiny_llama", 0, None), ("tiny_gemma3", 1, None), ("tiny_gemma3", 0, None),
                                                  ("tiny_gemma3", 3, "linear:4"), ("tiny_llama", 2, "linear:2")])
def test_a_moved_query_is_the_query_the_model_turns_to_the_new_position(request, arch, layer, scaling):
    """move(R(p)·x, p, t) = R(t)·x for the model's own RoPE: global and sliding layers (Gemma-3's two frequency sets)
    and linearly scaled positions."""
    lm = load_model(str(request.getfixturevalue(arch)), device=TEST_DEVICE,
                    rope_scaling=RopeScaling.parse(scaling) if scaling else None)
    rng = np.random.default_rng(layer)
    x = rng.standard_normal((40, lm.config.head_dim)).astype(np.float32)
    p, t = rng.integers(0, 3000, 40), rng.integers(0, 3000, 40)
    moved = rope.move(_model_rope(lm, x, p, layer), p, t, rope.inv_freq(lm.config, layer))
    expected = _model_rope(lm, x, t, layer)
    assert np.abs(moved - expected).max() < 1e-4 * np.abs(expected).max()
    assert np.abs(_model_rope(lm, x, p, layer) - expected).max() > 0.1  # the positions do differ


def test_the_dumps_frequencies_are_the_models(tiny_gemma3, tmp_path):
    """A dump's manifest gives each layer the frequencies the model turned its queries with."""
    from anns_lab.dumps.run import run_dump

    dump = run_dump(str(tiny_gemma3), tokens=64, decode_tokens=4, layers="all", dtype="float32", out=tmp_path / "d",
                    progress=False).dump
    rotary = load_model(str(tiny_gemma3)).model.model.rotary_emb
    for layer, kind in enumerate(["sliding_attention", "full_attention", "sliding_attention", "full_attention"]):
        assert np.allclose(rope.dump_inv_freq(dump.manifest, layer), getattr(rotary, f"{kind}_inv_freq").double().numpy())
    manifest = dict(dump.manifest, model={"name": "x"})
    from anns_lab.errors import DumpError

    with pytest.raises(DumpError, match="--train-positions own"):
        rope.dump_inv_freq(manifest, 1)


def test_serving_positions_are_drawn_from_the_range_and_only_the_angles_move():
    rng = np.random.default_rng(0)
    d, n = 16, 500
    freqs = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)
    x = rng.standard_normal((n, d)).astype(np.float32)
    pos = np.arange(n)
    moved = rope.to_serving(x, pos, 900, 963, freqs)
    pair = lambda v, i: np.arctan2(v[:, i + d // 2], v[:, i])  # noqa: E731
    slowest = len(freqs) - 1  # turns at most 0.34 rad over 963 positions: the angle gives the position back
    targets = pos + np.angle(np.exp(1j * (pair(moved, slowest) - pair(x, slowest)))) / freqs[slowest]
    assert targets.min() > 899.5 and targets.max() < 963.5 and np.ptp(np.round(targets)) >= 60
    assert np.allclose(np.linalg.norm(moved, axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)
    assert rope.move(x, pos, pos + 5, None) is not None and np.array_equal(rope.move(x, pos, pos + 5, None), x)
    from anns_lab.errors import AnnsLabError

    with pytest.raises(AnnsLabError, match="serving, own"):
        rope.check_place("decode")


def test_the_decoders_indexes_get_the_queries_moved_to_its_steps(tiny_gemma3):
    """LayerStore builds: the roargraph of each query head keeps (for add) its newest training queries, moved to the
    decode steps' positions under 'serving', as captured under 'own'."""
    import dataclasses

    from anns_lab.decode.builds import layer_store
    from anns_lab.decode.engine import Settings, prefill
    from anns_lab.decode.placement import IndexPlan
    from anns_lab.window import Window

    lm = load_model(str(tiny_gemma3), device=TEST_DEVICE)
    ids = np.random.default_rng(3).integers(3, 400, size=300).tolist()
    base = Settings(Window(4, 8), topk=20, add_batch=4, chunk=64, steps=16)
    pre = prefill(lm, ids, base, capture_queries=True)
    layer = lm.long_range_layers[0]
    queries = pre.queries[layer]
    kept = {}
    for place in rope.PLACES:
        settings = dataclasses.replace(base, train_positions=place)
        store = layer_store(lm, pre.cache, len(ids), layer, IndexPlan("roargraph", {"keep_queries": 32}, {}), settings, queries)
        kept[place] = np.stack([ix._recent_q for ix in store.indexes])
    assert np.array_equal(kept["own"], queries[:, -32:])
    expected = np.stack([rope.to_serving(q, np.arange(len(ids)), len(ids), len(ids) + 15, rope.inv_freq(lm.config, layer))
                         for q in queries])[:, -32:]
    assert np.allclose(kept["serving"], expected, atol=1e-6) and not np.allclose(kept["serving"], kept["own"], atol=1e-3)
    from anns_lab.errors import AnnsLabError

    # With fewer training queries kept than captured (max_train), only the kept rows are moved (Index.train_rows):
    # the graphs are those of builds given every query moved.
    from anns_lab.indexes.roargraph import RoarGraphIndex

    params = {"keep_queries": 32, "max_train": 100}
    store = layer_store(lm, pre.cache, len(ids), layer, IndexPlan("roargraph", params, {}), base, queries)
    for h, ix in enumerate(store.indexes):
        moved = rope.to_serving(queries[h], np.arange(len(ids)), len(ids), len(ids) + 15, rope.inv_freq(lm.config, layer))
        ref = RoarGraphIndex(**params).build(store.key_store.head(h // store.group), moved)
        assert np.array_equal(ix._nbrs, ref._nbrs) and np.array_equal(ix.hubs, ref.hubs)
        assert np.array_equal(ix._recent_q, ref._recent_q) and len(ix._recent_q) == 32
    # An index that reads them where they were (Index.own_positions: snapkv's window) is never given them moved.
    from anns_lab.indexes import registry

    snap = registry.get("snapkv")
    for place in rope.PLACES:
        store = layer_store(lm, pre.cache, len(ids), layer, IndexPlan("snapkv", {"window": 16}, {}),
                            dataclasses.replace(base, train_positions=place, calibrate=0.0), queries)
        for h, ix in enumerate(store.indexes):
            ref = snap(window=16).build(store.key_store.head(h // store.group), queries[h, -16:])
            assert np.array_equal(ix._order, ref._order)
    # One that reads positions (Index.reads_positions: infllm) gets the keys' (those outside the window) and the kept
    # training queries' (--train-queries: evenly spaced, the last included), in the prompt.
    from anns_lab.decode.builds import subsampled_positions
    from anns_lab.decode.engine import Mode, check_window
    from anns_lab.errors import DecodeError

    infllm, params = registry.get("infllm"), {"block": 16, "repr": 2, "local": 40}
    lo, hi = base.window.outside(len(ids))
    for kept_q in (0, 70):
        store = layer_store(lm, pre.cache, len(ids), layer, IndexPlan("infllm", params, {}),
                            dataclasses.replace(base, train_queries=kept_q, calibrate=0.0), queries)
        rows = subsampled_positions(len(ids), kept_q)
        assert len(rows) == (kept_q or len(ids))
        for h, ix in enumerate(store.indexes):
            ref = infllm(**params).build(store.key_store.head(h // store.group), queries[h, rows],
                                         key_positions=np.arange(lo, hi), train_positions=rows)
            assert np.array_equal(ix._reps, ref._reps) and np.array_equal(ix._starts, ref._starts)
    with pytest.raises(DecodeError, match="--mode infllm reads each training query's position; --train-group strided"):
        check_window(dataclasses.replace(base, train_group="strided"), len(ids), [Mode("infllm", IndexPlan("infllm"))],
                     16, 32)
    store = layer_store(lm, pre.cache, len(ids), layer, None, base, None)  # no plan: nothing built
    store.plan = IndexPlan("infllm", params, {})
    per_kv = np.stack([queries[0]] * store.key_store.buf.shape[0])  # a KV head's rows: no positions of their own
    with pytest.raises(ValueError, match="positions are a query head's own"):
        store.build(per_kv, per_kv_head=True,
                    positions={"key_positions": np.arange(lo, hi), "train_positions": np.arange(len(ids))})
    with pytest.raises(AnnsLabError, match="choose one of serving, own"):  # a Settings built by hand, not the CLI
        layer_store(lm, pre.cache, len(ids), layer, IndexPlan("roargraph", {}, {}),
                    dataclasses.replace(base, train_positions="decode"), queries)


# -- the sweep and the real model ----------------------------------------------------------------------------------

WINDOW = (16, 128)


@pytest.mark.realmodel
def test_load_head_moves_the_training_queries_to_the_test_positions(smollm2_dump):
    from anns_lab.eval.heads import load_head

    own = load_head(smollm2_dump, 15, 4, window=WINDOW, train_positions="own")
    serving = load_head(smollm2_dump, 15, 4, window=WINDOW)
    n = len(own.train_queries)
    assert np.array_equal(own.train_queries, smollm2_dump.queries(15, 4, "prefill")[:n])
    freqs = rope.dump_inv_freq(smollm2_dump.manifest, 15)
    assert np.array_equal(serving.train_queries, rope.to_serving(own.train_queries, np.arange(n), int(own.test_pos.min()),
                                                                  int(own.test_pos.max()), freqs))
    assert np.array_equal(serving.test_queries, own.test_queries) and np.array_equal(serving.keys, own.keys)


@pytest.mark.realmodel
@pytest.mark.parametrize("lh", [(2, 0), (15, 4)])
def test_serving_positions_cut_the_scans_on_real_heads(smollm2_dump, lh):
    """On real SmolLM2 heads a graph trained on the queries moved to the decode steps scans fewer keys for recall@100
    0.95 than one trained on them where they were (measured: BENCHMARKS "Query-aware graphs")."""
    from anns_lab.eval.heads import load_head
    from anns_lab.indexes.roargraph import RoarGraphIndex
    from anns_lab.testing import recall_at_k

    scans = {}
    for place in rope.PLACES:
        data = load_head(smollm2_dump, *lh, window=WINDOW, train_positions=place)
        index = RoarGraphIndex().build(data.keys, data.train_queries)
        pts = []
        for params in index.grid():
            res = index.search(data.test_queries, 100, **params)
            pts.append((res.n_scanned.mean(), recall_at_k(res.ids, data.test_queries, data.keys, 100)))
        scans[place] = next(s for s, r in pts if r >= 0.95)
    assert scans["serving"] < scans["own"], scans


@pytest.mark.realmodel
def test_the_sweep_records_its_training_positions_and_never_mixes_them(smollm2_dump, tmp_path):
    from anns_lab.errors import AnnsLabError
    from anns_lab.eval.sweep import run_sweep
    from anns_lab.eval.table import SETTINGS

    runs = {place: run_sweep(smollm2_dump.path, ["roargraph", "ivf"], [2], [1], window=WINDOW, out=tmp_path / place, jobs=1,
                             progress=False, quick=True, train_positions=place).table.sort_values(["index", "search_params", "direction"])
            for place in rope.PLACES}
    assert json.loads((tmp_path / "serving" / SETTINGS).read_text())["train_positions"] == "serving"
    assert "train_positions" not in json.loads((tmp_path / "own" / SETTINGS).read_text())  # as sweeps before the option
    rg, ivf = ({p: t[t["index"] == name].scanned_fraction.to_numpy() for p, t in runs.items()} for name in ("roargraph", "ivf"))
    assert np.array_equal(ivf["own"], ivf["serving"])  # a key-only index gets no training queries
    assert len(rg["own"]) == len(rg["serving"]) and not np.array_equal(rg["own"], rg["serving"])
    with pytest.raises(AnnsLabError, match="other settings"):
        run_sweep(smollm2_dump.path, ["roargraph"], [2], [1], window=WINDOW, out=tmp_path / "own", progress=False, quick=True)
    with pytest.raises(AnnsLabError, match="choose one of serving, own"):  # before anything is written
        run_sweep(smollm2_dump.path, ["roargraph"], [2], [1], window=WINDOW, out=tmp_path / "bad", progress=False,
                  train_positions="decode")
    assert not (tmp_path / "bad").exists()


# -- frequencies that cannot be known from the config, and configs that cannot be read back -------------------------

@pytest.mark.parametrize("params", [dict(rope_type="dynamic", factor=4.0),
                                    dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[4.0] * 8,
                                         original_max_position_embeddings=128)])
def test_frequencies_that_follow_the_sequence_length_are_refused(params):
    """dynamic NTK and longrope recompute ω from the longest position a forward sees: a prefill query beyond the
    original length was turned by other frequencies than the config's, so moving it by those would misplace it."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from anns_lab.errors import DumpError

    cfg = LlamaConfig(vocab_size=10, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, head_dim=16,
                      max_position_embeddings=512, rope_parameters=dict(params, rope_theta=10000.0))
    rotary = LlamaRotaryEmbedding(cfg)
    before = rotary.inv_freq.clone()
    rotary(torch.zeros(1, 1, 16), torch.arange(2000)[None])
    assert not torch.allclose(rotary.inv_freq, before)  # why: the frequencies at 2000 are not the config's
    with pytest.raises(DumpError, match=f"{params['rope_type']}.*--train-positions own"):
        rope.inv_freq(cfg, 0)


@pytest.mark.parametrize("edit", [lambda c: c.update(model_type="nonsense"), lambda c: c.update(rope_parameters="x"),
                                  lambda c: c.update(layer_types=["full_attention"]), lambda c: c.update(num_attention_heads=0)])
def test_a_manifest_config_that_cannot_be_read_back_is_one_clear_error(edit):
    from transformers import LlamaConfig

    from anns_lab.errors import DumpError

    config = json.loads(LlamaConfig(vocab_size=10, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    head_dim=16).to_json_string(use_diff=False))
    edit(config)
    with pytest.raises(DumpError, match="--train-positions own") as err:
        rope.dump_inv_freq({"model": {"config": config}}, 1)
    assert "\n" not in str(err.value)


def test_a_layer_without_rope_has_nothing_to_move():
    """SmolLM3 (and Llama-4) skip RoPE on the layers no_rope_layers marks 0: their queries sit at no position."""
    from transformers import SmolLM3Config

    cfg = SmolLM3Config(vocab_size=10, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    assert cfg.no_rope_layers[3] == 0 and cfg.no_rope_layers[2] == 1
    assert rope.inv_freq(cfg, 3) is None
    assert rope.inv_freq(cfg, 2) is not None and len(rope.inv_freq(cfg, 2)) == 8


@pytest.mark.parametrize("model_type", ["cohere", "glm"])
def test_a_rotary_layout_other_than_rotate_half_is_refused(model_type):
    """Cohere and GLM turn interleaved pairs (x[2i], x[2i+1]): moving their queries as rotate-half pairs misplaces them
    (checked against the model's own rotary embedding), so serving positions are refused for them."""
    import importlib

    from transformers import AutoConfig, AutoModelForCausalLM

    from anns_lab.errors import DumpError

    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    apply = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}").apply_rotary_pos_emb
    x = torch.tensor(np.random.default_rng(0).standard_normal((1, 1, 20, 16)), dtype=torch.float32)
    p, t = torch.arange(20)[None] * 7, torch.arange(20)[None] * 11 + 3

    def turned(pos):
        cos, sin = model.model.rotary_emb(x, pos)
        return apply(x, x, cos, sin)[0][0, 0].numpy()

    freqs = model.model.rotary_emb.inv_freq.double().numpy()  # the model's own frequencies, moved as rotate-half pairs
    assert not np.allclose(rope.move(turned(p), p[0].numpy(), t[0].numpy(), freqs), turned(t), atol=1e-3)
    with pytest.raises(DumpError, match=f"{model_type}.*--train-positions own"):
        rope.inv_freq(cfg, 0)


def test_mix_keeps_a_random_half_where_it_was_and_moves_the_rest():
    """``mix``: each query either exactly as captured or exactly as ``serving`` moves it, about half each, the
    same halves on every call; ``own`` and ``serving`` are what they were."""
    rng = np.random.default_rng(5)
    q = rng.normal(size=(400, 16)).astype(np.float32)
    pos = np.arange(400)
    freqs = 1.0 / 10000 ** (np.arange(0, 16, 2) / 16)
    served = rope.to_serving(q, pos, 1000, 1063, freqs)
    mixed = rope.placed(q, pos, 1000, 1063, freqs, "mix")
    kept = np.all(mixed == q, axis=1)
    moved = np.all(mixed == served, axis=1)
    assert np.all(kept ^ moved) and 150 < kept.sum() < 250
    assert np.array_equal(mixed, rope.placed(q, pos, 1000, 1063, freqs, "mix"))
    assert np.array_equal(rope.placed(q, pos, 1000, 1063, freqs, "own"), q)
    assert np.array_equal(rope.placed(q, pos, 1000, 1063, freqs, "serving"), served)
    with pytest.raises(AnnsLabError, match="unknown training-query positions"):
        rope.placed(q, pos, 1000, 1063, freqs, "half")
    rows = np.r_[3:400:7, 390:400]  # ``rows``: those rows only, each placed as among all
    for place, full in (("mix", mixed), ("serving", served), ("own", q)):
        assert np.array_equal(rope.placed(q, pos, 1000, 1063, freqs, place, rows=rows), full[rows])


def test_a_layers_heads_placed_at_once_are_each_head_placed_alone():
    """The decoder places a layer's (H, n, d) queries in one call: head h's rows are exactly what placing head h alone
    gives, for every place and with ``rows`` (the same positions drawn for every head)."""
    rng = np.random.default_rng(6)
    q = rng.normal(size=(3, 300, 16)).astype(np.float32)
    pos = np.arange(300)
    freqs = 1.0 / 10000 ** (np.arange(0, 12, 2) / 16)  # 12 of the 16 dims rotated: the rest left as they are
    rows = np.r_[0:300:5, 295:300]
    for place in ("serving", "mix", "own"):
        for r in (None, rows):
            stacked = rope.placed(q, pos, 500, 530, freqs, place, rows=r)
            alone = np.stack([rope.placed(x, pos, 500, 530, freqs, place, rows=r) for x in q])
            assert stacked.shape == alone.shape and np.array_equal(stacked, alone)
    assert not np.array_equal(rope.placed(q, pos, 500, 530, freqs, "serving")[1], q[1])
