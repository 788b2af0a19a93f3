"""Tables an index grows as keys are added: written in place with spare capacity, as stacking would give."""

import numpy as np
import pytest

from anns_lab.indexes.growable import Growable
from anns_lab.indexes.key_store import KeyStore


@pytest.mark.parametrize("axis", [0, 1])
def test_appends_and_cuts_give_what_concatenation_gives(axis):
    rng = np.random.default_rng(0)
    first = rng.normal(size=(40, 3) if axis == 0 else (3, 40))
    table, want = Growable.of(first, axis=axis, fill=-1.0, dtype=np.float32), first.astype(np.float32)
    buffers = {id(table.buf)}
    for step in range(60):
        if step % 7 == 6:  # cut the last entries, as quest writes its last page's bounds again
            keep = want.shape[axis] - 2
            table.resize(keep)
            want = want[:keep] if axis == 0 else want[:, :keep]
        part = rng.normal(size=(3, 3)).astype(np.float32)
        got = table.append(part)
        want = np.concatenate([want, part], axis=axis)
        np.testing.assert_array_equal(got, want)
        assert table.buf.flags.c_contiguous and table.n == want.shape[axis]
        spare = table.buf[(slice(None),) * axis + (slice(table.n, None),)]
        assert (spare == -1.0).all()  # entries past n read the fill, cut ones included
        buffers.add(id(table.buf))
    # A quarter more each time: 40 entries grown to ~170 in 5-7 buffers, where stacking made one an append.
    assert len(buffers) <= 8


def test_a_fill_the_dtype_cannot_hold_is_refused_at_once():
    with pytest.raises(ValueError, match="not a value"):
        Growable.of(np.zeros(3, np.uint32), fill=-1)  # it would have raised at the first growth, or wrapped
    with pytest.raises(ValueError, match="not a value"):
        Growable.of(np.zeros(3, np.int32), fill=-1.5)  # it would have read -1
    assert Growable.of(np.zeros(3, np.int32), fill=-1).resize(5).tolist() == [0, 0, 0, -1, -1]
    assert np.isnan(Growable.of(np.zeros(3, np.float32), fill=np.nan).resize(4)[3])  # NaN is a float's value


def _built_on_store(cls, rng, n: int, d: int, capacity: int):
    store = KeyStore(rng.normal(size=(1, n, d)).astype(np.float32), capacity=capacity)
    extra = {}
    if cls.uses_train_queries:
        extra["train_queries"] = rng.normal(size=(300, d)).astype(np.float32)
    if cls.reads_positions:
        extra |= {"key_positions": np.arange(n), "train_positions": np.arange(n - 300, n)}
    return store, cls().build(store.head(0), **extra)


# Indexes whose add makes a per-key structure anew (their adds cost O(n) a batch, by design or by their library), or
# whose per-key state faiss holds, read out afresh by held_arrays (flat's keys are not: its nbytes counts faiss's).
REMADE_ON_ADD = {
    "ivf": "faiss's inverted lists, read out",
    "pqcache": "faiss's codes, read out",
    "hnsw": "hnswlib inserts; the searched adjacency is read out of it again",
    "ngfix": "hnsw's, then its repair edges merged again",
    "clusterkv": "the clusters' member list written again, the new keys inserted in one pass (no sort since session 61)",
    "squeezed": "clusterkv's",
    "shadowkv": "the landmarks and outlier chunks chosen again among all chunks",
}


def _registered_with_add():
    from anns_lab.indexes import Index, registry

    return sorted(name for name, cls in registry.available().items() if cls._add is not Index._add)


@pytest.mark.parametrize("name", _registered_with_add())
def test_a_small_add_writes_its_own_rows_in_place(name):
    """An add of one key allocates nothing whose size grows with the keys held: a graph's rows, hash codes, page
    bounds and transposed keys grow in place. Until session 61 vamana's and robust-vamana's adjacency, simhash's
    and magicpig's codes (and norms), and quest's page bounds were stacked into new arrays at every add."""
    from anns_lab.indexes import registry

    cls = registry.get(name)
    rng = np.random.default_rng(3)
    store, index = _built_on_store(cls, rng, n=2000, d=16, capacity=2500)
    new = rng.normal(size=(1, 64, 16)).astype(np.float32)
    store.append(new)
    index.add(new[0])  # the first add grows the tables, with spare room
    remade = []
    for _ in range(3):
        before = index.held_arrays()
        new = rng.normal(size=(1, 1, 16)).astype(np.float32)
        store.append(new)
        index.add(new[0])
        remade += [a.shape for a in index.held_arrays()
                   if a.nbytes >= index.n_keys and not any(np.shares_memory(a, b) for b in before)]
    assert (remade != []) == (name in REMADE_ON_ADD), remade
