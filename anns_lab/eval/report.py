"""``anns-lab report``: findings, figures and tables from a sweep's results and its dump.

Writes ``report.md`` and a self-contained ``report.html`` (figures embedded, sortable tables)
beside the results, plus the figures as PNG files: recall against keys scanned with Q→K and
K→K overlaid (paper Fig. 3a / 6), recall and output error against bytes of index data read per
query (a cost fair across index families), Mahalanobis distances per head (Fig. 3b), and the decay of
a fixed top-k selection over decode steps (Fig. 2). Every finding is computed from the
numbers (see :mod:`anns_lab.eval.findings`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pandas as pd

from anns_lab.dumps.models import extrapolation_note
from anns_lab.dumps.prompts import CONTINUATION_WORDS
from anns_lab.dumps.store import dump_stamp, open_dump
from anns_lab.errors import AnnsLabError, IndexConfigError
from anns_lab.eval import costs, failures, figures, findings, html, ivf_gap, markdown, metrics, paper, plan
from anns_lab.eval.export import EXPORT_FILES
from anns_lab.eval.heads import check_k, index_range, load_head
from anns_lab.eval.findings import fmt_fraction  # noqa: F401 - benchmarks import it from here
from anns_lab.eval.table import RESULTS, SETTINGS, load_results, sweep_folder
from anns_lab.indexes import registry
from anns_lab.io import atomic_path, hold_folder, loads_json, read_json

TARGETS = (0.90, 0.95, 0.99)
FIGURES = {"recall_vs_scanned.png": "Recall against keys scanned, Q→K and K→K (Fig. 3a / 6)",
           "recall_vs_bytes.png": "Q→K: recall and output error against bytes read per query",
           "mahalanobis.png": "Out-of-distribution queries (Fig. 3b)",
           "dynamic_vs_static.png": "Dynamic against static selection (Fig. 2)"}
REPORT_FILES = ("report.md", "report.html", *FIGURES)
UNFINISHED_NAMED = 12  # unfinished parts named in the report's intro (a sweep stopped early lacks hundreds)


def _least(h: pd.DataFrame, t: float, column: str = "scanned_fraction") -> float:
    return metrics.at_recall(h["recall"], h[column], t)[0]


def _at_first_point(h: pd.DataFrame, t: float, column: str = "scanned_fraction") -> bool:
    """Whether the head's cheapest grid point by ``column`` (on that frontier) already reaches ``t``: its cost there is a
    bound, the least it could cost is below the grid. Not for a grid of one point (flat's): no setting is cheaper."""
    first = metrics.frontier(h["recall"], h[column])
    return len(h) > 1 and len(first) > 0 and float(h["recall"].iloc[first[0]]) >= t


def per_head(table: pd.DataFrame, targets=TARGETS) -> pd.DataFrame:
    """Per (layer, head, index, direction): the least scanned fraction (``scan@t``) and bytes read per query
    (``bytes@t``) reaching each recall target (:func:`metrics.at_recall`: between the two grid points around it; NaN:
    never), and the best recall."""
    rows = []
    for (layer, head, index, direction), g in table.groupby(["layer", "head", "index", "direction"], sort=True):
        row = {"layer": layer, "head": head, "index": index, "direction": direction,
               "best_recall": float(g["recall"].max())}
        row.update({f"scan@{t:.2f}": _least(g, t) for t in targets})
        row.update({f"bytes@{t:.2f}": _least(g, t, "bytes_read") for t in targets})
        row.update({f"first@{t:.2f}": _at_first_point(g, t) for t in targets})
        row.update({f"first_bytes@{t:.2f}": _at_first_point(g, t, "bytes_read") for t in targets})
        rows.append(row)
    return pd.DataFrame(rows)


def pareto(table: pd.DataFrame, targets=TARGETS) -> pd.DataFrame:
    """Per index and direction: median over heads of the least scanned fraction reaching each recall target, and
    of the least bytes read per query reaching it (``bytes@t``)."""
    heads = per_head(table, targets)
    rows = []
    for (index, direction), g in heads.groupby(["index", "direction"], sort=True):
        row = {"index": index, "direction": direction, "heads": len(g), "best_recall": float(g["best_recall"].median())}
        for t in targets:
            v = g[f"scan@{t:.2f}"].to_numpy(dtype=float)
            # A head that never reaches the target counts as needing everything (scanned fraction ≥ 1).
            row[f"scan@{t:.2f}"] = float(np.median(np.where(np.isfinite(v), v, np.inf)))
            row[f"reached@{t:.2f}"] = int(np.isfinite(v).sum())
            row[f"first@{t:.2f}"] = int(g[f"first@{t:.2f}"].sum())
            row[f"first_bytes@{t:.2f}"] = int(g[f"first_bytes@{t:.2f}"].sum())
            b = g[f"bytes@{t:.2f}"].to_numpy(dtype=float)
            row[f"bytes@{t:.2f}"] = float(np.median(np.where(np.isfinite(b), b, np.inf)))
        rows.append(row)
    return pd.DataFrame(rows)


def paper_figure(index: str, direction: str, kind: str) -> str:
    """What the paper reports for this kind of index in this direction at recall 0.95 ("—": no figure)."""
    if kind == "exact":
        return "100% (exact)"
    if direction == "q2k":
        if kind == "attention-aware":
            return f"{paper.Q2K_ATTENTION_AWARE} (attention-aware)"
        return {"ivf": str(paper.Q2K_IVF), "hnsw": "not reached"}.get(index, "—")
    return str(paper.K2K_IVF) if index == "ivf" else "—"


def sibling_sweeps(folder: Path, dump: str, out_folder: Path | None = None) -> list[tuple[str, str | None]]:
    """(name, link to its report.html relative to ``out_folder``, the page's folder, default ``folder``; None where it
    has no report yet) of the other sweep folders beside ``folder`` of the same dump."""
    start = (out_folder or folder).resolve()
    out = []
    for settings in sorted(folder.resolve().parent.glob(f"*/{SETTINGS}")):
        other = settings.parent
        if other == folder.resolve():
            continue
        try:
            other_settings = read_json(settings)
        except (OSError, ValueError):
            continue
        same = isinstance(other_settings, dict) and other_settings.get("dump") == dump
        if same:
            page = other / "report.html"
            out.append((other.name, Path(os.path.relpath(page, start)).as_posix() if page.is_file() else None))
    return out


def _results_dump(label: str, settings: dict, dump_path: str | Path | None):
    """The dump the results come from: ``dump_path`` when given, else the one the sweep recorded (``sweep.json``'s
    absolute path; the table's label, as typed then, for sweeps without one), checked to be that dump by its stamp
    (``store.dump_stamp``: the manifest's checksum; its creation time, to the second, for sweeps before they recorded
    it), so a path that now names another dump, or one reached from another folder, is never read for figures."""
    recorded = settings.get("dump") or label
    created = settings.get("dump_created")
    if dump_path is None and not Path(recorded).is_dir():
        if created is None or not Path(label).is_dir():  # the label as typed: results and dump moved together
            raise AnnsLabError(f"the dump these results come from, {recorded}, is not there; give it with --dump")
        recorded = label
    dump = open_dump(dump_path if dump_path is not None else recorded)
    stamp = settings.get("dump_stamp")
    if (stamp is not None and dump_stamp(dump.manifest) != stamp) or (
            created is not None and dump.manifest.get("created") != created):
        checksum = f", manifest checksum {stamp[:12]}" if stamp not in (None, created) else ""
        raise AnnsLabError(f"{dump.path} is not the dump these results come from ({recorded}, made {created}{checksum}); "
                           "give the matching --dump")
    if created is None and dump_path is not None and Path(dump_path).resolve() != Path(recorded).resolve():
        raise AnnsLabError(f"the results come from dump {recorded}, not {dump_path}; give the matching dump")
    return dump


def write_report(results: str | Path, out: str | Path | None = None, dump_path: str | Path | None = None) -> Path:
    """Write figures, ``report.md`` and ``report.html`` next to the results (or into ``out``); returns report.md."""
    table, settings = load_results(results)
    if table.empty:
        raise AnnsLabError(f"{results} holds no rows; the sweep produced nothing to report")
    dumps = sorted(table["dump"].unique())
    if len(dumps) != 1:
        raise AnnsLabError(f"{results} mixes several dumps ({dumps}); report one sweep at a time")
    folder = sweep_folder(results)
    k, window = _sweep_settings(table, settings, folder)
    table = findings.label_builds(table)
    dump = _results_dump(dumps[0], settings, dump_path)
    _check_key_count(table, dump, window, k, folder)
    out = Path(out) if out is not None else folder
    _check_out(out, folder)
    if out.is_dir():
        with hold_folder(out):  # refused at once where a sweep or report is writing there (held again to write)
            pass
    pairs = sorted({(int(r.layer), int(r.head)) for r in table[["layer", "head"]].itertuples()})
    n_keys = int(table["n_keys"].median())

    kinds = findings.index_kinds(table)
    par, heads, c = pareto(table), per_head(table), figures.grid_medians(table)
    maha = figures.mahalanobis_per_head(dump, pairs, window)
    decay = pd.concat([figures.selection_decay(dump, layer, head, k) for layer, head in pairs], ignore_index=True)
    pngs = {"recall_vs_scanned.png": figures.recall_vs_scanned(table, k, kinds, _best_attention_aware(par, kinds)),
            "recall_vs_bytes.png": figures.recall_vs_bytes(table, k, kinds),
            "mahalanobis.png": figures.mahalanobis_figure(maha),
            "dynamic_vs_static.png": figures.selection_decay_figure(decay, k)}
    medians = maha.groupby("kind")["distance"].median()
    found = findings.from_sweep(par, kinds, n_keys, {"ivf": _ivf_reason(dump, table, par, kinds, pairs, window, k)})
    n_decode = int(dump.manifest["n_tokens"]["decode"])
    topped = index_range(dump, window)[2]  # the last prefill queries held out to make up the test queries
    found += [findings.out_of_distribution(medians.get("Q→K: decode queries", np.nan),
                                           medians.get("K→K: held-out keys", np.nan),
                                           "Test queries" if topped else "Decode queries"),
              findings.dynamic_vs_static(decay["dynamic"].mean(), decay["static"].mean(),
                                         int(decay["step"].nunique()), k)]
    intro = (f"Dump {markdown.code(str(dump.path))} ({markdown.code(dump.model)}): {dump.manifest['n_tokens']['prefill']} prefill + "
             f"{n_decode} decode tokens ({CONTINUATION_WORDS[dump.continuation]}: "
             + (f"their queries and the last {topped} prefill queries, held out of the index, are the {n_decode + topped} "
                "test queries, called decode queries below" if topped else "their queries are the test queries")
             + f"); {len(pairs)} (layer, head) pairs of layers "
             f"{sorted({p[0] for p in pairs})}; {n_keys:,} keys indexed per head (static window {window[0]},{window[1]} "
             f"excluded); recall@{k}. The paper's figures are for 128K-token contexts of Llama-3-8B and Yi-9B "
             "(docs/paper.md); the metrics are defined in docs/metrics.md.")
    model_facts = dump.manifest.get("model", {})
    beyond = extrapolation_note(dump.model, dump.manifest["n_tokens"]["prefill"], model_facts.get("context"),
                                model_facts.get("rope_scaling"), dump.manifest["n_tokens"]["decode"])
    if beyond:  # it names the model, as the dump's manifest gives it
        intro += f" **{markdown.cell(beyond[0].upper() + beyond[1:])}.**"
    lost = failures.missing(folder / "parts")
    if lost:  # otherwise an index's medians and (n/m) would silently be over the heads it has left
        names = "; ".join(f"{markdown.cell(r['index'])} on layer {r['layer']} head {r['head']}" for r in lost)
        intro += (f" **{len(lost)} part(s) of this sweep failed and are in no table or figure below, so each such "
                  f"index's medians are over its other heads: {names} (errors in `parts/failed-*.json`; `anns-lab sweep "
                  "--retry-failed` tries them again).**")
    if left := plan.unfinished(folder):  # a run stopped before them (Ctrl-C, a killed driver): no part, no record
        names = "; ".join(f"{markdown.cell(r['index'])} on layer {r['layer']} head {r['head']}"
                          for r in left[:UNFINISHED_NAMED])
        more = f" and {len(left) - UNFINISHED_NAMED} more" if len(left) > UNFINISHED_NAMED else ""
        intro += (f" **{len(left)} part(s) this sweep set out to measure have no results yet (its runs stopped before "
                  f"them), so each such index's medians are over its other heads: {names}{more} (the same `anns-lab "
                  "sweep` command resumes it).**")
    pareto_view = _pareto_view(par, kinds)
    points = costs.at_target(table, 0.95)
    md = _markdown(dump, intro, found, pareto_view, _pareto_note(kinds), par, maha, decay, c, k,
                   costs.markdown_at_target(points, 0.95))
    links = sibling_sweeps(folder, str(settings.get("dump", "")), out)
    sections = [("Least fraction of keys scanned to reach a recall target (median over heads)",
                 html.paragraph(_pareto_note(kinds)) + html.table(pareto_view, "pareto")),
                (FIGURES["recall_vs_scanned.png"], html.figure(pngs["recall_vs_scanned.png"], "recall vs scanned")),
                ("Least bytes of index data read per query to reach a recall target (Q→K, median over heads)",
                 html.paragraph(BYTES_NOTE) + html.table(_bytes_view(par), "bytes")
                 + html.figure(pngs["recall_vs_bytes.png"], "recall and error vs bytes read")),
                 (AT_TARGET, html.table(costs.summary_at_target(points).round(4), "at-target")
                  + html.table(points.round(4), "at-target-heads")),
                (FIGURES["mahalanobis.png"], html.figure(pngs["mahalanobis.png"], "mahalanobis")),
                (FIGURES["dynamic_vs_static.png"], html.figure(pngs["dynamic_vs_static.png"], "dynamic vs static")),
                ("Every head: least fraction scanned for each recall target",
                 html.table(_heads_view(heads), "per-head")),
                ("Every operating point (median over heads, Q→K)", html.table(_points_view(c), "points"))]
    page = html.page(f"anns-lab report: {dump.model}, {dump.path.name}", intro, found, sections, links)
    # written once everything is computed: a refused or failed report leaves --out as it was (made by nothing)
    _write(out, {**pngs, "report.md": md.encode("utf-8"), "report.html": page.encode("utf-8")})
    return out / "report.md"


def _check_key_count(table: pd.DataFrame, dump, window: tuple[int, int], k: int, folder: Path) -> None:
    """Every row's index held the keys this dump leaves outside the sweep's window: a table copied in from a sweep
    of another window (same k, same dump) was reported with this folder's window, its figures loaded unlike it."""
    held = check_k(dump, window, k)
    odd = sorted(int(n) for n in table["n_keys"].unique() if int(n) != held)
    if odd:
        raise AnnsLabError(f"{folder / RESULTS} has rows whose indexes held {odd[0]:,} keys, where {dump.path.name} "
                           f"with the sweep's window {window[0]},{window[1]} leaves {held:,}: rows of another sweep; "
                           "report one sweep at a time")


def _sweep_settings(table: pd.DataFrame, settings: dict, folder: Path) -> tuple[int, tuple[int, int]]:
    """The sweep's k (one, the table's and its settings') and static window (from its settings: the figures and
    diagnosis load every head with it), refused where the table and ``sweep.json`` beside it cannot be one sweep."""
    ks = sorted(int(v) for v in table["k"].unique())
    if len(ks) != 1:  # every median, target and figure is of one recall@k
        raise AnnsLabError(f"{folder / RESULTS} mixes sweeps of several k ({', '.join(map(str, ks))}); report one "
                           "sweep at a time")
    window = settings.get("window")
    if window is None:  # a default assumed here built every figure and diagnosis with a window the sweep never used
        if (folder / SETTINGS).is_file():
            raise AnnsLabError(f"{folder / SETTINGS} says no window: it is not a sweep's settings; re-run the sweep")
        raise AnnsLabError(f"{folder / SETTINGS}, which says the sweep's window, is missing: report the results in the "
                           "folder the sweep wrote")
    if settings.get("k", ks[0]) != ks[0]:
        raise AnnsLabError(f"{folder / RESULTS} measured recall@{ks[0]}, but {folder / SETTINGS} is of a sweep with "
                           f"--k {settings['k']}: the table is not this folder's sweep's; re-run the sweep")
    return ks[0], (window[0], window[1])


def _ours(path: Path) -> bool:
    """Whether ``path`` is a file an earlier report wrote (its title, or Matplotlib's PNG stamp): replacing it loses
    nothing of the user's."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:  # a folder, or unreadable: not a report's file
        return False
    if path.suffix == ".png":
        return head.startswith(b"\x89PNG") and b"Matplotlib" in head
    return b"anns-lab report: " in head


def _check_out(out: Path, folder: Path) -> None:
    """Refuse an --out the report would damage: a file, a dump or an export, another sweep's folder (its report would be
    replaced by one of these results, looking like its own), or a folder holding a file of the report's names no report
    wrote."""
    if out.exists() and not out.is_dir():
        raise AnnsLabError(f"--out {out} is a file; give a folder for the report")
    # a sweep reads every file under its parts/ as its own (and names the rest): a report there would be one of them
    for above in (out.resolve(), *out.resolve().parents):
        if above.name == "parts" and (above.parent / SETTINGS).is_file():
            raise AnnsLabError(f"--out {out} is inside the sweep folder {above.parent}'s parts/, which holds its "
                               "results only; give the report a folder of its own")
    if not out.is_dir():
        return
    if out.resolve() != folder.resolve():
        if (out / "manifest.json").exists():
            raise AnnsLabError(f"--out {out} is a dump folder; give the report a folder of its own")
        if exported := [name for name in EXPORT_FILES if os.path.lexists(out / name)]:  # its --overwrite refused then
            raise AnnsLabError(f"--out {out} is an export folder (it holds {exported[0]}); give the report a folder of "
                               "its own")
        if (out / RESULTS).exists() or (out / SETTINGS).exists():
            raise AnnsLabError(f"--out {out} holds another sweep's results, whose report this one would replace; "
                               "give another --out")
    foreign = [name for name in REPORT_FILES if os.path.lexists(out / name) and not _ours(out / name)]
    if foreign:
        raise AnnsLabError(f"--out {out} holds {', '.join(foreign)}, not written by anns-lab report; move "
                           f"{'it' if len(foreign) == 1 else 'them'} away or give another --out")


def _write(out: Path, files: dict[str, bytes]) -> None:
    """Write the report's files into ``out`` (made if new) as one set: every file to a temporary beside its place
    first, then the renames, ``report.md`` last (a report stopped while writing its figures left new PNGs under the old
    pages), under the folder's lock (two reports into one --out both exited 0, their files possibly mixed; a sweep
    still writing its folder holds it); an unwritable --out is one error."""
    pages_last = sorted(files, key=lambda name: (name != "report.md", name != "report.html"))  # renamed in reverse
    try:
        out.mkdir(parents=True, exist_ok=True)
        with hold_folder(out), contextlib.ExitStack() as renames:  # each atomic_path renames at the stack's end
            for name in pages_last:
                renames.enter_context(atomic_path(out / name)).write_bytes(files[name])
    except OSError as err:
        raise AnnsLabError(f"cannot write the report into {out}: {err.strerror or err} ({err.filename or out}); "
                           "give another --out") from None


def spread(items: list, most: int) -> list:
    """Up to ``most`` of ``items``, evenly spaced from the first to the last (a stride of len // most took the first
    ``most`` of 10–17: layer 28's heads left out of a 12-head sweep)."""
    if len(items) <= most:
        return list(items)
    return [items[i] for i in np.unique(np.linspace(0, len(items) - 1, most).round().astype(int))]


def _ivf_reason(dump, table: pd.DataFrame, par: pd.DataFrame, kinds: dict[str, str], pairs, window, k: int,
                most: int = 9) -> str:
    """The measured reason behind IVF's Q→K / K→K figures, on up to ``most`` heads spread over the sweep's ("" if no IVF)."""
    q, kk = findings.scan(par, "ivf", "q2k"), findings.scan(par, "ivf", "k2k")
    if kinds.get("ivf") != "key-only" or q is None or kk is None:
        return ""
    rows = table[table["index"] == "ivf"]
    try:  # an edited table's nlist of text, -3 or 1e9 reached faiss (a traceback, or bad_alloc)
        ivf = registry.create("ivf", **loads_json(rows["build_params"].iloc[0]))
        ivf.check_keys(int(rows["n_keys"].min()))
    except IndexConfigError as err:
        raise AnnsLabError(f"the results table's ivf rows hold build parameters this version refuses ({err}); "
                           "re-run the sweep") from None
    chosen = spread(pairs, most)
    # IVF is key-only: its diagnosis reads no training queries, so none are moved (no model config needed)
    diag = pd.DataFrame([ivf_gap.diagnose(load_head(dump, layer, head, window, train_positions="own"), k,
                                          ivf.params["nlist"] or None, ivf.params["seed"])
                         for layer, head in chosen])
    return findings.ivf_reason(diag, q.fraction, kk.fraction)


def _pareto_note(kinds: dict[str, str]) -> str:
    """What the Pareto table's cells mean, and why estimators are read by their output error instead."""
    note = ("Per head, the cost at the target lies between the two grid points around it, on the line joining them "
            "(the expected cost of searching each query at one or the other: grids of coarse and fine steps compare "
            "at the same recall); a head that never reaches the target counts as needing more than every key; (n/m) "
            "is how many of the heads reach it; ≤: at least half of the heads reach it at their grid's cheapest point, "
            "so the median is at most that (a grid starting lower could read less).")
    estimators = sorted(n for n, kind in kinds.items() if kind == "estimator")
    if estimators:
        note += (f" Estimators ({', '.join(estimators)}) return a weighted sample or cluster summaries beyond their "
                 "exact ids, and recall counts only those ids (an estimator with no exact part has recall 0): compare "
                 "them by attention-output error against bytes read (the figure and table below).")
    return note


def _best_attention_aware(par: pd.DataFrame, kinds: dict[str, str]) -> str | None:
    """The attention-aware index that reaches recall 0.95 on Q→K with the fewest keys (median over heads)."""
    aware = par[(par["direction"] == "q2k") & par["index"].map(lambda n: kinds.get(n) == "attention-aware")]
    return None if aware.empty else str(aware.sort_values(["scan@0.95", "index"]).iloc[0]["index"])


def _pareto_view(par: pd.DataFrame, kinds: dict[str, str]) -> pd.DataFrame:
    rows = []
    for r in par.to_dict("records"):
        row = {"index": r["index"], "direction": r["direction"], "heads": r["heads"]}
        for t in TARGETS:
            row[f"recall {t:.2f}"] = (f"{_bound(r, t)}{fmt_fraction(r[f'scan@{t:.2f}'])} "
                                      f"({r[f'reached@{t:.2f}']}/{r['heads']})")
        row["paper at 0.95"] = paper_figure(r["index"], r["direction"], kinds.get(r["index"], "unknown"))
        rows.append(row)
    return pd.DataFrame(rows)


def _bound(r: dict, t: float, count: str = "first") -> str:
    """"≤ " where at least half of the heads reach ``t`` at their grid's cheapest point (``count``: by scanned fraction,
    or ``first_bytes`` by bytes read; the median is then a bound the grid cannot read below), else ""."""
    return "≤ " if 2 * r[f"{count}@{t:.2f}"] >= r["heads"] > 0 else ""


BYTES_NOTE = ("Bytes read count every index the same way (full keys at 4 bytes per dimension, centroids, page bounds, "
              "codes, graph adjacency rows; each index's docstring says what it counts), so families whose items are "
              "cheaper or dearer than a full key compare fairly.")


def fmt_bytes(v: float) -> str:
    """Bytes per query as KiB, or "not reached" for inf/NaN."""
    return "not reached" if not np.isfinite(v) else f"{v / 1024:.1f} KiB"


def _bytes_view(par: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for r in par[par["direction"] == "q2k"].to_dict("records"):
        row = {"index": r["index"], "heads": r["heads"]}
        row.update({f"recall {t:.2f}": f"{_bound(r, t, 'first_bytes')}{fmt_bytes(r[f'bytes@{t:.2f}'])} "
                                       f"({r[f'reached@{t:.2f}']}/{r['heads']})" for t in TARGETS})
        rows.append(row)
    return pd.DataFrame(rows)


def _heads_view(heads: pd.DataFrame) -> pd.DataFrame:
    view = heads[["layer", "head", "index", "direction"]].copy()
    for t in TARGETS:
        view[f"scan@{t:.2f}"] = heads[f"scan@{t:.2f}"].map(fmt_fraction)
    view["best recall"] = heads["best_recall"].map(lambda v: f"{v:.3f}")
    return view


def _points_view(c: pd.DataFrame) -> pd.DataFrame:
    q = c[c["direction"] == "q2k"]
    return pd.DataFrame({"index": q["index"], "search params": q["search_params"],
                         "recall": q["recall"].map(lambda v: f"{v:.3f}"),
                         "scanned": q["scanned_fraction"].map(lambda v: f"{100 * v:.2f}%"),
                         "KiB read": q["bytes_read"].map(lambda v: f"{v / 1024:.1f}"),
                         "mass kept (estimators: est. / true normaliser)": q["mass_recovered"].map(
                             lambda v: markdown.number(v, "{:.4f}")),
                         "output rel. error": q["output_rel_error"].map(lambda v: markdown.number(v, "{:.4f}")),
                         "latency µs": q["latency_us"].map(lambda v: markdown.number(v, "{:.0f}"))})


def _md_table(df: pd.DataFrame, code: tuple[str, ...] = ()) -> list[str]:
    """``df`` as a Markdown table, each cell as written (:func:`markdown.cell`), those of the ``code`` columns as code
    spans."""
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    as_code = [c in code for c in df.columns]
    return lines + ["| " + " | ".join(markdown.code(str(v), in_table=True) if c else markdown.cell(v)
                                      for v, c in zip(row, as_code)) + " |" for row in df.itertuples(index=False)]


AT_TARGET = "Each index at recall 0.95, head by head (Q→K): scanned fraction, bytes read, output error"


def _markdown(dump, intro: str, found, pareto_view: pd.DataFrame, pareto_note: str, par: pd.DataFrame,
              maha: pd.DataFrame, decay: pd.DataFrame, c: pd.DataFrame, k: int, at_target: list[str]) -> str:
    lines = [f"# anns-lab report: {markdown.code(dump.model)}, {markdown.code(dump.path.name)}", "", intro, "",
             "An HTML version with sortable tables and a per-head table is `report.html` beside this file.", "",
             "## Findings against the paper", ""]
    lines += [f.markdown() for f in found]
    lines += ["", "## Least fraction of keys scanned to reach a recall target (median over heads)", "",
              pareto_note, ""]
    lines += _md_table(pareto_view)
    lines += ["", "![recall vs scanned](recall_vs_scanned.png)", "",
              "## Least bytes of index data read per query to reach a recall target (Q→K, median over heads)", "",
              BYTES_NOTE, ""]
    lines += _md_table(_bytes_view(par))
    lines += ["", "![recall and error vs bytes read](recall_vs_bytes.png)", "", f"## {AT_TARGET}", "", *at_target, "",
              f"## {FIGURES['mahalanobis.png']}", "",
              "Median Mahalanobis distance to the distribution of the indexed keys, over every head:", ""]
    lines += [f"- {kind}: {v:.1f}" for kind, v in maha.groupby("kind")["distance"].median().items()]
    lines += ["", "![mahalanobis](mahalanobis.png)", "", f"## {FIGURES['dynamic_vs_static.png']}", "",
              f"- dynamic top-{k} (each step's own): mean recovered attention mass {decay['dynamic'].mean():.3f}",
              f"- static top-{k} (the first step's, kept fixed): {decay['static'].mean():.3f}, "
              f"{decay.loc[decay['step'] == decay['step'].max(), 'static'].mean():.3f} at the last step", "",
              "![dynamic vs static](dynamic_vs_static.png)", "", "## Every operating point (median over heads, Q→K)", ""]
    lines += _md_table(_points_view(c), code=("search params",))
    return "\n".join(lines) + "\n"
