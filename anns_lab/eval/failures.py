"""Failed-part records of a sweep: ``parts/failed-<part>.json`` with the attempts made and the last error.

A part that failed is tried again by the next run of the same sweep until it has used ``max_attempts``
in all (a worker that died counts one attempt, and is retried at once while attempts last); after that
it is reported without being run, so a rerun never loops on a part that kills its process.
``--retry-failed`` (or ``--overwrite`` of other settings) removes the records.
"""

from __future__ import annotations

import time
from pathlib import Path

from anns_lab.io import atomic_write_json, read_json
from anns_lab.eval.executors.base import Outcome, Part

PREFIX = "failed-"


def record_path(part_file: Path) -> Path:
    """``parts/L002_H00_ivf.parquet`` → ``parts/failed-L002_H00_ivf.json``."""
    return part_file.with_name(PREFIX + part_file.stem + ".json")


def previous(part_file: Path) -> dict | None:
    """The record of an earlier failure of this part, or None (an unreadable record counts as none, as one without a
    count of attempts ≥ 0 or an error in words: a record edited by hand)."""
    try:
        rec = read_json(record_path(part_file))
    except (OSError, ValueError):
        return None
    ok = isinstance(rec, dict) and type(rec.get("attempts")) is int and rec["attempts"] >= 0 \
        and isinstance(rec.get("error"), str)  # type(): a JSON true is an int to isinstance
    return rec if ok else None


def record(part_file: Path, outcome: Outcome, build_params: dict | None, earlier: int) -> dict:
    """Write (atomically) the record of a failed part; ``earlier`` attempts came from previous runs."""
    rec = {"layer": outcome.part.layer, "head": outcome.part.head, "index": outcome.part.index,
           "build_params": build_params or {}, "attempts": earlier + outcome.attempts, "error": outcome.error,
           "worker_died": outcome.crashed, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if trace := getattr(outcome.error, "trace", ""):  # where the index raised it (errors.error_text)
        rec["traceback"] = trace
    atomic_write_json(record_path(part_file), rec)
    return rec


def clear(part_file: Path) -> None:
    record_path(part_file).unlink(missing_ok=True)


def clear_all(parts: Path) -> int:
    """Remove every failure record under ``parts``; returns how many there were."""
    found = list(parts.glob(PREFIX + "*.json"))
    for p in found:
        p.unlink()
    return len(found)


def missing(parts: Path) -> list[dict]:
    """The failure records under ``parts`` whose part has no table: the parts a results table lacks (by name)."""
    out = []
    for path in sorted(parts.glob(PREFIX + "*.json")):
        if path.with_name(path.stem[len(PREFIX):] + ".parquet").exists():
            continue  # finished since (a record is removed on success; this one was left by hand)
        try:
            rec = read_json(path)
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and {"index", "layer", "head"} <= rec.keys():
            out.append(rec)
    return out


def exhausted_message(part: Part, rec: dict) -> str:
    return (f"failed {rec['attempts']} time(s) in earlier runs, not retried (last error: {rec['error']}); "
            "pass --retry-failed to try it again")


__all__ = ["Part", "clear", "clear_all", "exhausted_message", "missing", "previous", "record", "record_path"]
