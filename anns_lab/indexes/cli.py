"""``anns-lab indexes``: list every registered index with its package, parameters and search grid."""

from __future__ import annotations

import click

from anns_lab.cli_types import given_flags, parse_params
from anns_lab.errors import AnnsLabError
from anns_lab.indexes import registry
from anns_lab.indexes.base import Param


def _param_lines(title: str, params: dict[str, Param]) -> list[str]:
    if not params:
        return [f"    {title}: none"]
    lines = [f"    {title}:"]
    for name, p in params.items():
        lines.append(f"      {name} = {p.default!r}  range {p.range_text()}  {p.help}".rstrip())
    return lines


def _training(cls) -> str:
    """What an index reads of the prefill queries: which of the options on them (``--train-*``) it reads."""
    if not cls.uses_train_queries:
        return "no"
    how = ["at their own positions (reads no --train-positions)" if cls.own_positions
           else "moved by --train-positions"]
    if cls.accepts_group_queries:
        how.append("and the GQA group's other heads' (--train-group unlisted)")
    return f"yes, {' '.join(how)}"


def _describe(cls) -> list[str]:
    """The lines under an index's heading: description, training queries, parameters and search grid."""
    doc = (cls.__doc__ or "").strip().splitlines()
    lines = [f"    {doc[0]}" if doc else "    (no description)"]
    lines.append(f"    uses train_queries: {_training(cls)}")
    lines.append(f"    takes copy hints (decode --copy-hints): {'yes' if cls.takes_hints else 'no'}")
    lines += _param_lines("build parameters", dict(cls.build_params))
    lines += _param_lines("search parameters", dict(cls.search_params))
    grid = "  ".join(f"{name} ∈ {list(values)}" for name, values in cls.search_grid.items()) or "none"
    return lines + [f"    search grid: {grid}"]


@click.command(short_help="List registered indexes with their parameters and grids.")
@click.option("--check", metavar="NAME", default=None,
              help="Run the conformance kit (anns_lab.testing.check_index) on index NAME at its default build "
                   "parameters instead; exit status 1 when it fails (a plugin's CI).")
@click.option("--min-recall", type=click.FloatRange(0, 1), default=0.9, show_default=True,
              help="With --check: the recall@10 its most thorough grid point must reach on the kit's data.")
@click.option("--param", "params", multiple=True, metavar="NAME=VALUE",
              help="With --check: a build parameter other than its default (repeatable), as check_index's keywords.")
@click.option("--unbiased-at", "unbiased_at", multiple=True, metavar="NAME=VALUE",
              help="With --check, for an estimator that claims to be unbiased: the search parameters its unbiasedness "
                   "is checked at (repeatable) [default: its first grid point].")
@click.option("--plausible-gain", default=None, metavar="X|none",
              help="With --check: the bound of the kit's counts-plausibility rule (how much more of the top-k than "
                   "its scanned share an index may find), or none to skip it (an index ranking by partial products "
                   "or codes) [default: the kit's].")
def indexes(check: str | None, min_recall: float, params: tuple[str, ...], unbiased_at: tuple[str, ...],
            plausible_gain: str | None) -> None:
    """List registered indexes (entry-point group anns_lab.indexes) and any that fail to load."""
    if check is not None:
        _check(check, min_recall, parse_params(params), parse_params(unbiased_at, "--unbiased-at") or None,
               _gain(plausible_gain) if plausible_gain is not None else {})
        return
    if given := given_flags(click.get_current_context(), "min_recall", "params", "unbiased_at", "plausible_gain"):
        raise click.UsageError(f"{', '.join(given)} go{'es' if len(given) == 1 else ''} with --check NAME")
    broken = registry.broken()
    classes = registry.available()
    for entry in registry.entries():
        head = f"{entry.name}  [{entry.distribution} {entry.version}]  {entry.target}"
        if entry.name in broken:
            click.echo(f"{head}\n    FAILED TO LOAD: {broken[entry.name]}")
            continue
        try:
            lines = _describe(classes[entry.name])
        except Exception as err:  # noqa: BLE001 - a plugin's malformed declarations (a list as build_params) once
            # ended the listing with a traceback, the indexes after it unlisted: it is named as broken instead
            broken[entry.name] = f"{type(err).__name__}: {err}".splitlines()[0]
            click.echo(f"{head}\n    FAILED TO DESCRIBE: {broken[entry.name]}")
            continue
        click.echo("\n".join([head, *lines]))
    if broken:
        click.echo(f"\n{len(broken)} index plugin(s) failed to load or to describe: {', '.join(broken)}; the others "
                   "work.", err=True)


def _gain(text: str) -> dict:
    """``--plausible-gain X|none`` as the kit's keyword: a bound above 0, or None (the rule skipped)."""
    if text.strip().lower() == "none":
        return {"plausible_gain": None}
    try:
        gain = float(text)
    except ValueError:
        gain = float("nan")
    if not gain > 0:
        raise AnnsLabError(f"--plausible-gain {text!r}: give a number above 0, or none")
    return {"plausible_gain": gain}


def _check(name: str, min_recall: float, build: dict | None = None, unbiased_at: dict | None = None,
           kit: dict | None = None) -> None:
    """The conformance kit on ``name``: what it measured, or the rule it broke and exit status 1."""
    from anns_lab.testing import check_index

    cls = registry.get(name)  # an unknown or broken name: one error, exit status 2
    # the command's mistakes, status 2, before the kit: a --param k=1 was the kit's own k, min_recall a TypeError
    for option, given, declared in (("--param", build or {}, dict(cls.build_params)),
                                    ("--unbiased-at", unbiased_at or {}, dict(cls.search_params))):
        if unknown := sorted(set(given) - set(declared)):
            raise AnnsLabError(f"{option} {unknown[0]}: {name} has no such {option == '--param' and 'build' or 'search'}"
                               f" parameter (its own: {', '.join(declared) or 'none'})")
    if unbiased_at and not cls.unbiased:
        raise AnnsLabError(f"--unbiased-at: {name} does not claim to be unbiased (the kit checks it only where it does)")
    click.echo(f"checking {name} ({cls.__module__}.{cls.__qualname__}) with the conformance kit ...", err=True)
    try:
        measured = check_index(cls, min_recall=min_recall, unbiased_at=unbiased_at, **(kit or {}), **(build or {}))
    except Exception as err:  # noqa: BLE001 - the kit's AssertionError, or the index's own error: both its failure
        click.echo(f"{name} fails the conformance kit: {type(err).__name__}: {err}", err=True)
        raise SystemExit(1) from None
    top = ", ".join(f"{k}={v}" for k, v in measured["grid"][-1].items()) or "no search parameters"
    click.echo(f"{name} passes the conformance kit: recall@10 {measured['recall'][-1]:.3f} at its most thorough grid "
               f"point ({top}), {len(measured['grid'])} grid point(s) searched")
