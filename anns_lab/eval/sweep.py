"""``anns-lab sweep``: every index × every grid point × every (layer, head) of a dump, into one table.

Work is split by (layer, head) over ``jobs`` processes, each single-threaded (one thread is
what a decoder's retrieval gets per head, and it keeps timings comparable). Every finished
(layer, head, index) is written at once to ``parts/`` (atomic), so an interrupted sweep
continues where it stopped; ``results.parquet`` is the union of the parts, rewritten at the end.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from anns_lab.dumps.store import open_dump, write_table
from anns_lab.errors import AnnsLabError
from anns_lab.eval import metrics
from anns_lab.eval.heads import HeadData, default_layers, load_head
from anns_lab.eval.table import COLUMNS, RESULTS, SETTINGS
from anns_lab.io import atomic_write_json

LATENCY_QUERIES = 16


@dataclass
class SweepResult:
    """The results table, where it lives, and what failed (index, layer, head, error)."""

    table: pd.DataFrame
    path: Path
    failures: list[tuple[str, int, int, str]] = field(default_factory=list)
    seconds: float = 0.0


def _part_name(layer: int, head: int, index: str, build_params: dict | None = None) -> str:
    # Non-default build parameters get their own part, so variants of one index can share a sweep.
    tag = "" if not build_params else "-" + hashlib.sha1(json.dumps(build_params, sort_keys=True).encode()).hexdigest()[:10]
    return f"L{layer:03d}_H{head:02d}_{index}{tag}.parquet"


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
    from anns_lab.indexes import protocol, registry

    index = registry.create(name, **(build_params or {}))
    t0 = time.perf_counter()
    index.build(data.keys, data.train_queries if index.uses_train_queries else None)
    build_s = time.perf_counter() - t0
    rows = []
    for params in index.grid():
        for direction, queries in (("q2k", data.test_queries), ("k2k", data.k2k_queries)):
            t0 = time.perf_counter()
            res = index.search(queries, k, **params)
            batch_s = time.perf_counter() - t0
            # Nothing that breaks the protocol enters the table: the part fails, naming the index and the rule.
            protocol.check_result(f"{name} at {params}", res, len(queries), k, len(data.keys), index.max_scanned(),
                                  queries, data.keys)
            lat = []
            for q in queries[:0 if quick else LATENCY_QUERIES]:
                t0 = time.perf_counter()
                one = index.search(q[None, :], k, **params)
                lat.append(time.perf_counter() - t0)
                protocol.check_result(f"{name} at {params}", one, 1, k, len(data.keys), index.max_scanned())
            mass, err = data.attention_quality(res.ids) if direction == "q2k" and not quick else (np.nan, np.nan)
            rows.append({
                "dump": dump_label, "model": model, "layer": data.layer, "head": data.head, "kv_head": data.kv_head,
                "index": name, "build_params": json.dumps(index.params, sort_keys=True),
                "search_params": json.dumps(params, sort_keys=True), "direction": direction, "k": k,
                "n_keys": len(data.keys), "n_queries": len(queries),
                "recall": float(metrics.recall_at_k(res.ids, data.exact(direction), k).mean()),
                "scanned_fraction": float(res.n_scanned.mean() / len(data.keys)),
                "mass_recovered": mass, "output_rel_error": err,
                "latency_us": float(np.median(lat) * 1e6) if lat else np.nan, "qps": len(queries) / batch_s,
                "build_s": build_s, "index_bytes": int(index.nbytes),
            })
    return pd.DataFrame(rows, columns=COLUMNS)


def _run_head(dump_path: str, layer: int, head: int, names: list[str], k: int, window: tuple[int, int],
              parts: str, build_params: dict[str, dict], quick: bool) -> list[tuple[str, str | None]]:
    """Worker: one (layer, head), every index not yet done; returns (index, error or None)."""
    _single_thread()
    dump = open_dump(dump_path)
    data = load_head(dump, layer, head, window)
    out = []
    for name in names:
        part = Path(parts) / _part_name(layer, head, name, build_params.get(name))
        if part.exists():
            continue
        try:
            df = evaluate_index(name, data, k, str(dump.path), dump.model, build_params.get(name), quick)
        except AnnsLabError as err:
            out.append((name, str(err)))
            continue
        except Exception as err:  # noqa: BLE001 - a failing (plugin) index must not stop the sweep
            out.append((name, f"{type(err).__name__}: {err}"))
            continue
        write_table(part, pa.Table.from_pandas(df, preserve_index=False))
        out.append((name, None))
    return out


def run_sweep(dump_path: str | Path, indexes: list[str] | None = None, layers: list[int] | None = None,
              heads: list[int] | None = None, k: int = 100, window: tuple[int, int] = (128, 512),
              out: str | Path | None = None, jobs: int = 2, overwrite: bool = False, progress: bool = True,
              build_params: dict[str, dict] | None = None, quick: bool = False) -> SweepResult:
    """Run the sweep (see module doc) and return the combined results table.

    ``build_params`` maps an index name to build parameters that replace its defaults; ``quick``
    records recall, scanned fraction, throughput and build cost only.
    """
    from tqdm.auto import tqdm

    from anns_lab.indexes import registry

    t_start = time.perf_counter()
    dump = open_dump(dump_path)
    names = list(indexes) if indexes else sorted(registry.available())
    build_params = dict(build_params or {})
    for name in names:
        registry.create(name, **build_params.get(name, {}))  # unknown names or parameters fail here, before any work
    for name in set(build_params) - set(names):
        raise AnnsLabError(f"build parameters given for {name!r}, which is not among the swept indexes {names}")
    layers = layers if layers is not None else default_layers(dump.layers)
    for layer in layers:
        dump.scaling(layer)  # raises for a layer not in the dump
    heads = heads if heads is not None else list(range(dump.n_heads))
    for h in heads:
        dump.kv_head_of(h)
    if k < 1:
        raise AnnsLabError("--k must be positive")
    out = Path(out) if out is not None else Path("results") / dump.path.name
    settings = {"dump": str(dump.path.resolve()), "dump_created": dump.manifest["created"], "k": k, "window": list(window)}
    if quick:  # a quick sweep lacks columns a full one has: never mix their parts in one folder
        settings["quick"] = True
    _prepare(out, settings, overwrite)
    parts = out / "parts"
    todo = [(layer, h) for layer in layers for h in heads
            if not all((parts / _part_name(layer, h, n, build_params.get(n))).exists() for n in names)]
    failures: list[tuple[str, int, int, str]] = []
    bar = tqdm(total=len(todo) * len(names), unit="index", desc=f"sweep {dump.path.name}", disable=not progress)
    if todo:
        # spawn, not fork: forking a process whose OpenMP/numba thread pools already run can deadlock.
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(todo))), mp_context=ctx) as pool:
            futures = {pool.submit(_run_head, str(dump.path), layer, h, names, k, window, str(parts), build_params,
                                   quick): (layer, h)
                       for layer, h in todo}
            for fut in as_completed(futures):
                layer, h = futures[fut]
                for name, err in fut.result():
                    if err:
                        failures.append((name, layer, h, err))
                bar.update(len(names))
    bar.close()
    table = combine(out)
    return SweepResult(table, out / RESULTS, failures, time.perf_counter() - t_start)


def _prepare(out: Path, settings: dict, overwrite: bool) -> None:
    sfile = out / SETTINGS
    if sfile.is_file():
        old = json.loads(sfile.read_text())
        if old == settings:
            return
        if not overwrite:
            raise AnnsLabError(f"{out} holds a sweep of other settings ({old}); pass --overwrite or choose another --out")
        for p in (out / "parts").glob("*.parquet"):
            p.unlink()
        (out / RESULTS).unlink(missing_ok=True)
    elif out.exists() and any(out.iterdir()):
        raise AnnsLabError(f"{out} exists and is not a sweep folder; choose another --out")
    (out / "parts").mkdir(parents=True, exist_ok=True)
    atomic_write_json(sfile, settings)


def combine(out: Path) -> pd.DataFrame:
    """Union of all part files, sorted, written atomically as ``results.parquet``."""
    parts = sorted((out / "parts").glob("*.parquet"))
    frames = [pd.read_parquet(p) for p in parts]
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)
    table = table.sort_values(["layer", "head", "index", "direction", "scanned_fraction"], kind="stable", ignore_index=True)
    write_table(out / RESULTS, pa.Table.from_pandas(table, preserve_index=False))
    return table
