"""eval.costs: each index's cost at a recall target per head (between its grid points), checked by hand on a small table."""

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
    # a's frontier by bytes: (1000, 0.90), (4000, 0.97); (5000, 0.96) recalls less than a cheaper point. 0.95 lies
    # 5/7 of the way: every column mixed alike (before: the grid point of 4000 bytes, the whole step past the target)
    pts = costs.at_target(_table(), 0.95).set_index("index")
    w = 5 / 7
    assert pts.loc["a", "reached"] and np.isclose(pts.loc["a", "bytes_read"], 1000 + w * 3000)
    assert np.isclose(pts.loc["a", "recall"], 0.95) and np.isclose(pts.loc["a", "scanned_fraction"], 0.1 + w * 0.3)
    assert np.isclose(pts.loc["a", "output_rel_error"], 0.3 + w * (0.05 - 0.3)) and pts.loc["a", "search_params"] == "1 – 3"
    assert not pts.loc["b", "reached"] and pts.loc["b", "recall"] == 0.93 and pts.loc["b", "search_params"] == "x"
    s = costs.summary_at_target(costs.at_target(_table(), 0.95)).set_index("index")
    assert s.loc["a", "reached"] == 1 and np.isclose(s.loc["a", "kib_read"], (1000 + w * 3000) / 1024)
    assert s.loc["b", "reached"] == 0 and np.isnan(s.loc["b", "kib_read"]) and s.loc["b", "best_recall_unreached"] == 0.93
    text = "\n".join(costs.markdown_at_target(costs.at_target(_table(), 0.95)))
    assert "| 1 | 0 | 3 / 31.4% / 0.121 | *best 0.930* |" in text
    at_first = costs.at_target(_table(), 0.85).set_index("index")  # the cheapest point reaches it: its own values
    assert at_first.loc["a", "bytes_read"] == 1000 and at_first.loc["a", "recall"] == 0.90 and at_first.loc["a", "search_params"] == "1"


def test_rows_in_any_order_and_with_any_labels_give_the_same_points():
    # at_recall returns positions: a table read back in another order, with labels that are not positions, must not
    # mix one row's bytes with another's scanned fraction
    table = _table()
    shuffled = table.iloc[::-1].set_axis(np.arange(100, 100 + len(table)))
    a = costs.at_target(table, 0.95).set_index("index")
    b = costs.at_target(shuffled, 0.95).set_index("index")
    pd.testing.assert_frame_equal(a, b)


def test_an_unmeasured_output_error_reads_as_a_dash_not_nan():
    """A quick sweep leaves `output_rel_error` NaN: the report's tables (Markdown and HTML) read "nan" there before."""
    from anns_lab.eval import html, report

    table = _table().assign(output_rel_error=np.nan, mass_recovered=np.nan, latency_us=np.nan)
    points = costs.at_target(table, 0.95)
    text = "\n".join(costs.markdown_at_target(points))
    assert "| a | 1/1 | 31.43% | 3.1 | — | — |" in text and "| 1 | 0 | 3 / 31.4% / — | *best 0.930* |" in text
    assert "nan" not in text.lower()
    page = html.table(costs.summary_at_target(points).round(4), "t") + html.table(report._points_view(table), "p")
    assert "<td>—</td>" in page and "nan" not in page.lower()
    assert html.table(pd.DataFrame({"x": [0.5, np.nan], "y": ["nan", "b"]}), "u").count("<td>—</td>") == 1  # text stays
