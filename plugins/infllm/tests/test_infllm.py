"""InfLLM: the conformance kit, the representative scores against a query-by-query softmax, the blocks a search reads
against numpy, the counts, inserts, saves and the positions it is given."""

import numpy as np
import pytest

from anns_lab import indexes
from anns_lab.errors import IndexConfigError
from anns_lab.testing import check_index, easy_data
from anns_lab_infllm import InfLLM
from anns_lab_infllm.infllm import local_scores


def test_conformance():
    check_index(InfLLM, block=64)


def test_registered_through_entry_points():
    assert indexes.get("infllm") is InfLLM


def _scores_one_by_one(keys, key_pos, queries, query_pos, local, scale):
    """InfLLM's representative scores as its local attention gives them, one query at a time in float64: the
    softmax over the keys within ``local`` positions up to the query's, each weight added to its key."""
    scores = np.zeros(len(keys))
    for q, t in zip(queries.astype(np.float64), query_pos):
        reached = np.flatnonzero((key_pos <= t) & (key_pos > t - local))
        if len(reached):
            logits = keys[reached].astype(np.float64) @ q * scale
            w = np.exp(logits - logits.max())
            scores[reached] += w / w.sum()
    return scores


def _layout(n_keys, n_queries, seed):
    """Key positions with holes (the sweep's held-out keys) and training queries at every third position, some
    beyond the last key (the static window's queries)."""
    rng = np.random.default_rng(seed)
    key_pos = np.sort(rng.choice(np.arange(8, n_keys + n_keys // 4), n_keys, replace=False))
    query_pos = np.arange(0, 3 * n_queries, 3)
    return key_pos, query_pos


@pytest.mark.parametrize("local", [1, 7, 64, 100_000])
def test_the_scores_are_each_querys_softmax_over_the_keys_it_reaches(local):
    keys, _, _ = easy_data(n_keys=700, dim=16, seed=2)
    rng = np.random.default_rng(4)
    key_pos, query_pos = _layout(700, 330, 4)
    queries = rng.standard_normal((330, 16)).astype(np.float32)
    got = local_scores(keys, key_pos, queries, query_pos, local, 0.25)
    np.testing.assert_allclose(got, _scores_one_by_one(keys, key_pos, queries, query_pos, local, 0.25), rtol=1e-5,
                               atol=1e-9)


def _reference_ids(keys, queries, k, blocks, block, n_repr, scores):
    """The keys a search at ``blocks`` returns, in numpy: each whole block the mean of its best-scored keys, the blocks
    of the highest products with the query (ties: the lower block), their keys and the remainder after the last whole
    block, and those keys' exact top-k."""
    starts = list(range(0, len(keys) // block * block + 1, block))
    reps = np.stack([keys[s + np.argsort(-scores[s:e], kind="stable")[:n_repr]].mean(axis=0)
                     for s, e in zip(starts[:-1], starts[1:])])
    out = []
    for q in queries:
        chosen = np.sort(np.argsort(-(reps @ q), kind="stable")[:blocks])
        cand = np.concatenate([np.arange(starts[b], starts[b + 1]) for b in chosen] + [np.arange(starts[-1], len(keys))])
        out.append((cand[np.argsort(-(keys[cand] @ q), kind="stable")[:k]], len(reps) + len(cand), len(chosen)))
    return out


@pytest.mark.parametrize("blocks,block,n_repr", [(1, 50, 4), (3, 64, 1), (5, 37, 37), (100, 64, 4)])
def test_a_search_reads_the_blocks_of_best_representatives_and_counts_them(blocks, block, n_repr):
    keys, queries, train = easy_data(n_keys=600, dim=16, seed=5)
    key_pos, query_pos = np.arange(600), np.linspace(0, 700, len(train)).astype(np.int64)
    index = InfLLM(block=block, repr=n_repr, local=50).build(keys, train, key_positions=key_pos,
                                                             train_positions=query_pos)
    res = index.search(queries, 10, blocks=blocks)
    scores = _scores_one_by_one(keys, key_pos, train, query_pos, 50, 0.25)
    for row, (want, scanned, chosen) in enumerate(_reference_ids(keys, queries, 10, blocks, block, n_repr, scores)):
        assert res.ids[row, :len(want)].tolist() == want.tolist()
        assert res.n_scanned[row] == scanned and res.bytes_read[row] == 4 * 16 * scanned + 8 * chosen


def test_the_representatives_are_the_keys_the_following_queries_attend():
    """A key that its next position's query attends strongly represents its block; the same query placed elsewhere
    leaves it unchosen: the positions decide."""
    rng = np.random.default_rng(11)
    keys = rng.standard_normal((256, 16)).astype(np.float32)
    query = rng.standard_normal(16).astype(np.float32)
    keys[70] = 3 * query / np.linalg.norm(query)  # block 1 (64..127) holds it
    train = np.stack([query, rng.standard_normal(16).astype(np.float32)])
    near = InfLLM(block=64, repr=1, local=4).build(keys, train, key_positions=np.arange(256),
                                                   train_positions=np.array([71, 200]))
    far = InfLLM(block=64, repr=1, local=4).build(keys, train, key_positions=np.arange(256),
                                                  train_positions=np.array([30, 200]))
    np.testing.assert_array_equal(near._reps[1], keys[70])
    assert not np.array_equal(far._reps[1], keys[70])  # no query reached it: the block's first key (all score 0)
    np.testing.assert_array_equal(far._reps[1], keys[64])


def test_added_keys_are_always_searched():
    keys, queries, train = easy_data(n_keys=500, dim=8, seed=9)
    where = {"key_positions": np.arange(400), "train_positions": np.linspace(0, 450, len(train)).astype(np.int64)}
    grown = InfLLM(block=50).build(keys[:400], train, **where)
    reps = grown._reps.copy()
    assert (grown.search(queries, 10, blocks=2).n_scanned == 8 + 100).all()
    grown.add(keys[400:])
    np.testing.assert_array_equal(grown._reps, reps)
    res = grown.search(queries, 10, blocks=2)
    assert (res.n_scanned == 8 + 100 + 100).all()
    for q, ids in zip(queries, res.ids):
        chosen = np.sort(np.argsort(-(reps @ q), kind="stable")[:2])
        cand = np.concatenate([np.arange(50 * b, 50 * b + 50) for b in chosen] + [np.arange(400, 500)])
        assert ids.tolist() == cand[np.argsort(-(keys[cand] @ q), kind="stable")[:10]].tolist()


@pytest.mark.parametrize("where,message", [
    ({}, "pass key_positions"),
    ({"key_positions": np.arange(300)}, "pass train_positions"),
    ({"key_positions": np.arange(299), "train_positions": np.arange(160)}, "300 integer positions"),
    ({"key_positions": np.arange(300.0), "train_positions": np.arange(160)}, "integer positions"),
    ({"key_positions": np.arange(300)[::-1], "train_positions": np.arange(160)}, "ascending"),
    ({"key_positions": np.zeros(300, int), "train_positions": np.arange(160)}, "one key a position"),
    ({"key_positions": np.arange(300) - 1, "train_positions": np.arange(160)}, "non-negative"),
    ({"key_positions": np.arange(300), "train_positions": np.arange(160)[::-1]}, "ascending"),
    ({"key_positions": np.arange(300, dtype=np.uint64) + np.uint64(2**63), "train_positions": np.arange(160)}, "int64"),
])
def test_missing_or_wrong_positions_are_refused(where, message):
    keys, _, train = easy_data(n_keys=300, dim=8, seed=1)
    with pytest.raises(IndexConfigError, match=message):
        InfLLM().build(keys, train, **where)


def test_an_index_without_positions_refuses_them():
    keys, _, train = easy_data(n_keys=300, dim=8, seed=1)
    with pytest.raises(IndexConfigError, match="does not take key_positions"):
        indexes.create("roargraph").build(keys, train, key_positions=np.arange(300), train_positions=np.arange(160))


def test_repr_beyond_the_block_is_refused():
    with pytest.raises(IndexConfigError, match="repr=9 must not exceed block=8"):
        InfLLM(block=8, repr=9)


def test_a_save_with_broken_blocks_is_refused():
    keys, _, train = easy_data(n_keys=300, dim=8, seed=1)
    index = InfLLM(block=64).build(keys, train, key_positions=np.arange(300), train_positions=np.arange(160))
    arrays = index._arrays()
    assert index._starts.tolist() == [0, 64, 128, 192, 256]  # whole blocks: keys 256..299 are read by every search
    for starts in (np.array([0, 64, 64, 256]), np.array([1, 65, 129]), np.array([0, 64, 100]), np.array([0, 400]),
                   np.array([], np.int64)):
        broken = {**arrays, "starts": starts, "representatives": np.zeros((max(0, len(starts) - 1), 8), np.float32)}
        fresh = InfLLM(block=64)
        fresh.n_keys, fresh.dim = index.n_keys, index.dim
        with pytest.raises(IndexConfigError, match="partition"):
            fresh._restore(broken)


def test_exact_at_every_block():
    keys, queries, train = easy_data(n_keys=900, dim=16, seed=3)
    index = InfLLM(block=100).build(keys, train, key_positions=np.arange(900),
                                    train_positions=np.arange(len(train)))
    top = index.grid()[-1]
    assert top == {"blocks": 9}
    res = index.search(queries, 10, **top)
    want = np.argsort(-(queries @ keys.T), axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(res.ids, want)
    assert (res.n_scanned == 9 + 900).all()


def test_fewer_keys_than_a_block_are_all_read_and_the_scale_is_the_scores():
    keys, queries, train = easy_data(n_keys=100, dim=16, seed=6)
    short = InfLLM(block=128).build(keys, train, key_positions=np.arange(100), train_positions=np.arange(len(train)))
    assert short.grid() == [{"blocks": 1}] and len(short._reps) == 0
    res = short.search(queries, 10, blocks=1)
    np.testing.assert_array_equal(res.ids, np.argsort(-(queries @ keys.T), axis=1, kind="stable")[:, :10])
    assert (res.n_scanned == 100).all() and (res.bytes_read == 4 * 16 * 100).all()
    where = {"key_positions": np.arange(100), "train_positions": np.arange(0, 2 * len(train), 2)}
    hot = InfLLM(block=10, repr=2, local=30, scale=3.0).build(keys, train, **where)
    scores = _scores_one_by_one(keys, where["key_positions"], train, where["train_positions"], 30, 3.0)
    want = [keys[s + np.argsort(-scores[s:s + 10], kind="stable")[:2]].mean(axis=0) for s in range(0, 100, 10)]
    np.testing.assert_allclose(hot._reps, np.stack(want), rtol=1e-6)
    assert not np.allclose(InfLLM(block=10, repr=2, local=30).build(keys, train, **where)._reps, hot._reps)
