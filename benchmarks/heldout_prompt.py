"""A held-out prompt file: docstrings of installed third-party packages, text the lab's defaults were not tuned on.

    python benchmarks/heldout_prompt.py --out /tmp/heldout.txt [--packages numpy,pandas,torch]
    anns-lab dump --model smollm2 --prompt /tmp/heldout.txt --tokens 8192 --decode-tokens 64 --out dumps/smollm2-heldout-8192

The lab's default prompt (``--source text``) is the Python standard library's documentation, and every
roargraph default was chosen on dumps of it. This script writes, as UTF-8, the long docstrings (≥ 300
characters, tests skipped) of the packages given, found with ``importlib.util.find_spec`` (nothing is
imported), interleaved one docstring per package in turn so that any prefix mixes them.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
from pathlib import Path

from anns_lab.dumps.text import docstrings_under


def package_docstrings(name: str) -> list[str]:
    """The long docstrings of the installed package ``name`` (its source tree, tests skipped)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name!r} is not installed here")
    return docstrings_under(Path(next(iter(spec.submodule_search_locations))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the UTF-8 prompt file to write")
    ap.add_argument("--packages", default="numpy,pandas,torch", help="comma-separated installed packages")
    args = ap.parse_args()
    per_package = [package_docstrings(p) for p in args.packages.split(",")]
    docs = [d for group in itertools.zip_longest(*per_package) for d in group if d is not None]
    text = "\n\n".join(docs)
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    print(f"{out}: {len(docs)} docstrings from {args.packages} ({', '.join(str(len(g)) for g in per_package)}), "
          f"{len(text):,} characters")


if __name__ == "__main__":
    main()
