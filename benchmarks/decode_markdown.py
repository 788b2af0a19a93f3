"""Markdown tables of ``anns-lab decode --json`` results, as BENCHMARKS.md shows them.

    python benchmarks/decode_markdown.py /tmp/passkey8k.json /tmp/niah8k.json            # one table per run
    python benchmarks/decode_markdown.py --columns kl_mean,top1_agreement,scanned_fraction /tmp/fidelity.json
    python benchmarks/decode_markdown.py --by-run accuracy,accuracy_ci95 /tmp/*.json          # runs side by side

Cells are formatted as ``anns-lab decode`` prints them (``runner.COLUMNS``); each table is headed by the
run's model, task, context, samples and settings, and followed by the run's answers per sample.
``--by-run`` puts several runs side by side instead: one row per mode, the given columns of each run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from anns_lab.decode import runner

TASK_COLUMNS = "failed_samples,accuracy,accuracy_ci95,retrieval_ms,retrieval_cpu_ms,bytes_read_per_token,scanned_fraction,build_s,build_hidden_s,ttft_s"


def _labels(keys: list[str]) -> dict[str, tuple[str, str]]:
    """(label, format) of every column of ``runner.COLUMNS``; exits naming any of ``keys`` that is not one."""
    labels = {key: (label, fmt) for key, label, fmt in runner.COLUMNS}
    unknown = [k for k in keys if k not in labels]
    if unknown:
        raise SystemExit(f"unknown columns {unknown}; known: {', '.join(labels)}")
    return labels


def partial(result: dict) -> str | None:
    """"PARTIAL: 2 of 3 samples" for a result written before its run's last sample ("partial": true), else None."""
    if not result.get("partial"):
        return None
    return f"PARTIAL: {result.get('samples_done', '?')} of {result.get('samples_total', '?')} samples"


def markdown(result: dict, keys: list[str]) -> str:
    """The run's modes as rows of the ``keys`` columns (those that no mode has are left out), headed by
    :func:`partial`'s label where the run stopped midway (its figures are over fewer samples than it asked for)."""
    labels = _labels(keys)
    rows = [(name, m["summary"]) for name, m in result["modes"].items()]
    keys = [k for k in keys if any(s.get(k) is not None for _, s in rows)]
    out = [f"**{partial(result)}**\n"] if partial(result) else []
    out += ["| mode | " + " | ".join(labels[k][0] for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    out += [f"| {name} | " + " | ".join(runner.cell(s, k, labels[k][1]) for k in keys) + " |" for name, s in rows]
    return "\n".join(out)


def side_by_side(results: list[dict], keys: list[str]) -> str:
    """One row per mode (of any run), the ``keys`` columns of each run in turn ('-' where a run lacks the mode)."""
    labels = _labels(keys)
    names = list(dict.fromkeys(name for r in results for name in r["modes"]))
    head = [f"{r['task']} {r['context']}{f' ({partial(r)})' if partial(r) else ''}: {labels[k][0]}"
            for r in results for k in keys]
    out = ["| mode | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for name in names:
        cells = [runner.cell(r["modes"][name]["summary"], k, labels[k][1]) if name in r["modes"] else "-"
                 for r in results for k in keys]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def answers(result: dict) -> str:
    """Per sample: depth, expected answer, the modes whose answer scored 0 and those that failed on it."""
    samples = next(iter(result["modes"].values()))["samples"]
    lines = []
    for i, s in enumerate(samples):
        wrong = [f"{name} {m['samples'][i]['answer']!r}" for name, m in result["modes"].items()
                 if m["samples"][i].get("score", 1) < 1]
        failed = [name for name, m in result["modes"].items() if "error" in m["samples"][i]]
        said = ", ".join(([f"wrong: {', '.join(wrong)}"] if wrong else []) + ([f"failed: {', '.join(failed)}"] if failed else []))
        lines.append(f"- sample {i + 1} (depth {s.get('depth', 0):.2f}, expected {s.get('expected')}): "
                     + (said or "every mode right"))
    return "\n".join(lines)


def read(path: Path, needs: tuple[str, ...]) -> dict:
    """A result holding the keys ``needs``, or exit naming what it lacks: ``--by-run`` reads the runner's own keys
    (bench_decode.py's JSON has them too), a run's table also the model and device that ``anns-lab decode --json``
    adds."""
    result = json.loads(path.read_text())
    missing = [key for key in needs if not isinstance(result, dict) or key not in result]
    if missing:
        raise SystemExit(f"{path}: no {', '.join(missing)} in it: a run's table reads `anns-lab decode --json` results "
                         "(--by-run also bench_decode.py's)")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="JSON files written by anns-lab decode --json")
    ap.add_argument("--columns", default=None, help=f"comma list of summary keys (default: {TASK_COLUMNS}; "
                                                    "fidelity runs: KL, top-1, free=, scanned, bytes, build)")
    ap.add_argument("--by-run", default=None, help="comma list of summary keys: the runs side by side in one table")
    a = ap.parse_args()
    if a.by_run:
        results = [read(path, ("task", "context", "modes")) for path in a.results]
        print(side_by_side(results, a.by_run.split(",")))
        return
    for path in a.results:
        result = read(path, ("model", "task", "context", "modes", "device"))
        fidelity = result["task"] == "fidelity"
        cols = a.columns or ("kl_mean,top1_agreement,free_tokens_until_diff,scanned_fraction,bytes_read_per_token,"
                             "build_s" if fidelity else TASK_COLUMNS)
        n = len(next(iter(result["modes"].values()))["samples"])
        st = result.get("settings", {})
        print(f"**{result['model']}, {result['task']}, context {result['context']}"
              + ("" if fidelity else f", {n} sample{'s' if n != 1 else ''}") + f"** ({path.name}; window {st.get('sink')}+{st.get('recent')}, "
              f"top-{st.get('topk')}, device {result['device']})\n")
        print(markdown(result, cols.split(",")))
        if not fidelity:
            print("\n" + answers(result))
        print()


if __name__ == "__main__":
    main()
