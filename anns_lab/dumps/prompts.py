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

        ids = tasks.special_prefix(tokenizer)
        text = corpus()
        chars = 8 * n_tokens
        body = tasks.encode(tokenizer, text[:chars])
        while len(ids) + len(body) < n_tokens and chars < len(text):
            chars *= 2
            body = tasks.encode(tokenizer, text[:chars])
        ids = ids + body
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


def _from_file(path: Path, tokenizer, n_tokens: int | None) -> Prompt:
    text, raw = read_prompt_file(path)
    ids = tasks.special_prefix(tokenizer) + tasks.encode(tokenizer, text)
    if n_tokens is not None and len(ids) < n_tokens:
        raise PromptError(f"prompt file {path} has {len(ids)} tokens, fewer than --tokens {n_tokens}; "
                          "give a longer file or a smaller --tokens")
    ids = ids if n_tokens is None else ids[:n_tokens]
    return Prompt(ids, "file", {"path": str(path.resolve()), "sha256": hashlib.sha256(raw).hexdigest()})
