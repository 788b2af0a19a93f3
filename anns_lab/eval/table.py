"""The sweep's results table: its file names, its columns, and reading it back (no plotting, no index imports)."""

from __future__ import annotations

import json
import reprlib
from pathlib import Path

import numpy as np
import pandas as pd

from anns_lab.dumps import rope
from anns_lab.errors import AnnsLabError
from anns_lab.indexes import group_queries
from anns_lab.indexes.registry import NAME
from anns_lab.io import loads_json, read_json

RESULTS = "results.parquet"
SETTINGS = "sweep.json"
SWEEP_FORMAT = 1  # sweep.json's "format_version" (folders from before it have none: format 1)
COLUMNS = ["dump", "model", "layer", "head", "kv_head", "index", "build_params", "search_params", "direction", "k",
           "n_keys", "n_queries", "recall", "scanned_fraction", "bytes_read", "mass_recovered", "output_rel_error", "latency_us",
           "qps", "build_s", "index_bytes", "auto_rules"]
ADDED = ("auto_rules",)  # columns added after tables were swept: a table without one loads with it None (unknown)
NUMBERS = ("layer", "head", "k", "n_keys", "recall", "scanned_fraction", "bytes_read", "mass_recovered",
           "output_rel_error", "latency_us", "qps", "build_s", "index_bytes")
COUNTS = ("layer", "head", "k", "n_keys")  # whole numbers the readers turn into ints (a NaN there was a traceback)
DIRECTIONS = ("q2k", "k2k")
CELL = ["layer", "head", "index", "build_params", "search_params", "direction"]  # one measurement per cell

_BRIEF = reprlib.Repr()
_BRIEF.maxstring = 80


def _shown(value) -> str:
    """A value of a table or settings file in an error line, as Python writes it (numpy's scalars as the plain
    number), its text cut to 80 characters: an edited cell may hold megabytes."""
    return _BRIEF.repr(value.item() if isinstance(value, np.generic) else value)


def sweep_folder(path: str | Path) -> Path:
    """The sweep's folder of ``path``, a results.parquet or the folder itself."""
    path = Path(path)
    return path if path.is_dir() else path.parent


def swept_model(path: str | Path) -> dict | str:
    """The shape of the model whose dump the sweep at ``path`` read (``architecture``, None where the manifest predates
    it; ``n_layers``, ``n_heads``, ``n_kv_heads``, ``head_dim``), its ``weights_fingerprint``, ``source`` and
    ``files_stamp`` (None likewise), or why that dump cannot be read."""
    from anns_lab.dumps.store import read_manifest
    from anns_lab.errors import DumpError

    where = None
    try:
        where = loads_json((sweep_folder(path) / SETTINGS).read_bytes()).get("dump")
        m = read_manifest(Path(where))
    except (AttributeError, DumpError, OSError, TypeError, ValueError) as err:
        return str(err) if isinstance(err, DumpError) else f"the sweep records none at {where}"
    return {k: m["model"].get(k) for k in ("architecture", "weights_fingerprint", "source", "files_stamp")} | {
        k: m[k] for k in ("n_layers", "n_heads", "n_kv_heads", "head_dim")}


def load_results(path: str | Path) -> tuple[pd.DataFrame, dict]:
    """The results table and its sweep settings, from a results.parquet or its folder."""
    path = Path(path)
    folder = sweep_folder(path)
    file = folder / RESULTS if path.is_dir() else path
    if not file.is_file():
        raise AnnsLabError(f"no results table at {file}; run `anns-lab sweep` first")
    try:
        table = pd.read_parquet(file, page_checksum_verification=True)  # a flipped byte: an error, not a number
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise AnnsLabError(f"{file} is not an anns-lab results table ({type(err).__name__}: {err})") from None
    missing = set(COLUMNS) - set(table.columns) - set(ADDED)
    if missing:
        raise AnnsLabError(f"{file} is not an anns-lab results table (missing columns {sorted(missing)})")
    for column in ADDED:
        if column not in table.columns:
            table[column] = None
    table = table.reset_index(drop=True)  # a table written with its pandas index kept: labels repeat, rows do not
    problem = table_problem(table)
    if problem:
        raise AnnsLabError(f"{file} holds a row no conforming index produces: {problem}; re-run the sweep")
    # One spelling per value, the sweep's (keys sorted): an edited cell's spacing was another cell to the duplicate
    # check below, and another build to the readers' groupings.
    for column in ("build_params", "search_params"):
        spelled = {t: json.dumps(loads_json(t), sort_keys=True) for t in table[column].unique()}
        table[column] = table[column].map(spelled)
    dup = table.duplicated([*CELL, "k"])  # two sweeps of several k merged: the readers say that, in their words
    if dup.any():  # the sweep writes one row per cell; a repeated one would weigh twice in every median and pick
        r = table[dup].iloc[0]
        raise AnnsLabError(f"{file} holds {r['index']} {r['search_params']} {r['direction']} on layer {r['layer']} "
                           f"head {r['head']} more than once; re-run the sweep")
    try:
        settings = read_json(folder / SETTINGS) if (folder / SETTINGS).is_file() else {}
    except (OSError, ValueError) as err:
        raise AnnsLabError(f"{folder / SETTINGS} is corrupt ({err}); re-run the sweep") from None
    if isinstance(settings, dict) and (other := format_problem(settings)):  # another format's settings read otherwise
        raise AnnsLabError(f"{folder / SETTINGS}: {other}; read it with the anns-lab that swept it, or sweep again")
    problem = (f"a JSON {type(settings).__name__}" if not isinstance(settings, dict) else _settings_problem(settings))
    if problem:
        raise AnnsLabError(f"{folder / SETTINGS} is not a sweep's settings ({problem}); re-run the sweep")
    return table, settings


def format_problem(settings: dict) -> str | None:
    """Why this anns-lab cannot read a sweep folder of ``settings`` (another sweep format), in words, or None."""
    version = settings.get("format_version", 1)
    if version == SWEEP_FORMAT:
        return None
    return f"its sweep format is {_shown(version)}, this anns-lab reads format {SWEEP_FORMAT}"


def _settings_problem(settings: dict) -> str | None:
    """A value no sweep writes into its ``sweep.json``, in words, or None: a window that is not two whole numbers
    ≥ 0 (report and ``decode --from-sweep`` load and compare with it), names and stamps that are not text."""
    window = settings.get("window")
    if window is not None and not (isinstance(window, list) and len(window) == 2
                                   and all(type(w) is int and w >= 0 for w in window)):
        return f"window {_shown(window)}"
    for key in ("dump", "dump_created", "dump_stamp", "train_group", "train_positions"):
        if key in settings and not isinstance(settings[key], str):
            return f"{key} {_shown(settings[key])}"
    for key, check in (("train_group", group_queries.check_mode), ("train_positions", rope.check_place)):
        try:  # decode --from-sweep would ask for it back
            if key in settings:
                check(settings[key])
        except AnnsLabError as err:
            return f"{key}: {err}"
    return None


def table_problem(table: pd.DataFrame) -> str | None:
    """The first row of a results table whose numbers no conforming index can produce, in words, or None.

    The sweep never writes such a row; this guards readers (report, ``decode --from-sweep``) against
    tables edited by hand or written by another tool.
    """
    if table.empty:  # its columns may be untyped (object): nothing to check
        return None
    for column in NUMBERS:  # before any comparison: text there made the readers fail with a traceback
        if not pd.api.types.is_numeric_dtype(table[column]) or pd.api.types.is_bool_dtype(table[column]):
            return f"column {column} holds {table[column].dtype} values, not numbers"
    def at_least(column: str, low: float, unmeasured: bool = False) -> pd.Series:  # NaN: not measured (a quick sweep)
        v = table[column].astype(float)
        return (np.isfinite(v) & (v >= low)) | (np.isnan(v) if unmeasured else False)

    checks = (("recall", (table["recall"] >= 0) & (table["recall"] <= 1), "is not in [0, 1]"),
              ("scanned_fraction", (table["scanned_fraction"] > 0) & np.isfinite(table["scanned_fraction"]),
               "is not a positive finite fraction"),
              ("bytes_read", at_least("bytes_read", 0), "is not a non-negative number"),
              # a negative latency or an infinite error was printed in the report as measured, or broke its figures
              ("mass_recovered", at_least("mass_recovered", 0, True), "is neither unmeasured nor a number ≥ 0"),
              ("output_rel_error", at_least("output_rel_error", 0, True), "is neither unmeasured nor a number ≥ 0"),
              ("latency_us", at_least("latency_us", 0, True), "is neither unmeasured nor a number ≥ 0"),
              ("qps", at_least("qps", 0, True), "is neither unmeasured nor a number ≥ 0"),
              ("build_s", at_least("build_s", 0), "is not a number ≥ 0"),
              ("index_bytes", at_least("index_bytes", 0), "is not a number ≥ 0"))
    for column, ok, rule in checks:
        if not ok.all():
            r = table[~ok].iloc[0]
            return (f"{column} {r[column]} of {r['index']} (layer {r['layer']}, head {r['head']}, "
                    f"{r['search_params']}) {rule}")
    return _kind_problem(table)


def _kind_problem(table: pd.DataFrame) -> str | None:
    """The first value of a kind no sweep writes, in words, or None: a fractional or missing layer, head, k or key
    count, a k or key count of 0 or a k above the keys, an unknown direction, an index without a name, a dump or model
    that is not text, parameters or auto rules that are not a JSON object (the readers failed on them with a traceback,
    or cast them silently)."""
    for column in COUNTS:
        v = table[column].to_numpy(dtype=float)
        bad = ~(np.isfinite(v) & (v == np.round(v)) & (v >= 0))
        if bad.any():
            return f"{column} {v[bad][0]} is not a whole number ≥ 0"
    for column in ("k", "n_keys"):  # a search of no keys, or over none: every ratio read from it divides by zero
        if (table[column] < 1).any():
            return f"{column} {table.loc[table[column] < 1, column].iloc[0]} is not a count ≥ 1"
    if (table["k"] > table["n_keys"]).any():
        r = table[table["k"] > table["n_keys"]].iloc[0]
        return f"k {r['k']} of {r['index']} (layer {r['layer']}, head {r['head']}) exceeds the {r['n_keys']} keys it held"
    odd = table.loc[~table["direction"].isin(DIRECTIONS), "direction"]
    if len(odd):
        return f"direction {_shown(odd.iloc[0])} is neither of {', '.join(DIRECTIONS)}"
    named = table["index"].map(lambda v: isinstance(v, str) and bool(NAME.fullmatch(v)))
    if not named.all():  # names reach file names, figure labels and report cells
        return f"an index name {_shown(table.loc[~named, 'index'].iloc[0])} is not a name (letters, digits and . _ + -)"
    for column in ("dump", "model"):  # report and decode sort and print them (a None among text was a TypeError)
        odd = table.loc[~table[column].map(lambda v: isinstance(v, str)), column]
        if len(odd):
            v = odd.iloc[0]
            missing = v is None or (isinstance(v, float) and np.isnan(v))
            return f"a row has no {column}" if missing else f"{column} {_shown(v)} is not text"
    for column in ("build_params", "search_params", "auto_rules"):  # decode --from-sweep reads them (after the load)
        for text in table[column].unique():
            if column == "auto_rules" and text is None:  # a table from before the column: the rules are unknown
                continue
            try:
                params = loads_json(text)
            except (TypeError, ValueError):
                params = None
            if not isinstance(params, dict):
                return f"{column} {_shown(text)} is not a JSON object"
            if column == "auto_rules" and not all(isinstance(v, str) for v in params.values()):
                return f"auto_rules {_shown(text)} does not name each rule with text"
    return None
