"""The static window value: one validation, its positions."""

import numpy as np
import pytest

from anns_lab.window import Window, WindowError


@pytest.mark.parametrize("text", ["64", "a,b", "1,2,3", "-1,4", "4,-1"])
def test_bad_windows_are_one_error(text):
    with pytest.raises(WindowError, match="SINK,RECENT"):
        Window.parse(text)


def test_positions_outside_and_ring_slots():
    w = Window.parse("3,4")
    assert w == (3, 4) and w.size == 7 and str(w) == "3,4"
    assert w.outside(20) == (3, 16) and w.outside(5) == (3, 3)
    slots = [w.slot(p) for p in range(3, 20)]
    assert set(slots) == set(range(3, 7)) and slots[:4] == [3, 4, 5, 6] and slots[4] == 3  # a ring of 4 after 3 sinks
    assert w.positions(10, 8).tolist() == [0, 1, 2, 8, 9, 10]
    assert w.positions(1, 0).tolist() == [0, 1]  # nothing before the query, nothing twice
    assert np.array_equal(Window(0, 0).positions(5, 5), [5])
