"""``anns-lab decode``: generate with RetrievalAttention (or a baseline) and report accuracy and latency."""

from __future__ import annotations

import contextlib
import dataclasses

import json
import math
import numbers
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import click

from anns_lab.cli_types import WINDOW, parse_params
from anns_lab.decode import checks
from anns_lab.decode.options import (CALIBRATE_AUTO, GIVE_UP_AFTER, LAYERS_AT_ONCE, UNTIL_BUILT, UNTIL_BUILT_HELP,
                                     Settings, mode_names)
from anns_lab.dumps import rope
from anns_lab.dumps.cli import ROPE_HELP, ROPE_SCALING
from anns_lab.dumps.tasks import TASKS
from anns_lab.errors import DecodeError, ExecutorLost
from anns_lab.indexes.group_queries import DEFAULT as GROUP_DEFAULT
from anns_lab.indexes.group_queries import MODES as GROUP_MODES
from anns_lab.io import atomic_write_bytes, hold_file, loads_json, missing_folders

if TYPE_CHECKING:
    from anns_lab.decode.engine import Mode


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def builds_during_prefill(choice: bool | None, until_built: str, device: str) -> bool:
    """``--build-during-prefill/--build-after-prefill`` as given, or by default during the prefill (its last chunk
    hides part of the builds), except on an accelerator with ``--until-built exact``: there the first token waits for the
    prefill alone, and builds beside it slow it (likely their threads competing with the one launching its kernels; not
    profiled) far more than they gain (SmolLM2 at 8K on an H200: the prefill 1.08-1.34 s with them, 0.65 s without;
    BENCHMARKS "The CUDA path, measured again")."""
    if choice is not None:
        return choice
    return not (until_built == "exact" and not str(device).startswith("cpu"))


def builds_in_processes(choice: bool | None, device: str) -> bool:
    """``--build-processes/--build-threads`` as given, or by default in worker processes on an accelerator: there the
    thread that launches the model's kernels runs Python, and a build on a thread beside it waits up to the switch
    interval (5 ms) for the GIL after each of its ~100 kernels (a SmolLM2 8K layer's builds and calibration beside a
    Python thread: 9-10x their time alone on threads, 2x in worker processes; BENCHMARKS "Builds in worker processes");
    on threads on a CPU, where the prefill's thread waits in torch's kernels (GIL released) and the workers gained
    nothing measured."""
    if choice is not None:
        return choice
    return not str(device).startswith("cpu")


class _CalibrateTarget(click.ParamType):
    """``--calibrate``'s value: ``auto`` (the target by the keys a layer holds) or a weight recall (0: off)."""

    name = "auto|TARGET"

    def convert(self, value, param, ctx):
        if value == CALIBRATE_AUTO:
            return value
        try:
            return float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither {CALIBRATE_AUTO!r} nor a number", param, ctx)


class _DecodeCommand(click.Command):
    """Reads ``--calibrate -1`` (or ``=-1``) as a bad target: click takes a dash after an option whose value may be
    left out for the next option, and would report an unknown option ``-1``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        for flag, value in zip(args, [*args[1:], ""]):
            given = flag.partition("=")[2] if flag.startswith("--calibrate=") else value if flag == "--calibrate" else ""
            if given.startswith("-"):
                try:
                    checks.check_calibrate(float(given))
                except ValueError:  # another option: the flag's default target
                    pass
        return super().parse_args(ctx, args)


@click.command(cls=_DecodeCommand, short_help="Generate with retrieval attention; accuracy and time per token.")
@click.option("--model", default="smollm2", show_default=True, help="model alias, local folder or HF id")
@click.option("--mode", "modes", default="full,default", show_default=True,
              help="comma list of full, window, or the name of a registered index (flat, ivf, roargraph, ...; "
                   "`anns-lab indexes` lists them); default = the attention-aware index")
@click.option("--param", "params", multiple=True, help="search parameter NAME=VALUE for the index modes (e.g. L=200)")
@click.option("--build-param", "build_params", multiple=True,
              help="build parameter NAME=VALUE for the index modes (a VALUE in double quotes stays text)")
@click.option("--topk", default=100, show_default=True, help="keys retrieved per query head and step")
@click.option("--window", "window", type=WINDOW, default="128,512", show_default=True, help="static window: first SINK + most recent RECENT tokens")
@click.option("--add-batch", default=64, show_default=True,
              help="tokens leaving the window are attended exactly from a side-buffer and inserted into the index in batches of this size")
@click.option("--train-queries", default=0, show_default=True,
              help="prefill queries given to attention-aware indexes, evenly strided (0 = all)")
@click.option("--train-group", type=click.Choice(GROUP_MODES), default=GROUP_DEFAULT, show_default=True,
              help="attention-aware indexes: one per KV head trained on its GQA group's queries (group: all of them; "
                   "strided: one head's count, round robin over the heads by position), or one per query head on its own ('head'; "
                   "'unlisted': with the group's other heads' newest queries for the keys its own lists leave out)")
@click.option("--train-positions", type=click.Choice(rope.PLACES), default=rope.DEFAULT, show_default=True, help=rope.HELP)
@click.option("--copy-hints", default=8, show_default=True,
              help="per step, the positions after the latest N earlier occurrences of the text's last 1-3 tokens (and the "
                   "two steps before's, moved on) also enter the searches of indexes that take hints (roargraph; counted "
                   "as scanned); 0 = none")
@click.option("--task", type=str, default=None, help=f"synthetic task: {', '.join(TASKS)}")
@click.option("--prompt", type=str, default=None, help="free-form prompt text (instead of --task)")
@click.option("--eval", "evaluation", type=click.Choice(["task", "fidelity"]), default="task", show_default=True,
              help="fidelity: teacher-forced KL and top-1 agreement against full attention on real text")
@click.option("--context", default=2048, show_default=True, help="prompt tokens (task and fidelity)")
@click.option("--samples", default=1, show_default=True, help="task prompts per mode, their needles at depths spread over the context")
@click.option("--give-up-after", default=GIVE_UP_AFTER, show_default=True,
              help="leave an index mode out of the later samples once it has failed (its build or search broke) on "
                   "this many samples in a row: a broken plugin fails on every sample, and with builds during the "
                   "prefill each try costs a prefill; 0 = try it on every sample")
@click.option("--seed", default=0, show_default=True, help="seed of the first task prompt (its key, needle and values); sample i uses SEED+i")
@click.option("--max-new-tokens", type=int, default=None, help="generated tokens (default per task)")
@click.option("--positions", default=256, show_default=True, help="fidelity: teacher-forced positions")
@click.option("--free-tokens", default=64, show_default=True, help="fidelity: free-running greedy tokens")
@click.option("--chunk", default=2048, show_default=True, help="prefill chunk size")
@click.option("--build-during-prefill/--build-after-prefill", default=None,
              help="start a layer's index builds on a CPU thread once the prompt's last chunk has passed that layer "
                   "(the overlap is not counted in TTFT), or only after the whole prefill (--eval fidelity: always after). "
                   "Default: during, except on an accelerator with --until-built exact, where the first token waits for "
                   "the prefill alone and builds beside it only slow it (SmolLM2 at 8K on an H200: 1.34 s against 0.65 s)")
@click.option("--build-layers", default=LAYERS_AT_ONCE, show_default=True,
              help="layers an index mode builds at once (each on its own thread, its heads on the threads' budget, "
                   "at most that many; each holds its layer's keys and moved queries). 0 = auto: enough layers for an "
                   "index per thread (the threads' budget over a layer's indexes: one per query head, or per KV head for "
                   "key-only indexes and --train-group group|strided), at least 2")
@click.option("--build-processes/--build-threads", default=None,
              help="build the indexes in worker processes (their arrays come back as a saved index's do; an index that "
                   "cannot save builds on threads), or on threads of this process. Default: processes on an "
                   "accelerator, where the thread launching the model's kernels runs Python and a build on a thread "
                   "beside it waits for the GIL after each of its kernels; threads on a CPU")
@click.option("--shared-prefill", is_flag=True,
              help="with --build-after-prefill: every mode decodes from one prefill, the index modes' (one prefill a "
                   "sample, the cheaper run at 128K on a CPU; full's TTFT then carries the queries the index modes keep, "
                   "which without it it does not)")
@click.option("--until-built", type=click.Choice(UNTIL_BUILT), default="wait", show_default=True, help=UNTIL_BUILT_HELP)
@click.option("--question-after-prefill", is_flag=True,
              help="--task: prefill the context without the task's question and build the indexes on it, then feed the "
                   "question's tokens as decode steps through each mode before it answers (a cached context asked "
                   "later: no index, and no selection such as snapkv's, has seen the question)")
@click.option("--calibrate-question", is_flag=True,
              help="with --question-after-prefill: raise each layer's search again, as --calibrate does at build time, "
                   "on the queries of the question's steps but its last (whose output is the answer's first token), "
                   "in that step's time; the answer's tokens search as raised")
@click.option("--from-sweep", "from_sweep", type=str, default=None,
              help="a sweep's results.parquet (or folder): decode also with the index + parameters of least scanned fraction reaching --target-recall (in place of 'default')")
@click.option("--target-recall", default=0.95, show_default=True,
              help="with --from-sweep: least Q→K recall@k (mean over a layer's heads) of the pick")
@click.option("--calibrate", type=_CalibrateTarget(), is_flag=False, flag_value=CALIBRATE_AUTO, default=CALIBRATE_AUTO,
              show_default=True, metavar="[auto|TARGET]",
              help="raise each layer's index search (its grid parameter: roargraph L, IVF nprobe, HNSW ef) at build time, "
                   "where its weight recall@k on the newest prefill queries (the share of their exact top-k's softmax "
                   "weight it finds) falls short of TARGET, to the cheapest value reaching it (counted in the build); "
                   "auto: 0.95 up to 32K keys, 0.01 more per doubling above (0.97 at 128K); "
                   "0: off (the index's default search, or --param's)")
@click.option("--device", default=None, help="accelerator side: cuda when available, else cpu")
@click.option("--torch-threads", default=0, show_default=True,
              help="CPU threads of torch (the accelerator stand-in on CPU-only machines); 0 = torch's default")
@click.option("--allow-extrapolation", is_flag=True, help="allow a context beyond the model's trained length")
@click.option("--rope-scaling", type=ROPE_SCALING, default=None, help=ROPE_HELP)
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="ray: one Ray task per sample (all its modes; one GPU each when the cluster has GPUs)")
@click.option("--address", default=None, help="Ray cluster to join (HOST:PORT of its head, or 'auto'); none starts Ray here")
@click.option("--cpus-per-task", type=float, default=1.0, show_default=True, help="Ray: CPUs reserved per sample task")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="write the full results here (after each sample; \"partial\": true until the last); an existing "
                   "file only with --overwrite")
@click.option("--overwrite", is_flag=True, help="let --json replace an existing file (never the --from-sweep table, a "
                                                "link, or what is not a regular file)")
def decode(model, modes, params, build_params, topk, window, add_batch, train_queries, train_group, train_positions, copy_hints, task,
           prompt, evaluation, context, samples, give_up_after,
           seed, max_new_tokens, positions, free_tokens, chunk, build_during_prefill, build_layers, build_processes, shared_prefill, until_built, question_after_prefill, calibrate_question, from_sweep, target_recall, calibrate, device, torch_threads,
           allow_extrapolation, rope_scaling, executor, address, cpus_per_task, json_path, overwrite):
    """Generate with RetrievalAttention: static window on the accelerator + retrieved keys from a CPU index."""
    settings = Settings(window=window, topk=topk, add_batch=add_batch, chunk=chunk, train_queries=train_queries,
                        train_group=train_group, train_positions=train_positions,
                        build_during_prefill=build_during_prefill is not False, shared_prefill=shared_prefill,
                        build_layers=build_layers,
                        until_built=until_built, copy_hints=copy_hints, calibrate=calibrate,
                        question_after_prefill=question_after_prefill, calibrate_question=calibrate_question)
    checks.check_unused_by_modes(click.get_current_context(), mode_names(modes), from_sweep)
    checks.check_options(settings, evaluation, task, prompt, executor, address)
    if prompt is not None and _names_file(prompt):  # dump's --prompt reads a file: this one decodes the name
        click.echo(f"note: --prompt is the text decoded; {prompt!r} also names a file, which is not read (to decode "
                   "its text: --prompt \"$(cat FILE)\")", err=True)
    checks.check_unused(click.get_current_context(), evaluation, prompt, from_sweep)
    if shared_prefill and build_during_prefill is not False:
        raise DecodeError("--shared-prefill puts every mode on one prefill with the builds after it: add "
                          "--build-after-prefill, given explicitly (builds during a prefill give each index mode its "
                          "own, so that its TTFT counts its own builds' contention)")
    checks.check_counts(max_new_tokens=max_new_tokens, seed=seed, torch_threads=torch_threads, samples=samples,
                        give_up_after=give_up_after)
    if json_path is not None and not json_path.strip():  # `--json "$OUT"` with OUT unset ran, then wrote nothing
        raise DecodeError("--json '': give a file path for the results")
    if from_sweep is not None and not from_sweep.strip():  # `--from-sweep "$SWEEP"` unset ran without any pick
        raise DecodeError("--from-sweep '': give the folder of an `anns-lab sweep`")
    from anns_lab.decode import runner  # torch and transformers: after the checks that need neither

    mode_list = _parse_mode_list(modes, params, build_params, from_sweep)
    if not from_sweep:  # the pick's index is known once the model has loaded
        checks.check_unread_by_indexes(click.get_current_context(), mode_list)
    checks.check_calibrate(calibrate)
    if json_path:  # last of the checks: it makes the folder
        _check_replaceable(Path(json_path), overwrite, from_sweep)
        _check_writable(Path(json_path))
    elif overwrite:
        raise DecodeError("--overwrite lets --json replace an existing file: give --json, or leave it out")
    if from_sweep:  # what the pick needs of the table, before the weights load
        from anns_lab.decode.modes import check_sweep_pick

        check_sweep_pick(from_sweep, target_recall, settings.topk, tuple(settings.window))
    kept: dict = {}  # samples the --json file holds: what an interrupted run says it kept
    with _held_json(json_path, overwrite, from_sweep, kept):
        device = device or default_device()
        lm = _load(model, device, torch_threads, rope_scaling)
        recorded = {"torch_threads": _torch_threads(torch_threads, executor),
                    "cpus_per_task": cpus_per_task if executor == "ray" else None}
        pick = None
        if from_sweep:
            # the keys the indexes will hold: a task's or fidelity's context outside the window (a --prompt's: unknown yet)
            held = None if prompt is not None else max(0, context - settings.window.sink - settings.window.recent)
            mode_list, lines = _with_sweep_pick(mode_list, from_sweep, lm, target_recall, settings, held)
            checks.check_unread_by_indexes(click.get_current_context(), mode_list)
            pick = {"path": str(from_sweep), "target_recall": target_recall, "pick": lines}
        checks.check_train_positions(lm, mode_list, settings)
        if not lm.long_range_layers and any(m.kind != "full" for m in mode_list):
            raise DecodeError(f"{lm.name} has no full-attention layer (each attends within a sliding window of "
                              f"{getattr(lm.config, 'sliding_window', None)} tokens): retrieval attention has no "
                              "layer to serve; only --mode full runs on it")

        def progress(line: str) -> None:
            click.echo(line, err=True)

        remote = None

        def partial(res: dict) -> None:  # after each sample: a run stopped midway keeps what it finished
            describe = _run_description(lm, remote.device if remote else device, executor, settings, mode_list,
                                        recorded, pick)
            _write_json(Path(json_path), res | describe | {"partial": res["samples_done"] < res["samples_total"]},
                        kept)
            kept.update(done=res["samples_done"], total=res["samples_total"])

        on_sample = partial if json_path else None
        if evaluation == "fidelity":
            mode_list = _with_full(mode_list)
            # one prefill for every mode, the indexes built after it: the result must not record builds during it
            settings = dataclasses.replace(settings, build_during_prefill=False,
                                           build_processes=builds_in_processes(build_processes, device))
            result = runner.run_fidelity(lm, mode_list, settings, context, positions, free_tokens,
                                         allow_extrapolation, progress)
        else:
            if executor == "ray":
                from anns_lab.decode.ray_samples import RaySamples
                from anns_lab.eval.executors import machine_cpus

                remote = RaySamples(address, model, cpus_per_task, machine_cpus(), log=progress,
                                    rope_scaling=rope_scaling, torch_threads=torch_threads)
            # where the samples run: a Ray cluster's tasks take its GPU, whatever this driver has
            settings = dataclasses.replace(settings, build_during_prefill=builds_during_prefill(
                build_during_prefill, until_built, remote.device if remote else device),
                build_processes=builds_in_processes(build_processes, remote.device if remote else device))
            try:
                if prompt is not None:
                    result = runner.run_prompt(lm, mode_list, settings, prompt, max_new_tokens, allow_extrapolation,
                                               progress, remote, on_sample)
                else:
                    result = runner.run_task(lm, mode_list, settings, task, context, samples, seed, max_new_tokens,
                                             allow_extrapolation, progress, remote, on_sample,
                                             give_up_after=give_up_after)
            finally:
                if remote is not None:
                    remote.close()
        result |= _run_description(lm, remote.device if remote else device, executor, settings, mode_list, recorded,
                                   pick)
        if json_path:  # before the table: a failed print (a closed pipe, a full disk) loses no result
            done = {"partial": False, "samples_done": kept["total"], "samples_total": kept["total"]} if kept else {}
            try:
                _write_json(Path(json_path), result | done, kept)  # the keys its after-sample writes had
            except DecodeError:
                _print_table(result, settings, None)  # the run's figures, where the file could not take them
                raise
        _print_table(result, settings, json_path)
        if failed := {name: m["summary"]["failed_samples"] for name, m in result["modes"].items()
                      if m["summary"].get("failed_samples")}:  # the others' results stand; the run did not all succeed
            left_out = {name: m["summary"].get("skipped_samples") for name, m in result["modes"].items()}
            click.echo("FAILED: " + ", ".join(f"{name} on {n} sample(s)"
                                              + (f" ({left_out[name]} of them left out)" if left_out[name] else "")
                                              for name, n in failed.items())
                       + " (the errors are in the notes above)", err=True)
            raise SystemExit(1)


@contextlib.contextmanager
def _held_json(json_path: str | None, overwrite: bool, from_sweep: str | None, kept: dict):
    """The run's ``--json`` file held by this process alone (:func:`io.hold_file`; its checks made again once held:
    another decode may have written it since), and what it keeps said on an interrupt."""
    with contextlib.ExitStack() as held:
        if json_path:
            held.enter_context(hold_file(Path(json_path)))
            _check_replaceable(Path(json_path), overwrite, from_sweep)
        with _a_stop_says_what_was_kept(json_path, kept):
            yield


@contextlib.contextmanager
def _a_stop_says_what_was_kept(json_path: str | None, kept: dict):
    """Ctrl-C or SIGTERM ends the run with status 130 and a line saying what the ``--json`` file keeps ("Aborted!"
    alone hid a partial result): the samples finished before it (marked partial), or nothing; a Ray head lost says
    the same in its error."""
    try:
        yield
    except KeyboardInterrupt:
        click.echo(_kept_words("interrupted", json_path, kept), err=True)
        raise SystemExit(130) from None
    except ExecutorLost as err:  # likewise, when the Ray cluster's head is gone
        raise ExecutorLost(_kept_words(str(err), json_path, kept)) from None


def _kept_words(why: str, json_path: str | None, kept: dict) -> str:
    """``why`` the run stopped, and what its ``--json`` file keeps."""
    if not json_path:
        return f"{why}: nothing was written (--json keeps each finished sample as it ends)"
    if not kept:
        return f"{why} before the first sample finished: nothing of this run was written to {json_path}"
    if kept["done"] == kept["total"]:
        return f"{why}: all {kept['total']} samples finished and kept in {json_path}"
    return (f"{why}: {kept['done']} of {kept['total']} samples finished and kept in {json_path} (\"partial\": true); "
            "run again with --overwrite to redo them all")


def _names_file(text: str) -> bool:
    """Whether ``text`` (one line) is the name of an existing file."""
    try:
        return "\n" not in text and len(text) < 4096 and Path(text).expanduser().is_file()
    except (OSError, ValueError):  # a name too long for the system, a NUL in it
        return False


def _check_replaceable(path: Path, overwrite: bool, from_sweep: str | None) -> None:
    """Refuse a ``--json`` path whose first write (an atomic rename over it) would destroy something: the
    ``--from-sweep`` table or its settings (the pick's input), a link or anything but a regular file (as root a run
    replaced /dev/null with a file), or, without ``--overwrite``, an existing file (a stopped rerun replaced a complete
    result with a partial one)."""
    if from_sweep:
        from anns_lab.eval.table import RESULTS, SETTINGS, sweep_folder

        sweep = Path(from_sweep)
        folder = sweep_folder(sweep)
        for read in (folder / RESULTS if sweep.is_dir() else sweep, folder / SETTINGS):
            if path.exists() and read.exists() and os.path.samefile(path, read):
                raise DecodeError(f"--json {path} is {read}, which --from-sweep reads: choose another --json")
    if path.is_symlink():
        raise DecodeError(f"--json {path} is a symbolic link: the result would replace the link, not write where it "
                          "points; choose another --json")
    if path.exists() and not path.is_file():
        raise DecodeError(f"--json {path} exists and is not a regular file (a device, a fifo, ...): the result would "
                          "replace it; choose another --json")
    if path.exists() and not overwrite:
        raise DecodeError(f"--json {path} exists: pass --overwrite to replace it, or choose another --json")
    if path.exists() and not _is_decode_result(path):
        raise DecodeError(f"--json {path} exists and is not an earlier decode result (a dump's manifest, a sweep's "
                          "table, ...?): --overwrite replaces only those; choose another --json")


RESULT_KEYS = ("model", "executor", "settings")  # what every result _write_json writes holds, partial ones too


def _is_decode_result(path: Path) -> bool:
    """Whether ``path`` holds what ``decode --json`` writes: --overwrite once replaced a dump's manifest.json."""
    try:
        with open(path, "rb") as f:
            data = loads_json(f.read(64 << 20))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(key in data for key in RESULT_KEYS)


def _check_writable(path: Path) -> None:
    """Refuse a ``--json`` path that cannot be written before the first sample runs: its first write comes after that
    sample, which an error there would lose. Makes no folder (a refused or failed run leaves nothing behind):
    the nearest existing folder on the way must let one be made, or the file be written."""
    folder = (missing_folders(path.parent) or [path])[-1].parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(20, "not a folder", str(folder))
        if folder != path.parent:
            if not os.access(folder, os.W_OK | os.X_OK):
                raise PermissionError(13, "no permission to make a folder in it", str(folder))
            return
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{path.name}.", suffix=".check"):
            pass
    except OSError as err:
        raise DecodeError(f"--json {path}: cannot write there ({type(err).__name__} at {folder}: "
                          f"{err.strerror or err})") from None


def _parse_mode_list(modes: str, params: tuple[str, ...], build_params: tuple[str, ...],
                     from_sweep: str | None) -> list[Mode]:
    """The modes of ``--mode`` with their parameters; with ``--from-sweep`` the sweep's pick replaces 'default'."""
    from anns_lab.decode import modes as modes_mod

    if from_sweep:  # modes named explicitly stay
        modes = ",".join(t for t in mode_names(modes) if t != "default") or "full"
    return modes_mod.parse_modes(modes, parse_params(params), parse_params(build_params, "--build-param"))


def _load(model: str, device: str, torch_threads: int, rope_scaling=None):
    """The model on ``device`` (its RoPE scaled when asked), torch limited to ``torch_threads`` CPU threads when > 0."""
    from anns_lab.dumps.models import load_model
    from anns_lab.indexes.threads import numpy_blas_one_thread, set_torch_threads

    if torch_threads > 0:
        set_torch_threads(torch_threads)
    numpy_blas_one_thread()
    return load_model(model, device=device, rope_scaling=rope_scaling)


def _with_full(mode_list: list[Mode]) -> list[Mode]:
    """``mode_list`` with ``full`` first when it is missing (the reference of fidelity and of a sweep's pick)."""
    from anns_lab.decode.engine import Mode

    return mode_list if any(m.name == "full" for m in mode_list) else [Mode("full"), *mode_list]


def _with_sweep_pick(mode_list: list[Mode], from_sweep: str, lm, target_recall: float,
                     settings: Settings, n_keys: int | None = None) -> tuple[list[Mode], list[str]]:
    """Add the sweep's pick for ``lm`` (and ``full``), printing what was picked and why (the lines, also returned)."""
    from anns_lab.decode import modes as modes_mod

    picked, lines = modes_mod.pick_from_sweep(from_sweep, lm.name, target_recall, lm.long_range_layers,
                                              settings.train_group, settings.train_positions, settings.topk,
                                              tuple(settings.window), n_keys)
    lines += checks.check_swept_model(from_sweep, lm)
    for line in lines:  # its notes on stderr, beside the run's progress
        click.echo(line, err=line.startswith(modes_mod.NOTE))
    return _with_full(mode_list + [picked]), lines


def _torch_threads(asked: int, executor: str) -> int | None:
    """torch's CPU threads where the samples run, as the JSON records them: ``--torch-threads``, else torch's default
    here (a local run), else None (a Ray task's default, unknown here)."""
    import torch

    return asked if asked > 0 else (torch.get_num_threads() if executor == "local" else None)


def _run_description(lm, device: str, executor: str, settings: Settings, mode_list: list[Mode], threads: dict,
                     pick: dict | None = None) -> dict:
    """What the result records about the run besides its numbers: model (and its trained context), device, settings
    (with ``threads``: torch's threads and a Ray task's CPUs, which change the timings too), each mode's plan, and
    with ``--from-sweep`` what was picked and why (``pick``: the lines printed)."""
    return ({"from_sweep": pick} if pick else {}) | {"model": lm.name, "model_context": lm.context,
            "rope_scaling": str(lm.rope_scaling) if lm.rope_scaling else None, "device": device, "executor": executor,
            "settings": {"sink": settings.window.sink, "recent": settings.window.recent, "topk": settings.topk,
                         "add_batch": settings.add_batch, "chunk": settings.chunk, "train_queries": settings.train_queries,
                         "train_group": settings.train_group, "train_positions": settings.train_positions,
                         "build_during_prefill": settings.build_during_prefill,
                         "shared_prefill": settings.shared_prefill, "build_layers": settings.build_layers,
                         "build_processes": settings.build_processes,
                         "until_built": settings.until_built,
                         "copy_hints": settings.copy_hints, "calibrate": settings.calibrate or None,
                         "question_after_prefill": settings.question_after_prefill,
                         "calibrate_question": settings.calibrate_question} | threads,
            "plans": {m.name: ({"default": m.plan.describe(), **{str(k): p.describe() for k, p in m.per_layer.items()}}
                               if m.plan else None) for m in mode_list}}


def _print_table(result: dict, settings: Settings, json_path: str | None) -> None:
    """:func:`_print_result` to a standard output that may be closed or failing (a pipe whose reader ended, a full
    disk): one error saying where the result is, not a traceback or a silent exit 1."""
    try:
        _print_result(result, settings)
        if sys.stdout is not None:  # None where the process started with it closed
            sys.stdout.flush()
    except OSError as err:
        where = f"the result is in {json_path}" if json_path else "nothing was written (--json keeps the result)"
        raise DecodeError(f"cannot print the result table ({type(err).__name__}: {err.strerror or err}); {where}") \
            from None


def _print_result(result: dict, settings: Settings) -> None:
    """The headline, the per-mode table, each mode's notes and, for a free prompt, each mode's answer."""
    from anns_lab.decode import runner

    w = settings.window
    click.echo(f"{result['model']}  {result['task']}  context {result['context']}  device {result['device']}  "
               f"window {w.sink}+{w.recent}  top-k {settings.topk}")
    if settings.question_after_prefill:
        click.echo("the question fed after the prefill and the builds, as decode steps (in each mode's per-token figures)")
    if result.get("extrapolated"):
        click.echo(result["extrapolated"])
    click.echo(runner.table(result))
    for name, m in result["modes"].items():
        for note in m.get("notes", []):
            click.echo(f"note ({name}): {note}")
    if result["task"] == "prompt":  # the result says what it is: a fidelity result has no answers to print
        for name, m in result["modes"].items():
            for row in m["samples"]:
                click.echo(f"[{name}] " + (row["answer"] if "answer" in row else f"(failed: {row['error']})"))


def _write_json(path: Path, result: dict, kept: dict | None = None) -> None:
    """The full result as JSON, written atomically (numpy scalars as floats); refused where it holds a NaN or an
    infinity (bare ``NaN`` is no JSON, and no figure either). A write that fails (a full disk, the folder's permissions
    changed) is one error saying what the file still keeps (``kept``: its last write's samples)."""
    try:
        text = json.dumps(result, indent=1, default=float, allow_nan=False)
    except ValueError:
        raise DecodeError(f"--json {path}: not written: the result holds a NaN or an infinity at "
                          f"{_non_finite(result)}, a failed measurement") from None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, text.encode("utf-8"))
    except OSError as err:
        holds = ("nothing of this run" if not kept else f"all {kept['total']} samples" if kept["done"] == kept["total"]
                 else f"the {kept['done']} of {kept['total']} samples of its last write (\"partial\": true; run again "
                      "with --overwrite to redo them all)")
        raise DecodeError(f"--json {path}: cannot write it ({type(err).__name__}: {err.strerror or err}); it holds "
                          f"{holds}") from None
    click.echo(f"wrote {path}", err=True)


def _non_finite(value, where: str = "") -> str | None:
    """The path (``modes.flat.summary.kl_mean``) of the first NaN or infinity in ``value``, else None."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return where or "the top" if isinstance(value, numbers.Real) and not math.isfinite(value) else None
    return next((found for k, v in items if (found := _non_finite(v, f"{where}.{k}" if where else str(k)))), None)
