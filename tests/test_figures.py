"""The report figures' curve rule: each index's best grid point within each cost, against a by-hand walk."""

from __future__ import annotations

import numpy as np
import pandas as pd

from anns_lab.eval.figures import best_within


def test_best_within_is_the_running_best_by_cost_and_reaches_the_largest_cost():
    # A two-parameter grid out of cost order (vattention-like): costs 5, 1, 3, 4, 2, 6 with errors that do not fall with cost.
    pts = pd.DataFrame({"bytes_read": [5.0, 1.0, 3.0, 4.0, 2.0, 6.0], "err": [0.2, 0.5, 0.1, 0.3, 0.6, np.nan]})
    got = best_within(pts, "bytes_read", "err", higher_is_better=False)
    # By hand, in cost order: 1→0.5 (first), 2→0.6 (no better), 3→0.1 (better), 4→0.3, 5→0.2 (no), NaN dropped;
    # the last point (cost 5) stays with the best so far.
    assert got["bytes_read"].tolist() == [1.0, 3.0, 5.0]
    assert got["err"].tolist() == [0.5, 0.1, 0.1]
    rec = best_within(pts.rename(columns={"err": "recall"}), "bytes_read", "recall", higher_is_better=True)
    assert rec["bytes_read"].tolist() == [1.0, 2.0, 5.0] and rec["recall"].tolist() == [0.5, 0.6, 0.6]
    assert best_within(pts.iloc[:0], "bytes_read", "err", False).empty
