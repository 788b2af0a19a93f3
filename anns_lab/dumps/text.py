"""Real English text that every Python installation carries, for prompts that need no download.

The corpus is the interactive-help topics of ``pydoc_data`` followed by the docstrings of the
standard library's pure-Python modules, in a fixed order. Both are prose written by people
(the Python documentation), several hundred thousand tokens in all. The text differs slightly
between Python versions, so a dump records the corpus checksum.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import sys
import sysconfig
from pathlib import Path

# Skip trees whose docstrings are mostly code, test fixtures or not English prose.
_SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages", "__pycache__"}
_MIN_DOCSTRING_CHARS = 300


def docstrings_under(root: Path, skip_parts: set[str] = _SKIP_PARTS, min_chars: int = _MIN_DOCSTRING_CHARS) -> list[str]:
    """The docstrings (module, class, function) of at least ``min_chars`` characters of every ``*.py`` under
    ``root``, in sorted path order, skipping files under a folder named in ``skip_parts``."""
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if skip_parts.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    out.append(doc.strip())
    return out


@functools.lru_cache(maxsize=1)
def corpus() -> str:
    """The whole offline corpus as one string (kept on disk per Python version: parsing the stdlib takes seconds)."""
    from anns_lab.dumps.models import cache_dir

    cached = cache_dir() / f"corpus-py{sys.version_info[0]}.{sys.version_info[1]}.{sys.version_info[2]}.txt"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    from pydoc_data.topics import topics

    parts = [topics[key].strip() for key in sorted(topics)]
    parts += docstrings_under(Path(sysconfig.get_paths()["stdlib"]))
    text = "\n\n".join(parts)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, cached)
    return text


def corpus_sha256() -> str:
    """Checksum of :func:`corpus`, recorded in a dump's manifest."""
    return hashlib.sha256(corpus().encode("utf-8")).hexdigest()
