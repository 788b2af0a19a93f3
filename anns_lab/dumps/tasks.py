"""Synthetic long-context tasks (∞-Bench and RULER style), built to an exact token count.

Shared by ``dump`` (as prompt sources) and ``decode`` (as scored tasks). A sample is token
ids, not text: pieces are tokenized separately and concatenated, so its length is exact for
any tokenizer, and the filler is cut to fit.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

import numpy as np

from anns_lab.errors import PromptError

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TASKS = ("passkey", "number_string", "kv_retrieval", "niah", "niah_multikey", "niah_multivalue")

_NIAH_WORDS = (
    "apple", "river", "lantern", "violin", "harbor", "meadow", "comet", "pepper", "glacier", "saddle",
    "orchid", "falcon", "marble", "thunder", "cobalt", "willow", "canyon", "ember", "quartz", "tulip",
)


@dataclass(frozen=True)
class TaskSample:
    """One prompt of a task: exactly ``len(ids)`` tokens, the expected answer(s) and where the needle lies; its last
    ``question`` ids ask for the answer (the rest is the context a cache may hold before the question comes)."""

    task: str
    ids: list[int]
    answers: tuple[str, ...]
    depth: float
    params: dict = field(default_factory=dict)
    question: int = 0


def special_prefix(tokenizer) -> list[int]:
    """Token ids the tokenizer puts before any text (e.g. Gemma's BOS); empty for SmolLM2."""
    with_special = tokenizer("x").input_ids
    plain = tokenizer("x", add_special_tokens=False).input_ids
    return list(with_special[: len(with_special) - len(plain)])


def encode(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` without special tokens."""
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _filler_ids(tokenizer, n: int, haystack: str) -> list[int]:
    unit = encode(tokenizer, haystack)
    if not unit:
        raise PromptError("the filler text encodes to no tokens")
    reps = n // len(unit) + 1
    return (unit * reps)[:n]


def _haystack_ids(tokenizer, n: int, haystack: str | None) -> list[int]:
    if haystack is None:  # RULER's niah uses real essays; we use the offline corpus
        from anns_lab.dumps.text import corpus

        text = corpus()
        ids = encode(tokenizer, text[: max(8 * n, 1000)])
        if len(ids) < n:
            ids = encode(tokenizer, text)
        if len(ids) < n:
            raise PromptError(f"the offline corpus has {len(ids)} tokens, fewer than the {n} needed")
        return ids[:n]
    return _filler_ids(tokenizer, n, haystack)


def _assemble(tokenizer, n_tokens: int, head: str, needles: list[str], question: str,
              depths: list[float], haystack: str | None) -> tuple[list[int], int]:
    """head + haystack with needles inserted at relative depths + question, exactly n_tokens long; and the question's
    length in tokens."""
    pre = special_prefix(tokenizer) + encode(tokenizer, head)
    needle_ids = [encode(tokenizer, " " + s + " ") for s in needles]
    q = encode(tokenizer, question)
    budget = n_tokens - len(pre) - len(q) - sum(len(x) for x in needle_ids)
    if budget < 0:
        raise PromptError(f"{n_tokens} tokens cannot hold this task's instructions and needles "
                          f"({n_tokens - budget} tokens needed)")
    hay = _haystack_ids(tokenizer, budget, haystack)
    order = np.argsort(depths, kind="stable")
    out, cut_prev = list(pre), 0
    for i in order:
        cut = int(round(depths[i] * budget))
        out += hay[cut_prev:cut] + needle_ids[i]
        cut_prev = cut
    out += hay[cut_prev:] + q
    assert len(out) == n_tokens
    return out, len(q)


def make_sample(task: str, tokenizer, n_tokens: int, seed: int, depth: float | None = None) -> TaskSample:
    """Build one sample of ``task`` with ``n_tokens`` tokens; the needle at ``depth`` (0..1, random if None)."""
    rng = np.random.default_rng(seed)
    depth = float(rng.uniform(0.05, 0.95)) if depth is None else float(depth)
    if not 0.0 <= depth <= 1.0:
        raise PromptError(f"depth must lie in [0, 1], got {depth}")
    params = {"seed": seed, "depth": depth}
    if task == "passkey":
        key = str(rng.integers(10_000, 100_000))
        head = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about the important information there."
        ids, asked = _assemble(tokenizer, n_tokens, head + " ", [f"The pass key is {key}. Remember it. {key} is the pass key."],
                               " What is the pass key? The pass key is", [depth], PASSKEY_FILLER)
        return TaskSample(task, ids, (key,), depth, params, asked)
    if task == "number_string":
        digits = "".join(str(d) for d in rng.integers(0, 10, size=10))
        if digits[0] == "0":
            digits = str(rng.integers(1, 10)) + digits[1:]
        head = "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the important information there."
        ids, asked = _assemble(tokenizer, n_tokens, head + " ",
                               [f"The sequence of digits is {digits}. Remember it. {digits} is the sequence of digits."],
                               " What is the sequence of digits? The sequence of digits is", [depth], PASSKEY_FILLER)
        return TaskSample(task, ids, (digits,), depth, params, asked)
    if task == "kv_retrieval":
        return _kv_retrieval(tokenizer, n_tokens, rng, depth, params)
    if task in ("niah", "niah_multikey", "niah_multivalue"):
        words = list(rng.choice(_NIAH_WORDS, size=4, replace=False))
        values = [str(rng.integers(1_000_000, 10_000_000)) for _ in range(4)]
        if task == "niah":
            needles, answers, depths = [f"One of the special magic numbers for {words[0]} is: {values[0]}."], (values[0],), [depth]
        elif task == "niah_multikey":  # distractor needles with other keys; ask for the first
            needles = [f"One of the special magic numbers for {w} is: {v}." for w, v in zip(words, values)]
            answers, depths = (values[0],), [depth] + list(rng.uniform(0.05, 0.95, size=3))
        else:  # several values for one key; all must be recalled
            needles = [f"One of the special magic numbers for {words[0]} is: {v}." for v in values]
            answers, depths = tuple(values), [depth] + list(rng.uniform(0.05, 0.95, size=3))
        what = "all the special magic numbers" if task == "niah_multivalue" else "the special magic number"
        head = "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you about the numbers afterwards.\n"
        question = f"\nWhat is {what} for {words[0]} mentioned in the provided text? The special magic number for {words[0]} mentioned in the provided text is"
        ids, asked = _assemble(tokenizer, n_tokens, head, needles, question, depths, None)
        return TaskSample(task, ids, answers, depth, params | {"key": words[0]}, asked)
    raise PromptError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def _kv_retrieval(tokenizer, n_tokens: int, rng: np.random.Generator, depth: float, params: dict) -> TaskSample:
    def uid() -> str:
        return str(uuid.UUID(bytes=rng.bytes(16), version=4))

    head = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n"
    pre = special_prefix(tokenizer) + encode(tokenizer, head)
    probe = encode(tokenizer, json.dumps({uid(): uid()})[1:-1] + ", ")
    per_pair = len(probe) + 2  # UUIDs tokenize to slightly different lengths
    q_len = len(encode(tokenizer, f'}}\n\nKey: "{uid()}"\nThe value associated with the specified key is: ')) + 2
    n_pairs = (n_tokens - len(pre) - q_len) // per_pair
    if n_pairs < 1:
        raise PromptError(f"{n_tokens} tokens cannot hold a kv_retrieval sample")
    pairs = [(uid(), uid()) for _ in range(n_pairs)]
    target = min(int(depth * n_pairs), n_pairs - 1)
    key, value = pairs[target]
    body = encode(tokenizer, "{" + json.dumps(dict(pairs))[1:-1])
    q = encode(tokenizer, f'}}\n\nKey: "{key}"\nThe value associated with the specified key is: ')
    pad = n_tokens - len(pre) - len(body) - len(q)
    if pad < 0:  # a pair longer than the estimate: drop pairs other than the target
        while pad < 0 and len(pairs) > 1:
            pairs.pop(-1 if target != len(pairs) - 1 else 0)
            body = encode(tokenizer, "{" + json.dumps(dict(pairs))[1:-1])
            pad = n_tokens - len(pre) - len(body) - len(q)
    # Whitespace-free padding between the header and the JSON keeps the object valid.
    ids = pre + _filler_ids(tokenizer, pad, PASSKEY_FILLER) + body + q if pad > 0 else pre + body + q
    if len(ids) != n_tokens:
        raise PromptError(f"could not fit a kv_retrieval sample into exactly {n_tokens} tokens")
    return TaskSample("kv_retrieval", ids, (value,), depth, params | {"n_pairs": len(pairs)}, len(q))


def score(task: str, answer: str, expected: tuple[str, ...]) -> float:
    """Benchmark scoring: first integer equals the key (passkey, number_string); else values found."""
    if task in ("passkey", "number_string"):
        m = re.search(r"\d+", answer)
        return float(m is not None and m.group(0) == expected[0])
    return sum(v in answer for v in expected) / len(expected)
