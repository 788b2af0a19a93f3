"""Keys owned once: the decoder's KeyStore and the indexes built on its heads."""

import numpy as np
import pytest

from anns_lab.errors import IndexConfigError
from anns_lab.indexes.key_store import KeyStore
from anns_lab.indexes.vamana import VamanaIndex


def test_indexes_read_the_owners_rows_and_add_what_it_appended():
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(2, 300, 8)).astype(np.float32)
    store = KeyStore(keys, capacity=310)
    indexes = [VamanaIndex(R=8, L=16).build(store.head(g)) for g in range(2)]
    new = rng.normal(size=(2, 40, 8)).astype(np.float32)
    store.append(new)  # the owner appends (the buffer grows past its capacity), then the indexes add
    for g, index in enumerate(indexes):
        index.add(new[g])
        assert index.n_keys == 340 and np.shares_memory(index._arrays()["keys"], store.buf)
        fresh = VamanaIndex(R=8, L=16).build(np.concatenate([keys[g], new[g]]))  # a store of its own
        assert fresh.search(new[g][:5], 1).ids[:, 0].tolist() == index.search(new[g][:5], 1).ids[:, 0].tolist()
    with pytest.raises(IndexConfigError, match="key store"):
        indexes[0].add(new[1][:3])  # rows the owner did not append


def test_an_index_of_its_own_wraps_then_grows():
    keys = np.arange(12, dtype=np.float32).reshape(3, 4)
    rows = KeyStore.own(keys)
    assert np.shares_memory(rows.view(3), keys)  # no copy until an append
    rows.append(3, np.ones((2, 4), np.float32))
    assert rows.n == 5 and not np.shares_memory(rows.view(5), keys) and rows.view(5)[3:].sum() == 8


LIBRARY_HELD = {"flat", "ivf"}  # faiss keeps its own vector of the keys (counted by their nbytes), not a numpy copy


def _registered_with_add():
    from anns_lab.indexes import registry

    return sorted(name for name, cls in registry.available().items() if name not in LIBRARY_HELD)


@pytest.mark.parametrize("name", _registered_with_add())
def test_an_index_on_the_callers_store_keeps_no_copy_of_its_keys_through_adds(name):
    """Built on one head of the decoder's store, an index reads the rows there: neither its build nor its adds (the
    store's buffer replaced as it grows) leave it a copy of every key. Until session 60, thirteen indexes' ``add``
    stacked the keys into a copy of their own: per query head, O(n·d) a batch."""
    from anns_lab.indexes import registry

    cls = registry.get(name)
    rng = np.random.default_rng(3)
    n, d = 600, 16
    store = KeyStore(rng.normal(size=(1, n, d)).astype(np.float32), capacity=n + 10)
    extra = {}
    if cls.uses_train_queries:
        extra["train_queries"] = rng.normal(size=(200, d)).astype(np.float32)
    if cls.reads_positions:
        extra |= {"key_positions": np.arange(n), "train_positions": np.arange(n - 200, n)}
    index = cls().build(store.head(0), **extra)

    def copies() -> list[tuple]:
        rows = store.buf[0, : index.n_keys]
        return [a.shape for a in index.held_arrays()
                if a.shape == rows.shape and not np.shares_memory(a, store.buf) and np.array_equal(a, rows)]

    assert copies() == []
    for batch in (64, 700):  # the second outgrows the buffer's grown capacity: a new buffer under the index
        new = rng.normal(size=(1, batch, d)).astype(np.float32)
        store.append(new)
        if index.supports_add:  # one without add still reads its rows from the store's new buffer, not the old one
            index.add(new[0])
        assert index.n_keys == (store.n if index.supports_add else n) and copies() == [], batch
    if not index.supports_add or cls.estimates:  # a sampler's top-k may hold no key (magicpig's estimate is its answer)
        return
    q = store.buf[0, n + 10: n + 12] * 10  # added keys, long: an index that searches them all finds each first
    assert index.search(q, 5, **(index.grid()[-1])).ids[:, 0].tolist() == [n + 10, n + 11]


def test_a_table_the_indexes_of_a_head_share_is_made_once_and_lives_while_one_holds_it(monkeypatch):
    """``KeyRows.shared``: indexes built on one head on threads share one derived table, made once (a race made one
    per thread, all but one thrown away); it goes with the last index that holds it (a layer that turns to an exact
    scan drops its indexes: their table stayed with the store, uncounted)."""
    import gc
    import time
    from concurrent.futures import ThreadPoolExecutor

    from anns_lab_lowrank import partial

    from anns_lab.indexes import registry

    made = []
    columns = partial.columns

    def slow_columns(table):  # a make that takes long enough for every thread to race into it
        made.append(1)
        time.sleep(0.05)
        return columns(table)

    monkeypatch.setattr(partial, "columns", slow_columns)
    store = KeyStore(np.random.default_rng(4).normal(size=(2, 3000, 32)).astype(np.float32))
    sparq = registry.get("sparq")
    with ThreadPoolExecutor(8) as pool:
        indexes = list(pool.map(lambda h: sparq().build(store.head(h // 4)), range(8)))
    assert len(made) == 2 and len(store.derived) == 2  # one per head
    assert all(ix._by_dim is indexes[4 * (h // 4)]._by_dim for h, ix in enumerate(indexes))
    np.testing.assert_array_equal(indexes[5]._by_dim.table, store.buf[1].T)
    del indexes
    gc.collect()
    assert len(store.derived) == 0


@pytest.mark.parametrize("name", ["roargraph", "vamana", "robust-vamana", "sparq", "double-sparsity"])
def test_an_index_on_a_store_pickles_and_copies(name):
    """An index holding its rows in a key store (its own or the caller's, with the store's lock and shared tables)
    pickles and deep-copies, as it did before the store shared tables: the copy searches as the index, after an add
    too, and holds what it holds (a graph's row views came back as copies of their own in session 61's first cut)."""
    import copy
    import pickle

    from anns_lab.indexes import registry
    from anns_lab.testing import easy_data

    keys, queries, train = easy_data(n_keys=600, dim=16, seed=2)
    cls = registry.get(name)
    extra = {"train_queries": train} if cls.uses_train_queries else {}
    if cls.reads_positions:
        extra |= {"key_positions": np.arange(600), "train_positions": np.arange(600 - len(train), 600)}
    for rows in (keys, KeyStore(keys[None].copy(), capacity=700).head(0)):
        index = cls().build(rows, **extra)
        want = index.search(queries[:5], 10)
        held = sum(a.nbytes for a in index.held_arrays())
        copies = [pickle.loads(pickle.dumps(index)), copy.deepcopy(index)]
        for again in copies:
            got = again.search(queries[:5], 10)
            assert np.array_equal(got.ids, want.ids) and np.array_equal(got.n_scanned, want.n_scanned)
            assert sum(a.nbytes for a in again.held_arrays()) == held
        if isinstance(rows, np.ndarray):  # an index of its own store appends: the copies add as the index does
            for one in [index, *copies]:
                one.add(keys[:40] + 0.5)
            want = index.search(queries[:5], 10)
            for again in copies:
                got = again.search(queries[:5], 10)
                assert np.array_equal(got.ids, want.ids) and np.array_equal(got.n_scanned, want.n_scanned)
