"""``indexes.scan_rows``: the exact products with chosen rows and the top-k selects that SparQ, Loki and SnapKV share."""

import numpy as np
import pytest

from anns_lab.indexes.scan_rows import largest, score_rows, select_largest


def test_score_rows_are_the_rows_inner_products():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((50, 24)).astype(np.float32)
    rows = np.array([7, 0, 49, 7, 13], np.int64)
    q = rng.standard_normal(24).astype(np.float32)
    out = np.empty(len(rows), np.float32)
    score_rows(keys, rows, q, out)
    np.testing.assert_allclose(out, keys[rows].astype(np.float64) @ q.astype(np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 3, 7, 12, 20, 40])
def test_the_selects_break_ties_by_position(m):
    """Small integers, many repeats: the ``m`` largest are those a sort by (value, position) gives first."""
    values = np.random.default_rng(m).integers(-3, 4, size=30).astype(np.float32)
    want = sorted(range(30), key=lambda j: (-values[j], j))[: min(m, 30)]
    assert largest(values, m).tolist() == want
    assert select_largest(values, m).tolist() == sorted(want)
