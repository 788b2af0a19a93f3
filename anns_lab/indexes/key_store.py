"""Key rows owned once: a growable store the caller keeps, and the view of one head an index reads from it."""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.indexes.growable import Growable


class KeyStore:
    """Growable float32 rows of G heads: ``buf`` (G, capacity, d), rows ``[0, n)`` valid.

    The owner of the keys (the decoder's layer store) appends to it; an index built on
    ``store.head(g)`` reads head g's rows from the same buffer, so the keys exist once however
    many indexes (a GQA group's query heads) use them. Capacity grows by a quarter (a :class:`Growable` along
    the rows, as the indexes' own tables grow), so the buffer is replaced now and then: readers take a fresh
    :meth:`view` rather than keep one.
    """

    def __init__(self, rows: np.ndarray, capacity: int = 0) -> None:
        rows = rows if rows.ndim == 3 else rows[None]
        if capacity > rows.shape[1]:
            self.buf = np.zeros((rows.shape[0], capacity, rows.shape[2]), np.float32)
            self.buf[:, : rows.shape[1]] = rows
        else:  # wrap the caller's array: no copy until the first append
            self.buf = rows
        self.n = rows.shape[1]
        self._share()

    def _share(self) -> None:
        # KeyRows.shared's tables, by head and name, each as long as an index holds it (not the store: a layer that
        # turns to an exact scan drops its indexes and their tables)
        self.derived: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.lock = threading.RLock()  # a group's indexes may build on threads

    def __getstate__(self) -> dict:
        # An index pickles with its store (or a copy of it): the lock and the weak references stay behind, each index
        # carrying the tables it holds itself.
        return {"buf": self.buf, "n": self.n}

    def __setstate__(self, state: dict) -> None:
        self.buf, self.n = state["buf"], state["n"]
        self._share()

    def head(self, g: int) -> "KeyRows":
        """Head ``g``'s rows, for indexes to be built on (the store's owner appends to it)."""
        return KeyRows(self, g)

    @classmethod
    def own(cls, keys: np.ndarray) -> "KeyRows":
        """Rows of an index's own around ``keys`` (n, d): no copy until the index's ``add`` appends."""
        return KeyRows(cls(keys), 0, owned=True)

    def append(self, rows: np.ndarray) -> None:
        """Add rows (G, t, d) after the last."""
        table = Growable(self.buf, self.n, axis=1)
        table.append(rows)
        self.buf, self.n = table.buf, table.n


class KeyRows(NamedTuple):
    """Head ``g`` of a :class:`KeyStore`: what an index holds in place of its own copy of the keys."""

    store: KeyStore
    g: int
    owned: bool = False  # the index's own store: its add appends; else the store's owner does

    @property
    def n(self) -> int:
        return self.store.n

    def view(self, n: int) -> np.ndarray:
        """Rows ``[0, n)`` (C-contiguous: a slice of one head of the buffer)."""
        return self.store.buf[self.g, :n]

    def held(self, n: int) -> np.ndarray:
        """The rows whose memory the index holds: its own store's whole buffer (the spare capacity ``add``'s growth
        left included), or rows ``[0, n)`` of a store the caller owns (whose buffer the caller counts)."""
        return self.store.buf[self.g] if self.owned else self.view(n)

    def shared(self, name: str, make, grow=None):
        """The object ``make()`` returns, made once per head of the store and ``name``, and the same for every index
        built on that head (a GQA group's query heads) while one holds it: a table derived from the rows, such as their
        transpose, which the indexes that read it keep in step with the rows (each only ever appended) by ``grow(it)``,
        called here too. Made and grown under the store's lock: the indexes may build on threads."""
        key = (self.g, name)
        with self.store.lock:
            made = self.store.derived.get(key)
            if made is None:
                made = self.store.derived[key] = make()
            if grow is not None:
                grow(made)
            return made

    def append(self, start: int, rows: np.ndarray) -> None:
        """Make rows ``[start, start + t)`` hold ``rows`` (t, d): appended to a store of the index's own; already
        there (checked) in a store the caller owns, which appends them before calling the index's ``add``."""
        end = start + len(rows)
        if self.owned and self.store.n == start:
            self.store.append(rows[None])
        elif self.owned or self.store.n < end or not np.array_equal(self.view(end)[start:], rows):
            raise IndexConfigError(f"add(): rows {start}..{end} are not those of the key store the index was built on "
                                   "(its owner appends them before calling add)")
