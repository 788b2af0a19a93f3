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
