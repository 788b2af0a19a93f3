"""Peak memory foreseen before a prefill (dump and decode): the estimate's parts and the one clear refusal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from anns_lab.cli import main
from anns_lab.dumps.memory import (GIB, WORKER_BYTES, MemoryEstimateError, available_bytes, check_prefill,
                                   prefill_estimate)
from anns_lab.dumps.run import run_dump

GEMMA_LIKE = SimpleNamespace(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                             hidden_size=640, intermediate_size=2048, sliding_window=512,
                             layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 12)


def test_estimate_parts():
    est = prefill_estimate(GEMMA_LIKE, 131072, 2048)
    # KV: one full layer over every token plus 17 sliding layers over their window, K and V, float32.
    assert est.parts["KV cache"] == 2 * 256 * 4 * (131072 + 17 * 512)
    assert est.parts["attention scores of a 2048-token chunk"] == 2 * 2048 * 4 * 131072 * 4
    assert est.parts["attention mask of a 2048-token chunk"] == 2048 * 131072 * (4 + 1)  # float, from a boolean one
    small = prefill_estimate(GEMMA_LIKE, 131072, 512)
    assert small.total < est.total and small.parts["KV cache"] == est.parts["KV cache"]
    decode = prefill_estimate(GEMMA_LIKE, 131072, 2048, query_layers=3, index_layers=3, cache_copy=True)
    assert decode.parts["prefill queries kept"] == 3 * 4 * 131072 * 256 * 4
    newest = prefill_estimate(GEMMA_LIKE, 131072, 2048, query_layers=3, query_tokens=64)  # --calibrate alone
    assert newest.parts["prefill queries kept"] == 3 * 4 * 64 * 256 * 4
    assert decode.total > est.total + decode.parts["copy of the KV cache (full)"]
    building = prefill_estimate(GEMMA_LIKE, 131072, 2048, index_layers=3, building_layers=2)  # decode --build-layers
    assert building.parts["2 layers' builds in flight"] == 2 * 4 * 131072 * 256 * 4
    spawned = prefill_estimate(GEMMA_LIKE, 131072, 2048, index_layers=3, building_layers=2, build_workers=16)
    spooled = 2 * (1 + 4) * 131072 * 256 * 4  # the layers in flight: keys of the KV head and queries of each query head
    assert spawned.parts["16 build worker processes"] == 16 * (WORKER_BYTES + 2 * 131072 * 256 * 4) + spooled
    assert spawned.parts.keys() - building.parts.keys() == {"16 build worker processes"} and spawned.total > building.total


def test_a_refusal_with_layers_building_at_once_names_build_layers(monkeypatch):
    need = prefill_estimate(GEMMA_LIKE, 131072, 128, index_layers=3, building_layers=3).total
    monkeypatch.setenv("ANNS_LAB_MEMORY_LIMIT", str(need - 1))
    with pytest.raises(MemoryEstimateError, match=r"or build fewer layers at once \(--build-layers, 3 here\)"):
        check_prefill(GEMMA_LIKE, 131072, 2048, "decoding", "--context", index_layers=3, building_layers=3)


def test_refusal_names_the_chunk_that_fits(monkeypatch):
    need_512 = prefill_estimate(GEMMA_LIKE, 131072, 512).total
    monkeypatch.setenv("ANNS_LAB_MEMORY_LIMIT", str(need_512 + 1))
    assert available_bytes() == need_512 + 1
    with pytest.raises(MemoryEstimateError, match=r"--chunk 512 \(about") as err:
        check_prefill(GEMMA_LIKE, 131072, 2048, "a dump", "--tokens")
    assert "KV cache" in str(err.value) and "GiB is available" in str(err.value)
    check_prefill(GEMMA_LIKE, 131072, 512, "a dump", "--tokens")  # fits: no error
    monkeypatch.setenv("ANNS_LAB_MEMORY_LIMIT", "0.01G")
    with pytest.raises(MemoryEstimateError, match=r"is available \(ANNS_LAB_MEMORY_LIMIT=0.01G\); even --chunk 128 "
                                                  "would not fit: lower --tokens"):
        check_prefill(GEMMA_LIKE, 131072, 2048, "a dump", "--tokens")
    with pytest.raises(MemoryEstimateError, match="would not fit: give a shorter --prompt$"):  # was "lower --prompt"
        check_prefill(GEMMA_LIKE, 131072, 2048, "decoding", "--prompt")
    with pytest.raises(MemoryEstimateError, match="available .ANNS_LAB_MEMORY_LIMIT=0.01G.; lower --tokens$"):
        check_prefill(GEMMA_LIKE, 131072, 64, "a dump", "--tokens")  # was "even --chunk 128 would not fit", at 64
    monkeypatch.setenv("ANNS_LAB_MEMORY_LIMIT", "lots")
    with pytest.raises(Exception, match="ANNS_LAB_MEMORY_LIMIT"):
        available_bytes()


@pytest.mark.parametrize("limit", ["infG", "1e400G", "-5G", "-1"])
def test_unusable_memory_limit_is_one_error(monkeypatch, limit):
    from anns_lab.errors import AnnsLabError

    # An infinite size was a raw OverflowError; a negative one refused every run with "-0.0 GiB is available".
    monkeypatch.setenv("ANNS_LAB_MEMORY_LIMIT", limit)
    with pytest.raises(AnnsLabError, match="ANNS_LAB_MEMORY_LIMIT"):
        available_bytes()


def test_machine_has_memory():
    assert available_bytes() > 0.1 * GIB


def test_dump_refused_before_the_prefill(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("ANNS_LAB_MEMORY_LIMIT", "1K")
    with pytest.raises(MemoryEstimateError, match="a dump of 100 \\+ 2 tokens"):
        run_dump(str(tiny_llama), tokens=100, decode_tokens=2, out=tmp_path / "d", progress=False)
    assert not list((tmp_path / "d").glob("**/*.npy")) and not (tmp_path / "d" / "manifest.json").exists()


def test_dump_refused_before_its_prompt_is_built(tiny_llama, tmp_path, monkeypatch):
    """Before: the prompt's ids were built first: 10^9 of them (--source passkey --tokens 1000000000
    --allow-extrapolation) were themselves more than the machine's memory, killed before the estimate refused them."""
    from anns_lab.dumps import tasks

    monkeypatch.setattr(tasks, "make_sample", lambda *a, **k: pytest.fail("the prompt was built before the estimate"))
    with pytest.raises(MemoryEstimateError, match="a dump of 1000000000 \\+ 2 tokens"):
        run_dump(str(tiny_llama), source="passkey", tokens=10**9, decode_tokens=2, out=tmp_path / "d", progress=False,
                 allow_extrapolation=True)
    assert not (tmp_path / "d").exists()


def test_decode_refused_before_the_prefill(tiny_llama, monkeypatch):
    monkeypatch.setenv("ANNS_LAB_MEMORY_LIMIT", "1K")
    res = CliRunner().invoke(main, ["decode", "--model", str(tiny_llama), "--task", "passkey", "--context", "200",
                                    "--mode", "full,roargraph", "--window", "4,16", "--topk", "20"])
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.startswith("Error:")]
    assert len(lines) == 1 and "decoding" in lines[0] and "GiB is available" in lines[0], res.output


def test_decode_refused_before_its_task_prompts_are_made(tiny_llama, monkeypatch):
    """Before: --context 1000000000 --allow-extrapolation made the passkey prompt first (20 GB, 2.5 min here) and was
    refused only then."""
    from anns_lab.dumps import tasks

    monkeypatch.setattr(tasks, "make_sample", lambda *a, **k: pytest.fail("the prompt was made before the estimate"))
    res = CliRunner().invoke(main, ["decode", "--model", str(tiny_llama), "--task", "passkey", "--context", str(10**9),
                                    "--allow-extrapolation", "--mode", "full", "--max-new-tokens", "2"])
    assert res.exit_code == 2, res.output
    assert "Error: decoding 1000000002 tokens of" in res.output and "GiB is available" in res.output, res.output


def test_decode_prompt_longer_than_the_context_is_refused(tiny_llama):
    res = CliRunner().invoke(main, ["decode", "--model", str(tiny_llama), "--prompt", "green grass " * 400,
                                    "--mode", "full", "--max-new-tokens", "2"])
    assert res.exit_code == 2, res.output
    assert "exceed" in res.output and "--allow-extrapolation" in res.output


def test_graph_bytes_per_key_cover_roargraphs_default_row():
    """The estimate's per-key graph term (``dumps`` may not import the indexes) holds roargraph's default row of R int32
    ids and its degree: raising ``R`` without it would under-count a 128K decode's memory by 4 bytes per id per head."""
    from anns_lab.dumps.memory import GRAPH_BYTES_PER_KEY
    from anns_lab.indexes.roargraph import RoarGraphIndex

    assert GRAPH_BYTES_PER_KEY >= 4 * RoarGraphIndex.build_params["R"].default + 4


def test_a_tasks_samples_are_made_one_at_a_time(tiny_llama, monkeypatch):
    """Before: every sample's prompt was made before the first ran (--samples 10^6 would have held 10^6 prompts' ids);
    now each is made as its turn comes, and the result is the same."""
    from anns_lab.decode import runner
    from anns_lab.decode.engine import Mode, Settings
    from anns_lab.dumps import tasks
    from anns_lab.dumps.models import load_model
    from anns_lab.window import Window

    lm = load_model(str(tiny_llama), device="cpu")
    made, seen = [], []
    make, run = tasks.make_sample, runner.run_sample
    monkeypatch.setattr(tasks, "make_sample", lambda *a, **k: made.append(a[3]) or make(*a, **k))
    monkeypatch.setattr(runner, "run_sample", lambda *a, **k: seen.append(len(made)) or run(*a, **k))
    res = runner.run_task(lm, [Mode("full")], Settings(Window(4, 16)), "passkey", 200, 3, seed=5, max_new=2)
    assert seen == [1, 2, 3] and made == [5, 6, 7]  # sample i made just before it runs, once
    assert [s["seed"] for s in res["modes"]["full"]["samples"]] == [5, 6, 7] and res["context"] == 200
