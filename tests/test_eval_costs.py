"""eval.costs: each index's cheapest point at a recall target per head, checked by hand on a small table."""

import numpy as np
import pandas as pd

from anns_lab.eval import costs


def _table():
    rows = []
    # index a, head (1, 0): reaches 0.95 at two points, the cheaper in bytes is the second (fewer bytes, more scanned)
    for recall, scanned, nbytes, err, p in [(0.90, 0.1, 1000, 0.3, 1), (0.96, 0.3, 5000, 0.1, 2), (0.97, 0.4, 4000, 0.05, 3)]:
        rows.append({"index": "a", "layer": 1, "head": 0, "direction": "q2k", "recall": recall,
                     "scanned_fraction": scanned, "bytes_read": nbytes, "output_rel_error": err, "search_params": str(p)})
    # index b never reaches it on that head: its best recall is reported
    for recall, nbytes in [(0.5, 10), (0.93, 20), (0.8, 30)]:
        rows.append({"index": "b", "layer": 1, "head": 0, "direction": "q2k", "recall": recall,
                     "scanned_fraction": 0.2, "bytes_read": nbytes, "output_rel_error": 0.2, "search_params": "x"})
    rows.append(rows[0] | {"direction": "k2k", "recall": 1.0, "bytes_read": 1})  # other direction: ignored
    return pd.DataFrame(rows)


def test_least_bytes_reaching_the_target_and_best_recall_otherwise():
    pts = costs.at_target(_table(), 0.95).set_index("index")
    assert pts.loc["a", "reached"] and pts.loc["a", "bytes_read"] == 4000 and pts.loc["a", "output_rel_error"] == 0.05
    assert not pts.loc["b", "reached"] and pts.loc["b", "recall"] == 0.93
    s = costs.summary_at_target(costs.at_target(_table(), 0.95)).set_index("index")
    assert s.loc["a", "reached"] == 1 and s.loc["a", "kib_read"] == 4000 / 1024
    assert s.loc["b", "reached"] == 0 and np.isnan(s.loc["b", "kib_read"]) and s.loc["b", "best_recall_unreached"] == 0.93
    text = "\n".join(costs.markdown_at_target(costs.at_target(_table(), 0.95)))
    assert "| 1 | 0 | 4 / 40.0% / 0.050 | *best 0.930* |" in text
