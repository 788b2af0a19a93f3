"""Numba's on-disk kernel cache, kept only while every kernel source of the lab is unchanged.

Numba keys a cached kernel on its own file's contents: a kernel that calls one in another file
(vamana's insertion pass calling ``graph.prune``, ngfix's kernels calling the graph search) kept the
machine code of the callee it was compiled with after that callee changed. An edit to the occlusion
rule left every cached ``vamana_pass`` on the old rule, silently, in any tree whose caches had been
written (a fresh clone has none). Here a kernel of the lab or of a plugin (a module named
``anns_lab*``) is keyed on its file plus every ``anns_lab`` source that defines kernels, so a
change to any of them compiles them again. :func:`install` runs before the first kernel is
defined: the kernel modules call it, or import one that does (``anns_lab.indexes`` through
``estimate``, ``anns_lab.indexes.graph``), before their kernels. Not covered: a plugin's kernels
calling kernels in its own other files, and ``NUMBA_CACHE_LOCATOR_CLASSES`` (which replaces the
locators this puts first).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent


@functools.cache
def kernels_digest(root: Path = ROOT) -> bytes:
    """sha256 over the kernel sources under ``root`` (the ``.py`` files that mention ``njit``), with their paths,
    read once per process."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        text = path.read_bytes()
        if b"njit" in text:
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + text + b"\0")
    return h.digest()


def _ours(py_func) -> bool:
    return (getattr(py_func, "__module__", None) or "").startswith("anns_lab")


def _keyed(base: type) -> type:
    """``base`` (one of numba's locators) for the lab's kernels only, its source stamp joined with
    :func:`kernels_digest` (numba drops an index whose stamp differs)."""

    class Locator(base):
        def get_source_stamp(self):
            return (super().get_source_stamp(), kernels_digest())

        @classmethod
        def from_function(cls, py_func, py_file):
            return super().from_function(py_func, py_file) if _ours(py_func) else None

    Locator.__name__ = Locator.__qualname__ = f"AnnsLab{base.__name__}"
    return Locator


def install() -> bool:
    """Put the keyed locators before numba's own (once per process); False where this numba's caching has
    another shape (then its own keys stand)."""
    try:
        from numba.core import caching

        impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # public from numba 0.61
        classes = list(impl._locator_classes)
        if any(getattr(c, "__name__", "").startswith("AnnsLab") for c in classes):
            return True
        bases = (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator)
        # numba's order: a user's NUMBA_CACHE_DIR, then __pycache__, then per user
        impl._locator_classes = [*(_keyed(b) for b in bases), *classes]
    except Exception:  # another numba's internals: its own keys stand rather than the lab failing to import
        return False
    return True


install()
