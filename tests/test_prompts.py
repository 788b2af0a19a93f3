"""Prompt sources: exact lengths with any tokenizer, the needle really inside, benchmark scoring."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from anns_lab.dumps import tasks
from anns_lab.dumps.prompts import build_prompt
from anns_lab.dumps.text import corpus
from anns_lab.errors import PromptError


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.mark.parametrize("source", ["text", *tasks.TASKS])
@pytest.mark.parametrize("n", [300, 1000])
def test_every_source_has_exactly_n_tokens(tok, source, n):
    p = build_prompt(source, tok, n, seed=3)
    assert len(p.ids) == n and p.source == source


@pytest.mark.parametrize("task", tasks.TASKS)
def test_needle_and_answer_are_in_the_prompt_at_its_depth(tok, task):
    s = tasks.make_sample(task, tok, 1500, seed=11, depth=0.25)
    text = tok.decode(s.ids)
    for answer in s.answers:
        assert answer in text
    # The asked-for needle (the first) sits at the requested depth; distractors lie anywhere.
    assert 0.05 < text.index(s.answers[0]) / len(text) < 0.6
    if task == "kv_retrieval":
        body = text[text.index("{"):text.rindex("}") + 1]
        pairs = json.loads(body)
        key = re.search(r'Key: "([^"]+)"', text).group(1)
        assert pairs[key] == s.answers[0]


QUESTIONS = {"passkey": "What is the pass key?", "number_string": "What is the sequence of digits?",
             "kv_retrieval": "Key: \"", "niah": "What is the special magic number for",
             "niah_multikey": "What is the special magic number for", "niah_multivalue": "What is all the special magic"}


@pytest.mark.parametrize("task", tasks.TASKS)
def test_the_last_question_ids_ask_and_the_rest_holds_every_answer(tok, task):
    """``question`` splits a sample where ``decode --question-after-prefill`` does: the context before it holds the
    needles and not the question, the tail is the question alone."""
    s = tasks.make_sample(task, tok, 1500, seed=11, depth=0.25)
    context, question = tok.decode(s.ids[: -s.question]), tok.decode(s.ids[-s.question:])
    assert 0 < s.question < len(s.ids) // 4
    assert QUESTIONS[task] in question and QUESTIONS[task] not in context
    assert question.lstrip().startswith("}" if task == "kv_retrieval" else "What")  # not a token more or fewer
    assert all(answer in context and answer not in question for answer in s.answers)


def test_samples_depend_on_seed_only(tok):
    a = tasks.make_sample("passkey", tok, 400, seed=5)
    b = tasks.make_sample("passkey", tok, 400, seed=5)
    c = tasks.make_sample("passkey", tok, 400, seed=6)
    assert a == b and a.answers != c.answers


def test_scoring_follows_the_benchmarks():
    assert tasks.score("passkey", " 12345. The pass key", ("12345",)) == 1.0
    assert tasks.score("passkey", " 123456", ("12345",)) == 0.0  # first integer must equal the key
    assert tasks.score("number_string", "is 0012 and 9876543210", ("9876543210",)) == 0.0
    assert tasks.score("kv_retrieval", 'value "ab-cd" ok', ("ab-cd",)) == 1.0
    assert tasks.score("niah_multivalue", "1111111 and 2222222", ("1111111", "2222222", "3333333", "4444444")) == 0.5


def test_offline_corpus_is_long_real_text():
    text = corpus()
    assert len(text) > 1_000_000
    words = re.findall(r"[a-z]+", text[:200_000].lower())
    assert words.count("the") > 2000  # English prose, not code


@pytest.mark.realmodel
def test_offline_corpus_has_200k_smollm2_tokens():
    from anns_lab.dumps.models import load_model

    lm = load_model("smollm2")
    assert len(build_prompt("text", lm.tokenizer, 200_000).ids) == 200_000


def test_too_short_for_the_task(tok):
    with pytest.raises(PromptError, match="cannot hold"):
        tasks.make_sample("niah_multikey", tok, 40, seed=0)
    with pytest.raises(PromptError, match="unknown prompt source"):
        build_prompt("essays", tok, 100)


@pytest.mark.parametrize("n", [1, 57, 400, 3000])
def test_a_prefix_gives_the_whole_texts_first_tokens(tok, n):
    """--tokens N reads a file's (or the corpus's) first N tokens from a prefix of it, at a cost bounded by N (the whole
    of a 42 MB file took 6.4 GB to tokenize): they must be the whole text's first N."""
    from anns_lab.dumps.prompts import prefix_ids

    text = corpus()[: 64 * n + 20_000]
    whole = tasks.encode(tok, text)
    assert prefix_ids(tok, text, n)[:n] == whole[:n]


def test_a_prompt_file_is_read_to_its_tokens_and_refused_whole_past_the_limit(tok, tmp_path, monkeypatch):
    from anns_lab.dumps import prompts

    f = tmp_path / "p.txt"
    f.write_text(corpus()[:40_000])
    whole = tasks.special_prefix(tok) + tasks.encode(tok, f.read_text())
    assert build_prompt("text", tok, 500, path=f).ids == whole[:500]
    assert build_prompt("text", tok, None, path=f).ids == whole  # no --tokens: all of it
    monkeypatch.setattr(prompts, "FILE_MOST", len(whole) - 1)
    with pytest.raises(PromptError, match=f"holds more than {len(whole) - 1:,} tokens, too many to prefill whole: give "
                                          "--tokens N"):
        build_prompt("text", tok, None, path=f)
    assert build_prompt("text", tok, len(whole), path=f).ids == whole  # --tokens reads past the limit
