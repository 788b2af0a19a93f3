"""The one index registry: the entry-point group ``anns_lab.indexes``.

Built-ins are announced in anns-lab's own ``pyproject.toml`` exactly as a plugin announces
its index, so there is no second path. A plugin that fails to import is recorded by name
(see :func:`broken`) and every other index keeps working.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from anns_lab.errors import IndexConfigError
from anns_lab.indexes.base import Index

GROUP = "anns_lab.indexes"


@dataclass(frozen=True)
class Entry:
    """One registered index: its name, where it points, and the distribution that announced it."""

    name: str
    target: str
    distribution: str
    version: str


def _entry_points() -> dict[str, EntryPoint]:
    # Re-read on every call: a plugin installed during a session is then visible at once.
    eps = entry_points(group=GROUP)
    return {ep.name: ep for ep in sorted(eps, key=lambda e: e.name)}


def entries() -> list[Entry]:
    """Every announced index, importable or not, sorted by name."""
    out = []
    for name, ep in _entry_points().items():
        dist = getattr(ep, "dist", None)
        out.append(Entry(name, ep.value, dist.name if dist else "?", dist.version if dist else "?"))
    return out


def _load(ep: EntryPoint) -> type[Index]:
    obj = ep.load()
    if not (isinstance(obj, type) and issubclass(obj, Index)):
        raise TypeError(f"{ep.value} is not a subclass of anns_lab.indexes.Index")
    if obj.name != ep.name:
        obj.name = ep.name  # error messages and listings use the registry name
    return obj


def available() -> dict[str, type[Index]]:
    """Every index class that imports cleanly, by name."""
    out = {}
    for name, ep in _entry_points().items():
        try:
            out[name] = _load(ep)
        except Exception:  # noqa: BLE001 - a broken plugin must not break the others; see broken()
            continue
    return out


def broken() -> dict[str, str]:
    """Indexes whose entry point fails to load, by name, with the error as one line."""
    out = {}
    for name, ep in _entry_points().items():
        try:
            _load(ep)
        except Exception as err:  # noqa: BLE001
            out[name] = f"{type(err).__name__}: {err}".splitlines()[0]
    return out


def get(name: str) -> type[Index]:
    """The index class registered as ``name``; unknown names get close-name suggestions."""
    eps = _entry_points()
    if name not in eps:
        close = difflib.get_close_matches(name, list(eps), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise IndexConfigError(f"unknown index {name!r} (registered: {', '.join(eps) or 'none'}){hint}")
    try:
        return _load(eps[name])
    except Exception as err:  # noqa: BLE001
        raise IndexConfigError(f"index {name!r} ({eps[name].value}) failed to load: {type(err).__name__}: {err}") from err


def create(name: str, **build_params: Any) -> Index:
    """A new, unbuilt index ``name`` with the given build parameters (defaults for the rest)."""
    return get(name)(**build_params)
