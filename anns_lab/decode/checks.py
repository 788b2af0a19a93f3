"""What ``anns-lab decode`` refuses before it runs: options the run would ignore or that contradict each other,
counts out of range, and a ``--from-sweep`` table swept on another model. Each refusal is one :class:`DecodeError`
(one ``Error:`` line, exit status 2); those that need neither the model nor the index classes come before torch loads."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from anns_lab.cli_types import given_flags
from anns_lab.decode.options import CALIBRATE_AUTO, GIVE_UP_AFTER, Settings, calibrates, mode_kind
from anns_lab.dumps import rope
from anns_lab.dumps.tasks import TASKS
from anns_lab.errors import DecodeError

if TYPE_CHECKING:
    from anns_lab.decode.engine import Mode


def check_options(settings: Settings, evaluation: str, task: str | None, prompt: str | None, executor: str,
                  address: str | None) -> None:
    """Refuse inconsistent options before anything is loaded, one :class:`DecodeError` each."""
    if settings.topk < 1:
        raise DecodeError(f"--topk must be at least 1, got {settings.topk}")
    if settings.copy_hints < 0:
        raise DecodeError("--copy-hints must be 0 (none) or more")
    for flag, value in (("--add-batch", settings.add_batch), ("--chunk", settings.chunk)):
        if value < 1:
            raise DecodeError(f"{flag} must be at least 1, got {value}")
    if settings.build_layers < 0:
        raise DecodeError(f"--build-layers must be 0 (auto) or more, got {settings.build_layers}")
    if settings.train_queries < 0:
        raise DecodeError(f"--train-queries must be 0 (all) or more, got {settings.train_queries}")
    if evaluation == "task" and (task is None) == (prompt is None):
        raise DecodeError("give exactly one of --task NAME or --prompt TEXT (or --eval fidelity)")
    if prompt is not None:
        try:  # bytes the shell's locale cannot decode arrive as surrogates, which the tokenizer fails on (a TypeError)
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise DecodeError(f"--prompt is not valid UTF-8 text (byte {err.start} of it, or near it): pass the "
                              "prompt as UTF-8") from None
    if executor == "ray" and evaluation == "fidelity":
        raise DecodeError("--executor ray runs task and prompt evaluations (a task per sample); --eval fidelity is "
                          "one prefill and runs here")
    if evaluation == "fidelity" and settings.until_built != "wait":
        raise DecodeError("--until-built exact is for --task and --prompt runs: --eval fidelity measures each index on "
                          "every position, so its steps wait for the builds")
    question = settings.calibrate_question and evaluation != "fidelity" and prompt is None  # else: check_unused's
    if question and not settings.question_after_prefill:
        raise DecodeError("--calibrate-question raises the searches on the question's steps: add --question-after-prefill")
    if question and settings.until_built == "exact":
        raise DecodeError("--calibrate-question raises every layer's search before the question's last step; with "
                          "--until-built exact a layer still building then has none: use --until-built wait")
    if question and not calibrates(settings.calibrate):
        raise DecodeError("--calibrate-question raises each search to --calibrate's target: --calibrate 0 sets none")
    if executor == "local" and address is not None:
        raise DecodeError("--address is for --executor ray")
    if task is not None and task not in TASKS:
        raise DecodeError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def check_unused(ctx: click.Context, evaluation: str, prompt: str | None, from_sweep: str | None) -> None:
    """Refuse options set on the command line that this run would ignore (a --seed with --eval fidelity ran as if left
    out; --eval fidelity --prompt ran for half a minute, then crashed): one :class:`DecodeError` naming them."""
    if evaluation == "fidelity":
        unused = given_flags(ctx, "task", "prompt", "samples", "give_up_after", "seed", "max_new_tokens", "shared_prefill",
                             "question_after_prefill", "calibrate_question")
        why = ("--eval fidelity teacher-forces --positions tokens of its own text after --context tokens of it, every "
               "mode from one prefill")
    elif prompt is not None:
        unused = given_flags(ctx, "context", "samples", "give_up_after", "seed", "positions", "free_tokens",
                             "question_after_prefill", "calibrate_question")
        why = "--prompt decodes that text once: its tokens are the context (a task's question is the one it can defer)"
    else:
        unused = given_flags(ctx, "positions", "free_tokens")
        why = "--positions and --free-tokens are for --eval fidelity"
    if unused:
        raise DecodeError(f"{', '.join(unused)}: not used by this run ({why}); leave {'them' if len(unused) > 1 else 'it'} out")
    if ctx.params.get("executor") != "ray" and given_flags(ctx, "cpus_per_task"):
        raise DecodeError("--cpus-per-task: not used by this run (it reserves CPUs for each Ray task); pass --executor "
                          "ray, or leave it out")
    if from_sweep is None and given_flags(ctx, "target_recall"):
        raise DecodeError("--target-recall is the recall a --from-sweep pick must reach: pass --from-sweep, or leave it out")


INDEX_OPTIONS = ("topk", "add_batch", "train_queries", "train_group", "train_positions", "copy_hints",
                 "build_during_prefill", "build_layers", "build_processes", "shared_prefill", "until_built", "calibrate",
                 "calibrate_question", "give_up_after")


def check_unused_by_modes(ctx: click.Context, names: list[str], from_sweep: str | None) -> None:
    """Refuse the options of index modes where none runs (``--mode full,window``), and ``--window`` where only ``full``
    runs: they were dropped in silence (``--mode full --window 600,600`` printed that window in its table). Read from
    the names alone (``options.mode_kind``), before anything heavy loads."""
    kinds = {mode_kind(n) for n in names} | ({"index"} if from_sweep else set())
    if "index" not in kinds and (unused := given_flags(ctx, *INDEX_OPTIONS)):
        raise DecodeError(f"{', '.join(unused)}: not used by this run (--mode {','.join(names)} has no index mode); "
                          f"leave {'them' if len(unused) > 1 else 'it'} out, or add an index mode")
    if kinds == {"full"} and given_flags(ctx, "window"):
        raise DecodeError("--window: not used by this run (--mode full attends every key); leave it out, or add a "
                          "window or index mode")


# The options only some index classes read: which classes read each, and what a run none of whose indexes does lacks.
_TRAINS = (lambda c: c.uses_train_queries,
           "none trains on the prefill's queries ('uses train_queries' in `anns-lab indexes`)")
READ_BY = {"train_queries": _TRAINS, "train_group": _TRAINS, "train_positions": _TRAINS,
           "copy_hints": (lambda c: c.takes_hints, "none takes copy hints ('takes copy hints' in `anns-lab indexes`)")}


def check_unread_by_indexes(ctx: click.Context, mode_list: list[Mode]) -> None:
    """Refuse the options that no index of the run reads (``--mode flat --train-group strided``, ``--copy-hints``
    where no index takes hints) and the values none acts on (``--train-positions serving`` where every index reads
    its queries where they were, ``--train-group unlisted`` where none takes another head's): they were recorded in
    the JSON's settings as if they had shaped the run. Asked once the modes are known (a plugin's class says)."""
    from anns_lab.indexes import registry

    classes = {registry.get(p.name) for m in mode_list for p in m.plans()}
    if not classes:  # no index mode: check_unused_by_modes has spoken
        return
    unread = {flag: why for option, (reads, why) in READ_BY.items() if not any(reads(c) for c in classes)
              for flag in given_flags(ctx, option)}
    names = ", ".join(sorted({p.name for m in mode_list for p in m.plans()}))
    if unread:
        it = "them" if len(unread) > 1 else "it"
        raise DecodeError(f"{', '.join(unread)}: read by none of this run's indexes ({names}: "
                          f"{'; '.join(dict.fromkeys(unread.values()))}); leave {it} out, or add an index that reads {it}")
    place = ctx.params.get("train_positions")
    if given_flags(ctx, "train_positions") and place != "own" and not any(c.moves_train_queries() for c in classes):
        raise DecodeError(f"--train-positions {place} moves training queries, and none of this run's indexes ({names}) "
                          "has any moved: each reads them where the prefill had them; leave it out")
    if given_flags(ctx, "train_group") and ctx.params.get("train_group") == "unlisted" and not any(
            c.accepts_group_queries for c in classes):  # it builds as `head` there, keeping every prefill query
        raise DecodeError(f"--train-group unlisted gives the GQA group's other queries to an index that takes them "
                          f"(roargraph); none of this run's does ({names}): pass --train-group head")


# Above any machine's cores: 100000 threads' stacks exhausted the process's memory maps (a traceback from an import).
MAX_TORCH_THREADS = 1024
MAX_SAMPLES = 10_000  # task prompts per run at most: each is a full prefill per mode


def check_counts(max_new_tokens: int | None, seed: int, torch_threads: int, samples: int,
                 give_up_after: int = GIVE_UP_AFTER) -> None:
    """Refuse counts out of range before anything is loaded (a negative token count decoded nothing and scored 0, 0 meant
    the task's default, a negative seed failed after the model had loaded, 10^11 samples a traceback allocating their
    needles' depths)."""
    if not 1 <= samples <= MAX_SAMPLES:
        raise DecodeError(f"--samples must lie in [1, {MAX_SAMPLES}] (each is a prefill of the context per mode), got {samples}")
    if give_up_after < 0:
        raise DecodeError(f"--give-up-after must be 0 (never give up) or more, got {give_up_after}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise DecodeError(f"--max-new-tokens must be at least 1 (leave it out for the task's default), got {max_new_tokens}")
    if seed < 0:
        raise DecodeError(f"--seed must be 0 or more, got {seed}")
    if not 0 <= torch_threads <= MAX_TORCH_THREADS:
        raise DecodeError(f"--torch-threads must lie in [0, {MAX_TORCH_THREADS}] (0: torch's default), got {torch_threads}")


def check_calibrate(target: float | str) -> None:
    """A calibration target is ``auto`` or a weight recall: in (0, 1], or 0 for none."""
    if target != CALIBRATE_AUTO and not (target == 0 or 0 < target <= 1):
        raise DecodeError(f"--calibrate takes a weight recall target in (0, 1] (0: off), got {target}")


def check_train_positions(lm, mode_list: list[Mode], settings: Settings) -> None:
    """Refuse, before the prefill, training queries that cannot be moved to the serving positions (the RoPE
    frequencies of a long-range layer unknown: :func:`dumps.rope.inv_freq`'s one error)."""
    from anns_lab.indexes import registry

    if settings.train_positions != "own" and any(registry.get(p.name).moves_train_queries()
                                                  for m in mode_list for p in m.plans()):
        for layer in lm.long_range_layers:
            rope.inv_freq(lm.config, layer)


def check_swept_model(from_sweep: str, lm) -> list[str]:
    """Refuse a sweep whose dump came from a model of another shape than ``lm`` (the table names its model by the
    folder's name alone: a Llama's picks were taken for a Gemma-3 of the same name); a note where that dump is not at
    the path the sweep read it from, so the name alone was matched, and where it came from other weights of this shape
    (a fine-tune, another revision: the picks may still serve, but were measured on another model's attention)."""
    from anns_lab.decode.modes import NOTE
    from anns_lab.dumps.models import files_stamp, weights_fingerprint
    from anns_lab.dumps.rope import head_dim, kv_heads
    from anns_lab.eval.table import swept_model

    there = swept_model(from_sweep)
    if isinstance(there, str):
        return [f"{NOTE}the sweep's dump cannot be read ({there}): its model is matched by name alone ({lm.name})"]
    cfg = lm.config
    here = {"architecture": type(lm.model).__name__, "n_layers": cfg.num_hidden_layers,
            "n_heads": cfg.num_attention_heads, "n_kv_heads": kv_heads(cfg), "head_dim": head_dim(cfg)}
    if differ := [f"{k} {there[k]} there, {v} here" for k, v in here.items() if there[k] not in (None, v)]:
        raise DecodeError(f"{from_sweep} was swept on a dump of another model named {lm.name!r} ({'; '.join(differ)}): "
                          "pick from a sweep of this model")
    swept = there["weights_fingerprint"]  # none in a manifest from before it (or not text: not compared)
    if not isinstance(swept, str) or (there["source"] == lm.source and there["files_stamp"] is not None
                                      and there["files_stamp"] == files_stamp(lm.source)):
        return []  # the very files the dump read (a fingerprint by an older sampling rule would differ)
    if swept != (now := weights_fingerprint(lm.model)):
        return [f"{NOTE}the sweep's dump came from other weights than {lm.name}'s (weights fingerprint "
                f"{swept[:12]}… there, {now[:12]}… here: another checkpoint, a fine-tune, revision or format): its "
                "picks were measured on that model's attention and may not reach the target recall on this one"]
    return []
