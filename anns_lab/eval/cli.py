"""``anns-lab sweep``, ``anns-lab report`` and ``anns-lab export``."""

from __future__ import annotations

from pathlib import Path

import click

from anns_lab.cli_types import WINDOW, given_flags, name_list
from anns_lab.errors import AnnsLabError
from anns_lab.dumps import rope
from anns_lab.indexes.group_queries import DEFAULT as GROUP_DEFAULT
from anns_lab.indexes.group_queries import MODES as GROUP_MODES
from anns_lab.io import param_value


def _heads(spec: str | None, dump_path: str | Path) -> list[int] | None:
    """``--heads`` in ``--layers``' syntax (``0,4``, ``0-3``, ``0:9:2``, ``all``) over the dump's query heads; one that
    names nothing is left to the sweep to refuse."""
    from anns_lab.dumps.run import parse_selection
    from anns_lab.dumps.store import open_dump

    if spec is None:
        return None
    if not spec.replace(",", "").strip():
        return []
    if spec.strip().lower() in ("all", "default"):  # the default: the same sweep, the same default folder
        return None
    n_heads = open_dump(dump_path, verify=False).n_heads  # the count only: the sweep opens and checks it again
    return parse_selection(spec, n_heads, list(range(n_heads)), "--heads", "query heads", "the dump",
                           "all, a list (0,4) or a range (0-3, 0:9:2)")


def _layers(spec: str | None, dump_path: str | Path) -> list[int] | None:
    """``--layers`` read as the dump command reads it (one syntax for both); ``all`` is the dump's full-attention
    layers here (:func:`heads.evaluable_layers`)."""
    from anns_lab.dumps.run import parse_layers
    from anns_lab.dumps.store import open_dump
    from anns_lab.eval.heads import default_layers, evaluable_layers

    if spec is None:
        return None
    dump = open_dump(dump_path, verify=False)  # the layer count only: the sweep opens and checks it again
    if spec.strip().lower() == "all":
        return evaluable_layers(dump)
    return parse_layers(spec, int(dump.manifest["n_layers"]), default_layers(evaluable_layers(dump)))


def _build_params(items: tuple[str, ...]) -> dict[str, dict]:
    """``("roargraph.M=16", "ivf.nlist=64")`` → ``{"roargraph": {"M": 16}, "ivf": {"nlist": 64}}`` (JSON values)."""
    out: dict[str, dict] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        index, dot, name = key.partition(".")
        if not (sep and dot and index and name):
            raise AnnsLabError(f"--build-param takes INDEX.NAME=VALUE (e.g. roargraph.M=16), got {item!r}")
        value = param_value(raw)
        if name in out.setdefault(index, {}):  # the last one silently won before: say which is meant
            raise AnnsLabError(f"--build-param {index}.{name} is given twice ({out[index][name]!r} and {value!r}): "
                               "give one value")
        out[index][name] = value
    return out


def default_out(dump_path: str | Path, indexes: list[str] | None, layers: list[int] | None, heads: list[int] | None,
                quick: bool) -> Path:
    """``results/<dump>``, with the selection in the name when it is not the default one.

    So a small sweep (``--indexes ivf,hnsw --heads 0,4``) never adds its rows to the demo's full sweep.
    Build-parameter variants share their selection's folder (their parts are named apart).
    """
    parts = [Path(dump_path).resolve().name]
    if indexes:
        parts.append("+".join(indexes))
    if layers is not None:
        parts.append("L" + "+".join(map(str, layers)))
    if heads is not None:
        parts.append("H" + "+".join(map(str, heads)))
    if quick:
        parts.append("quick")
    return Path("results") / "-".join(parts)


def plural(n: int, word: str) -> str:
    """``1 head``, ``2 heads``; ``1 index``, ``3 indexes``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}es" if word.endswith("x") else f"{n} {word}s"


def latest_dump() -> Path | None:
    """The most recently finished dump under ./dumps, if any."""
    found = sorted(Path("dumps").glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def _note_unread_training(names: list[str] | None) -> None:
    """Say so where --train-group or --train-positions, typed, reaches none of the chosen indexes (each builds on the
    keys alone, or reads its queries where the prefill had them): the sweep records them all the same, its folder's
    settings governing its resumes, where decode refuses them."""
    from anns_lab.indexes import registry

    ctx = click.get_current_context()
    typed = given_flags(ctx, "train_group", "train_positions")
    if not typed or not names:
        return
    try:
        classes = [registry.get(name) for name in names]
    except AnnsLabError:  # an unknown index: run_sweep's error, in its words
        return
    unread = [flag for flag in typed if not any(c.uses_train_queries for c in classes)]
    if "--train-positions" in typed and not unread and ctx.params["train_positions"] != "own" and not any(
            c.moves_train_queries() for c in classes):
        unread.append("--train-positions")  # every index here reads its queries at their own positions
    if unread:
        click.echo(f"note: {', '.join(unread)}: read by none of --indexes {','.join(names)}; recorded in the sweep's "
                   "settings all the same", err=True)


@click.command(short_help="Recall against keys scanned for every index, per (layer, head).")
@click.option("--dump", "dump_path", type=click.Path(), default=None,
              help="Dump folder [default: the newest under dumps/, or make the default SmolLM2 dump first].")
@click.option("--indexes", default=None, help="Comma-separated index names [default: every registered index].")
@click.option("--layers", default=None,
              help="Layers as `anns-lab dump` takes them: 2,15,28, 3-7, 0:30:2, all (the dump's full-attention layers: "
                   "one whose sliding window is shorter than the dump is refused), or a mix [default: three spread over "
                   "the dump's full-attention layers].")
@click.option("--heads", default=None, help="Query heads, as --layers reads layers: 0,4, 0-3, 0:9:2, all [default: all].")
@click.option("--k", type=int, default=100, show_default=True)
@click.option("--window", type=WINDOW, default="128,512", show_default=True, help="Static window excluded from the index.")
@click.option("--out", type=click.Path(), default=None, help="Results folder [default: results/<dump name>, plus the selection when one is given, e.g. "
                   "results/<dump>-ivf+hnsw-L15-H0+4].")
@click.option("--jobs", type=int, default=None,
              help="Parallel processes (one (layer, head) each); at most this machine's CPUs.  [default: 2, or 1 on one CPU]")
@click.option("--overwrite", is_flag=True, help="Discard an existing sweep of other settings in --out.")
@click.option("--build-param", "build_param", multiple=True, metavar="INDEX.NAME=VALUE",
              help="Override a build parameter, e.g. --build-param roargraph.M=16 (repeatable).")
@click.option("--quick", is_flag=True, help="Skip attention-quality and batch-1 latency passes (for parameter scans).")
@click.option("--train-group", type=click.Choice(GROUP_MODES), default=GROUP_DEFAULT, show_default=True,
              help="Training queries of the attention-aware indexes: their GQA group's (group: all; strided: one head's "
                   "count, round robin over the heads by position), or the query head's own ('head'; 'unlisted': with the group's "
                   "other heads' newest queries for the keys its own lists leave out).")
@click.option("--train-positions", type=click.Choice(rope.PLACES), default=rope.DEFAULT, show_default=True, help=rope.HELP)
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: --jobs worker processes here; ray: one task per (layer, head, index) on a Ray cluster.")
@click.option("--address", default=None,
              help="Ray cluster to join (HOST:PORT of its head, or 'auto'); none starts Ray on this machine.")
@click.option("--cpus-per-task", type=float, default=None, help="Ray: CPUs reserved per task.  [default: 1]")
@click.option("--ray-data", type=click.Choice(["auto", "path", "ship"]), default=None,
              help="Ray: nodes read the dump at its path, or the driver ships each head's arrays (auto: path when every "
                   "node has it).  [default: auto]")
@click.option("--part-timeout", type=float, default=0.0, show_default=True,
              help="Seconds an index may run on one head before its worker is killed and the part failed as timed out "
                   "(a stuck plugin; on Ray the worker ends itself); the head's read and the kernels' first load or "
                   "compile in a worker are not counted (that warm-up is bounded apart, at least 600 s); 0 = no bound.")
@click.option("--max-attempts", type=int, default=3, show_default=True,
              help="A failing part is tried at most this many times over all runs, then reported.")
@click.option("--retry-failed", is_flag=True, help="Forget earlier failures (parts/failed-*.json) and try those parts again.")
def sweep(dump_path, indexes, layers, heads, k, window, out, jobs, overwrite, build_param, quick, train_group, train_positions,
          executor, address,
          cpus_per_task, ray_data, part_timeout, max_attempts, retry_failed) -> None:
    """Evaluate every index on recall@k against fraction of keys scanned, per (layer, head)."""
    from anns_lab.eval.sweep import SweepInterrupted, run_sweep

    if dump_path is None:
        dump_path = latest_dump()
        if dump_path is None:
            from anns_lab.dumps.run import DumpInterrupted, run_dump

            click.echo("no dump found under dumps/: making the default SmolLM2 dump first")
            try:
                result = run_dump()
            except DumpInterrupted as stop:  # what was kept and how to resume, as `anns-lab dump` says it
                click.echo(str(stop), err=True)
                raise SystemExit(130) from None
            click.echo(result.summary())
            dump_path = result.dump.path
    # --indexes "" names nothing (refused by run_sweep), it does not mean every index
    names = list(dict.fromkeys(name_list(indexes, "--indexes"))) if indexes is not None else None
    layer_list, head_list = _layers(layers, dump_path), _heads(heads, dump_path)
    _note_unread_training(names)
    if out is None:
        out = default_out(dump_path, names, layer_list, head_list, quick)
    try:
        res = run_sweep(dump_path, names, layer_list, head_list, k, window, out, jobs, overwrite,
                        build_params=_build_params(build_param), quick=quick, executor=executor, address=address,
                        cpus_per_task=cpus_per_task, max_attempts=max_attempts, retry_failed=retry_failed,
                        part_timeout=part_timeout,
                        ray_data=ray_data, train_group=train_group, train_positions=train_positions)
    except SweepInterrupted as stop:
        click.echo(str(stop), err=True)
        raise SystemExit(130) from None
    except KeyboardInterrupt:  # outside the parts' run (the kernels' warm-up): click said "Aborted!", status 1
        click.echo(f"interrupted: the finished parts in {Path(out) / 'parts'} are kept; run the same command again to "
                   "resume", err=True)
        raise SystemExit(130) from None
    t = res.table
    click.echo(f"sweep of {dump_path}: {len(t)} rows ({plural(t.groupby(['layer', 'head']).ngroups, 'head')} × "
               f"{plural(t['index'].nunique(), 'index')}) in {res.path} ({res.seconds:.0f} s)")
    others = t[~t["index"].isin(names or t["index"].unique()) | ~t["layer"].isin(layer_list or t["layer"].unique())
               | ~t["head"].isin(head_list or t["head"].unique())]
    if len(others):
        click.echo(f"note: {len(others)} of these rows come from earlier sweeps into {res.path.parent} "
                   f"(other indexes, layers or heads); `anns-lab report` covers them all")
    for name, layer, head, err in res.failures:
        click.echo(f"  FAILED {name} on layer {layer} head {head}: {err}", err=True)
    if any(getattr(err, "trace", "") for *_, err in res.failures):
        click.echo(f"  (where each index raised its error: the \"traceback\" of {res.path.parent / 'parts'}/failed-*.json)",
                   err=True)
    if res.failures:
        raise SystemExit(1)


@click.command(short_help="Findings, figures and an HTML page from a sweep's results.")
@click.argument("results", type=click.Path(), required=False)
@click.option("--dump", "dump_path", type=click.Path(), default=None,
              help="The dump the results come from, where it has moved (checked by its creation stamp) [default: the "
                   "one the sweep recorded].")
@click.option("--out", type=click.Path(), default=None, help="Folder for report.md and figures [default: beside RESULTS].")
def report(results, dump_path, out) -> None:
    """Findings against the paper, figures (paper Figs. 2, 3a, 3b, 6) and tables from a sweep's results.

    Writes report.md, a self-contained report.html and the figures as PNG files beside RESULTS
    (default: the newest results/*/results.parquet).
    """
    from anns_lab.eval.report import FIGURES, write_report

    if results is None:
        found = sorted(Path("results").glob("*/results.parquet"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise AnnsLabError("no results under results/; run `anns-lab sweep` first or give RESULTS")
        results = found[-1]
    path = write_report(results, out, dump_path)
    click.echo(f"report: {path}")
    click.echo(f"html:   {path.with_suffix('.html')} (self-contained; open it in a browser)")
    click.echo(f"figures: {', '.join(str(path.parent / name) for name in sorted(FIGURES))}")  # not other PNGs there


@click.command(short_help="Keys, queries and ground truth of one head as .fbin files.")
@click.option("--dump", "dump_path", type=click.Path(), required=True, help="The dump folder.")
@click.option("--layer", type=int, required=True, help="A layer the dump holds.")
@click.option("--head", type=int, required=True, help="A query head (its KV head's keys are exported).")
@click.option("--format", "fmt", type=click.Choice(["fbin"]), default="fbin", show_default=True,
              help="big-ann-benchmarks' .fbin vectors and ground-truth .bin files (docs/results-table.md).")
@click.option("--k", type=int, default=100, show_default=True, help="Neighbours per query in the ground truth.")
@click.option("--window", type=WINDOW, default="128,512", show_default=True,
              help="Static window excluded from the keys, as the sweep's.")
@click.option("--out", type=click.Path(), required=True, help="A new or empty folder (or an earlier export's).")
@click.option("--train-positions", type=click.Choice(rope.PLACES), default=rope.DEFAULT, show_default=True, help=rope.HELP)
@click.option("--overwrite", is_flag=True, help="Replace an earlier export in --out.")
def export(dump_path, layer, head, fmt, k, window, out, train_positions, overwrite) -> None:
    """Keys, queries and ground truth of one (layer, head) in big-ann-benchmarks formats."""
    from anns_lab.dumps.store import open_dump
    from anns_lab.eval.export import export_fbin

    files = export_fbin(open_dump(dump_path), layer, head, out, k, window, train_positions, overwrite)
    for name, path in files.items():
        click.echo(f"{name:20s} {path}")
