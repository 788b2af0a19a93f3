"""``--rope-scaling``: the long-range layers' RoPE positions scaled, checked against RoPE applied by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from anns_lab.cli import main
from anns_lab.dumps.models import RopeScaling, extrapolation_note, load_model
from anns_lab.dumps.run import run_dump
from anns_lab.errors import DumpError


def rotate(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """RoPE by hand (rotate-half layout): the pair (x[i], x[i + d/2]) turned by positions × inv_freq[i]."""
    angle = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    half = x.shape[1] // 2
    a, b = x[:, :half], x[:, half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1)


def test_parse_accepts_kind_factor_and_refuses_the_rest():
    assert RopeScaling.parse("linear:4") == RopeScaling("linear", 4.0)
    assert str(RopeScaling.parse("yarn:2.5")) == "yarn:2.5"
    for bad in ("linear", "linear:", "linear:1", "linear:0.5", "cubic:4", "linear:x", "linear:nan", ":4", "linear:inf"):
        with pytest.raises(ValueError, match="KIND:FACTOR"):
            RopeScaling.parse(bad)


def test_cli_refuses_a_malformed_scaling_before_loading(tmp_path):
    for cmd in (["dump", "--model", "smollm2", "--out", str(tmp_path / "d")], ["decode", "--task", "passkey"]):
        res = CliRunner().invoke(main, [*cmd, "--rope-scaling", "linear:1"])
        assert res.exit_code == 2 and "FACTOR a finite number > 1" in res.output, res.output
    assert not (tmp_path / "d").exists()
    with pytest.raises(DumpError, match="rope-scaling"):
        run_dump("smollm2", tokens=16, rope_scaling="cubic:4", out=tmp_path / "e", progress=False)


def test_only_the_long_range_layers_are_scaled(tiny_gemma3, tiny_llama):
    plain, scaled = load_model(str(tiny_gemma3)), load_model(str(tiny_gemma3), rope_scaling=RopeScaling("linear", 4.0))
    rp, rs = plain.model.model.rotary_emb, scaled.model.model.rotary_emb
    assert np.allclose(rs.full_attention_inv_freq.numpy(), rp.full_attention_inv_freq.numpy() / 4)
    assert np.array_equal(rs.sliding_attention_inv_freq.numpy(), rp.sliding_attention_inv_freq.numpy())
    assert scaled.context == plain.context  # the trained context does not move
    one_set = load_model(str(tiny_llama), rope_scaling=RopeScaling("linear", 2.0)).model.model.rotary_emb
    assert np.allclose(one_set.inv_freq.numpy(), load_model(str(tiny_llama)).model.model.rotary_emb.inv_freq.numpy() / 2)


def test_configs_without_a_full_attention_rope_are_refused():
    from types import SimpleNamespace

    from anns_lab.errors import ModelNotAvailable

    def config(rope, layer_types=None):
        text = SimpleNamespace(rope_parameters=rope, layer_types=layer_types, max_position_embeddings=512)
        return SimpleNamespace(get_text_config=lambda: text)

    scaling = RopeScaling("linear", 4.0)
    for cfg in (config(None), config({"sliding_attention": {"rope_theta": 1e4}}, ["sliding_attention"])):
        with pytest.raises(ModelNotAvailable, match="rope-scaling linear:4"):
            scaling.apply(cfg)
    per_type = config({"sliding_attention": {"rope_theta": 1e4}, "full_attention": {"rope_theta": 1e6}},
                      ["sliding_attention", "full_attention"])
    scaling.apply(per_type)
    assert per_type.get_text_config().rope_parameters == {"sliding_attention": {"rope_theta": 1e4},
                                                          "full_attention": {"rope_theta": 1e6, "rope_type": "linear",
                                                                             "factor": 4.0}}


def test_dump_keys_are_rotated_by_the_scaled_positions(tiny_gemma3, tmp_path):
    """Layer 1 (global) sees layer 0's (sliding, unscaled) output in both models, so its keys before RoPE are the same:
    the scaled dump's keys are the plain dump's turned back by t and forward by t / 4. The decode steps take the text's
    own tokens: greedy ones may differ between the two models."""
    kw = dict(tokens=40, decode_tokens=3, continuation="text", layers="0,1", dtype="float32", progress=False)
    plain = run_dump(str(tiny_gemma3), out=tmp_path / "plain", **kw).dump
    scaled = run_dump(str(tiny_gemma3), out=tmp_path / "scaled", rope_scaling="linear:4", **kw).dump
    assert scaled.manifest["settings"]["rope_scaling"] == "linear:4" and "rope_scaling" not in plain.manifest["settings"]
    assert scaled.manifest["model"]["rope_scaling"] == "linear:4"
    theta = plain.manifest["model"]["config"]["rope_parameters"]["full_attention"]["rope_theta"]
    d = plain.head_dim
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    t = np.arange(len(plain.positions()), dtype=np.float64)
    for g in range(plain.n_kv_heads):
        assert np.array_equal(scaled.keys(0, g), plain.keys(0, g))  # the sliding layer: unscaled
        before = rotate(plain.keys(1, g).astype(np.float64), -t, inv_freq)
        expected = rotate(before, t / 4, inv_freq)
        got = scaled.keys(1, g).astype(np.float64)
        assert np.abs(got - expected).max() < 1e-4 * np.abs(expected).max()
        assert np.abs(got - plain.keys(1, g)).max() > 1e-2 * np.abs(expected).max()  # and it did change


def test_decode_records_the_scaling_and_says_so_beyond_the_context(tiny_gemma3, tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(main, ["decode", "--model", str(tiny_gemma3), "--task", "passkey", "--context", "600",
                                    "--mode", "full,flat", "--window", "4,64", "--rope-scaling", "linear:2", "--allow-extrapolation",
                                    "--max-new-tokens", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert result["rope_scaling"] == "linear:2"
    assert result["extrapolated"] == extrapolation_note(result["model"], 602, 512, "linear:2")
    assert "RoPE positions scaled (linear:2)" in res.output
