"""A held-out prompt file: docstrings of installed third-party packages, or English manual pages: text the lab's
defaults were not tuned on.

    python benchmarks/heldout_prompt.py --out /tmp/heldout.txt [--packages numpy,pandas,torch]
    python benchmarks/heldout_prompt.py --out /tmp/man.txt --man-pages 400      # prose of another domain: shell tools
    python benchmarks/heldout_prompt.py --out /tmp/langref.txt --language-reference  # the Python Language Reference
    anns-lab dump --model smollm2 --prompt /tmp/heldout.txt --tokens 8192 --decode-tokens 64 --out dumps/smollm2-heldout-8192

The lab's default prompt (``--source text``) is the Python standard library's documentation, and every
roargraph default was chosen on dumps of it. This script writes, as UTF-8, the long docstrings (≥ 300
characters, tests skipped) of the packages given, found with ``importlib.util.find_spec`` (nothing is
imported), interleaved one docstring per package in turn so that any prefix mixes them. ``--man-pages N`` writes
instead N section-1 manual pages (a seeded sample of ``/usr/share/man/man1``), each rendered by ``man -l`` and
reflowed into paragraphs (the terminal layout's indentation would be most of the tokens). ``--language-reference``
writes the Python Language Reference as the interpreter ships it for ``help()`` (``pydoc_data.topics``, its topics in
name order): strings of the stdlib that are not docstrings, so not in the default prompt.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

from anns_lab.dumps.text import docstrings_under


def package_docstrings(name: str) -> list[str]:
    """The long docstrings of the installed package ``name`` (its source tree, tests skipped)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name!r} is not installed here")
    return docstrings_under(Path(next(iter(spec.submodule_search_locations))))


def man_pages(count: int, seed: int = 0, folder: Path = Path("/usr/share/man/man1")) -> list[str]:
    """``count`` English manual pages of ``folder`` (a seeded sample, in sample order), rendered by ``man -l`` and
    reflowed: each paragraph on one line, pages of under 1,000 characters skipped, and the Google Cloud SDK's (where
    installed, ~16K generated near-copies that would be most of any sample)."""
    if count < 1:
        raise SystemExit(f"--man-pages {count}: give a positive number of pages")
    if shutil.which("man") is None:
        raise SystemExit("no `man` command here to render the manual pages (the man-db package)")
    pages = sorted(p for p in folder.glob("*.gz") if not p.name.startswith("gcloud"))
    if not pages:
        raise SystemExit(f"no manual pages under {folder} (is the man-db package installed?)")
    out: list[str] = []
    for page in random.Random(seed).sample(pages, len(pages)):
        run = subprocess.run(["man", "--nh", "--nj", "-l", str(page)], capture_output=True, text=True, env={**os.environ, "MANWIDTH": "200"})
        plain = re.sub(r".\x08", "", run.stdout)  # overstrike (bold, underline) when man writes for a terminal
        paragraphs = [" ".join(line.split()) for line in re.split(r"\n\s*\n", plain)]
        text = "\n\n".join(p for p in paragraphs if p)
        if run.returncode == 0 and len(text) >= 1000:
            out.append(text)
        if len(out) == count:
            break
    if len(out) < count:
        raise SystemExit(f"only {len(out)} of {folder}'s pages render to 1,000 characters or more; ask for at most that many")
    return out


def language_reference() -> list[str]:
    """The topics of the Python Language Reference that ``help()`` shows (keywords, statements, operators, data
    model), in name order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the UTF-8 prompt file to write")
    ap.add_argument("--packages", default="numpy,pandas,torch", help="comma-separated installed packages")
    ap.add_argument("--man-pages", type=int, default=None, help="write this many English manual pages instead (section 1)")
    ap.add_argument("--language-reference", action="store_true", help="write the Python Language Reference instead")
    args = ap.parse_args()
    if args.man_pages is not None and args.language_reference:
        raise SystemExit("give --man-pages or --language-reference, not both")
    if args.language_reference:
        docs, source = language_reference(), "topics of the Python Language Reference (pydoc_data.topics)"
    elif args.man_pages is not None:
        docs, source = man_pages(args.man_pages), "manual pages of /usr/share/man/man1"
    else:
        per_package = [package_docstrings(p) for p in args.packages.split(",")]
        docs = [d for group in itertools.zip_longest(*per_package) for d in group if d is not None]
        source = f"docstrings from {args.packages} ({', '.join(str(len(g)) for g in per_package)})"
    text = "\n\n".join(docs)
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    print(f"{out}: {len(docs)} {source}, {len(text):,} characters")


if __name__ == "__main__":
    main()
