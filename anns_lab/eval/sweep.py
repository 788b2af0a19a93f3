"""``anns-lab sweep``: every index × every grid point × every (layer, head) of a dump, into one table.

Work is split by (layer, head) over an executor (:mod:`anns_lab.eval.executors`: worker processes
on this machine, or a Ray cluster), each worker single-threaded (one thread is what a decoder's
retrieval gets per head, and it keeps timings comparable). The driver writes every finished
(layer, head, index) at once to ``parts/`` (atomic), so an interrupted sweep continues where it
stopped, on either executor; a part that fails leaves a record (:mod:`anns_lab.eval.failures`)
so reruns retry it a bounded number of times. ``results.parquet`` is the union of the parts,
rewritten at the end (also after Ctrl-C).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from anns_lab import stops
from anns_lab.dumps import rope
from anns_lab.dumps.store import dump_stamp, open_dump, write_table
from anns_lab.errors import AnnsLabError, ExecutorLost, IndexConfigError, IndexResultError
from anns_lab.eval import failures as failed
from anns_lab.eval import metrics, plan
from anns_lab.eval.executors import Outcome, Part, open_executor
from anns_lab.eval.heads import HeadData, check_full_attention, check_k, default_layers, evaluable_layers, load_head
from anns_lab.eval.table import (ADDED, CELL, COLUMNS, DIRECTIONS, RESULTS, SETTINGS, SWEEP_FORMAT, format_problem,
                                 table_problem)
from anns_lab.indexes import group_queries, protocol
from anns_lab.indexes.warmup import warm_up
from anns_lab.io import atomic_write_json, loads_json, read_json, sole_writer

LATENCY_QUERIES = 16
MAX_ATTEMPTS = 3
PART_SETTINGS = b"anns_lab.sweep"  # a part's Parquet schema metadata: the settings of the sweep that wrote it (JSON)
PART_CODE = b"anns_lab.index_code"  # and its index's code (registry.code_stamp, JSON)
STALE = "stale"  # parts/stale/: a part being evaluated again, kept there until its new one is written
PART_NAME = re.compile(r"L(\d+)_H(\d+)_(.+?)(-[0-9a-f]{10})?\.parquet")  # _part_name's


class SweepInterrupted(AnnsLabError):
    """Ctrl-C stopped the sweep; the finished parts are kept and the message says how to resume."""


@dataclass
class SweepResult:
    """The results table, where it lives, and what failed (index, layer, head, error)."""

    table: pd.DataFrame
    path: Path
    failures: list[tuple[str, int, int, str]] = field(default_factory=list)
    seconds: float = 0.0


def _non_default(index: str, build_params: dict | None) -> dict:
    """``build_params`` without the values equal to ``index``'s declared defaults: a build given its defaults is the
    default build, one part (named apart, it was a second copy of the same rows)."""
    from anns_lab.indexes import registry

    declared = registry.get(index).build_params
    return {k: v for k, v in (build_params or {}).items() if k not in declared or v != declared[k].default}


def _part_name(layer: int, head: int, index: str, build_params: dict | None = None) -> str:
    # Non-default build parameters get their own part, so variants of one index can share a sweep. A whole float is
    # named as the int it equals: the values are coerced (min_cooc=0 arrives as 0.0), and folders swept before that
    # named the usual spelling, min_cooc=0, so they still resume.
    whole = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in (build_params or {}).items()}
    tag = "" if not whole else "-" + hashlib.sha1(json.dumps(whole, sort_keys=True).encode()).hexdigest()[:10]
    return f"L{layer:03d}_H{head:02d}_{index}{tag}.parquet"


# Native thread pools (OpenMP, OpenBLAS) size themselves when loaded, before any call can shrink them:
# a local worker gets these in its environment from the start. Without them numpy's and the kernels'
# pools spin on a busy machine (one ivf part: 35 s wall / 8 s CPU against 2.8 s / 0.7 s, load 25).
WORKER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _single_thread() -> None:
    import faiss
    import numba

    faiss.omp_set_num_threads(1)
    numba.set_num_threads(1)


def evaluate_index(name: str, data: HeadData, k: int, dump_label: str, model: str,
                   build_params: dict | None = None, quick: bool = False) -> pd.DataFrame:
    """Build ``name`` (defaults overridden by ``build_params``) on one head; measure its grid in both directions.

    ``quick`` skips the attention-quality and batch-1 latency passes (their columns are NaN): for parameter scans.
    """
    from anns_lab.indexes import registry

    index = registry.create(name, **(build_params or {}))
    t0 = time.perf_counter()
    group = data.group_queries if index.accepts_group_queries else None
    index.build(data.keys, data.train_queries_for(type(index)) if index.uses_train_queries else None, group_queries=group,
                **data.positions_for(type(index)))
    build_s = time.perf_counter() - t0
    rows = []
    for params in index.grid():
        search = type(index).scaled(params, data.scaling)  # the table records the grid's parameters
        for direction, queries in (("q2k", data.test_queries), ("k2k", data.k2k_queries)):
            t0 = time.perf_counter()
            res = index.search(queries, k, **search)
            batch_s = time.perf_counter() - t0
            # Nothing that breaks the protocol enters the table: the part fails, naming the index and the rule.
            protocol.check_result(f"{name} at {params}", res, len(queries), k, len(data.keys), index.max_scanned(),
                                  queries, data.keys)
            protocol.check_estimate(f"{name} at {params}", res, index)
            lat = []
            for q in queries[:0 if quick else LATENCY_QUERIES]:
                t0 = time.perf_counter()
                one = index.search(q[None, :], k, **search)
                lat.append(time.perf_counter() - t0)
                protocol.check_result(f"{name} at {params}", one, 1, k, len(data.keys), index.max_scanned())
            mass, err = (data.attention_quality(res.ids, res.estimate, index.summaries())
                         if direction == "q2k" and not quick else (np.nan, np.nan))
            rows.append({
                "dump": dump_label, "model": model, "layer": data.layer, "head": data.head, "kv_head": data.kv_head,
                "index": name, "build_params": json.dumps(index.params, sort_keys=True),
                "search_params": json.dumps(params, sort_keys=True), "direction": direction, "k": k,
                "n_keys": len(data.keys), "n_queries": len(queries),
                "recall": float(metrics.recall_at_k(res.ids, data.exact(direction), k).mean()),
                "scanned_fraction": float(res.n_scanned.mean() / len(data.keys)),
                "bytes_read": float(res.bytes_read.mean()),
                "mass_recovered": mass, "output_rel_error": err,
                "latency_us": float(np.median(lat) * 1e6) if lat else np.nan, "qps": len(queries) / batch_s,
                "build_s": build_s, "index_bytes": protocol.held_bytes(name, index),
                "auto_rules": json.dumps(dict(index.auto_rules), sort_keys=True),
            })
    if not rows:  # a part of no rows: kept as finished, it stood for the head in the table as if measured
        raise IndexResultError(f"{name}: its grid() gave no search parameters to measure")
    table = pd.DataFrame(rows, columns=COLUMNS)
    if problem := table_problem(table):  # an estimate's infinite error: its readers refuse such a part, every resume
        raise IndexResultError(f"{name}: {problem}")
    return table


@dataclass(frozen=True)
class SweepWork:
    """What a worker needs to evaluate one part, on any executor (picklable: plain settings, no arrays)."""

    dump: str
    k: int
    window: tuple[int, int]
    build_params: dict
    quick: bool
    train_group: str = group_queries.DEFAULT
    train_positions: str = rope.DEFAULT
    label: str | None = None  # the rows' dump and model, resolved on the driver: a node sent a head's arrays may not
    model: str | None = None  # see the dump at all (None: read from the dump here)
    stamp: str | None = None  # the dump's (store.dump_stamp) when the sweep began: a dump replaced since is refused
    keep_own: bool = False  # an index swept reads the training queries where they were (Index.own_positions)

    def worker_env(self) -> dict[str, str]:
        return dict(WORKER_ENV)

    def setup_worker(self) -> None:
        _single_thread()

    def load(self, layer: int, head: int) -> HeadData:
        dump = open_dump(self.dump)
        if self.stamp is not None and dump_stamp(dump.manifest) != self.stamp:  # `dump --overwrite` into its folder
            raise AnnsLabError(f"the dump at {self.dump} was replaced during the sweep (its manifest is not the one the "
                               "sweep began with): its heads would mix two dumps in one table; sweep the new dump into "
                               "another --out, or with --overwrite")
        return load_head(dump, layer, head, self.window, train_group=self.train_group,
                         train_positions=self.train_positions, keep_own=self.keep_own)

    def fingerprint(self) -> str | None:
        try:
            return dump_stamp(read_json(Path(self.dump) / "manifest.json"))
        except (OSError, ValueError, AttributeError):
            return None

    def warm(self, data: HeadData, index: str) -> None:
        _warm_once(index, data.keys.shape[1], self.build_params)

    def evaluate(self, data: HeadData, index: str) -> pd.DataFrame:
        if self.label is None or self.model is None:
            dump = open_dump(self.dump)
            label, model = str(dump.path), dump.model
        else:
            label, model = self.label, self.model
        if spoiler := data.__dict__.get("_spoiled_by"):
            raise AnnsLabError(f"not measured: {spoiler} wrote into this head's arrays, which could not be read again "
                               f"from {self.dump} to restore them")
        before = _given_sums(data)
        try:
            table = evaluate_index(index, data, self.k, label, model, self.build_params.get(index), self.quick)
        finally:  # a plugin that writes into its inputs would corrupt its own rows and every later index's of the head
            changed = [name for name, a, b in zip(GIVEN, before, _given_sums(data)) if a != b]
            if changed:  # those arrays back as loaded (only those: an unchanged one may be a read-only view of the dump)
                self._restore(data, changed, index)
        if changed:
            raise protocol.inputs_changed(index)
        return table

    def _restore(self, data: HeadData, changed: list[str], index: str) -> None:
        """The ``changed`` arrays of ``data`` back as loaded, for the head's later indexes. Where this node cannot
        read the dump (a Ray task sent the head's arrays, its own: none come after), ``data`` is marked spoiled by
        ``index`` instead, so that no later index is measured on the changed arrays."""
        try:
            fresh = self.load(data.layer, data.head)
        except AnnsLabError:
            data.__dict__["_spoiled_by"] = index
            return
        for name in changed:
            np.copyto(getattr(data, name), getattr(fresh, name))
        for cache in ("_exact", "_reference"):  # HeadData's, computed from the changed arrays
            data.__dict__.pop(cache, None)


_WARMED: set[str] = set()  # the indexes whose kernels this process has compiled (or loaded from numba's cache)


def _warm_once(index: str, dim: int, build_params: dict) -> None:
    """The index's kernels ready in this process before its part is timed (``Work.warm``, which the executors call
    ahead of the part's clock and --part-timeout): loaded from numba's cache, which the driver's warm-up filled, or
    compiled where it is empty (a Ray node with a checkout of its own: minutes, which once counted as the part's)."""
    if index not in _WARMED:
        _WARMED.add(index)
        warm_up([index], dim, build_params)


GIVEN = ("keys", "train_queries", "own_train_queries", "test_queries", "k2k_queries", "group_queries")  # what an index sees of a head


def _given_sums(data: HeadData) -> list[int | None]:
    """:func:`protocol.input_sums` of each array an index is given (``GIVEN``)."""
    return protocol.input_sums(*(getattr(data, name) for name in GIVEN))


def _every_index(log) -> list[str]:
    """Every index that loads, sorted; the ones that do not are named, not silently left out (a plugin that claims
    ``flat`` takes the built-in out of the default sweep)."""
    from anns_lab.indexes import registry

    for name, err in registry.broken().items():
        log(f"note: {name} is left out of the sweep: it fails to load ({err}); `anns-lab indexes` lists every index")
    return sorted(registry.available())


def run_sweep(dump_path: str | Path, indexes: list[str] | None = None, layers: list[int] | None = None,
              heads: list[int] | None = None, k: int = 100, window: tuple[int, int] = (128, 512),
              out: str | Path | None = None, jobs: int | None = None, overwrite: bool = False, progress: bool = True,
              build_params: dict[str, dict] | None = None, quick: bool = False, executor: str = "local",
              address: str | None = None, cpus_per_task: float | None = None, max_attempts: int = MAX_ATTEMPTS,
              retry_failed: bool = False, ray_data: str | None = None, train_group: str = group_queries.DEFAULT,
              train_positions: str = rope.DEFAULT, log=None, part_timeout: float = 0.0) -> SweepResult:
    """Run the sweep (see module doc) and return the combined results table.

    ``build_params`` maps an index name to build parameters that replace its defaults; ``quick``
    records recall, scanned fraction, throughput and build cost only. ``executor`` is ``local`` or
    ``ray`` (``address``: a cluster's, or ``auto``; none starts a local Ray); a part is attempted at
    most ``max_attempts`` times over all runs unless ``retry_failed`` clears its earlier failures.
    ``ray_data``: ``path`` (nodes read the dump), ``ship`` (the driver sends each head), ``auto`` (path when
    every node sees the dump). ``train_group``: the attention-aware indexes' training queries
    (:mod:`indexes.group_queries`; each query head's index is built, on its own held-out keys, from them);
    ``train_positions``: ``serving`` moves them to the test queries' positions (:mod:`dumps.rope`), ``mix`` a random
    half of them, ``own`` none. ``part_timeout``: seconds an index may run on a head before its worker is killed and
    its part failed (on Ray the worker ends itself, by its own watchdog; 0: no bound).
    """
    from tqdm.auto import tqdm

    from anns_lab.indexes import registry

    t_start = time.perf_counter()
    log = log or (lambda line: tqdm.write(line) if progress else None)
    dump = open_dump(dump_path)
    names = _distinct(list(indexes), "--indexes") if indexes is not None else _every_index(log)
    build_params = dict(build_params or {})
    for name in set(build_params) - set(names):
        raise AnnsLabError(f"build parameters given for {name!r}, which is not among the swept indexes {names}")
    for name, given in build_params.items():  # a name both build and search parameter (vamana's L) is the build's here
        cls = registry.get(name)
        if searched := sorted(set(given) & set(cls.search_params) - set(cls.build_params)):
            grid = cls.search_grid.get(searched[0])
            raise AnnsLabError(f"--build-param {name}.{searched[0]}: {searched[0]} is a search parameter of {name}, which "
                               f"the sweep takes over its grid ({', '.join(map(str, grid or ()))}): give build parameters only")
    # unknown names or parameters fail here, before any work
    made = {name: registry.create(name, **build_params.get(name, {})) for name in names}
    # each value as the index takes it (idf=1 and idf=1.0 are one build: one part, not the same rows twice)
    build_params = {name: {p: made[name].params[p] for p in given} for name, given in build_params.items()}
    layers = _distinct(layers, "--layers") if layers is not None else default_layers(evaluable_layers(dump))
    for layer in layers:
        dump.scaling(layer)  # raises for a layer not in the dump
    check_full_attention(dump, layers)
    for layer in layers:
        dump.check_columns(layer)  # another tool's column types failed every part alike
    heads = _distinct(heads, "--heads") if heads is not None else list(range(dump.n_heads))
    for h in heads:
        dump.kv_head_of(h)
    n_keys = check_k(dump, window, k)  # before any index is built
    names = _fitting(made, n_keys, dump.head_dim, build_params, chosen=indexes is not None, log=log)
    group_queries.check_mode(train_group)
    positional = [n for n in names if registry.get(n).reads_positions]
    if positional and train_group not in group_queries.PER_HEAD:
        raise AnnsLabError(f"{', '.join(positional)} read each training query's position; --train-group {train_group} "
                           "interleaves a GQA group's queries, which have none of their own: sweep them with "
                           "--train-group head or unlisted")
    aware = any(registry.get(name).uses_train_queries for name in names)
    if rope.check_place(train_positions) != "own" and aware:
        for layer in layers:  # the frequencies that move the queries: a manifest without them is one error, before any work
            rope.dump_inv_freq(dump.manifest, layer)
    if max_attempts < 1:
        raise AnnsLabError("--max-attempts must be at least 1")
    if jobs is not None and jobs < 1:
        raise AnnsLabError(f"--jobs {jobs}: give at least 1 worker process")
    out = Path(out) if out is not None else Path("results") / dump.path.name
    settings = {"format_version": SWEEP_FORMAT, "dump": str(dump.path.resolve()), "dump_created": dump.manifest["created"],
                "dump_stamp": dump_stamp(dump.manifest), "k": k, "window": list(window)}
    if quick:  # a quick sweep lacks columns a full one has: never mix their parts in one folder
        settings["quick"] = True
    if train_group != "head":  # sweeps from before the option trained per query head: their folders stay valid
        settings["train_group"] = train_group
    if rope.check_place(train_positions) != "own":  # likewise: before, the training queries sat at their own positions
        settings["train_positions"] = train_positions
    dump.verify(layers)  # a damaged file failed every part alike, an attempt spent each: one error, before any work
    # Connect (Ray) before the results folder is touched: a cluster that is unreachable or too small
    # for a task is one error and leaves nothing behind.
    runner = open_executor(executor, jobs, address, cpus_per_task, ray_data, log=log, part_timeout=part_timeout)
    try:
        # two sweeps into one folder: an --overwrite removed the other's parts
        with sole_writer(out, lambda: _prepare(out, settings, overwrite)):
            return _run(runner, dump, out, settings, names, layers, heads, k, window, build_params, quick, max_attempts,
                        retry_failed, progress, log, t_start, train_group,
                        train_positions if aware else "own")  # key-only indexes get no training queries: nothing to move
    finally:
        runner.close()


def _run(runner, dump, out, settings, names, layers, heads, k, window, build_params, quick, max_attempts, retry_failed,
         progress, log, t_start, train_group, train_positions) -> SweepResult:
    from tqdm.auto import tqdm

    parts = out / "parts"
    own = _part_settings(settings, dump)  # what each part records, and a part kept must have recorded
    from anns_lab.indexes import registry

    code = {n: registry.code_stamp(n) for n in names}
    if retry_failed and (n := failed.clear_all(parts)):
        log(f"--retry-failed: {n} failed part(s) will be tried again")
    part_file = {Part(layer, h, n): parts / _part_name(layer, h, n, _non_default(n, build_params.get(n)))
                 for layer in layers for h in heads for n in names}
    ours = set(part_file.values())
    for f in sorted(parts.glob("*.parquet")):  # another run's part in the folder, unreadable: named before any work
        if f not in ours and (why := _read_part(f, own)[1]):
            raise _unreadable(f, why)
    if parts.is_dir() and (others := sorted(f.name for f in parts.iterdir() if f.suffix != ".parquet" and f.name != STALE
                                           and not f.name.startswith((".", failed.PREFIX)))):  # temp files: "."
        log(f"note: {parts} holds {len(others)} file(s) no sweep writes, not read: {', '.join(others[:5])}"
            + (", ..." if len(others) > 5 else ""))
    plan.record(out, part_file)
    failures: list[tuple[str, int, int, str]] = []
    earlier: dict[Part, int] = {}
    tries: dict[Part, int] = {}
    for part, f in part_file.items():
        kept, why = _read_part(f, own, part, code[part.index]) if f.exists() else (None, None)
        if kept is not None and (why := _built_otherwise(kept, part.index, build_params.get(part.index))) is None:
            continue
        if f.exists():  # cut short, damaged, or of other code since it was written: evaluated again, not trusted
            log(f"{f.name} is not a results part this sweep can keep ({why}): evaluating {part} again (the part "
                f"waits in {STALE}/ until its new one is written)")
            (parts / STALE).mkdir(exist_ok=True)  # out of the table; a new one that fails must not have cost the old
            f.replace(parts / STALE / f.name)
        rec = failed.previous(f)
        earlier[part] = rec["attempts"] if rec else 0
        if earlier[part] >= max_attempts:
            failures.append((part.index, part.layer, part.head, failed.exhausted_message(part, rec)))
        else:
            tries[part] = max_attempts - earlier[part]
    units = [(layer, h, [n for n in names if Part(layer, h, n) in tries]) for layer in layers for h in heads]
    units = [u for u in units if u[2]]
    if units and progress:

        log("preparing the index kernels (numba compiles them on the first run of an installation: 1-3 min) ...")
        log(f"index kernels ready in {warm_up(sorted({u for _, _, ns in units for u in ns}), dump.head_dim, build_params):.0f} s")
    # smoothing=0: the estimate uses the mean rate since the start, steady where parts finish in bursts.
    bar = tqdm(total=len(tries), unit="index", desc=f"sweep {dump.path.name}", disable=not progress, smoothing=0)

    def on_outcome(o: Outcome) -> None:
        f = part_file[o.part]
        if o.table is not None:
            try:
                write_table(f, _with_settings(pa.Table.from_pandas(o.table, preserve_index=False), own,
                                              code[o.part.index]))
            except OSError as err:  # the driver's own (a full disk, the folder's permissions): it stops the sweep
                done = sum(1 for g in part_file.values() if g.exists())
                raise AnnsLabError(f"could not write the finished part {f.name} ({err}); {done} of {len(part_file)} "
                                   f"parts are kept in {parts}: free space or fix the folder, then run the same "
                                   "command again to resume") from err
            failed.clear(f)
            (parts / STALE / f.name).unlink(missing_ok=True)
        else:
            failed.record(f, o, build_params.get(o.part.index), earlier[o.part])
            failures.append((o.part.index, o.part.layer, o.part.head, o.error))
        bar.update(1)
        stops.check()  # a Ctrl-C whose exception a finalizer swallowed (a part writer's): stop after this part

    work = SweepWork(str(dump.path), k, tuple(window), build_params, quick, train_group, train_positions,
                     str(dump.path), dump.model, dump_stamp(dump.manifest),
                     any(registry.get(n).own_positions for n in names))
    if not units and (kept := sum(1 for f in part_file.values() if f.exists())):  # a resume with nothing left to run
        log(f"sweep {dump.path.name}: " + ("every part is finished" if kept == len(part_file) else
                                           "nothing left to run (the rest failed their attempts)")
            + f" (resumed: {kept} of {len(part_file)} finished parts kept)")
    if units:
        kept = len(part_file) - len(tries) - len(failures)
        log(f"sweep {dump.path.name}: {len(tries)} part{'s' if len(tries) > 1 else ''} on {runner.describe()}"
            + (f" (resumed: {kept} of {len(part_file)} finished parts kept)" if kept else ""))
        try:
            runner.run(work, units, tries, on_outcome, on_running=lambda parts: bar.set_postfix_str(_running(parts)))
        except (KeyboardInterrupt, ExecutorLost) as err:
            bar.close()
            combine(out, own, str(dump.path))
            done = sum(1 for f in part_file.values() if f.exists())
            stop, why = (SweepInterrupted, ("interrupted after its last part:", "interrupted:")) \
                if isinstance(err, KeyboardInterrupt) else (ExecutorLost, (f"{err};", f"{err};"))
            if done == len(part_file):  # nothing left to resume: the table above holds every part
                raise stop(f"{why[0]} all {done} parts are finished and kept in {parts}, and their table written") \
                    from None
            raise stop(f"{why[1]} {done} of {len(part_file)} parts are finished and kept in {parts}; run the same "
                       "command again to resume") from None
    bar.close()
    table = combine(out, own, str(dump.path))
    if stale := sorted(f.name for f in (parts / STALE).glob("*.parquet")):
        log(f"note: {len(stale)} earlier part(s) whose new evaluation failed wait in {parts / STALE} (not in the "
            f"table): fix the index and run again (they go once evaluated again), or undo the edit and move them back "
            f"into {parts}: {', '.join(stale[:5])}" + (", ..." if len(stale) > 5 else ""))
    return SweepResult(table, out / RESULTS, failures, time.perf_counter() - t_start)


def _fitting(made: dict, n_keys: int, dim: int, build_params: dict, chosen: bool, log) -> list[str]:
    """The swept indexes whose build parameters can index ``n_keys`` keys of ``dim`` dimensions (more lists than keys
    cannot): one error up front for an index the command named or configured, rather than one failed part per head; an
    index swept only as one of every registered index, at its defaults, is left out with a line saying so."""
    names = []
    for name, index in made.items():
        if problem := protocol.declaration_problem(type(index)):  # else one failed part per head, read as a bad --param
            said = f"index {name}'s class is inconsistent: {problem}"
            if chosen or name in build_params:
                raise AnnsLabError(f"{said}; fix its declarations (`anns-lab indexes --check {name}` says so too), "
                                   "or leave it out of --indexes")
            log(f"{name} left out: {said}")
            continue
        try:
            index.check_dim(dim)
            index.check_keys(n_keys)
        except IndexConfigError as err:
            if chosen or name in build_params:
                raise AnnsLabError(f"{err}: {name} cannot index the {n_keys} keys of dimension {dim} each index "
                                   "holds with this dump and --window; set its --build-param, or leave it out of "
                                   "--indexes") from None
            log(f"{name} left out: {err} ({n_keys} keys of dimension {dim} per index here; name it with a "
                "--build-param to sweep it)")
            continue
        names.append(name)
    if not names:
        raise AnnsLabError(f"no index can index the {n_keys} keys each index holds with this dump and --window at its "
                           "defaults: use a longer dump or a smaller --window")
    return names


def _distinct(values: list[int], flag: str) -> list[int]:
    """``values`` in order without repeats (a repeated head would be evaluated twice); none is an error."""
    if not values:
        raise AnnsLabError(f"{flag} names nothing; leave it out for the default")
    return list(dict.fromkeys(values))


def _read_part(path: Path, own: dict, cell: Part | None = None,
               code: dict | None = None) -> tuple[pd.DataFrame | None, str | None]:
    """A results part of the sweep whose parts record ``own`` (:func:`_part_settings`) and None, or None and why
    ``path`` is not one it can keep, in words: not Parquet, without the results table's columns, holding a row no
    conforming index produces (a part edited or damaged since it was written once kept a NaN recall through every
    resume, and the report said "re-run the sweep"), not this sweep's part of ``cell`` (by default the cell its name
    gives): :func:`_part_problem`, or, given its index's ``code`` now, written by other code: :func:`_code_changed`."""
    try:
        arrow = pq.read_table(path, page_checksum_verification=True)  # a flipped byte: evaluated again
        part = arrow.to_pandas()
    except (OSError, ValueError, pa.ArrowException) as err:
        return None, f"{type(err).__name__}: {err}"
    if missing := set(COLUMNS) - set(ADDED) - set(part.columns):
        return None, f"missing columns {sorted(missing)}"
    part = part.reset_index(drop=True)
    if problem := table_problem(part):
        return None, problem
    cell = cell or _named_cell(path, part)
    if cell is None:
        return None, "its name is not a part's (L<layer>_H<head>_<index>.parquet)"
    meta = arrow.schema.metadata or {}
    if problem := _part_problem(part, cell, own, meta.get(PART_SETTINGS)):
        return None, problem
    if code is not None and (problem := _code_changed(meta.get(PART_CODE), cell.index, code)):
        return None, problem
    return part, None


def _named_cell(path: Path, part: pd.DataFrame) -> Part | None:
    """The cell a part's file name gives, or None: ``L001_H00_ivf-<hash>`` is ivf's build variant, unless the rows are
    of an index whose name itself ends in a dash and ten hex digits (``roar-2025061001``)."""
    if not (named := PART_NAME.fullmatch(path.name)):
        return None
    index = named[3] + named[4] if named[4] and (part["index"] == named[3] + named[4]).all() else named[3]
    return Part(int(named[1]), int(named[2]), index)


def _part_problem(part: pd.DataFrame, cell: Part, own: dict, recorded: bytes | None) -> str | None:
    """Why readable rows are not the part of ``cell`` that the sweep recording ``own`` writes, in words, or None: the
    settings the part recorded (``recorded``; parts written before they did have none, and only their rows are
    checked) are not ``own``, or its rows are another cell's, lack a direction, measured another k, or are a quick
    sweep's in a full one (no latency) or the reverse. A part copied from another folder or machine was kept as
    finished, and its rows then stood in the table for the cell its name gave, or dropped another's as duplicates."""
    if recorded is not None:
        try:
            theirs = loads_json(recorded)
        except ValueError:
            return "the sweep settings it recorded are unreadable"
        if theirs != own:
            return f"swept with other settings ({_differences(theirs, own)})"
    if part.empty:
        return "it holds no rows"
    cells = set(zip(part["layer"].astype(int), part["head"].astype(int), part["index"]))
    if cells != {(cell.layer, cell.head, cell.index)}:
        return f"its rows are not all {cell}'s"
    if lacking := sorted(set(DIRECTIONS) - set(part["direction"])):
        return f"it has no {', '.join(lacking)} rows"
    if (other := part.loc[part["k"] != own["k"], "k"]).any():
        return f"it measured recall@{int(other.iloc[0])}, this sweep recall@{own['k']}"
    timed, quick = part["latency_us"].notna(), bool(own.get("quick"))
    if timed.any() and not timed.all():  # a sweep times every row or none
        return "some of its rows are timed and some not"
    if quick == timed.all():  # a --quick sweep times nothing, a full one every row
        return f"it is a {'full' if timed.all() else '--quick'} sweep's part, this sweep is {'--quick' if quick else 'full'}"
    return None


def _built_otherwise(rows: pd.DataFrame, index: str, given: dict | None) -> str | None:
    """Why a part's rows were built with other parameters than this sweep builds ``index`` with, in words, or None: a
    default changed since (clusterkv's nlist in session 47), and the resumed folder kept the old build as the default
    one, its heads beside new ones built otherwise. A parameter added since counts in an older part as the value that
    built as the part was (``Index.build_params_before``: retroinfer's estimation budget in session 48), where the index
    declares one; parameters otherwise named on one side only are not compared (a part from before a parameter that
    changed nothing stays)."""
    from anns_lab.indexes import registry

    built = registry.create(index, **(given or {}))
    now = built.params
    then = dict(type(built).build_params_before) | loads_json(rows["build_params"].iloc[0])
    if differ := [key for key in sorted(set(now) & set(then)) if then[key] != now[key]]:
        return "built with other parameters (" + "; ".join(f"{key}: {then[key]} there, {now[key]} here"
                                                           for key in differ) + ")"
    return None


def _part_settings(settings: dict, dump) -> dict:
    """What each part of the sweep of ``settings`` over ``dump`` records: the settings but the dump's path (parts of one
    dump swept on several machines, each with its own path to it, belong together), and the dump's stamp
    (``store.dump_stamp``: its manifest's checksum, where its creation time, to the second, may be another's too)."""
    # nor the folder's format: a part is read by its own schema, and one written before the record is this sweep's
    own = {key: value for key, value in settings.items() if key not in ("dump", "format_version")}
    return own | {"dump_stamp": dump_stamp(dump.manifest)}


def _with_settings(table: pa.Table, own: dict, code: dict) -> pa.Table:
    """``table`` with ``own`` and its index's ``code`` in its schema metadata (:data:`PART_SETTINGS`,
    :data:`PART_CODE`), pandas' own kept."""
    meta = dict(table.schema.metadata or {})
    meta[PART_SETTINGS] = json.dumps(own, sort_keys=True).encode()
    meta[PART_CODE] = json.dumps(code, sort_keys=True).encode()
    return table.replace_schema_metadata(meta)


def _code_changed(recorded: bytes | None, index: str, now: dict) -> str | None:
    """Why a part whose metadata holds ``recorded`` (:data:`PART_CODE`) is of other code than ``index``'s now
    (:func:`registry.code_stamp`), in words, or None: a plugin edited and swept again kept its old rows, the command's
    resume trusting them. A part written before parts recorded it is kept."""
    try:
        then = loads_json(recorded) if recorded is not None else now
    except ValueError:
        return "its index's code record is unreadable"
    if not isinstance(then, dict):
        return "its index's code record is unreadable"
    if then == now:
        return None
    if then.get("stamp_rule") != now.get("stamp_rule") and then.get("version") == now.get("version"):
        return "the lab reads an index's code otherwise since it was written (evaluated again once)"
    if then.get("source_sha256") != now.get("source_sha256") and then.get("version") == now.get("version"):
        return f"{index}'s source changed since it was written"
    return (f"written by {index} of {then.get('distribution')} {then.get('version')}, "
            f"now {now.get('distribution')} {now.get('version')}")


def _unreadable(path: Path, why: str | None = None) -> AnnsLabError:
    """The error for a file in ``parts/`` that is not a results part this sweep can read."""
    return AnnsLabError(f"{path} is not a readable results part{f' ({why})' if why else ''}; remove it (or start the "
                        "folder again with --overwrite) and run the same command again")


def _prepare(out: Path, settings: dict, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise AnnsLabError(f"--out {out} is a file; give a folder for the sweep's results")
    sfile = out / SETTINGS
    if sfile.is_file():
        try:
            old = read_json(sfile)
        except (OSError, ValueError) as err:
            if not overwrite:
                raise AnnsLabError(f"{sfile} is corrupt ({err}); pass --overwrite to start this sweep again there, "
                                   "or choose another --out") from None
            old = None
        if isinstance(old, dict) and (other := format_problem(old)) and not overwrite:
            raise AnnsLabError(f"{sfile}: {other}; finish it with the anns-lab that began it, pass --overwrite to "
                               "start this sweep again there, or choose another --out")
        if isinstance(old, dict) and "format_version" not in old:  # a folder from before the record: format 1
            old = {"format_version": 1, **old}
            if old == settings:
                atomic_write_json(sfile, settings)
        before_stamp = isinstance(old, dict) and "dump_stamp" not in old  # a sweep from before sweep.json held it
        if before_stamp and old | {"dump_stamp": settings["dump_stamp"]} == settings:
            old = settings  # the same sweep: its parts check the stamp themselves
            atomic_write_json(sfile, settings)
        if old == settings:
            (out / "parts").mkdir(exist_ok=True)  # removed by hand to redo every part: the parts are written there
            return
        if not overwrite:
            said = settings
            if before_stamp:  # the stamp such a folder lacks is no difference to name
                said = {key: value for key, value in settings.items() if key != "dump_stamp"}
            raise AnnsLabError(f"{out} holds a sweep of other settings ({_differences(old, said)}); pass "
                               "--overwrite or choose another --out")
        for p in (out / "parts").glob("*.parquet"):
            p.unlink()
        shutil.rmtree(out / "parts" / STALE, ignore_errors=True)
        failed.clear_all(out / "parts")
        plan.forget(out)
        (out / RESULTS).unlink(missing_ok=True)
    elif out.exists() and any(out.iterdir()):
        raise AnnsLabError(f"{out} exists and is not a sweep folder; choose another --out")
    try:
        (out / "parts").mkdir(parents=True, exist_ok=True)
        atomic_write_json(sfile, settings)
    except OSError as err:
        raise AnnsLabError(f"cannot write the sweep into {out}: {err.strerror or err} ({err.filename or out}); "
                           "choose another --out") from None


def _differences(old, new: dict) -> str:
    """``k: 100 there, 10 here; window: ...``: the settings in which a folder's sweep and this one differ."""
    if not isinstance(old, dict):
        return f"{old!r}"
    def said(settings: dict, key: str) -> str:
        return str(settings[key]) if key in settings else "default"

    return "; ".join(f"{key}: {said(old, key)} there, {said(new, key)} here"
                     for key in sorted(set(old) | set(new), key=str) if old.get(key) != new.get(key))


def _running(parts: list[Part]) -> str:
    """The bar's note of what the workers are on (a stuck index is seen by name): ``ivf 3/0, flat 1/2``."""
    return ", ".join(f"{p.index} {p.layer}/{p.head}" for p in parts)


def combine(out: Path, own: dict, label: str) -> pd.DataFrame:
    """Union of all part files of the sweep whose parts record ``own``, sorted, written atomically as
    ``results.parquet``; every row's ``dump`` is ``label`` (the dump as this run was given it: the parts are checked to
    be of one dump, and rows of the same dump under other spellings of its path read as several to ``report``)."""
    frames = []
    for p in sorted((out / "parts").glob("*.parquet")):
        part, why = _read_part(p, own)  # checked again: a part may have changed since the run began, or be another's
        if why:
            raise _unreadable(p, why)
        frames.append(part)
    table = pd.concat(frames, ignore_index=True).assign(dump=label) if frames else pd.DataFrame(columns=COLUMNS)
    # one measurement per cell: a build's part named apart in an older folder (a float spelled 1.0 there) and its part
    # named now measure the same build; one of them is kept
    table = table.drop_duplicates(CELL, ignore_index=True)
    table = table.sort_values(["layer", "head", "index", "direction", "scanned_fraction"], kind="stable", ignore_index=True)
    write_table(out / RESULTS, pa.Table.from_pandas(table, preserve_index=False))
    return table
