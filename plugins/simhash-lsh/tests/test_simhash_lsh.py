"""The example plugin's own tests: the anns-lab conformance kit plus checks of its counting."""

import numpy as np

from anns_lab import indexes
from anns_lab.testing import check_index, easy_data, recall_at_k
from anns_lab_simhash import SimHashLSH


def test_conformance():
    # LSH is approximate even at its most thorough setting, so the recall floor is declared here.
    check_index(SimHashLSH, min_recall=0.75)


def test_registered_through_entry_point():
    assert indexes.get("simhash") is SimHashLSH


def test_scanned_counts_candidates_plus_hyperplanes():
    keys, queries, _ = easy_data()
    index = SimHashLSH(K=6, L=16).build(keys)
    res = index.search(queries, 10, min_collisions=2)
    # Independent count: recompute the codes bit by bit with the stored hyperplanes.
    planes = index._planes.reshape(16, 6, -1)
    kc = np.einsum("tbd,nd->ntb", planes, keys) > 0
    qc = np.einsum("tbd,nd->ntb", planes, queries) > 0
    collisions = (kc[None] == qc[:, None]).all(axis=3).sum(axis=2)
    assert np.array_equal(res.n_scanned, (collisions >= 2).sum(axis=1) + 16 * 6)
    # Bytes: the scanned vectors as float32, and every key's 16 one-byte codes compared (they were left out before).
    assert np.array_equal(res.bytes_read, res.n_scanned * 4 * keys.shape[1] + len(keys) * 16 * 1)


def test_recall_rises_as_min_collisions_falls():
    keys, queries, _ = easy_data()
    index = SimHashLSH().build(keys)
    recalls = [recall_at_k(index.search(queries, 10, **p).ids, queries, keys, 10) for p in index.grid()]
    assert recalls == sorted(recalls) and recalls[-1] > recalls[0] + 0.5
