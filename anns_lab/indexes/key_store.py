"""The physical key array of one KV head, shared by the graph indexes of its GQA group."""

from __future__ import annotations

import weakref

import numpy as np


class KeyStore:
    """The physical key array of one KV head, shared by the indexes of its GQA group.

    ``build`` wraps the caller's float32 array without a copy; indexes built on the same array
    get the same store (looked up by buffer address and shape), so a GQA group holds its keys
    once. ``append(start, keys)`` grows the store with spare capacity (amortised doubling);
    when a sibling index already appended exactly these rows at ``start`` it is a no-op, so
    every index of the group can be given the same new keys by the decoder.
    """

    _live: weakref.WeakValueDictionary | None = None

    def __init__(self, keys: np.ndarray) -> None:
        self.buf = keys
        self.n = keys.shape[0]

    @classmethod
    def for_array(cls, keys: np.ndarray) -> "KeyStore":
        if cls._live is None:
            cls._live = weakref.WeakValueDictionary()
        tag = _tag(keys)
        store = cls._live.get(tag)
        if store is None or _tag(store.buf) != tag:  # a store that has grown since is not this array any more
            store = cls(keys)
            cls._live[tag] = store
        return store

    def view(self, n: int) -> np.ndarray:
        return self.buf[:n]

    def append(self, start: int, keys: np.ndarray) -> None:
        end = start + keys.shape[0]
        if self.n >= end and np.array_equal(self.buf[start:end], keys):
            return  # a sibling of the group already appended these rows
        if self.n != start:
            raise ValueError("KeyStore: the shared key array has diverged from this index")
        if end > self.buf.shape[0]:
            grown = np.empty((max(end, 2 * self.buf.shape[0]), self.buf.shape[1]), np.float32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[start:end] = keys
        self.n = end


def _tag(a: np.ndarray) -> tuple:
    return (a.__array_interface__["data"][0], a.shape, a.strides)
