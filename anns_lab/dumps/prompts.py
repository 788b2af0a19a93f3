"""Prompt sources for a dump: a text file, the offline corpus, or a synthetic task, as exact token ids."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from anns_lab.dumps import tasks
from anns_lab.errors import PromptError

SOURCES = ("text",) + tasks.TASKS
CONTINUATIONS = ("greedy", "text")  # a dump's decode steps: the model's argmax tokens, or the text's own next ones
CONTINUATION_WORDS = {"greedy": "the model's greedy tokens", "text": "the text's own next tokens, teacher-forced"}


@dataclass(frozen=True)
class Prompt:
    """Token ids to prefill, and how they were made (recorded in the manifest)."""

    ids: list[int]
    source: str
    params: dict = field(default_factory=dict)


def build_prompt(source: str, tokenizer, n_tokens: int | None, seed: int = 0, path: str | Path | None = None) -> Prompt:
    """Ids of exactly ``n_tokens`` tokens from ``source`` (or from the file ``path``; all of it if ``n_tokens`` is None)."""
    if path is not None:
        return _from_file(Path(path), tokenizer, n_tokens)
    if n_tokens is None or n_tokens < 1:
        raise PromptError("--tokens must be a positive number of tokens")
    if source == "text":
        from anns_lab.dumps.text import corpus, corpus_sha256

        ids = tasks.special_prefix(tokenizer) + prefix_ids(tokenizer, corpus(), n_tokens)
        if len(ids) < n_tokens:
            raise PromptError(f"the offline corpus has {len(ids)} tokens with this tokenizer, fewer than --tokens {n_tokens}")
        return Prompt(ids[:n_tokens], "text", {"corpus": "python-stdlib-docs", "corpus_sha256": corpus_sha256()})
    if source in tasks.TASKS:
        s = tasks.make_sample(source, tokenizer, n_tokens, seed)
        return Prompt(s.ids, source, {"seed": seed, "depth": s.depth, "answers": list(s.answers), **s.params})
    raise PromptError(f"unknown prompt source {source!r}; choose one of: {', '.join(SOURCES)}, or give --prompt PATH")


def read_prompt_file(path: str | Path) -> tuple[str, bytes]:
    """The text and bytes of a ``--prompt`` file, or a PromptError if it is missing, not UTF-8 or empty."""
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"prompt file {path} " + ("is not a regular file (a folder, device or pipe): give a text file"
                                                     if path.exists() else "does not exist"))
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise PromptError(f"prompt file {path} cannot be read ({err.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PromptError(f"prompt file {path} is not UTF-8 text ({err})") from None
    if not text.strip():
        raise PromptError(f"prompt file {path} is empty: give a file with the text to prefill")
    return text, raw


#: Tokens past which a whole prompt file (no --tokens) is refused before the rest is read (8x the paper's 128K contexts):
#: the tokenizer's encoding of a 42 MB file took 6.4 GB, of a few hundred MB more than the machine had. --tokens N reads
#: the first N of any file (:func:`prefix_ids`).
FILE_MOST = 1 << 20
#: Tokens past the ones wanted that a prefix must hold for them to be the whole text's: a cut changes the tokens at it.
PREFIX_MARGIN = 64


def prefix_ids(tokenizer, text: str, n: int) -> list[int]:
    """Ids (no special tokens) of the shortest prefix of ``text`` (8·n characters, doubled as needed) holding ``n`` +
    PREFIX_MARGIN tokens, or of all of it: its first ``n`` are those of the whole text, at a cost bounded by ``n``."""
    chars = 8 * n
    ids = tasks.encode(tokenizer, text[:chars])
    while len(ids) < n + PREFIX_MARGIN and chars < len(text):
        chars *= 2
        ids = tasks.encode(tokenizer, text[:chars])
    return ids


def _from_file(path: Path, tokenizer, n_tokens: int | None) -> Prompt:
    text, raw = read_prompt_file(path)
    want = FILE_MOST + 1 if n_tokens is None else n_tokens
    ids = tasks.special_prefix(tokenizer) + prefix_ids(tokenizer, text, want)
    if n_tokens is None and len(ids) > FILE_MOST:
        raise PromptError(f"prompt file {path} holds more than {FILE_MOST:,} tokens, too many to prefill whole: give "
                          "--tokens N to prefill its first N")
    if n_tokens is not None and len(ids) < n_tokens:
        raise PromptError(f"prompt file {path} has {len(ids)} tokens, fewer than --tokens {n_tokens}; "
                          "give a longer file or a smaller --tokens")
    ids = ids if n_tokens is None else ids[:n_tokens]
    return Prompt(ids, "file", {"path": str(path.resolve()), "sha256": hashlib.sha256(raw).hexdigest()})
