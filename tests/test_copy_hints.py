"""Copy hints (decode.copy_hints): the positions they name, and that the decoder's searches enter there."""

import numpy as np
import pytest

from anns_lab.decode.copy_hints import CopyHints, continuations
from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.eval.metrics import exact_topk


def _reference(tokens: list[int], n_max: int, cap: int) -> list[int]:
    """The longest suffix (≤ n_max) with an earlier occurrence; the positions after its latest ``cap`` occurrences."""
    n = len(tokens)
    for length in range(min(n_max, n - 1), 0, -1):
        suffix = tokens[n - length:]
        after = [s + length for s in range(n - length) if tokens[s:s + length] == suffix]
        if after:
            return sorted(after, reverse=True)[:cap]
    return []


@pytest.mark.parametrize("alphabet", [2, 5, 40])
def test_continuations_match_a_plain_reference(alphabet):
    rng = np.random.default_rng(alphabet)
    for _ in range(200):
        tokens = rng.integers(0, alphabet, rng.integers(1, 60)).tolist()
        n_max, cap = int(rng.integers(1, 5)), int(rng.integers(1, 10))
        assert continuations(np.array(tokens), n_max, cap).tolist() == _reference(tokens, n_max, cap)


def test_a_copied_number_is_continued_where_it_was_read():
    """The needle's digits: after "is: 8 3" the hint is the position of the digit that followed "8 3" in the text."""
    text = [7, 9, 11, 20, 21, 8, 3, 1, 9, 30, 7, 9, 11, 40, 41, 42]  # ... "is: 8 3 1 9" ... later the question
    generated = text + [20, 21, 8, 3]
    assert continuations(np.array(generated)).tolist() == [7]  # "21 8 3" occurred once; then came position 7 (the "1")
    hints = CopyHints(cap=8)
    hints.update(generated)
    np.testing.assert_array_equal(hints.rows(first=4), [3])  # row = position − sink
    hints.update(generated[:8])  # the hint at position 7 itself would be the current token: rows before the sink drop
    assert all(r >= 0 for r in hints.rows(first=4))
    off = CopyHints(cap=0)
    off.update(generated)
    assert off.rows(first=4) is None


def _clustered(rng, n, d, centers=12, spread=0.3):
    c = rng.normal(size=(centers, d))
    return (c[rng.integers(0, centers, n)] + spread * rng.normal(size=(n, d))).astype(np.float32)


@pytest.mark.parametrize("name", ["roargraph", "flat"])
def test_layer_store_searches_enter_at_the_hints(name):
    """With a narrow beam, hints naming a head's exact top-k make its retrieved set exactly that top-k (the hints are
    scanned and nothing scores higher), so the attention equals numpy's over them; an index that takes no hints
    (flat) gives the same result with and without them."""
    rng = np.random.default_rng(7)
    n, d, topk = 600, 16, 6
    keys = _clustered(rng, n, d)[None]
    values = rng.normal(size=(1, n, d)).astype(np.float32)
    params = {"L": 6} if name == "roargraph" else {}
    build = dict(M=8, R=16, n_hubs=4, keep_queries=64) if name == "roargraph" else {}
    store = LayerStore(0, 1, keys, values, topk, IndexPlan(name, build, params), add_batch=64)
    store.build(_clustered(rng, 300, d)[None])
    for _ in range(5):
        q = _clustered(rng, 1, d) * 3
        top = exact_topk(q @ keys[0].T, topk)[0]
        side = store.side(q, 0.2, hints=np.concatenate([top[::-1], [n + 5]]))  # a row past the index is dropped
        s = (q[0].astype(np.float64) @ keys[0][top].T.astype(np.float64)) * 0.2
        w = np.exp(s - s.max())
        np.testing.assert_allclose(side.out[0], w @ values[0][top].astype(np.float64) / w.sum(), rtol=1e-6, atol=1e-9)
        if name == "flat":
            np.testing.assert_array_equal(side.out, store.side(q, 0.2).out)


def test_copy_hints_follow_the_sequence_as_it_grows():
    """The decoder calls update with the prompt, then once per generated token: each step's hints are those of the
    whole sequence so far."""
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, 6, 300).tolist()
    hints = CopyHints(cap=5)
    for n in [200, *range(201, 300)]:
        hints.update(tokens[:n])
        np.testing.assert_array_equal(hints.positions, _reference(tokens[:n], 3, 5))
