"""Tables an index grows as keys are added (a graph's rows, hash codes, page bounds, a transposed copy of the keys):
spare capacity, so that an ``add`` writes its own entries where stacking old and new copied the whole table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Growable:
    """A table grown along ``axis`` (0: rows; 1: the columns of a (d, n) table). Its capacity grows by a quarter,
    amortised O(1) an entry without doubling the hundreds of tables a decoder holds; entries past ``n`` read ``fill``.
    ``buf`` stays C-contiguous (numba's kernels take it whole where a view of columns would be strided). A
    dataclass, so that ``Index.held_arrays`` counts its buffer, spare included."""

    buf: np.ndarray
    n: int
    axis: int = 0
    fill: int | float = 0

    @classmethod
    def of(cls, table: np.ndarray, axis: int = 0, fill: int | float = 0, dtype=None) -> Growable:
        """A table holding ``table``: not copied where it is C-contiguous and of ``dtype`` already, so a ``resize``
        that cuts writes ``fill`` into it (give it an array of the index's own). ``fill`` must be a value of the dtype."""
        table = np.ascontiguousarray(table, dtype)
        cast = np.full(1, fill).astype(table.dtype)[0]
        if cast != fill and not (np.isnan(fill) and np.isnan(cast)):  # NaN is a float's value
            raise ValueError(f"fill {fill!r} is not a value of the table's dtype {table.dtype}")
        return cls(table, table.shape[axis], axis, fill)

    def _span(self, start: int, stop: int) -> tuple[slice, ...]:
        return (slice(None),) * self.axis + (slice(start, stop),)

    @property
    def table(self) -> np.ndarray:
        """Entries ``[0, n)``, a view (a fresh one after each growth: the buffer is replaced)."""
        return self.buf[self._span(0, self.n)]

    def resize(self, n: int) -> np.ndarray:
        """Entries ``[0, n)``: those past the old end read ``fill``; those cut off are filled again."""
        cap = self.buf.shape[self.axis]
        if n > cap:
            shape = list(self.buf.shape)
            shape[self.axis] = max(n, cap + cap // 4)
            grown = np.full(shape, self.fill, self.buf.dtype)
            grown[self._span(0, self.n)] = self.table
            self.buf = grown
        elif n < self.n:
            self.buf[self._span(n, self.n)] = self.fill
        self.n = n
        return self.table

    def append(self, part: np.ndarray) -> np.ndarray:
        """Entries ``[0, n + len(part))``, ``part`` written after the old ones."""
        start = self.n
        self.resize(start + part.shape[self.axis])
        self.buf[self._span(start, self.n)] = part
        return self.table
