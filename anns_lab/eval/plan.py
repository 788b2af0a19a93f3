"""The parts a sweep folder's runs set out to measure: ``planned.json``, so that a reader can name what is missing.

A part's file appears when it is finished and a failure record when it failed (:mod:`anns_lab.eval.failures`); a
part a run never reached (Ctrl-C, a killed driver) leaves neither, and only the plan says it was wanted. Each run adds
its parts to the plan before any work (the union over the runs into the folder: a selection extended by a later run
is one sweep).
"""

from __future__ import annotations

from pathlib import Path

from anns_lab.eval.executors.base import Part
from anns_lab.eval.failures import record_path
from anns_lab.io import atomic_write_json, read_json

PLAN = "planned.json"


def record(out: Path, part_files: dict[Part, Path]) -> None:
    """Add ``part_files`` (a part → its file in ``out/parts``) to the folder's plan, atomically."""
    planned = _read(out)
    planned.update({f.name: {"layer": p.layer, "head": p.head, "index": p.index} for p, f in part_files.items()})
    atomic_write_json(out / PLAN, {"parts": dict(sorted(planned.items()))})


def unfinished(out: Path) -> list[dict]:
    """The planned parts of the sweep in ``out`` with neither a results part nor a failure record (the runs stopped
    before them), each ``{"layer", "head", "index"}``; none for a folder without a plan (swept before it)."""
    parts = out / "parts"
    return [cell for name, cell in _read(out).items()
            if not (parts / name).exists() and not record_path(parts / name).exists()]


def forget(out: Path) -> None:
    """Remove the plan (``--overwrite``: the folder's parts are removed with it)."""
    (out / PLAN).unlink(missing_ok=True)


def _read(out: Path) -> dict[str, dict]:
    """The plan's parts by file name; an unreadable plan (edited by hand) counts as none: it only ever adds notes."""
    try:
        parts = read_json(out / PLAN).get("parts")
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(parts, dict):
        return {}
    return {name: cell for name, cell in parts.items() if isinstance(name, str) and "/" not in name
            and isinstance(cell, dict) and {"layer", "head", "index"} <= cell.keys()}
