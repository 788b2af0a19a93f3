"""A decode run: tasks (accuracy), a free prompt, or fidelity against ``full``; results as a table and JSON.

The summary per mode has the shape of the paper's Tables 4–5: accuracy, prefill and index
build time, and per generated token the time in retrieval, CPU attention, accelerator
attention, merge and everything else, and tokens/s.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from anns_lab import stops as stop_requests  # `stops` here are the stop tokens' ids
from anns_lab.errors import DecodeError, IndexFailed, IndexResultError, error_text
from anns_lab.decode import stats
from anns_lab.decode.builds import start_build_processes, warm_up
from anns_lab.decode.modes import ranges
from anns_lab.decode.options import GIVE_UP_AFTER
from anns_lab.decode.engine import (Mode, ModeRun, Settings, check_window, exact_seconds, first_step_seconds,
                                    kept_queries, prefill, run_mode, summarize, warmup_steps)
from anns_lab.dumps import rope, tasks
from anns_lab.dumps.models import extrapolation_note

MODE_FAILURES = (IndexFailed, IndexResultError)  # an index mode's own: it fails on the sample, the others go on

# Enough for the answer with the preamble models write first: Gemma-3 once spent 14 tokens on
# "magic_number = 114874" and lost the needle's last digit.
MAX_NEW = {"passkey": 8, "number_string": 14, "kv_retrieval": 40, "niah": 24, "niah_multikey": 24,
           "niah_multivalue": 56, "prompt": 32}


def check_context(lm, n_tokens: int, allow_extrapolation: bool, option: str = "--context") -> str | None:
    """Refuse ``n_tokens`` (prompt + generated) beyond the model's context unless allowed (``option``: the one that set
    the prompt's length, named in the error); when allowed, the sentence the results carry (``extrapolated``), else
    None."""
    if lm.context and n_tokens > lm.context and not allow_extrapolation:
        raise DecodeError(f"{n_tokens} tokens (prompt + generated) exceed {lm.name}'s context of {lm.context} tokens; "
                          f"use a shorter {option}, or pass --allow-extrapolation to go beyond it")
    return extrapolation_note(lm.name, n_tokens, lm.context, str(lm.rope_scaling) if lm.rope_scaling else None)


def stop_ids(lm) -> set[int]:
    eos = lm.tokenizer.eos_token_id
    cfg_eos = getattr(lm.model.generation_config, "eos_token_id", None) if hasattr(lm.model, "generation_config") else None
    out = set()
    for e in (eos, cfg_eos):
        if isinstance(e, int):
            out.add(e)
        elif e:
            out.update(int(x) for x in e)
    return out


def _pool(runs: list[ModeRun]) -> dict:
    """Per-token timings over several runs of one mode (all their steps together, less each run's warm-up step: every
    run searches indexes of its own, first in its first step, which is timed apart as ``first_step_s``); prefill and
    first-step latency averaged."""
    skips = [warmup_steps(r) for r in runs]
    merged = ModeRun(runs[0].mode, [], [], sum(r.build_s for r in runs) / len(runs), sum(r.decode_s for r in runs),
                     [s for r, k in zip(runs, skips) for s in r.steps[k:]],
                     [s for r, k in zip(runs, skips) for s in r.step_s[k:]],
                     device_kv_bytes=max(r.device_kv_bytes for r in runs),
                     build_hidden_s=sum(r.build_hidden_s for r in runs) / len(runs),
                     cpu_bytes=sum(r.cpu_bytes for r in runs), cpu_keys=sum(r.cpu_keys for r in runs))
    firsts = [first_step_seconds(r) for r in runs if r.step_s]
    pooled = summarize(merged, skip=0)
    if pooled["steps"]:
        pooled["warmup_steps_excluded"] = sum(skips)
    exact = {}
    if all(r.exact_steps is not None for r in runs):  # --until-built exact: per run, as the first step
        exact = {"exact_steps": float(np.mean([r.exact_steps for r in runs])),
                 "exact_s": float(np.mean([exact_seconds(r) for r in runs]))}
    return pooled | exact | {"first_step_s": float(np.mean(firsts)) if firsts else None,
                             "prefill_s": float(np.mean([r.prefill_s for r in runs]))}


def time_to_first_token(modes: dict) -> None:
    """Add ``ttft_s`` to each mode's summary: prefill + what the first decode step waited for + that step (with the
    set-up before it: :func:`engine.first_step_seconds`), and
    ``ttft_x_full``, the ratio to ``full``'s when it ran. The prompt's last logits give one token before the
    build; the first step is the first that needs the index, so this is what the build delays: it waits for the index
    build not hidden behind the prefill (``build_s`` − ``build_hidden_s``), or with ``--until-built exact`` for nothing
    (the layers still building are attended whole; the index serves later, ``exact_steps``)."""
    for m in modes.values():
        s = m["summary"]
        if s.get("prefill_s") is not None and s.get("first_step_s") is not None:
            waited = 0.0 if s.get("exact_steps") is not None else \
                (s.get("build_s") or 0.0) - (s.get("build_hidden_s") or 0.0)
            s["ttft_s"] = s["prefill_s"] + waited + s["first_step_s"]
    full = modes.get("full", {}).get("summary", {}).get("ttft_s")
    for m in modes.values():
        if full and m["summary"].get("ttft_s") is not None:
            m["summary"]["ttft_x_full"] = m["summary"]["ttft_s"] / full


def depths(samples: int) -> list[float]:
    """Needle depths spread evenly over the context (0.05..0.95)."""
    return [0.5] if samples == 1 else np.linspace(0.05, 0.95, samples).tolist()


def run_task(lm, modes: list[Mode], settings: Settings, task: str, context: int, samples: int, seed: int,
             max_new: int | None = None, allow_extrapolation: bool = False, progress=None, executor=None,
             on_sample=None, give_up_after: int = GIVE_UP_AFTER) -> dict:
    """Every mode on ``samples`` samples of ``task``; per sample the full-attention prefills of :func:`prefill_groups`.

    ``executor`` (e.g. :class:`anns_lab.decode.ray_samples.RaySamples`) runs the samples elsewhere; the
    result is the same dict either way. ``give_up_after``: an index mode that failed on that many samples in a row is
    left out of the later ones (0: tried on every sample)."""
    if task not in tasks.TASKS:
        raise DecodeError(f"unknown task {task!r}; known: {', '.join(tasks.TASKS)}")
    if samples < 1:
        raise DecodeError("--samples must be at least 1")
    max_new = max_new or MAX_NEW[task]
    note = check_context(lm, context + max_new, allow_extrapolation,
                         "--context" if max_new <= context else "--max-new-tokens")
    # with the question held back, the indexes are built on the context before it (the first sample's: the others'
    # questions differ by a word at most)
    asked = tasks.make_sample(task, lm.tokenizer, context, seed, depths(samples)[0]).question \
        if settings.question_after_prefill else 0
    # the last new token is never fed back
    check_window(settings, context - asked, modes, asked + max_new - 1, rope.head_dim(lm.config))
    return _run_prompts(lm, modes, settings, _TaskPrompts(task, lm.tokenizer, context, seed, depths(samples)), context,
                        max_new, task, progress, executor, on_sample, note, give_up_after)


class _TaskPrompts(Sequence):
    """A task's samples as (ids, sample), each made when read (a function of its seed and depth): a local run holds one
    at a time (all of --samples 10^6 at once were more ids than memory holds)."""

    def __init__(self, task: str, tokenizer, context: int, seed: int, at: list[float]) -> None:
        self.task, self.tokenizer, self.context, self.seed, self.at = task, tokenizer, context, seed, at

    def __len__(self) -> int:
        return len(self.at)

    def __getitem__(self, i: int) -> tuple[list[int], tasks.TaskSample]:
        if not 0 <= i < len(self.at):
            raise IndexError(i)
        s = tasks.make_sample(self.task, self.tokenizer, self.context, self.seed + i, self.at[i])
        return s.ids, s


def run_prompt(lm, modes: list[Mode], settings: Settings, text: str, max_new: int | None = None,
               allow_extrapolation: bool = False, progress=None, executor=None, on_sample=None) -> dict:
    ids = tasks.special_prefix(lm.tokenizer) + tasks.encode(lm.tokenizer, text)
    max_new = max_new or MAX_NEW["prompt"]
    note = check_context(lm, len(ids) + max_new, allow_extrapolation, "--prompt" if max_new <= len(ids) else "--max-new-tokens")
    check_window(settings, len(ids), modes, max_new - 1, rope.head_dim(lm.config), "--prompt")
    return _run_prompts(lm, modes, settings, [(ids, None)], len(ids), max_new, "prompt", progress, executor, on_sample,
                        note)


def check_memory(lm, modes: list[Mode], settings: Settings, n_tokens: int, option: str = "--context") -> None:
    """Refuse, before the prefill, a run whose estimated peak memory exceeds what is available
    (:func:`memory.check_prefill`: KV cache, a chunk's activations, the kept queries (:func:`engine.kept_queries`),
    one mode's CPU store and indexes (modes run one after the other), the training queries moved for the layers
    building at once (``--build-layers``), the build worker processes (``--build-processes``), and a copy of the
    cache: ``full``'s, or with ``--until-built exact`` an index mode's, whose long-range layers stay whole while their
    indexes build).
    ``option``: the one that set the prompt's length, named in the error."""
    from anns_lab.decode.builds import indexes_per_layer, layers_at_once, worker_indexes
    from anns_lab.dumps.memory import check_prefill
    from anns_lab.indexes.threads import thread_budget

    n_long = len(lm.long_range_layers)
    indexed = n_long * min(1, sum(m.kind == "index" for m in modes))
    aware = any(m.uses_queries() for m in modes)  # training on the queries: each layer in flight moves them
    check_prefill(lm.config, n_tokens, settings.chunk, f"decoding {n_tokens} tokens of {lm.name}", option,
                  query_layers=n_long if any(m.uses_queries(settings) for m in modes) else 0,
                  query_tokens=kept_queries(modes, settings),
                  index_layers=indexed,
                  building_layers=min(layers_at_once(settings.build_layers, indexes=min(
                      indexes_per_layer(lm, m, settings) for m in modes if m.uses_queries())), n_long) if aware else 0,
                  cache_copy=any(m.kind == "full" for m in modes) or (indexed > 0 and settings.until_built == "exact"),
                  build_workers=thread_budget() if settings.build_processes and worker_indexes(modes) else 0)


def prefill_groups(modes: list[Mode], settings: Settings) -> list[list[Mode]]:
    """The modes that share a prefill, in run order. ``full`` and ``window`` decode from a prefill that keeps nothing
    for an index whenever an index mode runs beside them: keeping the long-range layers' queries costs the prefill time
    that ``full``'s time to first token must not carry (SmolLM2 at 8K on an H200: 0.65 s against 0.26 s; with one
    prefill for all, ``full``'s TTFT carried it and the index's ratio to it read 1.17x where against full alone it was
    ~2.6x). With builds during the prefill each index mode gets a prefill of its own, so that its time to first token
    counts its own builds' contention with the prefill and no other mode's; after it the index modes share one. The
    prefills compute the same cache: the modes decode from the same prompt state either way.
    ``settings.shared_prefill`` (with builds after the prefill only) puts every mode on one: the cheaper run at 128K on
    a CPU, where a prefill takes tens of minutes, and ``full``'s TTFT then carries the queries kept (SmolLM2 8K on a
    2-core CPU: +2% and +13% in two rounds)."""
    index = [m for m in modes if m.kind == "index"]
    rest = [m for m in modes if m.kind != "index"]
    if not index or (not settings.build_during_prefill
                     and (settings.shared_prefill or not any(m.uses_queries(settings) for m in index))):
        return [list(modes)]
    indexed = [[m] for m in index] if settings.build_during_prefill else [index]
    return ([rest] if rest else []) + indexed


def warm_kernels(lm, modes: list[Mode], settings: Settings, say) -> None:
    """:func:`builds.warm_up` before a first prefill, said when it takes a while (a fresh install compiles)."""
    if (warmed := warm_up(lm, modes, settings)) > 1.0:
        say(f"  index kernels compiled or loaded in {warmed:.1f} s, before anything is timed")


def run_sample(lm, modes: list[Mode], settings: Settings, ids: list[int], max_new: int, stops: set[int],
               say=None, question: int = 0) -> dict:
    """One prompt: every mode, each group of :func:`prefill_groups` after its own full-attention prefill; the
    unit a Ray task runs. Returns ``{"runs": {mode name: ModeRun}}`` in the order of ``modes``.

    ``say`` (a callable taking a line) hears what is happening before each long step and how long it took.
    ``question``: the prompt's last ids that ask (a task's); with ``settings.question_after_prefill`` the prefill and
    the builds take the rest alone, and each mode feeds them as decode steps before it answers (a cached context
    asked a question later: no index, no selection made from the prompt, has seen it).
    """
    bar = say is not None
    say = say or (lambda line: None)
    forced: list[int] = []
    if settings.question_after_prefill and question:
        ids, forced = ids[:-question], ids[-question:]
        if len(ids) <= settings.window.size:
            raise DecodeError(f"the context before the question holds {len(ids)} tokens, not more than the window's "
                              f"{settings.window.size}: nothing would be retrieved; use a longer --context")
        settings = dataclasses.replace(settings, steps=settings.steps + len(forced))  # the stores' room for them
    started = start_build_processes(modes, settings)
    if started is not None and started[1] > 0.5:  # the first sample's: later ones find them running
        say(f"  index builds: {started[0].workers} worker processes started in {started[1]:.1f} s")
    warm_kernels(lm, modes, settings, say)
    runs = {}
    for group in prefill_groups(modes, settings):
        names = ", ".join(m.name for m in group)
        say(f"  prefill for {names}: {len(ids)} tokens through {lm.name} (full attention, chunks of {settings.chunk}) ...")
        try:
            pre = prefill(lm, ids, settings, any(m.uses_queries(settings) for m in group), group, progress=bar,
                          newest_queries=kept_queries(group, settings))
            say(f"  prefill for {names}: done in {pre.seconds:.1f} s")
            if pre.early is not None and settings.until_built == "wait":  # no mode decodes while builds still share the CPU
                say("  index builds: started during the prefill's last chunk; finishing ...")
                pre.early.wait(progress=bar)
        except MODE_FAILURES as err:  # with builds during it, an index mode's prefill is its own: its builds' error too
            if not (settings.build_during_prefill and len(group) == 1 and group[0].kind == "index"):
                raise
            runs[group[0].name] = failed_run(group[0], err, say)
            pre = None  # its cache must not be held beside the next group's (a build fails after the prefill too)
            continue
        for mode in group:
            building = mode.kind == "index"
            doing = ("" if not building else "building one index per layer and head from the prefill, then "
                     if settings.until_built == "wait" else "each layer whole until its indexes are built, ")
            say(f"  {mode.name}: {doing}decoding up to {max_new} tokens ...")
            try:
                run = run_mode(lm, pre, mode, settings, max_new, stops, forced=forced)
            except MODE_FAILURES as err:  # an index's build or search broke: this mode's, the others' results stand
                if not building:
                    raise
                runs[mode.name] = failed_run(mode, err, say)
                continue
            say(f"  {mode.name}: " + (f"indexes built in {run.build_s:.1f} s ({run.build_hidden_s:.1f} s during the prefill), "
                                      if building else "")
                + f"{len(run.tokens)} tokens decoded in {run.decode_s:.1f} s"
                + (f", the first {run.exact_steps} with a layer still whole" if run.exact_steps is not None else ""))
            run.stores = None  # free the CPU copies and indexes
            runs[mode.name] = run
        del pre  # the next group's prefill must not hold this one's cache beside its own
    return {"runs": {m.name: runs[m.name] for m in modes}}


def failed_run(mode: Mode, err: Exception, say) -> ModeRun:
    """The record of ``mode`` failing on a prompt (its indexes' build or search raised ``err``), said as it happens: the
    other modes of the run go on, and the results name the failure (``error`` and ``traceback`` on its sample,
    ``failed_samples``)."""
    say(f"  {mode.name}: failed: {err}")
    return ModeRun(mode.name, [], [], 0.0, 0.0, [], [], error=str(err), trace=error_text(err).trace)


def _run_prompts(lm, modes, settings, prompts, n_prompt: int, max_new, task, progress, executor=None, on_sample=None,
                 extrapolated: str | None = None, give_up_after: int = GIVE_UP_AFTER) -> dict:
    """Every prompt (here, or through ``executor.map_samples``), scored and merged into one result. ``n_prompt``: the
    length of every prompt (a task's are made so), known before any is made: the memory estimate comes first (a task's
    prompts of 10^9 tokens, all made before it, took 20 GB before this refused them).

    ``on_sample(result)``: called after each prompt with the result of the prompts so far, so that a long run
    stopped midway keeps what it finished. ``extrapolated``: :func:`check_context`'s sentence, kept in the result.
    ``give_up_after``: as :func:`run_task`'s; a mode left out has each later sample recorded as failed, ``skipped``
    (the prompts already handed to the executor still run it).
    """
    settings = dataclasses.replace(settings, steps=max_new)  # the CPU stores' room for the tokens to come
    check_memory(lm, modes, settings, n_prompt + max_new, "--max-new-tokens" if max_new > n_prompt else
                 "--prompt" if task == "prompt" else "--context")
    stops = stop_ids(lm)
    per_mode = {m.name: {"runs": [], "samples": []} for m in modes}
    give_up = GiveUp(give_up_after)

    def live() -> list[Mode]:  # the modes the next sample runs
        return give_up.live(modes)

    def run_live(ids: list[int], question: int) -> dict:  # no prefill for a sample every mode is left out of
        return run_sample(lm, now, settings, ids, max_new, stops, progress, question=question) if (now := live()) else {"runs": {}}

    def asked(sample) -> int:
        return sample.question if sample is not None else 0

    if executor is None:  # each prompt made as its turn comes, run, and dropped
        done = ((p, run_live(p[0], asked(p[1]))) for p in prompts)
    else:  # likewise, made as the executor takes them (at most its window ahead), each once
        taken = collections.deque()

        def ids_of():
            for ids, sample in prompts:
                taken.append(sample)
                yield ids, asked(sample)

        results = executor.map_samples(live, settings, ids_of(), max_new, stops)
        done = (((None, taken.popleft()), res) for res in results)
    for i, ((_, sample), res) in enumerate(done):
        for mode in modes:
            run = res["runs"].get(mode.name)
            if run is None or run.error is not None:  # no answer, no score: the accuracy is over the samples it finished
                left_out = run is None
                error = (f"left out after failing on {give_up_after} samples in a row (--give-up-after)"
                         if left_out else run.error)
                row = {"sample": i, "error": error} | ({"skipped": True} if left_out else {}) \
                    | ({"traceback": run.trace} if run is not None and run.trace else {})
                if sample is not None:
                    row |= {"expected": list(sample.answers), "depth": sample.depth, "seed": sample.params["seed"]}
                per_mode[mode.name]["samples"].append(row)
                if not left_out:  # a note for each failure; the samples left out have one note for all
                    per_mode[mode.name].setdefault("notes_by_sample", []).append([f"failed: {error}"])
                if not left_out and give_up.failed(mode.name) and i + 1 < len(prompts) and progress:
                    progress(f"{mode.name}: failed on {give_up_after} samples in a row: left out of the samples not "
                             f"yet started (--give-up-after {give_up_after})")
                if progress:
                    progress(f"sample {i + 1}/{len(prompts)} {mode.name}: " + ("left out" if left_out else "failed"))
                continue
            give_up.finished(mode.name)
            answer = lm.tokenizer.decode(run.tokens, skip_special_tokens=True)
            row = {"sample": i, "answer": answer}
            if sample is not None:
                row |= {"expected": list(sample.answers), "depth": sample.depth, "seed": sample.params["seed"],
                        "score": tasks.score(task, answer, sample.answers)}
            if run.calibration:  # the prompt's own search values (the plans in the JSON are the ones asked for)
                row["calibration"] = {str(layer): c for layer, c in run.calibration.items()}
            if run.question_calibration:  # --calibrate-question: raised again on the question's steps
                row["question_calibration"] = {str(layer): c for layer, c in run.question_calibration.items()}
            if run.build_layers:  # when each layer's builds were queued, started, ended (ModeRun.build_layers)
                row["build_layers"] = {str(layer): span for layer, span in run.build_layers.items()}
            if run.layers_at_once is not None:  # --build-layers as it resolved here (auto; the process's threads)
                row["layers_at_once"] = run.layers_at_once
            if run.exact_steps is not None:  # --until-built exact: this prompt's steps before every index served
                row["exact_steps"] = run.exact_steps
                row["hand_over_steps"] = {str(layer): step for layer, step in run.hand_over_steps.items()}
            per_mode[mode.name]["runs"].append(run)
            per_mode[mode.name]["samples"].append(row)
            per_mode[mode.name].setdefault("notes_by_sample", []).append(run.notes)
            if progress:
                progress(f"sample {i + 1}/{len(prompts)} {mode.name}: {answer!r}"
                         + (f" (expected {sample.answers[0]!r}, score {row['score']:g})" if sample else ""))
        if on_sample is not None:
            on_sample(_merged(per_mode, task, n_prompt, extrapolated)
                      | {"samples_done": i + 1, "samples_total": len(prompts)})
        stop_requests.check()  # the sample is kept: a Ctrl-C a finalizer swallowed (stops.py) stops here
    return _merged(per_mode, task, n_prompt, extrapolated)


def merged_notes(by_sample: list[list[str]]) -> list[str]:
    """A mode's notes over its samples: those every sample gave once, then each sample's own, labelled (a calibration
    is the prompt's: its per-layer values differ between samples)."""
    common = [n for n in by_sample[0] if all(n in notes for notes in by_sample)] if by_sample else []
    own = [f"sample {i + 1}: {n}" for i, notes in enumerate(by_sample) for n in notes if n not in common]
    return common + own


class GiveUp:
    """Which modes the next sample runs (``decode --give-up-after``): a mode leaves once its last ``after`` finished
    samples all failed (0: never), and comes back if one of the samples already running when it left finishes (on Ray,
    those still run it): it is left out while its latest samples say it fails."""

    def __init__(self, after: int) -> None:
        self.after, self.streak, self.out = after, collections.Counter(), set()

    def live(self, modes: list[Mode]) -> list[Mode]:
        return [m for m in modes if m.name not in self.out]

    def failed(self, name: str) -> bool:
        """Count a failure of ``name``; True when this one leaves it out."""
        self.streak[name] += 1
        leaves = bool(self.after) and self.streak[name] >= self.after and name not in self.out
        if leaves:
            self.out.add(name)
        return leaves

    def finished(self, name: str) -> None:
        self.streak[name] = 0
        self.out.discard(name)


def _merged(per_mode: dict, task: str, context: int, extrapolated: str | None = None) -> dict:
    """The result of the samples run so far: per mode, pooled timings, accuracy and the samples themselves."""
    out = {"task": task, "context": context, "extrapolated": extrapolated, "modes": {}}
    for name, d in per_mode.items():
        summary = _pool(d["runs"]) if d["runs"] else {}
        if failed := sum("error" in r for r in d["samples"]):
            summary["failed_samples"] = failed
        notes = merged_notes(d.get("notes_by_sample", []))
        if skipped := [r["sample"] for r in d["samples"] if r.get("skipped")]:
            summary["skipped_samples"] = len(skipped)
            notes.append(f"left out of {len(skipped)} sample(s) ({ranges([i + 1 for i in skipped])}) after failing on "
                         "--give-up-after samples in a row (0 tries every sample)")
        full = per_mode["full"]["samples"] if "full" in per_mode else None
        # the samples this mode finished (and full, which never fails alone, with it: the paired difference)
        done = [(r, f) for r, f in zip(d["samples"], full or d["samples"]) if "score" in r and "score" in f]
        if task != "prompt" and done:
            summary |= _accuracy([r["score"] for r, _ in done], [f["score"] for _, f in done] if full else None)
        out["modes"][name] = {"summary": summary, "samples": list(d["samples"]), "notes": notes}
    time_to_first_token(out["modes"])
    return out


def _accuracy(scores: list[float], full: list[float] | None) -> dict:
    """Accuracy (%) with its 95% Wilson interval; the paired difference to ``full`` with Newcombe's interval."""
    lo, hi = stats.wilson(sum(scores), len(scores))
    out = {"accuracy": 100.0 * float(np.mean(scores)), "accuracy_ci95": [100.0 * lo, 100.0 * hi]}
    if full is not None:
        d, dlo, dhi = stats.paired_difference(scores, full)
        out |= {"diff_vs_full": 100.0 * d, "diff_vs_full_ci95": [100.0 * dlo, 100.0 * dhi]}
    return out


def run_fidelity(lm, modes: list[Mode], settings: Settings, context: int, positions: int = 256,
                 free_tokens: int = 64, allow_extrapolation: bool = False, progress=None) -> dict:
    """Teacher-forced KL / top-1 agreement against ``full`` on real text, and free-running agreement length; one prefill
    for every mode, each index mode's indexes built after it."""
    from anns_lab.dumps.prompts import build_prompt

    if positions < 1 or free_tokens < 1:
        raise DecodeError("--positions and --free-tokens must be at least 1")
    steps = max(positions, free_tokens)
    longest = "--context" if steps <= context else "--positions" if positions >= free_tokens else "--free-tokens"
    note = check_context(lm, context + steps, allow_extrapolation, longest)
    # every teacher token is fed
    check_window(settings, context, modes, max(positions, free_tokens - 1), rope.head_dim(lm.config))
    check_memory(lm, modes, settings, context + steps, longest)
    settings = dataclasses.replace(settings, steps=steps, until_built="wait")  # every position measures the index
    ids = build_prompt("text", lm.tokenizer, context + positions).ids
    say = progress or (lambda line: None)
    warm_kernels(lm, modes, settings, say)
    say(f"  prefill: {context} tokens through {lm.name} ...")
    pre = prefill(lm, ids[:context], settings, any(m.uses_queries(settings) for m in modes),
                  progress=progress is not None, newest_queries=kept_queries(modes, settings))
    say(f"  prefill: done in {pre.seconds:.1f} s; full attention: {positions} teacher-forced + {free_tokens} free tokens ...")
    teacher = ids[context:]
    full_tf = run_mode(lm, pre, Mode("full"), settings, 0, teacher=teacher, keep_logits=True)
    full_free = run_mode(lm, pre, Mode("full"), settings, free_tokens)
    ref_logp = torch.stack(full_tf.logits).double().log_softmax(-1)
    out = {"task": "fidelity", "context": context, "extrapolated": note, "positions": positions, "free_tokens": free_tokens,
           "modes": {}}
    for mode in modes:
        if mode.name == "full":
            tf, free = full_tf, full_free
        else:
            say(f"  {mode.name}: " + ("building indexes from the prefill, then " if mode.kind == "index" else "")
                + f"{positions} teacher-forced + {free_tokens} free tokens ...")
            try:
                tf = run_mode(lm, pre, mode, settings, 0, teacher=teacher, keep_logits=True)
                tf.stores = None
                free = run_mode(lm, pre, mode, settings, free_tokens)
                free.stores = None
            except MODE_FAILURES as err:  # an index's build or search broke: this mode's, the others' results stand
                if mode.kind != "index":
                    raise
                error = failed_run(mode, err, say).error
                out["modes"][mode.name] = {"summary": {"failed_samples": 1}, "samples": [], "notes": [f"failed: {error}"]}
                continue
        logp = torch.stack(tf.logits).double().log_softmax(-1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)[1:]  # position 0 is the prefill's own prediction
        top1 = (logp.argmax(-1) == ref_logp.argmax(-1)).double()[1:]
        same = next((i for i, (a, b) in enumerate(zip(free.tokens, full_free.tokens)) if a != b),
                    min(len(free.tokens), len(full_free.tokens)))
        summary = summarize(tf) | {"prefill_s": pre.seconds, "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                                   "top1_agreement": float(top1.mean()), "free_tokens_until_diff": int(same)}
        out["modes"][mode.name] = {"summary": summary, "samples": [], "notes": tf.notes}
        if progress:
            progress(f"fidelity {mode.name}: KL {summary['kl_mean']:.3g}, top-1 {100 * summary['top1_agreement']:.1f}%, "
                     f"{same} free tokens equal")
    time_to_first_token(out["modes"])
    return out


COLUMNS = [("failed_samples", "failed", "{:d}"), ("skipped_samples", "left out", "{:d}"), ("accuracy", "accuracy %", "{:.1f}"), ("accuracy_ci95", "acc 95% CI", "[{:.1f}, {:.1f}]"),
           ("diff_vs_full", "Δ full", "{:+.1f}"), ("diff_vs_full_ci95", "Δ 95% CI", "[{:+.1f}, {:+.1f}]"), ("kl_mean", "KL", "{:.2e}"), ("top1_agreement", "top-1", "{:.3f}"),
           ("free_tokens_until_diff", "free=", "{:d}"), ("prefill_s", "prefill s", "{:.2f}"), ("build_s", "build s", "{:.2f}"),
           ("build_hidden_s", "hidden s", "{:.2f}"),
           ("first_step_s", "1st step s", "{:.3f}"), ("ttft_s", "TTFT s", "{:.2f}"), ("ttft_x_full", "TTFT x full", "{:.2f}"),
           ("exact_steps", "exact steps", "{:g}"), ("exact_s", "exact s", "{:.2f}"),
           ("retrieval_ms", "retr ms", "{:.2f}"), ("retrieval_cpu_ms", "retr CPU ms", "{:.2f}"), ("cpu_attention_ms", "cpu-attn ms", "{:.2f}"),
           ("accel_attention_ms", "accel-attn ms", "{:.2f}"), ("merge_ms", "merge ms", "{:.2f}"), ("insert_ms", "insert ms", "{:.2f}"),
           ("other_ms", "other ms", "{:.2f}"), ("token_ms", "token ms", "{:.2f}"), ("tokens_per_s", "tok/s", "{:.2f}"),
           ("scanned_fraction", "scanned %", "{:.2%}"), ("bytes_read_per_token", "read KiB/tok", "{:.1f}"),
           ("device_kv_bytes", "dev KV MiB", "{:.2f}"), ("cpu_bytes_per_key", "CPU B/key", "{:.0f}")]


# Printed under the table for the columns it shows: every column defined on screen.
LEGEND = {
    "failed_samples": "samples on which the mode failed (its indexes' build or search broke: the error in its notes); "
                      "its other columns are over the samples it finished",
    "skipped_samples": "of those, samples the mode was left out of after failing on --give-up-after samples in a row",
    "accuracy": "share of task samples answered correctly",
    "accuracy_ci95": "95% Wilson interval of the accuracy over the samples",
    "diff_vs_full": "accuracy minus full attention's on the same samples, points",
    "diff_vs_full_ci95": "95% interval of that paired difference (Newcombe)",
    "kl_mean": "mean KL divergence of the next-token distribution from full attention's (teacher-forced)",
    "top1_agreement": "share of teacher-forced positions whose top-1 token equals full attention's",
    "free_tokens_until_diff": "greedy tokens generated before the first difference from full attention",
    "prefill_s": "the full-attention prefill the mode decoded from, seconds (with builds during the prefill each index "
                 "mode has its own, slowed by its builds, and full and window one with nothing else running; else one for all)",
    "build_s": "building the mode's indexes from the prefill (each layer's from when the prompt's last chunk has passed it), seconds",
    "build_hidden_s": "of that build, seconds that ran while the prefill was still running (not in TTFT)",
    "first_step_s": "the first decode step, which gives the second token (the prefill's logits give the first), with "
                    "the set-up before it (the cache cut to the window, the decoder's hooks), seconds; with "
                    "--question-after-prefill the question's steps, the last of which gives the answer's first token",
    "ttft_s": "time to the first token the index serves, the second (the first comes from the prefill, at prefill s): "
              "prefill + the index build not hidden behind it (none with --until-built exact) + 1st step, seconds "
              "(with --question-after-prefill: to the answer's first token)",
    "exact_steps": "--until-built exact: leading decode steps in which a layer was still attended over its whole cache "
                   "while its index built (left out of the per-token means, as the first step after them)",
    "exact_s": "those steps' wall time from the prefill's end, seconds (every index serves the steps after them)",
    "ttft_x_full": "that time over full attention's",
    "retrieval_ms": "per token: index search on the CPU, summed over long-range layers (wall time)",
    "retrieval_cpu_ms": "the same searches' CPU time on their thread: below retr ms when the thread waited for a core "
                        "(on a CPU-only machine torch's threads, the accelerator's stand-in, share the cores)",
    "cpu_attention_ms": "per token: CPU attention over the retrieved keys",
    "accel_attention_ms": "per token: accelerator attention (window modes: over the static window; full: over every key)",
    "merge_ms": "per token: merging the two partial softmaxes",
    "insert_ms": "per token: moving tokens that leave the window to the CPU store and index",
    "other_ms": "per token: everything outside the long-range layers' attention (projections, MLPs, other layers); "
                "the CPU and accelerator sides run concurrently, so the parts may sum to more than the token",
    "token_ms": "per token: wall time of one decode step",
    "tokens_per_s": "decode steps per second",
    "scanned_fraction": "mean share of the indexed keys whose inner product a search computed (the newest keys not yet "
                        "added, fewer than --add-batch, are scored whole beside it, in retr ms but not here; an LSH index counts its "
                        "query's hyperplane products too: above 100% where they outnumber the keys, as magicpig's "
                        "K*L = 512 at a short context)",
    "bytes_read_per_token": "per token: bytes the CPU-side searches read, as the indexes report them, KiB",
    "device_kv_bytes": "keys and values held on the accelerator at the end, MiB",
    "cpu_bytes_per_key": "CPU-side stores and indexes at the end, bytes per token held there and long-range layer "
                         "(keys and values of its KV heads, every index of its query heads)",
}


def cell(summary: dict, key: str, fmt: str) -> str:
    """One mode's ``key`` as the table prints it (``fmt`` from :data:`COLUMNS`; bytes in KiB or MiB; '-' when missing,
    'NaN' for a NaN)."""
    v = summary.get(key)
    if key == "device_kv_bytes" and v is not None:
        v = v / 2**20
    if key == "bytes_read_per_token" and v is not None:
        v = v / 2**10
    if isinstance(v, (list, tuple)):
        return fmt.format(*v)
    if isinstance(v, float) and math.isnan(v):  # a failed measurement, not a missing one: '-' hid it
        return "NaN"
    return "-" if v is None else fmt.format(v)


def table(result: dict) -> str:
    """The per-mode summary as a fixed-width text table (modes as rows) with a legend of its columns."""
    rows = [(name, m["summary"]) for name, m in result["modes"].items()]
    cols = [c for c in COLUMNS if any(s.get(c[0]) is not None for _, s in rows)]
    head = ["mode"] + [c[1] for c in cols]
    body = [[name] + [cell(s, key, fmt) for key, _, fmt in cols] for name, s in rows]
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    # A column without a legend entry still prints (tests/test_decode_cli.py asks for every entry).
    legend = [f"  {label:>{max(len(c[1]) for c in cols)}}  {LEGEND.get(key, '')}" for key, label, _ in cols]
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in body] + [""] + legend)
