"""``anns-lab decode`` from the command line: output, JSON shape, the sweep pick, and clear errors on bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from anns_lab.cli import main
from anns_lab.decode.builds import covered
from anns_lab.decode.modes import parse_modes, pick_from_sweep
from anns_lab.dumps.models import extrapolation_note
from anns_lab.errors import DecodeError
from anns_lab.indexes import registry
from anns_lab.eval.table import COLUMNS


def _run(*args):
    return CliRunner().invoke(main, ["decode", *map(str, args)])


def _error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.splitlines() if x.startswith("Error:")]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.mark.parametrize("fault", ["fault=raise", "build_fault=raise"])
@pytest.mark.parametrize("when", ["--build-during-prefill", "--build-after-prefill"])
def test_a_mode_whose_index_breaks_fails_alone_and_the_others_results_stand(tiny_llama, plugin_dir, monkeypatch,
                                                                            tmp_path, fault, when):
    """An index whose search or build raises fails its mode on each sample (the error in its notes and samples, a
    'failed' column, exit status 1) while every other mode's results are printed and written: before, the run ended at
    the error, and the modes finished before it were lost (session 46's audit)."""
    monkeypatch.syspath_prepend(str(plugin_dir))
    out = tmp_path / "r.json"
    res = _run("--model", tiny_llama, "--mode", "full,faulty,flat", "--build-param", fault, "--task", "passkey",
               "--context", 200, "--samples", 2, "--window", "4,16", "--topk", 20, "--max-new-tokens", 4, "--json", out,
               "--chunk", 64, when)
    assert res.exit_code == 1, res.output
    words = "boom in search" if fault.startswith("fault") else "no memory for its graph"
    assert "FAILED: faulty on 2 sample(s)" in res.output
    # one note where the samples' errors are the same, one a sample where they differ (the layer that failed first)
    assert re.search(rf"^note \(faulty\): (sample 1: )?failed: .*{words}", res.output, re.M), res.output
    assert re.search(r"^faulty +2 ", res.output, re.M)  # the table's failed column
    data = json.loads(out.read_text())
    faulty = data["modes"]["faulty"]
    assert faulty["summary"] == {"failed_samples": 2}
    assert [words in r["error"] and "answer" not in r and "score" not in r for r in faulty["samples"]] == [True, True]
    # where the plugin raised it, for its author: the traceback down to its own line
    assert all("faulty_indexes.py" in r["traceback"] and words in r["traceback"] for r in faulty["samples"])
    for name in ("full", "flat"):  # measured as in a run without it
        s = data["modes"][name]["summary"]
        assert "failed_samples" not in s and s["accuracy"] >= 0 and s["ttft_s"] > 0 and len(data["modes"][name]["samples"]) == 2
        assert all("answer" in r for r in data["modes"][name]["samples"])


@pytest.mark.parametrize("give_up_after", [2, 0])
def test_a_mode_that_keeps_failing_is_left_out_of_the_later_samples(tiny_llama, plugin_dir, monkeypatch, tmp_path,
                                                                    give_up_after):
    """Before: a broken index mode was tried on every sample, each try (with builds during the prefill) a prefill of its
    own. After --give-up-after samples failed in a row it is left out of the rest, said and recorded; 0 tries all."""
    monkeypatch.syspath_prepend(str(plugin_dir))
    out = tmp_path / "r.json"
    res = _run("--model", tiny_llama, "--mode", "full,faulty", "--build-param", "build_fault=raise", "--task", "passkey",
               "--context", 200, "--samples", 4, "--window", "4,16", "--topk", 20, "--max-new-tokens", 2, "--json", out,
               "--chunk", 64, "--build-during-prefill", "--give-up-after", give_up_after)
    assert res.exit_code == 1, res.output
    tried = 2 if give_up_after else 4
    assert len(re.findall(r"prefill for faulty: 200 tokens", res.output)) == tried  # each try, a prefill of its own
    faulty = json.loads(out.read_text())["modes"]["faulty"]
    rows = faulty["samples"]
    assert [r["sample"] for r in rows] == [0, 1, 2, 3] and all("no memory" in r["error"] for r in rows[:tried])
    if give_up_after:
        assert "FAILED: faulty on 4 sample(s) (2 of them left out)" in res.output
        assert faulty["summary"] == {"failed_samples": 4, "skipped_samples": 2}
        assert [r.get("skipped", False) for r in rows] == [False, False, True, True]
        assert rows[2]["error"] == "left out after failing on 2 samples in a row (--give-up-after)" and "expected" in rows[2]
        assert any(n.startswith("left out of 2 sample(s) (3-4)") for n in faulty["notes"]), faulty["notes"]
        assert re.search(r"^faulty +4 +2 ", res.output, re.M), res.output  # the failed and left-out columns
    else:
        assert "FAILED: faulty on 4 sample(s) (the errors" in res.output and faulty["summary"] == {"failed_samples": 4}


def test_give_up_after_counts_failures_in_a_row_only(monkeypatch):
    import collections

    """A sample's failure between successes does not end a mode; two in a row do, and the samples after them run
    without it (``run_sample`` stubbed: which modes each sample was asked to run, and which of them fail when)."""
    from types import SimpleNamespace

    from anns_lab.decode import runner
    from anns_lab.decode.engine import ModeRun, Settings
    from anns_lab.decode.modes import Mode

    fails = {"a": {0, 2, 3}, "b": {1}}  # a: fails, finishes, fails twice (left out of 4 and 5); b: fails once
    asked = []

    def run_sample(lm, modes, settings, ids, max_new, stops, say=None, question=0):
        i = len(asked)
        asked.append([m.name for m in modes])
        return {"runs": {m.name: ModeRun(m.name, [], [], 0.0, 0.0, [], [],
                                         error="broke" if i in fails.get(m.name, ()) else None) for m in modes}}

    monkeypatch.setattr(runner, "run_sample", run_sample)
    monkeypatch.setattr(runner, "check_memory", lambda *a, **k: None)
    monkeypatch.setattr(runner, "_pool", lambda runs: {})
    lm = SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=None, decode=lambda ids, **k: ""), model=None)
    modes = [Mode("a"), Mode("b")]
    res = runner._run_prompts(lm, modes, Settings(), [([1], None)] * 6, 1, 2, "prompt", None)
    assert asked == [["a", "b"]] * 4 + [["b"]] * 2
    a, b = res["modes"]["a"], res["modes"]["b"]
    assert a["summary"] == {"failed_samples": 5, "skipped_samples": 2}
    assert [r.get("skipped", False) for r in a["samples"]] == [False] * 4 + [True] * 2
    assert b["summary"] == {"failed_samples": 1} and [("error" in r) for r in b["samples"]] == [False, True] + [False] * 4
    # a mode alone, given up: the later samples run nothing, not even a prefill
    asked.clear()
    fails["a"] = set(range(6))
    res = runner._run_prompts(lm, [Mode("a")], Settings(), [([1], None)] * 6, 1, 2, "prompt", None)
    assert asked == [["a"]] * 2 and res["modes"]["a"]["summary"] == {"failed_samples": 6, "skipped_samples": 4}

    # through an executor that hands samples out two ahead of their results, as Ray's window does: each sample runs the
    # modes live when it is handed out; a mode left out comes back when a sample already running it finishes
    class Executor:
        def map_samples(self, modes, settings, prompts, max_new, stops):
            window = collections.deque()
            for ids in prompts:
                window.append(run_sample(None, modes(), settings, ids, max_new, stops))
                if len(window) == 2:
                    yield window.popleft()
            yield from window

    asked.clear()
    fails["a"] = {0, 2, 3}  # left out after sample 3's result; sample 4, handed out before it, finishes: back
    res = runner._run_prompts(lm, modes, Settings(), [([1], None)] * 7, 1, 2, "prompt", None, executor=Executor())
    assert asked == [["a", "b"]] * 5 + [["b"]] + [["a", "b"]]
    a = res["modes"]["a"]
    assert a["summary"] == {"failed_samples": 4, "skipped_samples": 1} and a["samples"][5].get("skipped")


def test_decode_loads_only_the_indexes_it_names(tmp_path, monkeypatch, capsys):
    """A plugin that hangs or fails at import stopped every decode, --mode full too (the modes loaded every
    registered index): now only the named ones are imported; 'default' falls back to flat when roargraph will not load."""
    from anns_lab.decode.modes import parse_modes
    from anns_lab.errors import IndexConfigError
    from anns_lab.indexes import registry

    d = tmp_path / "plugin"
    info = d / "anns_lab_noisy-0.1.dist-info"
    info.mkdir(parents=True)
    (d / "noisy_plugin.py").write_text("import os, pathlib\npathlib.Path(os.environ['NOISY_MARK']).write_text('x')\n"
                                       "from anns_lab.indexes.flat import FlatIndex as Noisy\n")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: anns-lab-noisy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[anns_lab.indexes]\nnoisy = noisy_plugin:Noisy\n")
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("NOISY_MARK", str(tmp_path / "imported"))
    assert [m.name for m in parse_modes("full,window,flat", {}, {})] == ["full", "window", "flat"]
    assert not (tmp_path / "imported").exists()
    assert [m.name for m in parse_modes("full,noisy", {}, {})] == ["full", "noisy"] and (tmp_path / "imported").exists()
    real = registry.get

    def get(name):
        if name == "roargraph":
            raise IndexConfigError("index 'roargraph' failed to load: ImportError: no numba")
        return real(name)

    monkeypatch.setattr(registry, "get", get)
    assert [m.name for m in parse_modes("default", {}, {})] == ["flat"]
    assert "no numba); the default mode is 'flat'" in capsys.readouterr().err


def test_a_quoted_parameter_value_stays_text():
    """A string parameter can be given "1" (it read as the number 1, which its type check then refused)."""
    from anns_lab.cli_types import parse_params

    assert parse_params(['a=1', 'b="1"', 'c=1e3', 'd="true"', 'e=true', 'f=""', 'g=x"']) == {
        "a": 1, "b": "1", "c": 1000.0, "d": "true", "e": True, "f": "", "g": 'x"'}


def test_task_run_prints_table_and_writes_json(tiny_llama, tmp_path):
    out = tmp_path / "r.json"
    res = _run("--model", tiny_llama, "--mode", "full,window,flat", "--task", "passkey", "--context", 200,
               "--samples", 2, "--window", "4,16", "--topk", 20, "--max-new-tokens", 4, "--json", out, "--chunk", 64)
    assert res.exit_code == 0, res.output
    assert re.search(r"prefill \S+: +100%.*200/200 \[", res.output)  # the prefill's progress bar over its 4 chunks
    assert "retr ms" in res.output and "accuracy %" in res.output
    assert "other ms  per token: everything outside" in res.output  # every column defined under the table
    data = json.loads(out.read_text())
    assert data["task"] == "passkey" and data["context"] == 200 and set(data["modes"]) == {"full", "window", "flat"}
    for mode in data["modes"].values():
        s = mode["summary"]
        for key in ("accuracy", "prefill_s", "build_s", "retrieval_ms", "cpu_attention_ms", "accel_attention_ms",
                    "merge_ms", "insert_ms", "other_ms", "tokens_per_s"):
            assert key in s
        assert len(mode["samples"]) == 2
        assert {"answer", "expected", "score", "depth"} <= set(mode["samples"][0])
    # Needles at depths spread over the context.
    assert [r["depth"] for r in data["modes"]["full"]["samples"]] == [0.05, 0.95]
    flat = data["modes"]["flat"]["summary"]
    assert flat["retrieval_ms"] > 0
    # the searches' CPU time on their own thread: positive, and never more than their wall time
    assert 0 < flat["retrieval_cpu_ms"] <= flat["retrieval_ms"] * (1 + 1e-6) + 1e-3
    assert "retr CPU ms" in res.output
    # "other" is everything outside long-range attention in every mode: full's attention is not inside it.
    full = data["modes"]["full"]["summary"]
    assert full["accel_attention_ms"] > 0
    assert full["other_ms"] + full["accel_attention_ms"] == pytest.approx(full["token_ms"])
    # Time to first token: prefill + build + the first decode step, and its ratio to full's, per mode.
    assert "TTFT s" in res.output and "TTFT x full" in res.output
    for mode in data["modes"].values():
        s = mode["summary"]
        assert s["first_step_s"] > 0
        # builds overlap the prefill's last chunk (--build-during-prefill): only the part after it counts
        assert 0.0 <= s["build_hidden_s"] <= s["build_s"]
        assert s["ttft_s"] == pytest.approx(s["prefill_s"] + s["build_s"] - s["build_hidden_s"] + s["first_step_s"])
        assert s["ttft_x_full"] == pytest.approx(s["ttft_s"] / data["modes"]["full"]["summary"]["ttft_s"])
    assert data["modes"]["full"]["summary"]["build_s"] == 0
    # each sample's layers: when their builds were queued, started and ended, from the prefill's end; their union is
    # the build time, its part before the prefill's end the hidden part (the summary's means over the samples)
    assert all("build_layers" not in row for row in data["modes"]["full"]["samples"])
    s, rows = data["modes"]["flat"]["summary"], data["modes"]["flat"]["samples"]
    for row in rows:
        assert row["build_layers"] and all(q <= a <= b for q, a, b in row["build_layers"].values())
    # --build-layers as it resolved: auto (the settings' 0) for flat's one index per KV head on this process's threads
    from anns_lab.decode import builds
    from anns_lab.decode.engine import Mode
    from anns_lab.decode.placement import IndexPlan
    from anns_lab.dumps.models import load_model

    lm = load_model(str(tiny_llama))
    expected = builds.layers_at_once(0, 1, builds.indexes_per_layer(lm, Mode("flat", IndexPlan("flat")), None))
    assert data["settings"]["build_layers"] == 0 and all(row["layers_at_once"] == expected for row in rows)
    assert all("layers_at_once" not in row for row in data["modes"]["full"]["samples"])
    spans = [[(a, b) for _, a, b in row["build_layers"].values()] for row in rows]
    assert np.mean([covered(x) for x in spans]) == pytest.approx(s["build_s"], abs=1e-3)
    assert np.mean([covered(x, end=0.0) for x in spans]) == pytest.approx(s["build_hidden_s"], abs=1e-3)


def test_prompt_and_fidelity(tiny_gemma3, tmp_path):
    res = _run("--model", tiny_gemma3, "--mode", "full,flat", "--prompt", "The grass is green. " * 20,
               "--window", "2,8", "--topk", 8, "--max-new-tokens", 3)
    assert res.exit_code == 0, res.output
    assert "[full]" in res.output and "[flat]" in res.output
    out = tmp_path / "f.json"
    res = _run("--model", tiny_gemma3, "--mode", "window,flat", "--eval", "fidelity", "--context", 64,
               "--positions", 6, "--free-tokens", 4, "--window", "2,8", "--topk", 60, "--json", out)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    modes = data["modes"]
    assert set(modes) == {"full", "window", "flat"}  # full is added as the reference
    # one prefill for every mode, the indexes built after it (--build-during-prefill, the default, does not apply)
    assert data["settings"]["build_during_prefill"] is False and modes["flat"]["summary"]["build_hidden_s"] == 0
    assert len({m["summary"]["prefill_s"] for m in modes.values()}) == 1
    assert modes["full"]["summary"]["kl_mean"] == 0 and modes["full"]["summary"]["top1_agreement"] == 1
    assert modes["flat"]["summary"]["kl_mean"] < 1e-6 and modes["flat"]["summary"]["free_tokens_until_diff"] == 4
    assert modes["window"]["summary"]["kl_mean"] > modes["flat"]["summary"]["kl_mean"]


@pytest.mark.parametrize("args, needle", [
    (["--context", 600], "exceed"),
    (["--task", "nope"], "unknown task"),
    (["--mode", "full,bogus"], "unknown mode"),
    (["--topk", 0], "--topk"),
    (["--topk", 5000], "--topk 5000 must lie in"),
    # 200 prompt + 2 of 3 new tokens fed back - 20 in the window: the last new token's key never reaches the CPU side
    (["--topk", 183, "--max-new-tokens", 3], "--topk 183 must lie in [1, 182]"),
    (["--mode", "ivf", "--build-param", "nlist=500"], "nlist=500 is larger than the number of keys (180)"),
    (["--window", "64,150"], "not smaller than the context"),
    (["--window", "64"], "SINK,RECENT"),
    (["--param", "L"], "NAME=VALUE"),
    (["--mode", "flat", "--param", "nprobe=4"], "no selected index mode declares it"),
    (["--mode", "ivf", "--param", "nprobe=0"], "nprobe"),
    (["--mode", "ivf", "--param", "ivf.nprobe=4"], "write NAME=VALUE without the index's name (e.g. --param nprobe=4)"),
    (["--train-group", "pooled"], "'pooled' is not one of 'head', 'group', 'strided'"),
    (["--copy-hints", -1], "--copy-hints must be 0"),
    (["--max-new-tokens", 0], "--max-new-tokens must be at least 1"),
    (["--build-layers", -1], "--build-layers must be 0 (auto) or more, got -1"),
    (["--max-new-tokens", -3], "--max-new-tokens must be at least 1"),
    (["--seed", -1], "--seed must be 0 or more"),
    (["--samples", 0], "--samples must lie in [1, 10000]"),
    (["--samples", 99999999999], "--samples must lie in [1, 10000]"),  # a traceback allocating 745 GiB, before
    (["--give-up-after", -1], "--give-up-after must be 0 (never give up) or more, got -1"),
    (["--torch-threads", -2], "--torch-threads must lie in [0, 1024]"),
    (["--torch-threads", 100000], "--torch-threads must lie in [0, 1024]"),  # a traceback from an import, before
    (["--json", ""], "--json '': give a file path"),  # ran every sample, then wrote nothing, exit 0
    (["--train-queries", -4], "--train-queries must be 0 (all) or more"),
    (["--device", "bogus"], "unknown device 'bogus'"),
    (["--device", "cuda:99"], "device 'cuda:99':"),
    (["--eval", "fidelity", "--until-built", "exact"], "--until-built exact is for --task and --prompt runs"),
    (["--until-built", "never"], "'never' is not one of 'wait', 'exact'"),
    (["--mode", ""], "--mode '' names nothing: give e.g. full,default"),
    (["--mode", ","], "--mode ',' names nothing"),
    (["--mode", " , "], "names nothing"),
    (["--mode", "full,,flat"], "--mode 'full,,flat' has an empty item between commas"),  # ran full and flat, before
    (["--param", "=3"], "--param '=3': NAME is empty"),
    (["--build-param", " =3"], "--build-param ' =3': NAME is empty"),
    (["--chunk", 0], "--chunk must be at least 1, got 0"),  # named --add-batch too, before
    (["--add-batch", -2], "--add-batch must be at least 1, got -2"),
    # nlist left at its default: the error says what the user can change, beside the index's own words
    (["--mode", "clusterkv"], "nlist=400 is larger than the number of keys (180): --mode clusterkv cannot index the "
                              "180 keys outside the window of this prompt: use a longer --context or set its --build-param"),
    # before: each layer's build failed after the prefill; vattention's named ivf, which the user never chose
    (["--mode", "pqcache", "--build-param", "M=3"], "pqcache: M=3 does not divide the key dimension 16: --mode pqcache "
                                                     "cannot index this model's keys of dimension 16"),
    (["--mode", "vattention", "--build-param", "nlist=500"], "vattention: nlist=500 is larger than the number of keys"),
])
def test_bad_input_is_one_clear_error(tiny_llama, args, needle):
    base = {"--model": tiny_llama, "--task": "passkey", "--context": 200, "--mode": "full,flat", "--window": "4,16"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    if base["--mode"] in ("clusterkv", "pqcache", "vattention") and base["--mode"] not in registry.available():
        pytest.skip(f"the {base['--mode']} plugin is not installed (make test installs it)")
    flat = [str(x) for kv in base.items() for x in kv]
    assert needle in _error(_run(*flat))


@pytest.mark.parametrize("flag", ["--param", "--build-param"])
def test_a_parameter_given_twice_is_refused_not_the_last_one_kept(tiny_llama, flag):
    name = "nprobe" if flag == "--param" else "nlist"
    args = ["--model", tiny_llama, "--task", "passkey", "--context", 200, "--mode", "ivf", "--window", "4,16",
            flag, f"{name}=4", flag, f"{name}=8"]
    assert f"{flag} {name} is given twice (4 and 8)" in _error(_run(*args))


def test_a_prompt_naming_a_file_is_decoded_as_text_with_a_note(tiny_llama, tmp_path, monkeypatch):
    """dump --prompt reads a file; decode --prompt decodes its text: a file's name there decoded the name, silently."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("The grass is green. " * 50)
    res = _run("--model", tiny_llama, "--prompt", "p.txt", "--mode", "full", "--max-new-tokens", 1)
    assert res.exit_code == 0, res.output
    assert "note: --prompt is the text decoded; 'p.txt' also names a file, which is not read" in res.output
    res = _run("--model", tiny_llama, "--prompt", "q.txt", "--mode", "full", "--max-new-tokens", 1)
    assert res.exit_code == 0 and "note: --prompt" not in res.output, res.output


def test_an_unknown_mode_lists_the_registered_indexes_once(tiny_llama):
    err = _error(_run("--model", tiny_llama, "--task", "passkey", "--mode", "full,bogus"))
    assert "unknown mode 'bogus'" in err and err.count("roargraph") == 1, err


@pytest.mark.parametrize("args, needle", [
    (["--prompt", "The grass is green. " * 200, "--mode", "full,window"],
     "use a shorter --prompt, or pass --allow-extrapolation"),
    (["--prompt", "The grass is green.", "--mode", "full,flat"], "use a smaller --window or a longer --prompt"),
    (["--prompt", "The grass is green. " * 12, "--mode", "full,ivf", "--build-param", "nlist=500", "--topk", 10],
     "use a longer --prompt or set its --build-param"),
])
def test_errors_on_a_free_prompt_name_the_prompt_not_the_context(tiny_llama, args, needle):
    """--context does not apply to --prompt: the errors on its length name --prompt."""
    err = _error(_run("--model", tiny_llama, "--window", "4,16", "--max-new-tokens", 2, *args))
    assert needle in err and "--context" not in err, err


@pytest.mark.parametrize("args", [["--task", "passkey", "--context", 200], ["--prompt", "The grass is green."]])
def test_new_tokens_past_the_context_name_max_new_tokens(tiny_llama, args):
    """Before (a decode audit): --max-new-tokens 10^5 on a 200-token context said "use a shorter --context"."""
    err = _error(_run("--model", tiny_llama, "--mode", "full,window", "--window", "4,16", "--max-new-tokens", 10**5,
                      *args))
    assert "use a shorter --max-new-tokens, or pass --allow-extrapolation" in err, err


@pytest.mark.parametrize("context, max_new, named", [(300, 300, "--context"), (299, 300, "--max-new-tokens")])
def test_the_longer_of_context_and_new_tokens_is_named_past_the_context(tiny_llama, context, max_new, named):
    """The option that set most of the length is the one to shorten; at a tie, --context."""
    err = _error(_run("--model", tiny_llama, "--mode", "full,window", "--window", "4,16", "--task", "passkey",
                      "--context", context, "--max-new-tokens", max_new))
    assert f"context of 512 tokens; use a shorter {named}, or pass --allow-extrapolation" in err, err


@pytest.mark.parametrize("args, named", [
    (["--task", "passkey", "--context", 200, "--max-new-tokens", 300], "lower --max-new-tokens"),
    (["--task", "passkey", "--context", 200, "--max-new-tokens", 200], "lower --context"),
    (["--prompt", "The grass is green and the sky is blue. " * 12, "--max-new-tokens", 4], "give a shorter --prompt"),
])
def test_a_run_past_memory_names_the_option_that_made_it_long(tiny_llama, monkeypatch, args, named):
    """Before (session 57's decode audit) the memory refusal always named --context."""
    from anns_lab.dumps import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 1)
    err = _error(_run("--model", tiny_llama, "--mode", "full,flat", "--window", "4,16", "--topk", 10, *args))
    assert "GiB is available" in err and err.endswith(named), err


def test_an_empty_from_sweep_is_refused_not_ignored(tiny_llama, monkeypatch):
    """Before (a decode audit): `--from-sweep "$SWEEP"` with SWEEP unset ran without any pick, --target-recall taken."""
    from anns_lab.decode import cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert _error(_run("--model", tiny_llama, "--task", "passkey", "--context", 200, "--mode", "full,flat",
                       "--from-sweep", "", "--target-recall", 0.5)) == \
        "Error: --from-sweep '': give the folder of an `anns-lab sweep`"


def test_a_result_table_that_cannot_be_printed_loses_no_result(tiny_llama, tmp_path):
    """Before (a decode audit): with standard output on a full disk a fidelity run ended in a traceback and wrote no
    --json (the table was printed first, and a fidelity run has no after-sample write); a reader's closed pipe, exit
    1 and no word. Here the output is /dev/full, a real device whose every write fails."""
    out = tmp_path / "f.json"
    cmd = [str(Path(sys.executable).parent / "anns-lab"), "decode", "--model", str(tiny_llama), "--eval", "fidelity",
           "--context", "200", "--positions", "2", "--free-tokens", "2", "--window", "4,16", "--topk", "8", "--mode",
           "full,flat", "--json", str(out)]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"Error: cannot print the result table (OSError: No space left on device); the result is in {out}" \
        in proc.stderr, proc.stderr
    assert json.loads(out.read_text())["task"] == "fidelity"


def test_a_json_write_that_fails_mid_run_says_what_the_file_keeps(tiny_llama, tmp_path, monkeypatch):
    """Before (a decode audit): a --json write that failed after the first sample (its folder made read-only, a full
    disk) ended the run in a traceback, the samples kept unsaid. A finished run's file keeps its after-sample keys."""
    from anns_lab.decode import cli

    real, writes = cli.atomic_write_bytes, []

    def second_fails(path, data):
        writes.append(path)
        if len(writes) == 2:
            raise PermissionError(13, "Permission denied")
        real(path, data)

    out = tmp_path / "r.json"
    args = ("--model", tiny_llama, "--mode", "full", "--task", "passkey", "--context", 200, "--samples", 2,
            "--max-new-tokens", 2, "--json", out)
    monkeypatch.setattr(cli, "atomic_write_bytes", second_fails)
    assert _error(_run(*args)) == (f"Error: --json {out}: cannot write it (PermissionError: Permission denied); it "
                                   "holds the 1 of 2 samples of its last write (\"partial\": true; run again with "
                                   "--overwrite to redo them all)")
    assert json.loads(out.read_text())["samples_done"] == 1
    monkeypatch.undo()
    res = _run(*args, "--overwrite")
    assert res.exit_code == 0, res.output
    assert {k: json.loads(out.read_text())[k] for k in ("partial", "samples_done", "samples_total")} == \
        {"partial": False, "samples_done": 2, "samples_total": 2}
    # a fidelity run has no after-sample write: its last write failing prints its table still, and says so
    monkeypatch.setattr(cli, "atomic_write_bytes", lambda path, data: (_ for _ in ()).throw(OSError(28, "No space left")))
    res = _run("--model", tiny_llama, "--eval", "fidelity", "--context", 200, "--positions", 2, "--free-tokens", 2,
               "--window", "4,16", "--topk", 8, "--mode", "full,flat", "--json", tmp_path / "f.json")
    assert _error(res) == f"Error: --json {tmp_path / 'f.json'}: cannot write it (OSError: No space left); it holds " \
                          "nothing of this run"
    assert "fidelity" in res.output and "flat" in res.output.split("Error:")[0]  # the table, printed before the error


@pytest.mark.parametrize("flag", ["--positions", "--free-tokens"])
def test_fidelity_past_the_context_names_the_option_that_went_past_it(tiny_llama, flag):
    """Before: --positions 10^6 on a 200-token context said "use a shorter --context"."""
    err = _error(_run("--model", tiny_llama, "--eval", "fidelity", "--mode", "full,flat", "--window", "4,16",
                      "--context", 200, flag, 10**6))
    assert f"use a shorter {flag}, or pass --allow-extrapolation" in err, err


@pytest.mark.parametrize("modes, extra, words", [
    ("full", ["--topk", 700], "--topk: not used by this run (--mode full has no index mode)"),
    ("full,window", ["--calibrate", 0.9, "--copy-hints", 3], "--copy-hints, --calibrate: not used by this run"),
    ("window", ["--build-after-prefill"], "--build-after-prefill: not used"),
    # before: "add --build-after-prefill", then that refused as unused (benchmarks/scale_128k.sh's baseline-only run)
    ("full,window", ["--shared-prefill"], "--shared-prefill: not used by this run"),
    ("full,window", ["--calibrate-question"], "--calibrate-question: not used by this run"),
    ("full", ["--window", "600,600"], "--window: not used by this run (--mode full attends every key)"),
    ("full,window", ["--give-up-after", 3], "--give-up-after: not used by this run"),  # a decode audit: taken before
])
def test_an_index_option_without_an_index_mode_is_refused(tiny_llama, modes, extra, words):
    """Before: dropped in silence (the README says refused), the table printing the --window it never used."""
    assert words in _error(_run("--model", tiny_llama, "--mode", modes, "--task", "passkey", "--context", 200, *extra))


@pytest.mark.parametrize("modes, extra, words", [
    ("full,flat", ["--train-group", "strided"], "--train-group: read by none of this run's indexes (flat: none trains "
                                                "on the prefill's queries"),
    ("flat,ivf", ["--copy-hints", 3, "--train-queries", 64], "--train-queries, --copy-hints: read by none of this "
                                                             "run's indexes (flat, ivf: none trains"),
    ("full,flat", ["--train-positions", "own"], "--train-positions: read by none of this run's indexes (flat: none "
                                                "trains on the prefill's queries"),
    # snapkv reads its queries where the prefill had them: serving moves none, unlisted gives it nothing
    ("full,snapkv", ["--train-positions", "serving"], "--train-positions serving moves training queries, and none of "
                                                      "this run's indexes (snapkv) has any moved"),
    ("full,snapkv", ["--train-group", "unlisted"], "--train-group unlisted gives the GQA group's other queries to an "
                                                   "index that takes them (roargraph); none of this run's does (snapkv)"),
    ("full,robust-vamana", ["--train-group", "unlisted"], "none of this run's does (robust-vamana): pass --train-group head"),
    ("flat,robust-vamana", ["--copy-hints", 2], "--copy-hints: read by none of this run's indexes (flat, robust-vamana: "
                                                "none takes copy hints ('takes copy hints' in `anns-lab indexes`))"),
])
def test_an_option_no_index_of_the_run_reads_is_refused(tiny_llama, modes, extra, words):
    """Before (session 57's decode audit): taken and recorded in the JSON's settings as if they had shaped the run."""
    if "snapkv" in modes and "snapkv" not in registry.available():
        pytest.skip("the snapkv plugin is not installed (make test installs it)")
    assert words in _error(_run("--model", tiny_llama, "--mode", modes, "--task", "passkey", "--context", 200,
                                "--window", "4,16", *extra))


@pytest.mark.parametrize("modes, extra", [
    ("flat,roargraph", ["--copy-hints", 3, "--train-group", "strided", "--train-positions", "serving"]),
    ("flat,roargraph", ["--train-group", "unlisted"]),
    ("flat,robust-vamana", ["--train-group", "strided", "--train-positions", "serving", "--train-queries", 64]),
    # its queries where the prefill had them: own is what it does, and a RoPE that cannot move them is no matter
    ("full,snapkv", ["--train-queries", 64, "--train-positions", "own"]),
    ("full,snapkv", ["--rope-scaling", "dynamic:2"]),  # refused before: "use --train-positions own"
])
def test_an_option_one_index_of_the_run_reads_is_taken(tiny_llama, tmp_path, modes, extra):
    if "snapkv" in modes and "snapkv" not in registry.available():
        pytest.skip("the snapkv plugin is not installed (make test installs it)")
    res = _run("--model", tiny_llama, "--mode", modes, "--window", "4,16", "--task", "passkey", "--context", 200,
               "--max-new-tokens", 2, "--topk", 20, *extra, "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    settings = json.loads((tmp_path / "r.json").read_text())["settings"]
    given = {flag[2:].replace("-", "_"): value for flag, value in zip(extra[::2], extra[1::2]) if flag != "--rope-scaling"}
    assert {k: settings[k] for k in given} == given


def test_the_window_with_a_window_mode_and_index_options_with_an_index_mode_are_taken(tiny_llama, tmp_path):
    res = _run("--model", tiny_llama, "--mode", "full,window", "--window", "8,8", "--task", "passkey", "--context", 200,
               "--max-new-tokens", 2, "--json", tmp_path / "w.json")
    assert res.exit_code == 0, res.output
    assert {k: json.loads((tmp_path / "w.json").read_text())["settings"][k] for k in ("sink", "recent")} == {"sink": 8, "recent": 8}
    res = _run("--model", tiny_llama, "--mode", "full,flat", "--window", "8,8", "--topk", 7, "--calibrate", 0,
               "--build-after-prefill", "--shared-prefill", "--task", "passkey", "--context", 200, "--max-new-tokens", 2,
               "--json", tmp_path / "f.json")
    assert res.exit_code == 0, res.output
    settings = json.loads((tmp_path / "f.json").read_text())["settings"]
    assert settings["topk"] == 7 and settings["shared_prefill"] is True


@pytest.mark.parametrize("args", [["--prompt", "", "--max-new-tokens", 2],
                                  ["--eval", "fidelity", "--context", 0, "--positions", 2, "--free-tokens", 2],
                                  ["--eval", "fidelity", "--context", -3, "--positions", 5, "--free-tokens", 2]])
def test_an_empty_prompt_is_one_clear_error(tiny_llama, args):
    """A prompt of no tokens (an empty --prompt, a fidelity --context below 1) with --mode full alone, where no window
    check refuses it: one error, not a TypeError from the prefill's missing logits."""
    assert "nothing to prefill" in _error(_run("--model", tiny_llama, "--mode", "full", *args))


@pytest.mark.parametrize("group, hints, place", [(None, None, None), ("strided", 0, "own"), ("unlisted", None, None)])
def test_train_group_is_recorded_in_the_json(tiny_llama, tmp_path, group, hints, place):
    """--train-group, --train-positions and --copy-hints reach the decode (one graph per KV head: the run's answer is
    full's with a top-k over every key) and the JSON records them; without them, the defaults."""
    from anns_lab.decode.engine import Settings
    from anns_lab.indexes.group_queries import DEFAULT

    out = tmp_path / "r.json"
    res = _run("--model", tiny_llama, "--mode", "full,roargraph", "--task", "passkey", "--context", 200, "--window", "4,16",
               "--topk", 180, "--max-new-tokens", 3, "--json", out, *(["--train-group", group] if group else []),
               *(["--copy-hints", hints] if hints is not None else []), *(["--train-positions", place] if place else []))
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["settings"]["train_group"] == (group or DEFAULT)
    assert data["settings"]["train_positions"] == (place or Settings.train_positions)
    assert data["settings"]["copy_hints"] == (Settings.copy_hints if hints is None else hints)
    assert data["modes"]["roargraph"]["samples"][0]["answer"] == data["modes"]["full"]["samples"][0]["answer"]


@pytest.mark.parametrize("threads", [None, 1])
def test_the_options_that_change_timings_are_recorded_in_the_json(tiny_llama, tmp_path, threads):
    """--torch-threads (without it, torch's default count here), --chunk, --build-after-prefill, the device and the
    executor are in the JSON (a Ray task's CPUs only with Ray)."""
    import torch

    before = torch.get_num_threads()
    out = tmp_path / "r.json"
    try:
        res = _run("--model", tiny_llama, "--mode", "full,flat", "--task", "passkey", "--context", 200,
                   "--window", "4,16", "--topk", 20, "--max-new-tokens", 2, "--chunk", 64, "--build-after-prefill",
                   "--shared-prefill", "--build-layers", 1, "--device", "cpu", "--json", out,
                   *(["--torch-threads", threads] if threads else []))
        ran = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)  # --torch-threads holds for the whole process
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    settings = data["settings"]
    assert settings["torch_threads"] == (threads or before) == ran
    assert (settings["chunk"], settings["build_during_prefill"], settings["cpus_per_task"]) == (64, False, None)
    assert settings["shared_prefill"] is True and settings["build_layers"] == 1
    assert settings["build_processes"] is False  # threads by default on a CPU
    full, flat = (data["modes"][m]["summary"]["prefill_s"] for m in ("full", "flat"))
    assert full == flat  # one prefill for both
    assert (data["device"], data["executor"]) == ("cpu", "local")


def test_the_command_line_loads_without_torch_or_transformers():
    """Every command (``anns-lab --help`` too) imports the decode command's options: taken from the engine they pulled
    in torch and transformers, ~3.5 s before any command ran."""
    import subprocess
    import sys

    code = ("import sys, anns_lab.cli; "
            "print(sorted(m for m in ('torch', 'transformers', 'faiss', 'pandas', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("args", [["--task", "passkey", "--prompt", "x"],  # needs no model nor mode
                                  ["--mode", "full", "--topk", "5", "--task", "passkey"]])  # read from the mode names
def test_an_option_refused_is_refused_before_torch_or_transformers_load(args):
    """Such refusals came after the engine's imports (~5 s, 16 s cold)."""
    import subprocess
    import sys

    code = ("import sys\nfrom click.testing import CliRunner\nfrom anns_lab.cli import main\n"
            f"res = CliRunner().invoke(main, ['decode', *{args!r}])\n"
            "print(res.exit_code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "2 []"


def test_full_decodes_from_a_prefill_that_keeps_nothing_for_an_index():
    """Keeping the queries costs the prefill time that full's TTFT must not carry: full and window get a prefill of
    their own beside index modes that keep them; with the builds after the prefill the index modes share one."""
    from anns_lab.decode.engine import Mode, Settings
    from anns_lab.decode.placement import IndexPlan
    from anns_lab.decode.runner import prefill_groups
    from anns_lab.window import Window

    full, window = Mode("full"), Mode("window")
    flat, roar = Mode("flat", IndexPlan("flat", {}, {})), Mode("roargraph", IndexPlan("roargraph", {}, {}))
    names = lambda groups: [[m.name for m in g] for g in groups]  # noqa: E731
    during, after = Settings(Window(4, 16)), Settings(Window(4, 16), build_during_prefill=False)
    assert names(prefill_groups([full, window, flat, roar], during)) == [["full", "window"], ["flat"], ["roargraph"]]
    assert names(prefill_groups([full, window, flat, roar], after)) == [["full", "window"], ["flat", "roargraph"]]
    uncalibrated = Settings(Window(4, 16), build_during_prefill=False, calibrate=0.0)
    assert names(prefill_groups([full, flat], uncalibrated)) == [["full", "flat"]]  # nothing kept: one prefill for all
    assert names(prefill_groups([full, roar], uncalibrated)) == [["full"], ["roargraph"]]  # roargraph trains on them
    assert names(prefill_groups([full, window], during)) == [["full", "window"]]
    shared = Settings(Window(4, 16), build_during_prefill=False, shared_prefill=True)  # --shared-prefill: one for all
    assert names(prefill_groups([full, window, flat, roar], shared)) == [["full", "window", "flat", "roargraph"]]


def test_shared_prefill_needs_the_builds_after_the_prefill(tiny_llama):
    res = _run("--model", tiny_llama, "--mode", "full,flat", "--task", "passkey", "--context", 200, "--window", "4,16",
               "--shared-prefill")
    assert res.exit_code != 0 and "--shared-prefill puts every mode on one prefill" in res.output
    assert "add --build-after-prefill" in res.output
    fidelity = _run("--model", tiny_llama, "--mode", "full,flat", "--eval", "fidelity", "--context", 200, "--window",
                    "4,16", "--shared-prefill", "--build-after-prefill")  # fidelity has one prefill for every mode
    assert fidelity.exit_code != 0 and "--shared-prefill: not used by this run" in fidelity.output


def test_builds_start_after_the_prefill_by_default_only_on_an_accelerator_with_until_built_exact():
    from anns_lab.decode.cli import builds_during_prefill

    assert builds_during_prefill(None, "wait", "cuda") and builds_during_prefill(None, "exact", "cpu")
    assert not builds_during_prefill(None, "exact", "cuda") and not builds_during_prefill(None, "exact", "cuda:1")
    assert builds_during_prefill(True, "exact", "cuda") and not builds_during_prefill(False, "wait", "cpu")


def test_builds_run_in_worker_processes_by_default_only_on_an_accelerator():
    from anns_lab.decode.cli import builds_in_processes

    assert builds_in_processes(None, "cuda") and builds_in_processes(None, "cuda:1")
    assert not builds_in_processes(None, "cpu")
    assert builds_in_processes(True, "cpu") and not builds_in_processes(False, "cuda")


def test_until_built_exact_reaches_the_decode_table_and_json(tiny_llama, tmp_path):
    """--until-built exact: recorded in the JSON's settings; the index mode's summary has its exact steps (a count of
    the leading steps, at most all of them) and the table their column; full's has none."""
    out = tmp_path / "r.json"
    res = _run("--model", tiny_llama, "--mode", "full,flat", "--task", "passkey", "--context", 200, "--window", "4,16",
               "--topk", 180, "--max-new-tokens", 4, "--until-built", "exact", "--json", out)
    assert res.exit_code == 0, res.output
    assert "exact steps" in res.output and "exact steps  --until-built exact:" in res.output
    data = json.loads(out.read_text())
    assert data["settings"]["until_built"] == "exact" and data["settings"]["build_during_prefill"]  # on the CPU: during
    flat, full = data["modes"]["flat"]["summary"], data["modes"]["full"]["summary"]
    assert 0 <= flat["exact_steps"] <= 3 and "exact_steps" not in full
    assert data["modes"]["flat"]["samples"][0]["exact_steps"] == flat["exact_steps"]
    handed = data["modes"]["flat"]["samples"][0]["hand_over_steps"]  # per long-range layer: its index's first step
    assert set(handed) == {"0", "1", "2", "3"} and all(v is None or 0 <= v <= flat["exact_steps"] for v in handed.values())
    assert None in handed.values() or max(handed.values()) == flat["exact_steps"]  # the last hand-over ends them
    assert "exact_steps" not in data["modes"]["full"]["samples"][0]
    assert data["modes"]["flat"]["samples"][0]["answer"] == data["modes"]["full"]["samples"][0]["answer"]


def test_extrapolation_is_allowed_when_asked_and_said(tiny_llama, tmp_path):
    res = _run("--model", tiny_llama, "--task", "passkey", "--context", 520, "--mode", "full", "--max-new-tokens", 2,
               "--allow-extrapolation", "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["context"] > data["model_context"] > 0
    # The check counts prompt + generated tokens, and so does the sentence.
    n = data["context"] + 2
    assert data["extrapolated"] == extrapolation_note(data["model"], n, data["model_context"])
    assert f"extrapolated: {n:,} tokens are beyond {data['model']}'s trained context of {data['model_context']:,}" in res.output
    edge = _run("--model", tiny_llama, "--task", "passkey", "--context", data["model_context"] - 1, "--mode", "full",
                "--max-new-tokens", 2, "--allow-extrapolation")  # the prompt fits, the generated tokens do not
    assert edge.exit_code == 0 and "extrapolated:" in edge.output
    within = _run("--model", tiny_llama, "--task", "passkey", "--context", 200, "--mode", "full", "--max-new-tokens", 2)
    assert within.exit_code == 0 and "extrapolated" not in within.output


def _results(path, window=(4, 16)):
    """A sweep's table at ``path`` and its sweep.json (the window the pick is checked against) beside it."""
    (path.parent / "sweep.json").write_text(json.dumps({"window": list(window)}))
    rows = []
    for layer in (1, 3):
        for index, sp, recall, scanned in [("flat", {}, 0.995, 1.0), ("ivf", {"nprobe": 2}, 0.90, 0.2),
                                           ("ivf", {"nprobe": 8}, 0.97, 0.5), ("vamana", {"L": 50}, 0.93, 0.05),
                                           ("vamana", {"L": 100}, 0.96 if layer == 1 else 0.92, 0.08),
                                           ("vamana", {"L": 200}, 0.99, 0.12)]:
            for head in range(2):
                row = dict.fromkeys(COLUMNS, 0)
                build = {"R": 16} if index == "vamana" else {}  # each index's own: a pick checks every row
                row |= {"model": "m", "layer": layer, "head": head, "index": index, "build_params": json.dumps(build),
                        "search_params": json.dumps(sp), "direction": "q2k", "recall": recall,
                        "scanned_fraction": scanned, "dump": "d", "kv_head": 0, "k": 100, "n_keys": 4096,
                        "auto_rules": None}  # a table from before the column
                rows.append(row)
                rows.append(row | {"direction": "k2k", "recall": 1.0, "scanned_fraction": 0.001})
    pd.DataFrame(rows, columns=COLUMNS).to_parquet(path)
    return path


def test_a_pick_without_the_sweeps_window_is_refused(tmp_path):
    """Before: a table without its sweep.json (copied alone, or a part file) was picked from for any window, its recall
    quoted for a window it was never measured with."""
    from anns_lab.decode.modes import check_sweep_pick

    path = _results(tmp_path / "results.parquet")
    assert check_sweep_pick(str(path), 0.95, 100, (4, 16))[1]["window"] == [4, 16]
    with pytest.raises(DecodeError, match="swept with --window 4,16"):
        check_sweep_pick(str(path), 0.95, 100, (8, 32))
    (tmp_path / "sweep.json").unlink()
    with pytest.raises(DecodeError, match="sweep.json beside its table.* are missing"):
        check_sweep_pick(str(path), 0.95, 100, (4, 16))


def test_from_sweep_picks_least_scanned_reaching_target_per_layer(tmp_path):
    path = _results(tmp_path / "results.parquet")
    mode, lines = pick_from_sweep(str(path), "m", 0.95, [1, 3, 5])
    assert mode.plan.name == "vamana" and mode.plan.search_params == {"L": 200}  # L=100 misses 0.95 on layer 3
    assert mode.per_layer[1].search_params == {"L": 100} and mode.per_layer[3].search_params == {"L": 200}
    assert mode.per_layer[1].build_params == {"R": 16}
    assert 5 not in mode.per_layer and any("layer 5: not in the table" in x for x in lines)
    assert mode.kind == "index"
    from anns_lab.errors import DecodeError

    with pytest.raises(DecodeError, match="no index .* reaches recall 0.999"):
        pick_from_sweep(str(path), "m", 0.999, [1])
    with pytest.raises(DecodeError, match="no Q→K results for model 'x'"):
        pick_from_sweep(str(path), "x", 0.9, [1])


def _edited(path, edit):
    """The table at ``path`` rewritten by ``edit`` (a DataFrame → DataFrame)."""
    edit(pd.read_parquet(path)).to_parquet(path)
    return path


def test_from_sweep_compares_only_configurations_measured_on_every_head(tmp_path):
    """Before: a failed part's missing rows narrowed the "mean over the layer's heads" of its configuration alone. Here
    vamana L=100 gets 0.96 on head 0 of layer 3 and 0.80 on head 1 (mean 0.88: not a pick); without head 1's row its
    mean over head 0 alone made it layer 3's pick, and the table's; now it is left out where it lacks a head."""
    l100 = lambda t: (t["index"] == "vamana") & (t["search_params"] == json.dumps({"L": 100}))  # noqa: E731

    def uneven(t):
        t.loc[l100(t) & (t["layer"] == 3), "recall"] = np.where(t.loc[l100(t) & (t["layer"] == 3), "head"] == 0, 0.96, 0.80)
        return t

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    whole = _edited(_results(tmp_path / "a" / "results.parquet"), uneven)
    mode = pick_from_sweep(str(whole), "m", 0.95, [1, 3])[0]
    assert mode.per_layer[3].search_params == {"L": 200} and mode.plan.search_params == {"L": 200}
    path = _edited(_results(tmp_path / "b" / "results.parquet"),
                   lambda t: uneven(t)[~(l100(t) & (t["layer"] == 3) & (t["head"] == 1))])
    mode, lines = pick_from_sweep(str(path), "m", 0.95, [1, 3])
    assert mode.per_layer[3].search_params == {"L": 200} and mode.plan.search_params == {"L": 200}
    assert mode.per_layer[1].search_params == {"L": 100}  # on layer 1 it has both heads: still that layer's pick
    assert any("vamana: some of its configurations lack rows for heads" in x for x in lines)
    short = _edited(path, lambda t: t[~((t["layer"] == 3) & (t["head"] == np.where(t["index"] == "flat", 0, 1)))])
    with pytest.raises(DecodeError, match="measured on every head"):  # every configuration short of a head
        pick_from_sweep(str(short), "m", 0.95, [1])


def test_from_sweep_names_indexes_that_are_not_registered(tmp_path):
    """Before: a table of indexes none of which is installed was "best mean recall nan"; one not installed among
    others was left out without a word."""
    path = _edited(_results(tmp_path / "results.parquet"),
                   lambda t: t.assign(index=t["index"].replace({"ivf": "nowhere-index"})))
    mode, lines = pick_from_sweep(str(path), "m", 0.95, [1, 3])
    assert mode.plan.name == "vamana" and any("nowhere-index is not registered here" in x for x in lines)
    _edited(path, lambda t: t.assign(index="nowhere-index"))
    with pytest.raises(DecodeError, match=r"no index of the table \(nowhere-index\) is registered here"):
        pick_from_sweep(str(path), "m", 0.95, [1, 3])


def test_from_sweep_notes_a_sweep_of_another_key_count(tmp_path):
    """Before: a pick from a sweep of 4,096 keys per head was quoted at the sweep's scanned fraction for a decode whose
    indexes hold far fewer keys (an absolute nprobe there scans another share)."""
    path = _results(tmp_path / "results.parquet")
    assert not any("keys" in x for x in pick_from_sweep(str(path), "m", 0.95, [1, 3], n_keys=4000)[1])
    lines = pick_from_sweep(str(path), "m", 0.95, [1, 3], n_keys=1408)[1]
    assert any("the sweep's heads held 4,096 keys, this decode's indexes about 1,408" in x for x in lines)


def test_from_sweep_refuses_parameters_the_index_does_not_have(tmp_path):
    """A table swept with an older version of an index (a build parameter since removed) is refused: sweep again."""
    from anns_lab.errors import DecodeError

    path = tmp_path / "results.parquet"
    df = pd.read_parquet(_results(path))
    df.loc[df["index"] == "vamana", "build_params"] = json.dumps({"R": 16, "tail_links": 4})
    df.to_parquet(path)
    with pytest.raises(DecodeError, match=r"parameters this version does not have \(tail_links\); sweep again"):
        pick_from_sweep(str(path), "m", 0.95, [1, 3])


def test_from_sweep_refuses_search_parameters_the_index_does_not_have(tmp_path):
    """Before: the pick was printed as valid and the mode failed on every sample, each after its prefill."""
    path = tmp_path / "results.parquet"
    df = pd.read_parquet(_results(path))
    df["search_params"] = df["search_params"].map(lambda p: json.dumps({**json.loads(p), "foo": 1}))
    df.to_parquet(path)
    with pytest.raises(DecodeError, match=r"search parameters this version does not have \(foo\); sweep again"):
        pick_from_sweep(str(path), "m", 0.95, [1, 3])
    # through the command line, before the model loads (a path that names none would be the error otherwise)
    err = _error(_run("--model", tmp_path / "no-model", "--from-sweep", tmp_path, "--window", "4,16", "--task", "passkey"))
    assert "search parameters this version does not have (foo)" in err, err


@pytest.mark.parametrize("build, words", [({"kernel": 4}, "kernel=4 must be odd"), ({"window": 0}, "window")])
def test_from_sweep_holds_a_row_to_its_index_classs_own_rules(tmp_path, build, words):
    """A rule of the class itself (snapkv's odd kernel), not only its parameters' ranges, refuses an edited row at the
    pick: before, after the model load."""
    if "snapkv" not in registry.available():
        pytest.skip("the snapkv plugin is not installed (make test installs it)")
    path = tmp_path / "results.parquet"
    df = pd.read_parquet(_results(path))
    df = df[df["index"] == "flat"].assign(index="snapkv", build_params=json.dumps(build), search_params="{}")
    df.to_parquet(path)
    with pytest.raises(DecodeError, match=rf"holds a row this version of snapkv refuses \(.*{words}"):
        pick_from_sweep(str(path), "m", 0.95, [1, 3])


def test_from_sweep_runs_rows_from_before_the_row_stop_with_full_rows(tmp_path):
    """A roargraph row swept before the row stop existed (search parameters: L only) measured full rows: the pick runs
    it with row_misses=0 and says so; a row that names its row stop keeps it, with no such line. (A sweep that old trained
    on the queries at their own positions.)"""
    from anns_lab.indexes.roargraph import RoarGraphIndex

    path = tmp_path / "results.parquet"
    df = pd.read_parquet(_results(path))
    df = df[df["index"] == "vamana"].assign(index="roargraph", build_params=json.dumps({"M": 12}))
    df.to_parquet(path)
    mode, lines = pick_from_sweep(str(path), "m", 0.95, [1, 3], train_positions="own")
    assert mode.plan.name == "roargraph" and mode.plan.build_params == {} and mode.plan.search_params == {"L": 200, "row_misses": 0}
    assert mode.per_layer[1].search_params == {"L": 100, "row_misses": 0}
    assert [x for x in lines if "predate" in x] == [
        "  roargraph rows of the table predate row_misses: run with row_misses=0, the search they measured"]
    assert RoarGraphIndex.search_params["row_misses"].default != 0  # the index's default is the row stop
    df["search_params"] = df["search_params"].map(lambda p: json.dumps({**json.loads(p), "row_misses": 6, "row_credit": 0.3}))
    df.to_parquet(path)
    mode, lines = pick_from_sweep(str(path), "m", 0.95, [1, 3], train_positions="own")
    assert mode.plan.search_params == {"L": 200, "row_misses": 6, "row_credit": 0.3}
    assert not any("predate" in x for x in lines)


def test_from_sweep_builds_rows_from_before_a_build_parameter_as_they_were_built(tmp_path):
    """A retroinfer row swept before its estimation budget existed (session 48) estimated every cluster it did not
    attend: the pick builds it with estimation_budget 1, what the row measured, not today's default; a row that names
    the budget keeps its own."""
    if "retroinfer" not in registry.available():
        pytest.skip("the retroinfer plugin is not installed (make test installs it)")
    path = tmp_path / "results.parquet"
    df = pd.read_parquet(_results(path))
    df = df[df["index"] == "ivf"].assign(index="retroinfer", build_params=json.dumps({"nlist": 0, "niter": 10}))
    df.to_parquet(path)
    mode, lines = pick_from_sweep(str(path), "m", 0.95, [1, 3])
    assert mode.plan.name == "retroinfer" and mode.plan.build_params == {"estimation_budget": 1.0}
    assert "  retroinfer rows of the table predate estimation_budget: built with estimation_budget=1.0, the index they " \
           "measured" in lines
    assert registry.get("retroinfer").build_params["estimation_budget"].default != 1.0
    df["build_params"] = json.dumps({"nlist": 0, "niter": 10, "estimation_budget": 0.232})
    df.to_parquet(path)
    mode, lines = pick_from_sweep(str(path), "m", 0.95, [1, 3])
    assert mode.plan.build_params == {} and not any("predate" in x for x in lines)


def test_from_sweep_runs_rows_of_a_current_sweep_with_their_row_stop(tmp_path):
    """A roargraph row as the sweep writes it now (evaluate_index: every build parameter, the grid's search parameters
    only, so L alone) measured the default row stop: the pick must not run it with full rows."""
    from anns_lab.eval.table import SETTINGS
    from anns_lab.indexes.roargraph import RoarGraphIndex

    index = RoarGraphIndex()
    assert set(index.grid()[0]) == {"L"}  # what the sweep records of the search (evaluate_index)
    path = tmp_path / "results.parquet"
    df = pd.read_parquet(_results(path))
    df = df[df["index"] == "vamana"].assign(index="roargraph", build_params=json.dumps(index.params, sort_keys=True))
    df.to_parquet(path)
    (tmp_path / SETTINGS).write_text(json.dumps({"k": 100, "train_positions": "serving"}))  # as a sweep writes them now
    mode, lines = pick_from_sweep(str(path), "m", 0.95, [1, 3])
    assert mode.plan.search_params == {"L": 200} and mode.per_layer[1].search_params == {"L": 100}
    assert not any("predate" in x for x in lines)


def test_from_sweep_refuses_an_attention_aware_pick_of_another_train_group(tmp_path):
    """A sweep with --train-group group measured one graph per KV head: picking its roargraph rows for a decode that builds
    one graph per query head (or the reverse) would run graphs it never measured. A key-only pick does not care."""
    from anns_lab.eval.table import SETTINGS

    df = pd.read_parquet(_results(tmp_path / "results.parquet"))
    df.assign(index=df["index"].replace("vamana", "roargraph")).to_parquet(tmp_path / "results.parquet")
    (tmp_path / SETTINGS).write_text(json.dumps({"k": 100, "train_group": "group", "train_positions": "serving"}))
    with pytest.raises(DecodeError, match="swept with --train-group group.*pass --train-group group"):
        pick_from_sweep(str(tmp_path), "m", 0.95, [1, 3])
    assert pick_from_sweep(str(tmp_path), "m", 0.95, [1, 3], "group")[0].plan.name == "roargraph"
    (tmp_path / SETTINGS).write_text(json.dumps({"k": 100}))  # a sweep from before the option: per query head
    with pytest.raises(DecodeError, match="swept with --train-group head"):
        pick_from_sweep(str(tmp_path), "m", 0.95, [1, 3], "strided")
    df.to_parquet(tmp_path / "results.parquet")  # vamana learns from no queries: any --train-group runs what it measured
    assert pick_from_sweep(str(tmp_path), "m", 0.95, [1, 3], "strided")[0].plan.name == "vamana"


def test_from_sweep_refuses_an_attention_aware_pick_of_other_training_positions(tmp_path):
    """A sweep's roargraph rows measured graphs trained on queries at one place (--train-positions): a decode that
    trains on them elsewhere would run graphs the sweep never measured; sweeps before the option: their own positions."""
    from anns_lab.eval.table import SETTINGS

    df = pd.read_parquet(_results(tmp_path / "results.parquet"))
    df.assign(index=df["index"].replace("vamana", "roargraph")).to_parquet(tmp_path / "results.parquet")
    (tmp_path / SETTINGS).write_text(json.dumps({"k": 100}))
    with pytest.raises(DecodeError, match="swept with --train-positions own.*pass --train-positions own"):
        pick_from_sweep(str(tmp_path), "m", 0.95, [1, 3])
    assert pick_from_sweep(str(tmp_path), "m", 0.95, [1, 3], train_positions="own")[0].plan.name == "roargraph"
    (tmp_path / SETTINGS).write_text(json.dumps({"k": 100, "train_positions": "serving"}))
    assert pick_from_sweep(str(tmp_path), "m", 0.95, [1, 3])[0].plan.name == "roargraph"


def _roargraph_sweep(folder, auto_rules):
    """The vamana rows of :func:`_results` as roargraph rows of a current sweep (every build parameter at its default, the
    auto ones 0) whose ``auto_rules`` column holds ``auto_rules``; None: a table from before the column."""
    from anns_lab.eval.table import SETTINGS
    from anns_lab.indexes.roargraph import RoarGraphIndex

    df = pd.read_parquet(_results(folder / "results.parquet"))
    df = df[df["index"] == "vamana"].assign(index="roargraph", build_params=json.dumps(RoarGraphIndex().params, sort_keys=True))
    df = df.drop(columns="auto_rules") if auto_rules is None else df.assign(auto_rules=json.dumps(auto_rules))
    df.to_parquet(folder / "results.parquet")
    (folder / SETTINGS).write_text(json.dumps({"k": 100, "train_positions": "serving", "window": [4, 16]}))
    return folder


def test_from_sweep_notes_a_table_swept_with_other_auto_rules(tmp_path):
    """max_train=0 is "auto", whose rule changed between versions: a table swept with another rule measured another graph
    than the decode builds, and the pick says so once, naming the parameter; the same rules: no note."""
    from anns_lab.decode.modes import NOTE
    from anns_lab.indexes.roargraph import RoarGraphIndex

    today = dict(RoarGraphIndex.auto_rules)
    assert {"max_train", "list_stride", "M_sq", "n_pivots"} <= set(today)
    mode, lines = pick_from_sweep(str(_roargraph_sweep(tmp_path, today | {"max_train": "2026-11-01"})), "m", 0.95, [1, 3])
    notes = [x for x in lines if x.startswith(NOTE)]
    assert len(notes) == 1, lines
    assert f"max_train (sweep 2026-11-01, now {today['max_train']})" in notes[0] and "today's rules" in notes[0]
    assert not any(name in notes[0] for name in ("list_stride", "M_sq", "n_pivots"))  # their rules are today's
    assert mode.plan.name == "roargraph" and mode.plan.build_params == {}  # built with today's auto rules
    _, lines = pick_from_sweep(str(_roargraph_sweep(tmp_path, today)), "m", 0.95, [1, 3])
    assert not any(x.startswith(NOTE) for x in lines)
    df = pd.read_parquet(tmp_path / "results.parquet")  # max_train given: no auto rule built it, whatever the stamp
    params = json.loads(df["build_params"].iloc[0]) | {"max_train": 4096}
    df.assign(build_params=json.dumps(params, sort_keys=True),
              auto_rules=json.dumps(today | {"max_train": "2026-11-01"})).to_parquet(tmp_path / "results.parquet")
    mode, lines = pick_from_sweep(str(tmp_path), "m", 0.95, [1, 3])
    assert mode.plan.build_params == {"max_train": 4096} and not any(x.startswith(NOTE) for x in lines)


def test_from_sweep_notes_unknown_auto_rules_of_a_table_from_before_they_were_recorded(tmp_path):
    from anns_lab.decode.modes import NOTE
    from anns_lab.eval.table import load_results

    _roargraph_sweep(tmp_path, None)
    table, _ = load_results(tmp_path)  # an old table still loads
    assert table["auto_rules"].isna().all()
    mode, lines = pick_from_sweep(str(tmp_path), "m", 0.95, [1, 3])
    notes = [x for x in lines if x.startswith(NOTE)]
    assert len(notes) == 1 and mode.plan.name == "roargraph"
    assert all(f"{name} (sweep unknown, now " in notes[0] for name in ("max_train", "list_stride", "M_sq", "n_pivots"))
    df = pd.read_parquet(_results(tmp_path / "results.parquet")).drop(columns="auto_rules")
    df.to_parquet(tmp_path / "results.parquet")  # vamana has no auto rule: nothing to note
    assert not any(x.startswith(NOTE) for x in pick_from_sweep(str(tmp_path), "m", 0.95, [1, 3])[1])


def test_from_sweep_auto_rules_note_reaches_stderr_and_the_json(tiny_llama, tmp_path):
    from anns_lab.dumps.models import canonical_name
    from anns_lab.indexes.roargraph import RoarGraphIndex

    _roargraph_sweep(tmp_path, dict(RoarGraphIndex.auto_rules) | {"list_stride": "2026-11-01"})
    df = pd.read_parquet(tmp_path / "results.parquet")
    df.assign(model=canonical_name(str(tiny_llama)), k=20).to_parquet(tmp_path / "results.parquet")  # as --topk
    res = _run("--model", tiny_llama, "--task", "passkey", "--context", 200, "--window", "4,16", "--topk", 20,
               "--max-new-tokens", 2, "--from-sweep", tmp_path, "--mode", "full", "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    assert "list_stride (sweep 2026-11-01, now" in res.stderr
    recorded = json.loads((tmp_path / "r.json").read_text())["from_sweep"]["pick"]
    assert sum("list_stride (sweep 2026-11-01, now" in line for line in recorded) == 1


def test_default_mode_is_attention_aware_when_registered():
    modes = parse_modes("full,default", {}, {})
    expected = "roargraph" if "roargraph" in registry.available() else "flat"
    assert [m.name for m in modes] == ["full", expected]


def test_from_sweep_on_the_command_line(tiny_llama, tmp_path):
    from anns_lab.dumps.models import canonical_name

    path = _results(tmp_path / "results.parquet")
    table = pd.read_parquet(path)
    table["model"] = canonical_name(str(tiny_llama))
    table["k"] = 20  # swept at the decode's --topk: another k is refused (test_hostile_inputs)
    table.to_parquet(path)
    res = _run("--model", tiny_llama, "--task", "passkey", "--context", 200, "--window", "4,16", "--topk", 20,
               "--max-new-tokens", 3, "--from-sweep", path, "--target-recall", 0.95, "--mode", "window,flat,default",
               "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    assert "from sweep" in res.output and "layer 1: vamana(R=16, L=100)" in res.output
    recorded = json.loads((tmp_path / "r.json").read_text())["from_sweep"]  # the pick and why, as printed
    assert recorded["path"] == str(path) and recorded["target_recall"] == 0.95
    assert any("layer 1: vamana(R=16, L=100)" in line for line in recorded["pick"])
    names = [line.split()[0] for line in res.output.splitlines() if line.startswith(("full", "window", "flat", "sweep:"))]
    assert names == ["full", "window", "flat", "sweep:vamana"]  # explicit modes stay; the pick replaces 'default'


def test_the_options_a_pick_reads_are_asked_of_the_run_after_the_pick(tiny_llama, tmp_path):
    """--copy-hints where only the sweep's pick takes hints (roargraph) runs; where the pick does not (vamana) it is
    refused once the pick is known, after the model loads (the modes named before it read none)."""
    from anns_lab.dumps.models import canonical_name

    path = _results(tmp_path / "results.parquet")
    table = pd.read_parquet(path).assign(model=canonical_name(str(tiny_llama)), k=20)
    aware = table["index"] == "vamana"
    table.assign(index=table["index"].where(~aware, "roargraph"), build_params=table["build_params"].where(~aware, "{}")
                 ).to_parquet(path)
    (tmp_path / "sweep.json").write_text(json.dumps({"window": [4, 16], "train_positions": "serving"}))
    args = ["--model", tiny_llama, "--task", "passkey", "--context", 200, "--window", "4,16", "--topk", 20,
            "--max-new-tokens", 2, "--from-sweep", path, "--target-recall", 0.95, "--mode", "full,flat,default",
            "--copy-hints", 3]
    res = _run(*args)
    assert res.exit_code == 0, res.output
    assert re.search(r"layer 1: roargraph\(.*L=100", res.output) and "\nsweep:roargraph " in res.output, res.output
    table.to_parquet(path)  # vamana's rows again: no index of the run takes hints
    res = _run(*args)
    assert "layer 1: vamana(R=16, L=100)" in res.output  # refused after the pick was made
    assert "Error: --copy-hints: read by none of this run's indexes (flat, vamana: none takes copy hints (" in _error(res)


def test_every_table_column_is_defined_in_the_legend():
    from anns_lab.decode.runner import COLUMNS as DECODE_COLUMNS, LEGEND

    assert {key for key, _, _ in DECODE_COLUMNS} <= set(LEGEND)
    labels = [label for _, label, _ in DECODE_COLUMNS]
    assert len(set(labels)) == len(labels) and "acc %" not in labels  # no "acc" beside "acc-attn"


def test_a_json_path_that_cannot_be_written_is_refused_before_the_model_loads(tiny_llama, tmp_path, monkeypatch):
    """Its first write comes after the first sample: an error there would lose that sample."""
    from anns_lab.decode import cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = _error(_run("--model", tiny_llama, "--task", "passkey", "--context", 200, "--mode", "full",
                      "--json", blocker / "r.json"))
    assert "cannot write there" in err and "a-file" in err
    assert list(tmp_path.iterdir()) == [blocker]
    # a bad option is refused before the folder is made
    _error(_run("--model", tiny_llama, "--task", "passkey", "--mode", "full,bogus", "--json", tmp_path / "new" / "r.json"))
    assert list(tmp_path.iterdir()) == [blocker]
    # a run refused after the check (here: the model cannot load) leaves no folder behind either
    monkeypatch.setattr(cli, "_load", lambda *a, **k: (_ for _ in ()).throw(cli.DecodeError("no such model")))
    err = _error(_run("--model", tiny_llama, "--task", "passkey", "--context", 200, "--mode", "full",
                      "--json", tmp_path / "new" / "deeper" / "r.json"))
    assert "no such model" in err and list(tmp_path.iterdir()) == [blocker]
    # a folder on the way that is a file is named
    err = _error(_run("--model", tiny_llama, "--task", "passkey", "--context", 200, "--mode", "full",
                      "--json", blocker / "sub" / "r.json"))
    assert "cannot write there" in err and str(blocker) in err


def test_json_is_written_after_each_sample(tiny_llama, tmp_path, monkeypatch):
    """A long run stopped midway keeps the samples it finished: the JSON is rewritten after each one."""
    from anns_lab.decode import cli

    seen = []
    real = cli._write_json
    monkeypatch.setattr(cli, "_write_json", lambda path, result, *kept: (
        seen.append(json.loads(json.dumps(result, default=float))), real(path, result, *kept)))
    out = tmp_path / "r.json"
    res = _run("--model", tiny_llama, "--mode", "full,flat", "--task", "passkey", "--context", 200, "--samples", 2,
               "--window", "4,16", "--topk", 20, "--max-new-tokens", 3, "--json", out)
    assert res.exit_code == 0, res.output
    first, final = seen[0], json.loads(out.read_text())
    assert first["partial"] is True and first["samples_done"] == 1 and first["samples_total"] == 2
    assert first["model"] == final["model"]
    for name in ("full", "flat"):
        assert len(first["modes"][name]["samples"]) == 1 and len(final["modes"][name]["samples"]) == 2
        assert first["modes"][name]["samples"][0] == final["modes"][name]["samples"][0]
    assert (final["partial"], final["samples_done"], final["samples_total"]) == (False, 2, 2)  # its last write's keys


def test_a_prompt_of_bytes_that_are_not_utf8_is_one_error(tiny_llama, monkeypatch):
    """Before: a TypeError from the tokenizer (Python hands undecodable argv bytes over as surrogates)."""
    from anns_lab.decode import cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
    bad = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")
    assert "--prompt is not valid UTF-8 text" in _error(_run("--model", tiny_llama, "--prompt", bad, "--mode", "full"))


def test_an_interrupted_decode_says_what_it_kept(tiny_llama, tmp_path, monkeypatch):
    """Before: Ctrl-C (or SIGTERM) printed "Aborted!" alone, though the finished samples were kept in --json."""
    from anns_lab.decode import runner

    real = runner.run_task

    def stopped_after_the_first_sample(*args, **kwargs):
        def on_sample(res):
            args[-1](res)
            raise KeyboardInterrupt

        return real(*args[:-1], on_sample, **kwargs)

    monkeypatch.setattr(runner, "run_task", stopped_after_the_first_sample)
    out = tmp_path / "r.json"
    args = ["--model", tiny_llama, "--mode", "full", "--task", "passkey", "--context", 200, "--samples", 3,
            "--max-new-tokens", 2]
    res = _run(*args, "--json", out)
    assert res.exit_code == 130, res.output
    assert f"interrupted: 1 of 3 samples finished and kept in {out}" in res.output and "Aborted" not in res.output
    kept = json.loads(out.read_text())
    assert kept["partial"] is True and kept["samples_done"] == 1
    monkeypatch.setattr(runner, "run_task", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    res = _run(*args)
    assert res.exit_code == 130 and "interrupted: nothing was written (--json keeps" in res.output


def test_a_decode_that_loses_its_ray_head_says_what_it_kept(tiny_llama, tmp_path, monkeypatch):
    """As an interrupt's line, in the error a lost Ray head ends the run with (the executor's watch raises it; Ray
    itself would have ended the process without a word)."""
    from anns_lab.decode import runner
    from anns_lab.errors import ExecutorLost

    real = runner.run_task

    def lost_after_the_first_sample(*args, **kwargs):
        def on_sample(res):
            args[-1](res)
            raise ExecutorLost("lost the Ray head at 10.0.0.1:6379: it has not answered for 30 s")

        return real(*args[:-1], on_sample, **kwargs)

    monkeypatch.setattr(runner, "run_task", lost_after_the_first_sample)
    out = tmp_path / "r.json"
    res = _run("--model", tiny_llama, "--mode", "full", "--task", "passkey", "--context", 200, "--samples", 3,
               "--max-new-tokens", 2, "--json", out)
    assert _error(res) == (
        f"Error: lost the Ray head at 10.0.0.1:6379: it has not answered for 30 s: 1 of 3 samples finished and kept in {out} "
        "(\"partial\": true); run again with --overwrite to redo them all")
    assert json.loads(out.read_text())["samples_done"] == 1


def test_serving_positions_under_dynamic_rope_are_one_error_before_the_prefill(tiny_llama, monkeypatch):
    """dynamic NTK turns positions by frequencies that follow the sequence length (dumps.rope): the training queries
    cannot be moved, and that is said before the prefill runs; key-only modes and --train-positions own are unaffected."""
    from anns_lab.decode import runner

    def no_prefill(*a, **kw):
        raise AssertionError("the prefill ran before the bad option was refused")

    args = ["--model", tiny_llama, "--task", "passkey", "--context", 200, "--samples", 1, "--window", "4,16", "--topk", 20,
            "--max-new-tokens", 2, "--chunk", 64, "--rope-scaling", "dynamic:2", "--allow-extrapolation"]
    with monkeypatch.context() as m:
        m.setattr(runner, "prefill", no_prefill)
        assert "--train-positions own" in _error(_run(*args, "--mode", "roargraph"))
        assert "--train-positions own" in _error(_run(*args, "--mode", "roargraph", "--train-positions", "mix"))
    res = _run(*args, "--mode", "roargraph", "--train-positions", "own")
    assert res.exit_code == 0, res.output


def _nan_from_step(monkeypatch, first: int) -> None:
    """Every forward pass of one token at position ``first`` or later gives NaN logits (a broken model or attention
    as the decode steps see it); the prefill's stay finite."""
    from anns_lab.decode import engine

    real = engine.forward_tokens

    def forward(lm, cache, ids, start, end):
        out = real(lm, cache, ids, start, end)
        return out.clone().fill_(float("nan")) if end - start == 1 and start >= first else out

    monkeypatch.setattr(engine, "forward_tokens", forward)


@pytest.mark.parametrize("args, needle", [
    (["--task", "passkey", "--mode", "flat", "--max-new-tokens", 4], "--mode flat at decode step 1 of 4"),
    (["--task", "passkey", "--mode", "window,flat", "--max-new-tokens", 4], "--mode window at decode step 1 of 4"),
    (["--eval", "fidelity", "--mode", "flat", "--positions", 4, "--free-tokens", 2], "--mode full at decode step 1 of 4"),
])
def test_non_finite_logits_are_one_error_naming_the_mode_and_step(tiny_llama, tmp_path, monkeypatch, args, needle):
    """NaN logits once scored as a result (fidelity: KL nan, top-1 100%, exit 0, a bare NaN in the JSON): now the run
    stops with one error naming the mode and the step, and writes no JSON."""
    _nan_from_step(monkeypatch, 200)
    out = tmp_path / "r.json"
    err = _error(_run("--model", tiny_llama, "--context", 200, "--window", "4,16", "--topk", 20, "--json", out, *args))
    assert needle in err and "not finite" in err, err
    assert not out.exists()


def test_non_finite_prefill_logits_are_one_error(tiny_llama, monkeypatch):
    """A model whose weights hold a NaN (as a broken --rope-scaling makes its logits): refused after the prefill, before
    any mode decodes from it."""
    from anns_lab.decode import cli

    real = cli._load

    def load(*a, **kw):
        lm = real(*a, **kw)
        lm.model.get_input_embeddings().weight.data.fill_(float("nan"))
        return lm

    monkeypatch.setattr(cli, "_load", load)
    err = _error(_run("--model", tiny_llama, "--task", "passkey", "--context", 200, "--window", "4,16", "--topk", 20,
                      "--mode", "full,flat", "--max-new-tokens", 2))
    assert "the full-attention prefill of 200 tokens" in err and "not finite" in err, err


def test_a_nan_is_never_written_as_json_nor_printed_as_missing(tmp_path):
    from anns_lab.decode import cli
    from anns_lab.decode.runner import cell

    out = tmp_path / "r.json"
    with pytest.raises(DecodeError, match=r"holds a NaN or an infinity at modes\.flat\.summary\.kl_mean"):
        cli._write_json(out, {"task": "fidelity", "modes": {"flat": {"summary": {"kl_mean": np.float64("nan")}}}})
    assert not out.exists()
    assert cell({"kl_mean": float("nan")}, "kl_mean", "{:.2e}") == "NaN"
    assert cell({"scanned_fraction": float("nan")}, "scanned_fraction", "{:.2%}") == "NaN"
    assert cell({}, "kl_mean", "{:.2e}") == "-"


@pytest.mark.parametrize("args, needle", [
    (["--eval", "fidelity", "--task", "passkey"], "--task: not used by this run (--eval fidelity teacher-forces"),
    (["--eval", "fidelity", "--prompt", "hello"], "--prompt: not used by this run"),
    (["--eval", "fidelity", "--samples", 3, "--seed", 4, "--max-new-tokens", 5],
     "--samples, --seed, --max-new-tokens: not used by this run (--eval fidelity"),
    (["--eval", "fidelity", "--seed", 0], "--seed: not used"),  # given, though at its default
    (["--prompt", "hello", "--context", 300], "--context: not used by this run (--prompt decodes that text once"),
    (["--prompt", "hello", "--samples", 2, "--seed", 1], "--samples, --seed: not used"),
    (["--prompt", "hello", "--give-up-after", 1], "--give-up-after: not used"),
    (["--eval", "fidelity", "--give-up-after", 0], "--give-up-after: not used"),
    (["--task", "passkey", "--positions", 8], "--positions: not used by this run (--positions and --free-tokens are for --eval fidelity)"),
    (["--task", "passkey", "--target-recall", 0.9], "--target-recall is the recall a --from-sweep pick must reach"),
    (["--task", "passkey", "--cpus-per-task", 2], "--cpus-per-task: not used by this run"),
])
def test_an_option_the_run_would_ignore_is_refused_before_the_model_loads(tiny_llama, monkeypatch, args, needle):
    """Each was ignored in silence (--eval fidelity --prompt ran 36 s, then crashed with an IndexError, and wrote no
    JSON)."""
    from anns_lab.decode import cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert needle in _error(_run("--model", tiny_llama, "--mode", "full", *args))


def test_the_answers_printed_are_the_results_own(capsys):
    """_print_result reads from the result whether it has answers (--eval fidelity --prompt once reached it with none
    and crashed with an IndexError after the whole run)."""
    from anns_lab.decode import cli
    from anns_lab.decode.engine import Settings

    def result(task, samples):
        return {"model": "m", "task": task, "context": 8, "device": "cpu",
                "modes": {"flat": {"summary": {"kl_mean": 0.5}, "samples": samples, "notes": []}}}

    cli._print_result(result("fidelity", []), Settings())
    assert "[flat]" not in capsys.readouterr().out
    cli._print_result(result("prompt", [{"answer": "green"}]), Settings())
    assert "[flat] green" in capsys.readouterr().out


def test_an_existing_json_is_replaced_only_with_overwrite(tiny_llama, tmp_path, monkeypatch):
    """A rerun stopped midway once replaced a complete result with a partial one: an existing --json file is refused,
    before the model loads, unless --overwrite says to replace it."""
    from anns_lab.decode import cli

    out = tmp_path / "r.json"
    earlier = '{"model": "m", "executor": "local", "settings": {}, "complete": true}'
    out.write_text(earlier)
    args = ["--model", tiny_llama, "--task", "passkey", "--context", 200, "--mode", "full", "--max-new-tokens", 2,
            "--json", out]
    with monkeypatch.context() as m:
        m.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
        err = _error(_run(*args))
        assert f"--json {out} exists: pass --overwrite to replace it, or choose another --json" in err
        assert "--overwrite lets --json replace" in _error(_run(*args[:-2], "--overwrite"))
    assert out.read_text() == earlier
    res = _run(*args, "--overwrite")
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["task"] == "passkey"


@pytest.mark.parametrize("what", ["table", "settings", "symlink", "fifo", "manifest", "other"])
def test_a_json_path_that_would_destroy_something_is_refused_even_with_overwrite(tiny_llama, tmp_path, monkeypatch, what):
    """The --from-sweep table or its settings (the pick's input), a link (replaced by a file, not written through), a
    fifo or device (as root, /dev/null became a regular file): refused before the model loads, left as they were."""
    import os

    from anns_lab.decode import cli
    from anns_lab.eval.table import SETTINGS

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
    sweep = _results(tmp_path / "results.parquet")
    (tmp_path / SETTINGS).write_text("{}")
    target = {"table": sweep, "settings": tmp_path / SETTINGS, "symlink": tmp_path / "link.json",
              "fifo": tmp_path / "fifo", "manifest": tmp_path / "dump" / "manifest.json",
              "other": tmp_path / "notes.txt"}[what]
    if what == "manifest":  # another dump's, not the pick's input: --overwrite once replaced it
        target.parent.mkdir()
        target.write_text('{"format": "anns-lab-dump", "model": "m"}')
    if what == "other":
        target.write_text("my notes")
    if what == "symlink":
        target.symlink_to(tmp_path / "elsewhere.json")
    if what == "fifo":
        os.mkfifo(target)
    before = sorted((p.name, p.is_symlink(), p.is_file()) for p in tmp_path.iterdir())
    err = _error(_run("--model", tiny_llama, "--task", "passkey", "--context", 200, "--window", "4,16", "--topk", 20,
                      "--mode", "full", "--from-sweep", tmp_path, "--json", target, "--overwrite"))
    needle = {"table": "which --from-sweep reads", "settings": "which --from-sweep reads",
              "symlink": "is a symbolic link", "fifo": "is not a regular file",
              "manifest": "is not an earlier decode result", "other": "is not an earlier decode result"}[what]
    assert needle in err and "choose another --json" in err, err
    assert sorted((p.name, p.is_symlink(), p.is_file()) for p in tmp_path.iterdir()) == before
    if what in ("manifest", "other"):
        assert "anns-lab-dump" in target.read_text() or target.read_text() == "my notes"


def test_decode_markdown_labels_a_partial_result_in_every_table(tmp_path):
    """benchmarks/decode_markdown.py printed a run stopped midway ("partial": true) as a finished one."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "decode_markdown", Path(__file__).resolve().parent.parent / "benchmarks" / "decode_markdown.py")
    md = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(md)
    done = {"task": "passkey", "context": 200, "modes": {"full": {"summary": {"accuracy": 100.0}, "samples": []}}}
    stopped = done | {"partial": True, "samples_done": 2, "samples_total": 3}
    assert "PARTIAL: 2 of 3 samples" in md.markdown(stopped, ["accuracy"])
    assert "PARTIAL" not in md.markdown(done, ["accuracy"])
    both = md.side_by_side([done, stopped], ["accuracy"])
    assert both.count("PARTIAL: 2 of 3 samples") == 1 and "passkey 200 (PARTIAL: 2 of 3 samples): accuracy %" in both


def test_decode_markdown_reads_what_each_table_needs_and_names_what_a_file_lacks(tmp_path):
    """A run's table needs `anns-lab decode --json`'s model and device (bench_decode.py's JSON raised a KeyError);
    --by-run needs the runner's keys only, which bench_decode.py's JSON has."""
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"task": "passkey", "context": 200,
                                 "modes": {"full": {"summary": {"accuracy": 100.0}, "samples": []}}}))
    script = [sys.executable, str(Path(__file__).resolve().parent.parent / "benchmarks" / "decode_markdown.py")]
    table = subprocess.run(script + [str(bench)], capture_output=True, text=True)
    assert table.returncode == 1 and "Traceback" not in table.stderr
    assert table.stderr.strip() == f"{bench}: no model, device in it: a run's table reads `anns-lab decode --json` " \
                                   "results (--by-run also bench_decode.py's)"
    by_run = subprocess.run(script + [str(bench), "--by-run", "accuracy"], capture_output=True, text=True)
    assert by_run.returncode == 0 and "passkey 200: accuracy %" in by_run.stdout, by_run


@pytest.mark.parametrize("column, value", [("build_params", {"R": "16"}), ("build_params", {"R": -3}),
                                           ("search_params", {"L": 2.5})])
def test_from_sweep_refuses_values_the_index_refuses(tmp_path, column, value):
    """Before: an edited table's R of text or below range reached the decode, whose check then blamed the prompt's length
    ("cannot index the 432 keys outside the window"); a fractional L reached the search."""
    path = tmp_path / "results.parquet"
    df = pd.read_parquet(_results(path))
    rows = (df["index"] == "vamana") & (df["search_params"] == json.dumps({"L": 200}))  # the pick: L=100 misses 0.95
    df.loc[rows, column] = json.dumps(value)  # one grid point: all three alike were one cell thrice (refused as such)
    df.to_parquet(path)
    with pytest.raises(DecodeError, match=r"holds a row this version of vamana refuses \(vamana: parameter .*; sweep again"):
        pick_from_sweep(str(path), "m", 0.95, [1, 3])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost raise is the case
def test_a_ctrl_c_lost_in_a_finalizer_still_stops_the_decode(tiny_llama, tmp_path, monkeypatch, lost_ctrl_c):
    """A Ctrl-C whose raise a finalizer dropped (stops.py: pyarrow's, a file's) stops the decode at its next prefill
    chunk, decode step or sample, as the Ctrl-C would have, saying what --json keeps; before, the run went on to its
    end with status 0."""
    from anns_lab.decode import cli as decode_cli
    from anns_lab.decode import engine

    args = ["--model", tiny_llama, "--mode", "full", "--task", "passkey", "--context", 200, "--samples", 3,
            "--max-new-tokens", 3, "--chunk", 64]
    real_forward, real_write = engine.forward_tokens, decode_cli._write_json
    for at in ("prefill", "decode", "sample"):
        calls, out, written = [], tmp_path / f"{at}.json", []

        def forward(lm, cache, ids, start, end):
            calls.append(end - start)
            if at == "prefill" and len(calls) == 2 or at == "decode" and end - start == 1:
                lost_ctrl_c()
            return real_forward(lm, cache, ids, start, end)

        def write(path, result, *kept):
            real_write(path, result, *kept)
            written.append(len(calls))
            if at == "sample":
                lost_ctrl_c()

        with monkeypatch.context() as m:
            m.setattr(engine, "forward_tokens", forward)
            m.setattr(decode_cli, "_write_json", write)
            res = _run(*args, "--json", out)
        assert res.exit_code == 130, (at, res.output)
        if at == "sample":
            assert f"interrupted: 1 of 3 samples finished and kept in {out}" in res.output
            assert json.loads(out.read_text())["samples_done"] == 1
            assert written == [len(calls)], "the next sample's prefill began"
        else:
            assert "interrupted before the first sample finished" in res.output and not out.exists()
            assert calls[-1] == (64 if at == "prefill" else 1) and len(calls) <= 5, (at, calls)


def test_the_builds_after_the_prefill_show_a_bar_over_the_layers(tiny_llama):
    """After the prefill the builds of a long context ran a minute with no sign of life (a plugin author's review): a
    bar counts the layers' builds, to every one of them."""
    res = _run("--model", tiny_llama, "--mode", "roargraph", "--task", "passkey", "--context", 300, "--samples", 1,
               "--window", "4,16", "--max-new-tokens", 2, "--chunk", 64)
    assert res.exit_code == 0, res.output
    assert "index builds: started during the prefill's last chunk; finishing ..." in res.output
    assert re.search(r"index builds: 100%.*4/4", res.output), res.output
