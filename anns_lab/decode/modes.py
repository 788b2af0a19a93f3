"""Which modes a decode run compares: parsed from ``--mode`` and ``--param``, or picked from a sweep's results."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from anns_lab.decode.engine import Mode
from anns_lab.decode.options import BASELINES, mode_names
from anns_lab.decode.placement import IndexPlan
from anns_lab.dumps import rope
from anns_lab.errors import DecodeError, IndexConfigError
from anns_lab.indexes import group_queries, protocol, registry
from anns_lab.indexes.base import resolve_params
from anns_lab.io import loads_json

if TYPE_CHECKING:
    import pandas as pd

ATTENTION_AWARE = "roargraph"
NOTE = "  note: "  # the start of a pick line that warns (the decode CLI prints those on stderr too)


def default_index() -> str:
    """The attention-aware index when registered, else exact top-k (``flat``), with a note why."""
    try:
        registry.get(ATTENTION_AWARE)
        return ATTENTION_AWARE
    except IndexConfigError as err:
        print(f"note: the attention-aware index is not available ({err}); the default mode is 'flat' (exact top-k)",
              file=sys.stderr)
    return "flat"


def parse_modes(spec: str, search: dict, build: dict) -> list[Mode]:
    """``full,window,flat,roargraph`` → modes; each --param goes to every index that declares it."""
    names = [default_index() if n == "default" else n for n in mode_names(spec)]
    modes, used_s, used_b = [], set(), set()
    for name in dict.fromkeys(names):
        if name in BASELINES:
            modes.append(Mode(name))
            continue
        try:  # the named indexes only: a plugin that hangs or fails at import stops no run that leaves it out
            cls = registry.get(name)
        except IndexConfigError as err:  # the registry's own message: close names, or why a registered one fails
            if any(e.name == name for e in registry.entries()):  # announced, but it fails to load: not "unknown"
                raise DecodeError(f"mode {name!r}: {err}") from None
            raise DecodeError(f"unknown mode {name!r}: use full, window or a registered index; {err}") from None
        s = {k: v for k, v in search.items() if k in cls.search_params}
        b = {k: v for k, v in build.items() if k in cls.build_params}
        used_s |= set(s)
        used_b |= set(b)
        if why := params_problem(cls, name, b, s):  # before any model is loaded
            raise DecodeError(why)
        modes.append(Mode(name, IndexPlan(name, b, s)))
    for given, used, flag in ((search, used_s, "--param"), (build, used_b, "--build-param")):
        unused = sorted(set(given) - used)
        if unused:
            raise DecodeError(f"{flag} {', '.join(unused)}: no selected index mode declares it "
                              f"(modes: {', '.join(m.name for m in modes)})")
    return modes


def _loads(name: str) -> bool:
    """Whether index ``name`` is registered and loads (one entry point imported, not every plugin's)."""
    try:
        registry.get(name)
        return True
    except IndexConfigError:
        return False


def check_sweep_pick(path: str, target: float, topk: int | None = None,
                     window: tuple[int, int] | None = None) -> tuple[pd.DataFrame, dict]:
    """The sweep's table and settings, refused where no pick could serve this decode: a target outside (0, 1], a table
    swept at another k than ``topk`` or another window (what needs no model: checked before it loads)."""
    from anns_lab.eval.table import SETTINGS, load_results

    if not 0 < target <= 1:
        raise DecodeError(f"--target-recall {target} must lie in (0, 1]")
    table, settings = load_results(path)
    if len(dumps := sorted(table["dump"].unique())) > 1:  # parts of several dumps' sweeps merged by hand: as report
        raise DecodeError(f"{path} mixes several dumps ({', '.join(dumps)}); pick from one sweep")
    swept_k = sorted({int(v) for v in table["k"].unique()})
    if topk is not None and len(swept_k) > 1:
        raise DecodeError(f"{path} mixes sweeps of several k ({', '.join(map(str, swept_k))}); pick from one sweep")
    if topk is not None and swept_k and swept_k != [topk]:
        raise DecodeError(f"{path} measured recall@{swept_k[0]}, this decode retrieves the top {topk}: "
                          f"sweep with --k {topk}, or decode with --topk {swept_k[0]}")
    swept_window = settings.get("window")
    if window is not None and swept_window is None:  # its recall was measured for a window nobody can tell
        raise DecodeError(f"{path}: the sweep's settings ({SETTINGS} beside its table, with the window it was swept "
                          "with) are missing: pick from the folder the sweep wrote")
    if window is not None and tuple(swept_window) != tuple(window):
        raise DecodeError(f"{path} was swept with --window {','.join(map(str, swept_window))}, this decode attends "
                          f"{','.join(map(str, window))} exactly: sweep with this window, or decode with the sweep's")
    rows = table.loc[table["direction"] == "q2k", ["index", "build_params", "search_params"]].drop_duplicates()
    for index, build, search in rows.itertuples(index=False):  # any of them may be the pick
        if _loads(index):  # one not registered here is left out of the pick, with a note
            _swept_row(path, index, build, search)
    return table, settings


def _swept_row(path: str, index: str, build_params: str, search_params: str) -> tuple[type, dict, dict, dict]:
    """A table row's index class, build parameters (those the row predates filled in as built then), search parameters
    and the build parameters filled in; one DecodeError where this version of the index refuses them (swept with
    another version, or an edited table): refused before the model loads, not blamed on the context after it."""
    cls = registry.get(index)
    swept = loads_json(build_params)
    if gone := sorted(set(swept) - set(cls.build_params)):
        raise DecodeError(f"{path} was swept with {index} parameters this version does not have ({', '.join(gone)}); "
                          "sweep again")
    filled = {k: v for k, v in cls.build_params_before.items() if k not in swept}
    swept = filled | swept
    search = loads_json(search_params)
    if unknown := sorted(set(search) - set(cls.search_params)):
        raise DecodeError(f"{path} was swept with {index} search parameters this version does not have "
                          f"({', '.join(unknown)}); sweep again")
    if why := params_problem(cls, index, swept, search):
        raise DecodeError(f"{path} holds a row this version of {index} refuses ({why}); sweep again")
    return cls, swept, search, filled


def params_problem(cls, name: str, build: dict, search: dict) -> str | None:
    """Why index ``name`` (``cls``) refuses these build parameters (their ranges, and its constructor's own rules:
    snapkv's odd kernel, infllm's repr within its block) or search parameters (their ranges), or None."""
    if problem := protocol.declaration_problem(cls):  # its calibration's grid, its --from-sweep tables
        return f"index {name}'s class is inconsistent: {problem}; fix its declarations"
    try:
        cls(**build)
        resolve_params(name, cls.search_params, search)
    except IndexConfigError as err:
        return str(err)
    except Exception as err:  # a plugin's own check that raised something else
        return f"{name}: {type(err).__name__}: {err}"
    return None


def pick_from_sweep(path: str, model: str, target: float, layers: list[int],
                    train_group: str = group_queries.DEFAULT, train_positions: str = rope.DEFAULT,
                    topk: int | None = None, window: tuple[int, int] | None = None,
                    n_keys: int | None = None) -> tuple[Mode, list[str]]:
    """The index + parameters with the least scanned fraction reaching ``target`` recall, per layer where possible.

    Recall and scanned fraction are averaged over the heads of a layer (Q→K rows only), among the configurations
    measured on every head the table holds there. Layers
    the table does not cover get the configuration that is best over all its layers. An attention-aware pick
    needs the decode's ``train_group`` and ``train_positions`` to be the sweep's (its rows measured those graphs); any
    pick needs its ``topk`` and ``window`` to be the sweep's ``--k`` and ``--window`` (recall@10 says nothing of a
    top-100, nor recall beside one window of another's). ``n_keys``: the keys this decode's indexes will hold, where
    known; a note says when the sweep's heads held other counts (absolute parameters such as ``nprobe`` then scan
    another fraction).
    """
    table, settings = check_sweep_pick(path, target, topk, window)
    rows = table[table["direction"] == "q2k"]
    models = sorted(rows["model"].unique())
    rows = rows[rows["model"] == model]
    if rows.empty:
        raise DecodeError(f"{path} has no Q→K results for model {model!r} (it has: {', '.join(models) or 'none'})")
    missing = sorted(name for name in set(rows["index"]) if not _loads(name))  # the table's indexes only
    if len(missing) == rows["index"].nunique():
        raise DecodeError(f"{path}: no index of the table ({', '.join(missing)}) is registered here; install "
                          "its plugin package, or pick from another sweep")
    rows = rows[~rows["index"].isin(missing)]
    keys = ["index", "build_params", "search_params"]
    cautions = [f"{NOTE}{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not registered here (a plugin not "
                "installed): left out of the pick"] if missing else []

    def whole(df):
        """The rows of the configurations measured on every (layer, head) of ``df`` (a failed or unfinished part
        leaves one short, and its mean over the heads left would not be comparable), and the indexes cut short."""
        pairs = df[["layer", "head"]].drop_duplicates().shape[0]
        covered = df.groupby(keys)[["layer", "head"]].apply(lambda g: g.drop_duplicates().shape[0])
        short = covered[covered < pairs]
        if short.empty:
            return df, []
        cut = df.set_index(keys).index.isin(short.index)
        return df[~cut], sorted({k[0] for k in short.index})

    def best(df):
        df, short = whole(df)
        for name in short:
            line = (f"{NOTE}{name}: some of its configurations lack rows for heads of the table (a failed or unfinished "
                    "sweep part: rerun the sweep to finish it); left out of the pick where they do")
            if line not in cautions:
                cautions.append(line)
        if df.empty:
            return None, None
        agg = df.groupby(keys, as_index=False)[["recall", "scanned_fraction"]].mean()
        ok = agg[agg["recall"] >= target]
        if ok.empty:
            return None, float(agg["recall"].max())
        return ok.sort_values(["scanned_fraction", "recall"], ascending=[True, False]).iloc[0], None

    overall, top = best(rows)
    if overall is None and top is None:
        raise DecodeError(f"no configuration in {path} was measured on every head of the table for {model} (failed or "
                          "unfinished sweep parts): rerun the sweep to finish them")
    if overall is None:
        raise DecodeError(f"no index in {path} reaches recall {target} for {model} (best mean recall {top:.3f}); "
                          "lower --target-recall or sweep more thorough parameters")

    older = {}  # index → the search parameters its rows predate, run as before they existed
    built_before = {}  # index → the build parameters its rows predate, built as before they existed
    notes = {}  # (index, build parameters) → the note on the auto rules its rows were swept with, once

    def plan(r) -> IndexPlan:
        """The row's index with only the parameters that differ from the index's defaults (short to read); a search
        parameter the row predates gets the index's value for "as before it existed" (``search_params_before``)."""
        cls, swept, search, filled = _swept_row(path, r["index"], r["build_params"], r["search_params"])
        if filled:
            built_before.setdefault(r["index"], filled)
        build = {k: v for k, v in swept.items() if v != cls.build_params[k].default}
        # The sweep records its grid's search parameters only (roargraph: L), so a missing one alone does not date a
        # row; the build parameters it records are all of them (search_params_since).
        before = {k: v for k, v in cls.search_params_before.items()
                  if k not in search and cls.search_params_since.get(k) not in swept}
        if before:
            older.setdefault(r["index"], before)
        same = rows[(rows["index"] == r["index"]) & (rows["build_params"] == r["build_params"])]
        note = _auto_rules_note(cls, r["index"], swept, same["auto_rules"])
        if note:
            notes.setdefault((r["index"], r["build_params"]), note)
        return IndexPlan(r["index"], build, {**search, **before})

    base = plan(overall)
    per_layer, lines = {}, [f"from sweep {path}: {base.describe()} reaches mean recall {overall['recall']:.3f} "
                            f"at {100 * overall['scanned_fraction']:.2f}% scanned (all layers of the table)"]
    uncovered = []
    for layer in layers:
        sub = rows[rows["layer"] == layer]
        if sub.empty:
            uncovered.append(layer)
            continue
        r, top = best(sub)
        if r is None:
            why = "no configuration measured on all its heads" if top is None else f"best {top:.3f}"
            lines.append(f"  layer {layer}: nothing reaches {target} ({why}), uses {base.describe()}")
            continue
        per_layer[layer] = plan(r)
        lines.append(f"  layer {layer}: {per_layer[layer].describe()} recall {r['recall']:.3f} at "
                     f"{100 * r['scanned_fraction']:.2f}% scanned")
    if uncovered:
        many = len(uncovered) > 1
        lines.append(f"  layer{'s' if many else ''} {ranges(uncovered)}: not in the table, "
                     f"use{'' if many else 's'} {base.describe()}")
    swept_keys = sorted({int(v) for v in rows["n_keys"].unique()})
    if n_keys is not None and any(abs(v - n_keys) > 0.1 * n_keys for v in swept_keys):
        held = f"{swept_keys[0]:,}" if len(swept_keys) == 1 else f"{swept_keys[0]:,} to {swept_keys[-1]:,}"
        cautions.append(f"{NOTE}the sweep's heads held {held} keys, this decode's indexes about {n_keys:,}: a search "
                        "parameter counts lists, nodes or tokens, not a share of the keys, so its recall and scanned "
                        "fraction here differ from the sweep's (sweep a dump of this context for a pick that holds)")
    lines.extend(cautions)
    for index, before in older.items():
        lines.append(f"  {index} rows of the table predate {', '.join(before)}: run with "
                     f"{', '.join(f'{k}={v}' for k, v in before.items())}, the search they measured")
    for index, before in built_before.items():
        lines.append(f"  {index} rows of the table predate {', '.join(before)}: built with "
                     f"{', '.join(f'{k}={v}' for k, v in before.items())}, the index they measured")
    lines.extend(notes.values())
    swept_group = settings.get("train_group", "head")  # sweeps before the option: one graph per query head
    aware = sorted({p.name for p in (base, *per_layer.values()) if registry.get(p.name).uses_train_queries})
    if aware and swept_group != train_group:
        raise DecodeError(f"{path} was swept with --train-group {swept_group}: its {', '.join(aware)} rows measured those "
                          f"graphs, not the decode's --train-group {train_group}; pass --train-group {swept_group}")
    swept_at = settings.get("train_positions", "own")  # sweeps before the option: queries at their own positions
    moved = [name for name in aware if registry.get(name).moves_train_queries()]
    if moved and swept_at != train_positions:
        raise DecodeError(f"{path} was swept with --train-positions {swept_at}: its {', '.join(moved)} rows measured "
                          f"those graphs, not the decode's --train-positions {train_positions}; pass --train-positions {swept_at}")
    name = f"sweep:{base.name}"
    return Mode(name, base, per_layer), lines


def _auto_rules_note(cls, name: str, swept: dict, recorded) -> str | None:
    """A note when a build parameter the rows left at auto (0) was resolved by another rule than this version's
    (``Index.auto_rules``), or by one the rows do not record (tables from before the ``auto_rules`` column); else None.
    ``recorded``: the rows' ``auto_rules`` (JSON text, or None)."""
    auto = [k for k in cls.auto_rules if swept.get(k, cls.build_params[k].default) == 0]
    seen = [loads_json(v) if isinstance(v, str) else None for v in set(recorded)]
    parts = []
    for k in auto:
        stamps = sorted({"unknown" if s is None or k not in s else s[k] for s in seen} - {cls.auto_rules[k]})
        if stamps:
            parts.append(f"{k} (sweep {'/'.join(stamps)}, now {cls.auto_rules[k]})")
    if not parts:
        return None
    return (f"{NOTE}{name}: parameters left at auto are resolved by rules the sweep did not use (or did not record): "
            f"{', '.join(parts)}; this decode builds them with today's rules, which the sweep's figures may not describe")


def ranges(values: list[int]) -> str:
    """Ascending whole numbers as runs, for a line a person reads: [0, 1, 3, 4, 5, 9] → '0-1, 3-5, 9'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)
