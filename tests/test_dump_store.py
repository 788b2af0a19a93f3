"""Dump format, resume and bad input: each failure is one clear error and nothing finished is lost."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from anns_lab import open_dump
from anns_lab.cli import main
from anns_lab.dumps import run as run_mod
from anns_lab.dumps import store
from anns_lab.dumps.run import parse_layers, run_dump
from anns_lab.errors import DumpError, ModelNotAvailable, PromptError
from anns_lab.io import atomic_write_json


def small_dump(model_dir, out, **kw):
    args = dict(tokens=30, decode_tokens=3, layers="all", dtype="float32", chunk=8, out=out, progress=False)
    return run_dump(str(model_dir), **(args | kw))


def test_manifest_and_api_shapes(tiny_llama, tmp_path):
    d = small_dump(tiny_llama, tmp_path / "d").dump
    m = d.manifest
    assert m["n_tokens"] == {"prefill": 30, "decode": 3}
    assert d.layers == [0, 1, 2, 3] and (d.n_heads, d.n_kv_heads, d.head_dim) == (4, 2, 16)
    assert d.queries(2, 3, phase="decode").shape == (3, 16)
    assert d.queries(2, 3, phase="all").shape == (33, 16)
    assert d.keys(2, 1, phase="prefill").shape == (30, 16)
    assert d.positions("decode").tolist() == [30, 31, 32]
    assert len(d.tokens()) == 33 and d.tokens("decode").tolist() == d.tokens()[30:].tolist()
    # Each file's checksum in the manifest is the file's own.
    for name, entry in m["files"].items():
        assert store.sha256_file(d.path / name) == entry["sha256"]
    # A float32 dump is read without copying: a read-only view on the memory-mapped column.
    keys = d.keys(0, 0)
    assert not keys.flags.writeable and not keys.flags.owndata
    base = keys
    while isinstance(base, np.ndarray):
        base = base.base
    assert "pyarrow" in type(base).__module__


def test_dump_files_are_readable_as_any_file_written_here(tiny_llama, tmp_path):
    mask = os.umask(0)
    os.umask(mask)
    d = small_dump(tiny_llama, tmp_path / "d").dump
    # The temporary files were made by mkstemp (mode 0600) and renamed so: no other user could read the dump.
    for f in d.path.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f.name


def test_float16_dump_matches_float32(tiny_llama, tmp_path):
    d32 = small_dump(tiny_llama, tmp_path / "a").dump
    d16 = small_dump(tiny_llama, tmp_path / "b", dtype="float16").dump
    a, b = d32.queries(1, 0, "all"), d16.queries(1, 0, "all")
    assert b.dtype == np.float32
    np.testing.assert_allclose(b, a, rtol=2e-3, atol=2e-3 * np.abs(a).max())
    assert d16.manifest["files"]["layer_001.parquet"]["bytes"] < d32.manifest["files"]["layer_001.parquet"]["bytes"]


def test_unfinished_dump_is_refused_for_reading(tiny_llama, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = store.write_table

    def crash_on_third(path, table):
        calls["n"] += 1
        if calls["n"] == 3:  # tokens, layer 0, then the interrupt while writing layer 1
            raise KeyboardInterrupt
        return real(path, table)

    monkeypatch.setattr(store, "write_table", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        small_dump(tiny_llama, tmp_path / "d")
    with pytest.raises(DumpError, match="unfinished"):
        open_dump(tmp_path / "d")
    assert not list((tmp_path / "d").glob(".*.tmp")), "a half-written file was left behind"


def _interrupt_after_two_layers(model_dir, out, monkeypatch):
    real = store.write_table
    calls = {"n": 0}

    def crash_on_fourth(path, table):
        calls["n"] += 1
        if calls["n"] == 4:  # tokens, layer 0, layer 1 written; interrupted at layer 2
            raise KeyboardInterrupt
        return real(path, table)

    monkeypatch.setattr(store, "write_table", crash_on_fourth)
    with pytest.raises(KeyboardInterrupt):
        small_dump(model_dir, out)
    monkeypatch.setattr(store, "write_table", real)


def test_interrupted_dump_resumes_without_redoing_finished_layers(tiny_llama, tmp_path, monkeypatch):
    reference = small_dump(tiny_llama, tmp_path / "ref").dump
    _interrupt_after_two_layers(tiny_llama, tmp_path / "d", monkeypatch)
    kept = {n: os.stat(tmp_path / "d" / n).st_mtime_ns for n in ("layer_000.parquet", "layer_001.parquet")}
    real = store.write_table
    written = []
    monkeypatch.setattr(store, "write_table", lambda p, t: written.append(p.name) or real(p, t))
    forwards = _count_forwards(monkeypatch)
    res = small_dump(tiny_llama, tmp_path / "d")
    assert sorted(written) == ["layer_002.parquet", "layer_003.parquet"]
    # interrupted while writing the layer files: the capture was complete in the staging maps, the model did not run
    # again (at 128K on a CPU that forward is hours of an 8B model's)
    assert forwards == []
    assert res.resumed_layers == 2
    for n, mtime in kept.items():
        assert os.stat(tmp_path / "d" / n).st_mtime_ns == mtime
    d = res.dump
    for layer in reference.layers:
        np.testing.assert_array_equal(d.keys(layer, 1), reference.keys(layer, 1))
        np.testing.assert_array_equal(d.queries(layer, 2, "all"), reference.queries(layer, 2, "all"))
    assert d.tokens().tolist() == reference.tokens().tolist()


def _count_forwards(monkeypatch) -> list:
    """The forward calls of the dumps from now on (their (start, end)), as a list that fills as they run."""
    from anns_lab.dumps import models

    calls, real = [], models.forward_tokens
    monkeypatch.setattr(models, "forward_tokens", lambda lm, cache, ids, start, end: calls.append((start, end))
                        or real(lm, cache, ids, start, end))
    return calls


def test_staging_maps_gone_or_of_another_shape_are_captured_again(tiny_llama, tmp_path, monkeypatch):
    """The staged maps are read only when all are there with the capture's shapes: one deleted, or another shape left
    by hand, and the model runs again for the missing layers, the dump the same."""
    reference = small_dump(tiny_llama, tmp_path / "ref").dump
    for damage in ("delete", "reshape"):
        out = tmp_path / damage
        _interrupt_after_two_layers(tiny_llama, out, monkeypatch)
        q3 = out / run_mod.STAGING / "layer_003.q.npy"
        if damage == "delete":
            q3.unlink()
        else:
            np.save(q3, np.zeros((1, 2, 3), np.float32), allow_pickle=False)
        forwards = _count_forwards(monkeypatch)
        d = small_dump(tiny_llama, out).dump
        assert forwards, damage
        for layer in reference.layers:
            np.testing.assert_array_equal(d.queries(layer, 2, "all"), reference.queries(layer, 2, "all"))
        monkeypatch.undo()


def test_a_capture_run_again_and_stopped_in_its_forward_never_leaves_its_maps_listed_as_complete(tiny_llama, tmp_path,
                                                                                                monkeypatch):
    """Maps found unusable (one deleted) are written anew by a second forward; killed in it, the progress record still
    listed them as staged, and a third run sealed their zeros past its last chunk into the dump (a review's finding)."""
    from anns_lab.dumps import models

    reference = small_dump(tiny_llama, tmp_path / "ref").dump
    out = tmp_path / "d"
    _interrupt_after_two_layers(tiny_llama, out, monkeypatch)
    (out / run_mod.STAGING / "layer_003.q.npy").unlink()
    real, calls = models.forward_tokens, []

    def stop_in_the_second_chunk(lm, cache, ids, start, end):
        calls.append(start)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(lm, cache, ids, start, end)

    monkeypatch.setattr(models, "forward_tokens", stop_in_the_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        small_dump(tiny_llama, out)
    monkeypatch.setattr(models, "forward_tokens", real)
    assert "staged" not in json.loads((out / run_mod.STAGING / run_mod.PROGRESS).read_text())
    d = small_dump(tiny_llama, out).dump
    for layer in reference.layers:
        np.testing.assert_array_equal(d.queries(layer, 2, "all"), reference.queries(layer, 2, "all"))
        np.testing.assert_array_equal(d.values(layer, 1), reference.values(layer, 1))


def test_resume_with_other_weights_at_the_same_path_is_refused(tmp_path, monkeypatch):
    from conftest import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model", "llama", seed=0)
    _interrupt_after_two_layers(model_dir, tmp_path / "d", monkeypatch)
    make_tiny_model(model_dir, "llama", seed=1)  # another checkpoint of the same shapes where the first one was
    kept = sorted(p.name for p in (tmp_path / "d").glob("layer_*.parquet"))
    with pytest.raises(DumpError, match="other weights"):
        small_dump(model_dir, tmp_path / "d")
    # Nothing finished is lost, and the first checkpoint back in place resumes the dump.
    assert sorted(p.name for p in (tmp_path / "d").glob("layer_*.parquet")) == kept
    make_tiny_model(model_dir, "llama", seed=0)
    res = small_dump(model_dir, tmp_path / "d")
    assert res.resumed_layers == 2
    reference = small_dump(model_dir, tmp_path / "ref").dump
    assert res.dump.manifest["model"]["weights_fingerprint"] == reference.manifest["model"]["weights_fingerprint"]
    np.testing.assert_array_equal(res.dump.keys(3, 1), reference.keys(3, 1))


def test_resume_on_another_device_is_refused(tiny_llama, tmp_path, monkeypatch):
    _interrupt_after_two_layers(tiny_llama, tmp_path / "d", monkeypatch)
    progress_path = tmp_path / "d" / run_mod.STAGING / run_mod.PROGRESS
    state = json.loads(progress_path.read_text())
    assert state["provenance"]["device"] == "cpu"
    state["provenance"]["device"] = "cuda"  # as a run begun on a GPU leaves it
    atomic_write_json(progress_path, state)
    with pytest.raises(DumpError, match="--device cuda"):
        small_dump(tiny_llama, tmp_path / "d")


def test_weights_fingerprint_tells_checkpoints_apart(tmp_path):
    from conftest import make_tiny_model

    from anns_lab.dumps.models import load_model, weights_fingerprint

    a = load_model(str(make_tiny_model(tmp_path / "a", "llama", seed=0))).model
    assert weights_fingerprint(a) == weights_fingerprint(load_model(str(tmp_path / "a")).model)
    b = load_model(str(make_tiny_model(tmp_path / "b", "llama", seed=1))).model
    assert weights_fingerprint(a) != weights_fingerprint(b)
    # One tensor scaled a little, as a fine-tune moves weights everywhere it trains them.
    import torch

    with torch.no_grad():
        a.model.layers[2].mlp.down_proj.weight.mul_(1.001)
    assert weights_fingerprint(a) != weights_fingerprint(load_model(str(tmp_path / "a")).model)
    # A tensor past float32's integer precision (SmolLM2's embedding has 28M values) is sampled up to its last value.
    big = torch.nn.Embedding(1 << 22, 7)
    before = weights_fingerprint(big)
    with torch.no_grad():
        big.weight[-1, -1] += 1.0
    assert weights_fingerprint(big) != before


def test_resume_stops_the_forward_pass_at_the_deepest_missing_layer(tiny_llama, tmp_path, monkeypatch):
    first = small_dump(tiny_llama, tmp_path / "d").dump
    # The state an interruption leaves after tokens, layer 2 and layer 3 were written: no manifest, a journal.
    out = first.path
    (out / store.MANIFEST).unlink()
    (out / "layer_000.parquet").unlink()
    (out / "layer_001.parquet").unlink()
    state = {"settings": first.manifest["settings"], "token_ids": first.tokens().tolist(),
             "scaling": first.manifest["scaling"],
             "done": {k: v for k, v in first.manifest["files"].items() if k not in ("layer_000.parquet", "layer_001.parquet")}}
    (out / run_mod.STAGING).mkdir()
    atomic_write_json(out / run_mod.STAGING / run_mod.PROGRESS, state)

    seen: list[int] = []
    real_sink = run_mod.StagingSink

    def spy_sink(*a, **kw):
        sink = real_sink(*a, **kw)
        record = sink.record
        sink.record = lambda layer, *r: seen.append(layer) or record(layer, *r)
        return sink

    monkeypatch.setattr(run_mod, "StagingSink", spy_sink)
    again = small_dump(tiny_llama, out).dump
    assert set(seen) == {0, 1}, "layers after the deepest missing one must not run"
    # Decode tokens are replayed from the journal (teacher forcing), so decode rows are captured too.
    assert again.queries(0, 0, "decode").shape == (3, 16)
    reference = small_dump(tiny_llama, tmp_path / "ref").dump
    for layer in (0, 1):
        np.testing.assert_array_equal(again.queries(layer, 1, "all"), reference.queries(layer, 1, "all"))
        np.testing.assert_array_equal(again.values(layer, 0), reference.values(layer, 0))


def test_corrupt_file_fails_its_checksum(tiny_llama, tmp_path):
    d = small_dump(tiny_llama, tmp_path / "d").dump
    f = d.path / "layer_002.parquet"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    fresh = open_dump(d.path)  # same size: opens, but the first read of that file is refused
    fresh.keys(0, 0)
    with pytest.raises(DumpError, match="checksum"):
        fresh.keys(2, 0)
    f.write_bytes(bytes(raw[:-10]))
    with pytest.raises(DumpError, match="bytes"):
        open_dump(d.path)
    raw[-12:-8] = b"\xff\xff\xff\x7f"  # the footer's length: the schema cannot be read, and the checksum says why
    f.write_bytes(bytes(raw))
    with pytest.raises(DumpError, match="checksum"):
        open_dump(d.path).check_columns(2)


def test_head_column_of_another_type_is_one_error(tiny_llama, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = small_dump(tiny_llama, tmp_path / "d", dtype="float16").dump
    f = d.path / "layer_000.parquet"
    original = pq.read_table(f)
    n = original.num_rows

    def rewrite(dtype: str, width: int) -> None:
        """layer_000's k0 as another tool might write it, with the manifest's checksums made to match."""
        field = pa.field("k0", pa.binary(width), nullable=False, metadata={"dtype": dtype, "head_dim": "16"})
        column = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(bytes(n * width))])
        table = original.set_column(original.schema.get_field_index("k0"), field, column)
        entry = store.write_table(f, table)
        manifest = dict(d.manifest, files=d.manifest["files"] | {f.name: entry})
        atomic_write_json(d.path / store.MANIFEST, store.sealed(manifest))

    # A dtype numpy does not know was a raw TypeError; integers, or a width that is not head_dim × itemsize (read
    # with the wrong stride), were read as vectors, silently.
    for dtype, width in (("bogus", 32), ("float16", 33), ("int16", 32)):
        rewrite(dtype, width)
        with pytest.raises(DumpError, match="column k0 of .*layer_000.parquet"):
            open_dump(d.path).keys(0, 0)


def test_existing_dump_with_other_settings_is_refused_unless_overwrite(tiny_llama, tmp_path):
    small_dump(tiny_llama, tmp_path / "d")
    again = small_dump(tiny_llama, tmp_path / "d")
    assert again.already_complete
    with pytest.raises(DumpError, match="other settings.*tokens"):
        small_dump(tiny_llama, tmp_path / "d", tokens=31)
    assert open_dump(tmp_path / "d").manifest["n_tokens"]["prefill"] == 30  # nothing lost
    assert small_dump(tiny_llama, tmp_path / "d", tokens=31, overwrite=True).dump.manifest["n_tokens"]["prefill"] == 31



def test_a_dump_whose_manifest_cannot_be_read_says_so_and_is_kept(tiny_llama, tmp_path):
    small_dump(tiny_llama, tmp_path / "d")
    (tmp_path / "d" / "manifest.json").write_text("{ not json")
    with pytest.raises(DumpError, match="manifest cannot be read.*--overwrite") as err:
        small_dump(tiny_llama, tmp_path / "d")
    assert "None" not in str(err.value)  # not "other settings", each one None there
    assert (tmp_path / "d" / "manifest.json").read_text() == "{ not json"  # nothing touched
    assert small_dump(tiny_llama, tmp_path / "d", overwrite=True).dump.manifest["n_tokens"]["prefill"] == 30

def test_foreign_folder_is_never_written_into(tiny_llama, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(DumpError, match="not a dump folder"):
            small_dump(tiny_llama, tmp_path / "mine", overwrite=overwrite)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_reading_errors(tiny_llama, tmp_path):
    d = small_dump(tiny_llama, tmp_path / "d").dump
    with pytest.raises(DumpError, match="layer 7 is not in dump"):
        d.keys(7, 0)
    with pytest.raises(DumpError, match="query head 4 is out of range"):
        d.queries(0, 4)
    with pytest.raises(DumpError, match="unknown phase"):
        d.queries(0, 0, phase="later")
    with pytest.raises(DumpError, match="does not exist"):
        open_dump(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpError, match="no manifest.json"):
        open_dump(tmp_path / "empty")


def test_nan_in_the_model_is_reported(tiny_llama, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.1.self_attn.k_proj.weight"][0, 0] = torch.nan
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DumpError, match="non-finite K values at layer 1"):
        small_dump(broken, tmp_path / "d")


def test_values_beyond_float16_are_reported(tiny_llama, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    big = tmp_path / "big"
    shutil.copytree(tiny_llama, big)
    weights = load_file(big / "model.safetensors")
    weights["model.layers.1.self_attn.v_proj.weight"] *= 1e6
    save_file(weights, big / "model.safetensors", metadata={"format": "pt"})
    # Finite in the model, but cast to float16 they became inf in the dump, silently.
    with pytest.raises(DumpError, match="V values beyond float16.*--dtype float32"):
        small_dump(big, tmp_path / "d", dtype="float16")
    d = small_dump(big, tmp_path / "e").dump
    assert np.isfinite(d.values(1, 0)).all() and np.abs(d.values(1, 0)).max() > 65504


@pytest.mark.parametrize("spec,expected", [
    ("all", [0, 1, 2, 3, 4, 5]), ("default", [1, 3]), ("2,4", [2, 4]), ("0:6:2", [0, 2, 4]), ("1-3", [1, 2, 3]),
    ("5, 0:2", [0, 1, 5]),
])
def test_parse_layers(spec, expected):
    assert parse_layers(spec, 6, [1, 3]) == expected


@pytest.mark.parametrize("spec", ["7", "x", "0:0", "-1", "0,,1", "2,", "4-9"])
def test_parse_layers_rejects(spec):
    with pytest.raises(DumpError):
        parse_layers(spec, 6, [1])


def test_parse_layers_huge_range_is_refused_before_it_is_built():
    # A bound of 10^11 once built a list of 10^11 ints (MemoryError), and 0-10^6 printed a 7.9 MB error line.
    for spec in ("0-100000000000", "0-1000000"):
        with pytest.raises(DumpError, match=r"lies outside the model's layers 0\.\.5") as err:
            parse_layers(spec, 6, [1])
        assert len(str(err.value)) < 200
    assert parse_layers("0-100000000000", None, [1]) == []  # syntax only, nothing built


def test_prompt_errors(tiny_llama, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.")
    with pytest.raises(PromptError, match="fewer than --tokens 100"):
        run_dump(str(tiny_llama), prompt_path=short, tokens=100, out=tmp_path / "d", progress=False)
    with pytest.raises(PromptError, match="513 prompt tokens exceed .* context of 512"):
        small_dump(tiny_llama, tmp_path / "e", tokens=513, decode_tokens=1)
    assert small_dump(tiny_llama, tmp_path / "f", tokens=513, decode_tokens=2, layers="0",
                      allow_extrapolation=True).dump.manifest["n_tokens"]["decode"] == 2
    # Decode steps may run past the context (8192 + 64 on SmolLM2 is the standard setting).
    assert small_dump(tiny_llama, tmp_path / "g", tokens=512, decode_tokens=2, layers="0").dump


def test_unknown_and_missing_models(tmp_path):
    with pytest.raises(ModelNotAvailable, match="Did you mean smollm2"):
        run_dump("smolm2", out=tmp_path / "x", progress=False)
    with pytest.raises(ModelNotAvailable, match="not on this machine.*Hugging Face cache"):
        run_dump("llama3", tokens=16, out=tmp_path / "y", progress=False)
    with pytest.raises(ModelNotAvailable, match="does not exist"):
        run_dump(str(tmp_path / "no-such-model.gguf"), out=tmp_path / "z", progress=False)
    assert not (tmp_path / "x").exists()
    assert not (tmp_path / "y").exists()  # a model that fails to load leaves no .staging/ behind
    (tmp_path / "kept").mkdir()  # a folder the user made stays, empty
    with pytest.raises(ModelNotAvailable):
        run_dump("llama3", tokens=16, out=tmp_path / "kept", progress=False)
    assert (tmp_path / "kept").is_dir() and not any((tmp_path / "kept").iterdir())


def test_bad_weight_files_are_one_error(tiny_llama, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    def broken(name, edit):
        folder = tmp_path / name
        shutil.copytree(tiny_llama, folder)
        edit(folder / "model.safetensors")
        return folder

    def truncate(f):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    def drop_tensor(f):
        weights = load_file(f)
        del weights["model.layers.1.self_attn.k_proj.weight"]
        save_file(weights, f, metadata={"format": "pt"})

    def reshape_tensor(f):
        weights = load_file(f)
        weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
        save_file(weights, f, metadata={"format": "pt"})

    # A truncated file and a tensor of another shape were raw tracebacks; a missing tensor was silently random.
    for name, edit, match in (("truncated", truncate, "cannot be read"), ("missing", drop_tensor, "k_proj"),
                              ("reshaped", reshape_tensor, "k_proj")):
        with pytest.raises(ModelNotAvailable, match=match):
            small_dump(broken(name, edit), tmp_path / f"d-{name}")
        assert not (tmp_path / f"d-{name}").exists()
    # A malformed config.json in a local folder was told to download the model from the hub.
    folder = broken("config", lambda f: (f.parent / "config.json").write_text('{"model_type": "llama", '))
    with pytest.raises(ModelNotAvailable, match="the folder .* cannot be loaded .*malformed: copy the model again") as err:
        small_dump(folder, tmp_path / "d-config")
    assert "Hugging Face" not in str(err.value) and not (tmp_path / "d-config").exists()



def test_a_model_that_caps_its_attention_logits_is_refused(tmp_path):
    """Gemma-2 caps its attention logits (tanh): a dump taken as if softmax(scaling * q.k) were its attention would
    be another model's attention, and so would every metric and decode on it."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    cfg = Gemma2Config(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, max_position_embeddings=256, sliding_window=8)
    folder = tmp_path / "tiny-gemma2"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    with pytest.raises(ModelNotAvailable, match="attn_logit_softcapping=50.0.*not supported"):
        small_dump(folder, tmp_path / "d")
    assert not (tmp_path / "d").exists()
    cfg.attn_logit_softcapping = None  # then still no SDPA attention in transformers: said so, not "weights missing"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "uncapped")
    with pytest.raises(ModelNotAvailable, match="SDPA interface, so this architecture is not supported") as err:
        small_dump(tmp_path / "uncapped", tmp_path / "d")
    assert "not on this machine" not in str(err.value)

def test_cli_reports_errors_in_one_line(tmp_path):
    r = CliRunner().invoke(main, ["dump", "--model", "gemma-270m", "--out", str(tmp_path / "d")])
    assert r.exit_code == 2
    assert "Error: unknown model 'gemma-270m'. Did you mean gemma3-270m" in r.output
    assert "Traceback" not in r.output


def test_cli_dump_summary(tiny_llama, tmp_path):
    r = CliRunner().invoke(main, ["dump", "--model", str(tiny_llama), "--tokens", "24", "--decode-tokens", "2",
                                  "--layers", "1,3", "--out", str(tmp_path / "d")])
    assert r.exit_code == 0, r.output
    assert "prefill 24, decode 2" in r.output and "layers    2: 1,3" in r.output and "MiB in 3 files" in r.output
    assert open_dump(tmp_path / "d").manifest["dtype"] == "float16"


def test_an_atomic_write_leaves_a_file_of_a_new_files_mode_and_no_temporary(tmp_path):
    """Dumps and results are exchanged: written through a temporary file, they must end as open() would make them
    (the temporary file's 0600 kept them from everyone else), and nothing of the write may remain beside them."""
    import os
    import stat

    mask = os.umask(0o022)
    os.umask(mask)
    atomic_write_json(tmp_path / "a.json", {"x": 1})
    (tmp_path / "b.json").write_text("{}")  # open()'s own
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == stat.S_IMODE((tmp_path / "b.json").stat().st_mode) \
        == 0o666 & ~mask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost raise is the case
def test_a_ctrl_c_lost_in_a_finalizer_still_stops_the_dump(tiny_llama, tmp_path, monkeypatch, lost_ctrl_c):
    """A Ctrl-C whose raise a finalizer dropped (stops.py) stops the dump at its next chunk, decode step or layer file,
    as the Ctrl-C would have: before, the dump ran to its end. Stopped at a layer file, the files written are kept and
    the resume does not run the model again."""
    from anns_lab.dumps import models

    reference = small_dump(tiny_llama, tmp_path / "ref").dump
    for at in ("prefill", "decode"):
        real, calls = models.forward_tokens, []

        def forward(lm, cache, ids, start, end):
            calls.append(end - start)
            if len(calls) == 2 and at == "prefill" or end - start == 1 and at == "decode":
                lost_ctrl_c()
            return real(lm, cache, ids, start, end)

        with monkeypatch.context() as m:
            m.setattr(models, "forward_tokens", forward)
            with pytest.raises(run_mod.DumpInterrupted, match="before any file was written"):
                small_dump(tiny_llama, tmp_path / at)
        assert calls == ([8, 8] if at == "prefill" else [8, 8, 8, 6, 1]), calls
        assert not (tmp_path / at / store.MANIFEST).exists()
    real_write = store.write_table

    def writing(path, table):
        out = real_write(path, table)
        if path.name == "layer_001.parquet":
            lost_ctrl_c()
        return out

    with monkeypatch.context() as m:
        m.setattr(store, "write_table", writing)
        with pytest.raises(run_mod.DumpInterrupted, match="2 layer file"):
            small_dump(tiny_llama, tmp_path / "d")
    forwards = _count_forwards(monkeypatch)
    res = small_dump(tiny_llama, tmp_path / "d")
    assert forwards == [] and res.resumed_layers == 2
    np.testing.assert_array_equal(res.dump.keys(3, 1), reference.keys(3, 1))


def test_a_dump_stopped_between_a_layer_file_and_its_record_counts_what_the_record_holds(tiny_llama, tmp_path,
                                                                                         monkeypatch):
    """The stop's message counted the layers in memory, one of them not yet in the progress record on disk: "2 layer
    file(s) kept", then the resume kept 1 and wrote the other again (an interrupt fuzz). It counts the record's now."""
    real = run_mod.atomic_write_json

    def recording(path, obj):
        if path.name == run_mod.PROGRESS and sum(n.startswith("layer_") for n in obj.get("done", {})) == 2:
            raise KeyboardInterrupt  # the second layer's file is written, its record not
        return real(path, obj)

    with monkeypatch.context() as m:
        m.setattr(run_mod, "atomic_write_json", recording)
        with pytest.raises(run_mod.DumpInterrupted, match="interrupted: 1 layer file.s. kept"):
            small_dump(tiny_llama, tmp_path / "d")
    assert small_dump(tiny_llama, tmp_path / "d").resumed_layers == 1


def _stopped_at_chunk(model, out, monkeypatch, n: int, **kw) -> None:
    """A dump of chunks of 8 with a checkpoint after each, stopped by a Ctrl-C as its ``n``-th chunk begins."""
    from anns_lab.dumps import models

    real, calls = models.forward_tokens, []

    def stopped(lm, cache, ids, start, end):
        calls.append(start)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(lm, cache, ids, start, end)

    with monkeypatch.context() as m:
        m.setattr(models, "forward_tokens", stopped)
        with pytest.raises(run_mod.DumpInterrupted, match=f"the prefill's first {8 * (n - 1)} tokens kept"):
            small_dump(model, out, checkpoint_every=1e-9, **kw)


@pytest.mark.parametrize("arch, kw", [("tiny_llama", {}), ("tiny_gemma3", {}),
                                      ("tiny_gemma3", {"decode_tokens": 0, "layers": "1"})])
def test_a_dump_interrupted_in_its_prefill_resumes_from_its_checkpoint(arch, kw, tmp_path, monkeypatch, request):
    """A dump stopped in its prefill kept nothing: at 128K that was the whole hour. With checkpoints (the cache after
    a chunk: full layers' rows, sliding layers' windows) the resume runs only the chunks after the last one, and the
    dump is the uninterrupted one's, bit for bit (Gemma-3's sliding layers of 8 tokens, a forward that stops early)."""
    model = request.getfixturevalue(arch)
    reference = small_dump(model, tmp_path / "ref", **kw).dump
    _stopped_at_chunk(model, tmp_path / "d", monkeypatch, 4, **kw)
    forwards = _count_forwards(monkeypatch)
    d = small_dump(model, tmp_path / "d", checkpoint_every=1e-9, **kw).dump
    assert forwards[0] == (24, 30), forwards  # the chunks before the checkpoint did not run again
    assert not list((tmp_path / "d" / run_mod.STAGING).glob("cache_*")), "the checkpoint's files were left behind"
    for layer in reference.layers:
        for h in range(reference.n_kv_heads):
            np.testing.assert_array_equal(d.keys(layer, h), reference.keys(layer, h))
            np.testing.assert_array_equal(d.values(layer, h), reference.values(layer, h))
        np.testing.assert_array_equal(d.queries(layer, 1, "all"), reference.queries(layer, 1, "all"))
    assert d.tokens().tolist() == reference.tokens().tolist()
    assert d.manifest["timing"]["prefill_s"] > 0 and d.manifest["timing"]["prefill_resumed_at"] == 24
    assert "prefill_resumed_at" not in reference.manifest["timing"]


def test_a_damaged_prefill_checkpoint_is_said_and_the_prefill_runs_again(tiny_gemma3, tmp_path, monkeypatch, capsys):
    """A checkpoint whose files are gone or cut short only costs the time it would have saved: said, dropped, and the
    prefill runs from its start to the same dump."""
    reference = small_dump(tiny_gemma3, tmp_path / "ref").dump
    for damage in ("sliding window gone", "full rows cut short", "record damaged", "full row changed",
                   "window changed", "captured row changed", "a length changed"):
        out = tmp_path / damage.replace(" ", "-")
        _stopped_at_chunk(tiny_gemma3, out, monkeypatch, 3)
        staging = out / run_mod.STAGING
        if damage == "sliding window gone":
            next(staging.glob("cache_000.k.r16.npy")).unlink()
        elif damage == "full rows cut short":  # numpy's "r+" would have extended the file with zeros
            f = staging / "cache_001.v.npy"
            f.write_bytes(f.read_bytes()[:200])
        elif damage in ("full row changed", "window changed", "captured row changed"):  # a value, not the size
            from numpy.lib.format import open_memmap

            name = {"full row changed": "cache_001.v.npy", "window changed": "cache_002.k.r16.npy",
                    "captured row changed": "layer_001.q.npy"}[damage]
            m = open_memmap(staging / name, mode="r+")
            m[0, 3, 0] += 1.0
            m.flush()
            del m
        else:
            state = json.loads((staging / run_mod.PROGRESS).read_text())
            if damage == "record damaged":
                state["prefill_at"]["row"] = "16"
            else:  # a sliding layer's: its count sets the sliding masks' offset, the restore cannot tell it
                state["prefill_at"]["layers"]["0"]["length"] = 15
            atomic_write_json(staging / run_mod.PROGRESS, state)
        capsys.readouterr()
        with monkeypatch.context() as m:
            forwards = _count_forwards(m)
            d = small_dump(tiny_gemma3, out, checkpoint_every=1e-9).dump
        assert forwards[0] == (0, 8), forwards
        assert "the prefill's checkpoint cannot be used" in "".join(capsys.readouterr())
        np.testing.assert_array_equal(d.keys(1, 0), reference.keys(1, 0))
        np.testing.assert_array_equal(d.queries(1, 1, "all"), reference.queries(1, 1, "all"))


def test_a_progress_record_naming_a_file_outside_the_dump_is_refused_and_the_file_kept(tiny_llama, tmp_path,
                                                                                      monkeypatch):
    """A resume deletes each file its progress record lists whose checksum no longer matches: a record naming
    "../victim.parquet" (or an absolute path) deleted that file, outside the dump (a hostile-input audit)."""
    _interrupt_after_two_layers(tiny_llama, tmp_path / "d", monkeypatch)
    victim = tmp_path / "victim.parquet"
    victim.write_text("precious")
    progress = tmp_path / "d" / run_mod.STAGING / run_mod.PROGRESS
    for name in ("../victim.parquet", str(victim)):
        state = json.loads(progress.read_text())
        state["done"][name] = {"rows": 1, "bytes": 1, "sha256": "0"}
        atomic_write_json(progress, state)
        with pytest.raises(DumpError, match="progress.json is corrupt; pass --overwrite"):
            small_dump(tiny_llama, tmp_path / "d")
        assert victim.read_text() == "precious"
        del state["done"][name]
        atomic_write_json(progress, state)


def test_a_staged_map_changed_since_the_capture_is_captured_again_not_sealed(tiny_llama, tmp_path, monkeypatch,
                                                                             capsys):
    """A dump stopped while writing its layer files writes the rest from the staged maps: a map changed since (a NaN,
    one edited value) was written into the sealed dump under a fresh checksum (a hostile-input audit). Each map's
    sha256 is recorded when the capture stages it; a map that differs is captured again."""
    from numpy.lib.format import open_memmap

    reference = small_dump(tiny_llama, tmp_path / "ref").dump
    _interrupt_after_two_layers(tiny_llama, tmp_path / "d", monkeypatch)
    m = open_memmap(tmp_path / "d" / run_mod.STAGING / "layer_003.k.npy", mode="r+")
    m[0, 5, 0] = 12345.0
    m.flush()
    del m
    capsys.readouterr()
    forwards = _count_forwards(monkeypatch)
    d = small_dump(tiny_llama, tmp_path / "d").dump
    assert "layer_003.k.npy changed since the capture staged it: capturing again" in "".join(capsys.readouterr())
    assert forwards, "the model did not run again"
    np.testing.assert_array_equal(d.keys(3, 0), reference.keys(3, 0))


def test_a_new_capture_leaves_no_checkpoint_on_disk_to_resume_its_zeroed_maps_from(tiny_gemma3, tmp_path, monkeypatch):
    """--overwrite of a dump of the same settings with nothing finished starts the capture's maps anew while the progress
    record on disk still named the old checkpoint: a kill no handler sees (the OOM killer) before the first new one,
    and the next run resumed from the old cache onto zeroed rows (the diff's review). The record and the checkpoint's
    files go before the maps are opened."""
    from anns_lab.dumps import models

    _stopped_at_chunk(tiny_gemma3, tmp_path / "d", monkeypatch, 3)
    real = models.forward_tokens
    staging = tmp_path / "d" / run_mod.STAGING
    seen = []

    def looking(lm, cache, ids, start, end):  # what a kill at this chunk would leave
        if start == 8:
            seen.append((json.loads((staging / run_mod.PROGRESS).read_text()).get("prefill_at"),
                         sorted(f.name for f in staging.glob("cache_*"))))
        return real(lm, cache, ids, start, end)

    with monkeypatch.context() as m:
        m.setattr(models, "forward_tokens", looking)
        small_dump(tiny_gemma3, tmp_path / "d", overwrite=True, checkpoint_every=0)
    assert seen == [(None, [])], seen


def test_a_full_disk_is_said_where_the_maps_are_made_not_a_crash_at_a_later_write(tiny_gemma3, tmp_path, monkeypatch,
                                                                                     capsys):
    """The staged maps and the checkpoints' growing maps were sparse files written through memory maps: on a full disk
    a write into a page the file system could not back killed the dump with SIGBUS (status 135; a docs review, on an
    8 MB tmpfs). Their space is reserved as they are made (``io.new_map``): a full disk is one error for the capture's
    maps, and for a checkpoint's the end of the checkpoints, not of the dump (the same dump as without them)."""
    import errno
    import os

    from anns_lab.dumps import models

    reference = small_dump(tiny_gemma3, tmp_path / "ref").dump
    real = os.posix_fallocate

    def full_for(prefix):
        def fallocate(fd, offset, length):
            if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(prefix):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, offset, length)
        return fallocate

    with monkeypatch.context() as m:
        m.setattr(os, "posix_fallocate", full_for("layer_"))
        with pytest.raises(DumpError, match=r"cannot stage the capture in .*No space left on device; its maps take "
                                            r"[0-9.,]+ [MG]iB .*free space there, or choose another --out"):
            small_dump(tiny_gemma3, tmp_path / "full")
    assert not list((tmp_path / "full" / run_mod.STAGING).glob("layer_*.npy"))  # no map half made
    capsys.readouterr()
    for made in (0, 2):  # the first save's first map, or its third: the two made before hold the disk's space
        calls, left = [], []
        staging = tmp_path / f"d{made}" / run_mod.STAGING

        def fallocate(fd, offset, length):
            if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("cache_"):
                calls.append(fd)
                if len(calls) > made:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, offset, length)

        def forward(lm, cache, ids, start, end):  # what the chunks after the failed save find on disk
            if len(calls) > made:
                left.extend(f.name for f in staging.glob("cache_*"))
            return real_forward(lm, cache, ids, start, end)

        real_forward = models.forward_tokens
        with monkeypatch.context() as m:
            m.setattr(os, "posix_fallocate", fallocate)
            m.setattr(models, "forward_tokens", forward)
            d = small_dump(tiny_gemma3, tmp_path / f"d{made}", checkpoint_every=1e-9).dump
        assert "no more prefill checkpoints (No space left on device); the dump goes on" in "".join(capsys.readouterr())
        np.testing.assert_array_equal(d.keys(1, 0), reference.keys(1, 0))
        assert len(calls) == made + 1 and not left, left  # a failed first save's maps held the disk's space
