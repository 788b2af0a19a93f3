"""Exact products with chosen key rows and their top-k, for indexes that choose their candidates their own way
(partial products, a kept selection): numba, one thread, no BLAS team beside the decoder's torch, no gathered copy of
the rows; ties go to the lower position at every cut."""

from __future__ import annotations

import numpy as np
from numba import njit

from anns_lab.kernel_cache import install

install()  # numba's cache keyed on every kernel source, before the first kernel is defined


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})  # sums in SIMD lanes: finite float32 throughout
def score_rows(keys, rows, q, out):
    """``out[t] = keys[rows[t]] · q`` for every t (float32)."""
    d = keys.shape[1]
    for t in range(len(rows)):
        key = keys[rows[t]]
        acc = np.float32(0.0)
        for e in range(d):
            acc += key[e] * q[e]
        out[t] = acc


@njit(cache=True, nogil=True)
def select_largest(values, m):
    """Positions of the ``m`` largest ``values`` in position order (ties at the cut: the first positions)."""
    n = len(values)
    if m >= n:
        return np.arange(n)
    cut = -np.partition(-values, m - 1)[m - 1]  # the m-th largest
    at_cut = m - np.sum(values > cut)  # how many of those equal to it are taken
    picked = np.empty(m, np.int64)
    taken = 0
    for j in range(n):
        if values[j] > cut or (values[j] == cut and at_cut > 0):
            at_cut -= values[j] == cut
            picked[taken] = j
            taken += 1
    return picked


@njit(cache=True, nogil=True)
def largest(values, m):
    """Positions of the ``m`` largest ``values``, largest first, ties by position."""
    picked = select_largest(values, m)
    return picked[np.argsort(-values[picked], kind="mergesort")]  # stable: picked is in position order
