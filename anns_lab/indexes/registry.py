"""The one index registry: the entry-point group ``anns_lab.indexes``.

Built-ins are announced in anns-lab's own ``pyproject.toml`` exactly as a plugin announces
its index, so there is no second path. A plugin that fails to import is recorded by name
(see :func:`broken`) and every other index keeps working.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import inspect
import re
import sys
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from anns_lab.errors import IndexConfigError
from anns_lab.indexes.base import Index

GROUP = "anns_lab.indexes"
#: What an index may be called: its name becomes part file names, figure labels and report cells (a plugin named
#: ``<script>...`` or ``$\frac{$`` once stopped a sweep or a report).
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")


@dataclass(frozen=True)
class Entry:
    """One registered index: its name, where it points, and the distribution that announced it."""

    name: str
    target: str
    distribution: str
    version: str


def _entry_points() -> dict[str, list[EntryPoint]]:
    # Re-read on every call: a plugin installed during a session is then visible at once. Every claim of a name is
    # kept: two distributions announcing one name (a plugin's "ivf") is a conflict, never a silent winner.
    out: dict[str, list[EntryPoint]] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        if all(ep.value != seen.value for seen in out.get(ep.name, [])):  # one distribution seen twice on the path
            out.setdefault(ep.name, []).append(ep)
    return out


def _dist(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    return (dist.name, dist.version) if dist else ("?", "?")


def entries() -> list[Entry]:
    """Every announced index, importable or not, sorted by name (a name two distributions claim: both, joined)."""
    return [Entry(name, " | ".join(ep.value for ep in eps), " | ".join(_dist(ep)[0] for ep in eps),
                  " | ".join(_dist(ep)[1] for ep in eps)) for name, eps in _entry_points().items()]


def _load(name: str, eps: list[EntryPoint]) -> type[Index]:
    if len(eps) > 1:
        raise IndexConfigError(f"{name!r} is announced by {len(eps)} distributions ("
                               + ", ".join(f"{_dist(ep)[0]}: {ep.value}" for ep in eps)
                               + "); uninstall one, or rename its entry point")
    if not NAME.fullmatch(name):
        raise IndexConfigError(f"index name {name!r} is not a name anns-lab can use: letters, digits and . _ + - "
                               "only, 64 at most (it names files and labels); rename its entry point")
    ep = eps[0]
    if not re.fullmatch(r"\s*[\w.]+\s*:\s*[\w.]+\s*(\[.*\]\s*)?", ep.value):  # ep.load() failed on .group of None
        raise IndexConfigError(f"entry point {name!r} = {ep.value!r} ({_dist(ep)[0]}) is not 'module:Class'; "
                               "fix the plugin's [project.entry-points.\"anns_lab.indexes\"]")
    try:
        obj = ep.load()
    except SystemExit as err:  # a plugin's sys.exit() at import must not end the listing or the sweep
        raise RuntimeError(f"{ep.value} called sys.exit({err.code!r}) at import") from None
    if not (isinstance(obj, type) and issubclass(obj, Index)):
        raise TypeError(f"{ep.value} is not a subclass of anns_lab.indexes.Index")
    return _named(obj, ep.name)


_RENAMED: dict[tuple[type[Index], str], type[Index]] = {}


def _named(cls: type[Index], name: str) -> type[Index]:
    """``cls`` under its registry name (error messages and listings use it). A class that declares no name of its
    own (a plugin's, or a plugin's subclass of a built-in) takes the first it is loaded under. A class announced under
    another name than its own (an alias entry point) is served as a subclass carrying the name: setting it on the
    class itself renamed it for every other name that serves it (a plugin's ``myflat`` alias of the built-in flat made
    flat's own saves and messages say ``myflat``)."""
    if not vars(cls).get("name"):
        cls.name = name
    if cls.name == name:
        return cls
    if (cls, name) not in _RENAMED:  # one class per name: a second load gives the same class (isinstance holds)
        # setdefault: two threads loading (or unpickling) the alias at once keep the first class made
        _RENAMED.setdefault((cls, name), type(cls.__name__, (cls,), {
            "name": name, "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
            "__reduce_ex__": _reduce_renamed}))
    return _RENAMED[cls, name]


def _reduce_renamed(self, protocol: int):
    """Pickle an alias's instance as its base class's reduction (its own ``__reduce_ex__`` or ``__reduce__`` where it
    has one, else object's), with the alias class as its callable or a top-level argument read as the base and the
    result renamed at load (the generated subclass is not importable; deeper references to it are not rewritten)."""
    cls = type(self)
    base = cls.__mro__[1]
    make, args, *rest = base.__reduce_ex__(self, protocol)
    make = base if make is cls else make  # ``return type(self), ...``
    args = tuple(base if a is cls else a for a in args)
    return (_renamed, (cls.name, make, args), *rest)


def _renamed(name: str, make, args: tuple) -> Index:
    """The base class's object made from its reduction, as the alias ``name``'s class (:func:`_named`)."""
    obj = make(*args)
    obj.__class__ = _named(type(obj), name)
    return obj


def available() -> dict[str, type[Index]]:
    """Every index class that imports cleanly, by name."""
    out = {}
    for name, eps in _entry_points().items():
        try:
            out[name] = _load(name, eps)
        except Exception:  # noqa: BLE001 - a broken plugin must not break the others; see broken()
            continue
    return out


def broken() -> dict[str, str]:
    """Indexes whose entry point fails to load (or whose name two distributions claim), by name, with the error as
    one line."""
    out = {}
    for name, eps in _entry_points().items():
        try:
            _load(name, eps)
        except Exception as err:  # noqa: BLE001
            out[name] = f"{type(err).__name__}: {err}".splitlines()[0]
    return out


def get(name: str) -> type[Index]:
    """The index class registered as ``name``; unknown names get close-name suggestions."""
    if not isinstance(name, str):
        raise IndexConfigError(f"an index is named by a string, got {name!r}")
    eps = _entry_points()
    if name not in eps:
        close = difflib.get_close_matches(name, list(eps), n=3, cutoff=0.5)
        hint = (f"; did you mean {', '.join(close)}?" if close else
                "; a plugin installed with pip --target DIR is seen with DIR on PYTHONPATH")
        raise IndexConfigError(f"unknown index {name!r} (registered: {', '.join(eps) or 'none'}){hint}")
    try:
        return _load(name, eps[name])
    except IndexConfigError:
        raise
    except Exception as err:  # noqa: BLE001
        value = " | ".join(ep.value for ep in eps[name])
        raise IndexConfigError(f"index {name!r} ({value}) failed to load: {type(err).__name__}: {err}") from err


#: How :func:`code_stamp` reads an index's code; a part recorded under another rule is evaluated again, said so.
#: 2 (session 56): the modules its classes import from their own packages count, and indentation.
STAMP_RULE = 2


def code_stamp(name: str) -> dict[str, str]:
    """What says which code ``name``'s index is: the distribution and version announcing it, and a sha256 over the
    source files of its class and its bases but ``Index``, and of every module of their packages they import, at any
    depth (anns-lab's own classes: of ``anns_lab.indexes``), but blank and comment-only lines and trailing spaces: a
    plugin edited in place keeps its version, and a sweep's resume must not keep the rows of its code before (a helper
    kernel's edit, or a base class's kernel's, included)."""
    cls = get(name)
    digest = hashlib.sha256()
    files: list[Path] = []
    scopes: set[str] = set()
    for base in cls.__mro__:
        if base in (Index, object):
            continue
        try:
            files.append(Path(inspect.getsourcefile(base)))
        except (TypeError, OSError):  # a class with no file of its own (built-in, made at run time)
            digest.update(f"{base.__module__}.{base.__qualname__}".encode())
            continue
        top = base.__module__.split(".")[0]
        scopes.add("anns_lab.indexes" if top == "anns_lab" else top)  # the lab's file handling is no index's code
    skip = {Path(inspect.getsourcefile(Index)), *files}
    for path in [*files, *_imported_sources(files, scopes, skip)]:
        # its lines but blank and comment-only ones: the same on any Python (ast.dump's text is not); indentation is
        # Python's syntax, kept
        digest.update(b"\n".join(line.rstrip() for line in path.read_bytes().splitlines()
                                 if line.strip() and not line.strip().startswith(b"#")))
    entry = next((e for e in entries() if e.name == name), None)
    return {"distribution": entry.distribution if entry else "?", "version": entry.version if entry else "?",
            "source_sha256": digest.hexdigest()[:16], "stamp_rule": STAMP_RULE}


def _imported_sources(files: list[Path], scopes: set[str], skip: set[Path]) -> list[Path]:
    """The source files of the modules within ``scopes`` (dotted packages) that ``files`` import, and those they
    import, at any depth (sorted; none of ``skip``): read from each file's import statements, so what a function
    imports counts too, and found on disk, never imported (a module's import may fail, or print)."""
    def within(module: str) -> bool:
        return any(module == scope or module.startswith(scope + ".") for scope in scopes)

    found: dict[str, Path] = {}
    todo = list(files)
    while todo:
        path = todo.pop()
        try:
            tree = ast.parse(path.read_bytes())
        except (OSError, SyntaxError, ValueError):
            continue
        package = _package_of(path, {scope.split(".")[0] for scope in scopes})
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package (level 1 is that package)
                    if package is None or node.level - 1 > package.count("."):
                        continue
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for module in names:
                if not within(module) or module in found:
                    continue
                origin = _source_of(module)
                if origin is not None and origin not in skip:
                    found[module] = origin
                    skip = skip | {origin}
                    todo.append(origin)
    return [found[m] for m in sorted(found)]


def _roots(top: str) -> list[Path]:
    """The folders of the (imported) top-level package ``top``; none for a single-file module or one not imported."""
    module = sys.modules.get(top)
    return [Path(p) for p in getattr(module, "__path__", None) or []]


def _package_of(path: Path, tops: set[str]) -> str | None:
    """The dotted package a source file under one of the packages ``tops`` belongs to (``a.b`` for ``a/b/c.py`` and
    for ``a/b/__init__.py``), or None."""
    for top in sorted(tops):
        for root in _roots(top):
            try:
                parts = path.resolve().relative_to(root.resolve()).with_suffix("").parts
            except ValueError:
                continue
            return ".".join([top, *parts[:-1]])
    return None


def _source_of(module: str) -> Path | None:
    """The .py file of a module of an imported package, found on disk, or None (a name that is no module: an
    imported function's)."""
    top, *rest = module.split(".")
    for root in _roots(top):
        base = root.joinpath(*rest)
        for candidate in ((base.with_suffix(".py"),) if rest else ()) + (base / "__init__.py",):
            if candidate.is_file():
                return candidate
    return None


def create(name: str, **build_params: Any) -> Index:
    """A new, unbuilt index ``name`` with the given build parameters (defaults for the rest)."""
    return get(name)(**build_params)
