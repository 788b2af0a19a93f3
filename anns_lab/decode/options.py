"""The decoder's option values that the command line needs before anything heavy loads (``anns-lab --help`` and
every other command import the decode command's options: importing them from the engine pulled in torch and
transformers, ~3.5 s before any command ran), and the run's :class:`Settings`, which the decode command checks before
it imports the engine (a refused option answered after ~5 s of imports)."""

from __future__ import annotations

from dataclasses import dataclass

from anns_lab.cli_types import name_list
from anns_lab.dumps import rope
from anns_lab.errors import DecodeError
from anns_lab.indexes import group_queries
from anns_lab.window import Window

BASELINES = ("full", "window")  # the modes that build no index


def mode_names(spec: str) -> list[str]:
    """``--mode``'s names in order, refused when it names none or has an empty item."""
    names = name_list(spec, "--mode")
    if not names:  # an empty --mode once ran the default index alone, as if asked for
        raise DecodeError(f"--mode {spec!r} names nothing: give e.g. full,default")
    return names


def mode_kind(name: str) -> str:
    """A mode's kind: ``full``, ``window``, or ``index`` (every other name, ``default`` and ``sweep:...`` too)."""
    return name if name in BASELINES else "index"


CALIBRATE_AUTO = "auto"  # the decoder's default target, and a bare ``--calibrate``'s: :func:`calibrate.auto_target` of the layer's keys


def calibrates(target: float | str) -> bool:
    """Whether a ``--calibrate`` setting calibrates at all (0 = off)."""
    return target == CALIBRATE_AUTO or float(target) > 0


UNTIL_BUILT = ("wait", "exact")
UNTIL_BUILT_HELP = ("what an index mode's decode steps do while its layers' indexes are still building: wait for them "
                    "(the time to first token then counts the build not hidden behind the prefill), or attend each such "
                    "layer over its whole cache on the accelerator, as full attention does (the first token does not "
                    "wait; a layer's index serves from the step after its build ends, and the table counts the steps "
                    "before every layer's did)")

# Layers one mode builds at once (builds.EarlyBuilds; decode --build-layers); 0, the default: auto
# (builds.layers_at_once: enough layers for an index per thread of the budget, at least MIN_LAYERS_AT_ONCE, so that
# the next layer's heads fill the threads as one ends). On the H200 host's 16 cores Gemma-3's three layers at once
# (four heads each) built in 4.2 s against 5.9 s two at a time; SmolLM2's eight at once (nine heads each) gained
# nothing (BENCHMARKS "The CUDA path, a third lease").
LAYERS_AT_ONCE = 0
MIN_LAYERS_AT_ONCE = 2

# A mode that failed on this many samples in a row is left out of the rest (decode --give-up-after): a broken plugin
# fails every sample, and with builds during the prefill each try costs a prefill of its own; one sample's failure
# alone does not end it.
GIVE_UP_AFTER = 2


@dataclass
class Settings:
    """Window, top-k and insertion batch shared by every mode of a run."""

    window: Window = Window()
    topk: int = 100
    add_batch: int = 64
    chunk: int = 2048
    train_queries: int = 0  # prefill queries given to attention-aware indexes, evenly strided (0 = all)
    train_group: str = group_queries.DEFAULT  # attention-aware indexes: one per KV head on its group's queries, or "head"
    train_positions: str = rope.DEFAULT  # their queries moved to the decode steps' positions ("serving") or at their own
    lists_on_device: bool | None = None  # training lists of the indexes on the accelerator (None: when it is CUDA)
    build_during_prefill: bool = True  # start a layer's index builds once the prompt's last chunk has passed it (builds.EarlyBuilds)
    build_layers: int = LAYERS_AT_ONCE  # layers one mode builds at once (builds.EarlyBuilds; at most the threads' budget)
    build_processes: bool = False  # the index builds in worker processes (indexes.build_processes), not this one's threads
    shared_prefill: bool = False  # with the builds after the prefill: every mode on one (full's TTFT then carries the queries kept)
    steps: int = 64  # decode steps of a mode at most: the CPU stores reserve a row per step past the prompt's
    calibrate: float | str = 0.0  # > 0 or "auto": each layer's index search raised at build time to this weight recall@k where short (calibrate.calibrate; "auto", the CLI's default: calibrate.auto_target of the layer's keys)
    until_built: str = "wait"  # decode steps while a mode's indexes still build: "wait" for them, or attend those layers' whole cache, "exact"ly (UNTIL_BUILT)
    question_after_prefill: bool = False  # a task's question fed as decode steps after the prefill and the builds (runner.run_sample)
    calibrate_question: bool = False  # with question_after_prefill and calibrate: each layer's search raised again on the question's steps' queries, before its last step (question_calibration)
    copy_hints: int = 8  # per step, the positions after this many earlier occurrences of the context's suffix (and the 2 steps before's, moved on) enter the searches (0 = none)
