"""What the C++ containers of the libraries behind some indexes (faiss, hnswlib) hold beyond their contents, so that
an index's ``nbytes`` is the memory it holds, not the bytes it stores (tests/test_index_memory.py checks every index
against glibc's allocator).

A ``std::vector`` that outgrows its capacity on ``resize`` reallocates to ``size + max(size, added)`` (libstdc++ and
libc++ alike): faiss's flat index grows its keys so on ``add``, and its inverted lists, filled one entry at a time,
end at the power of two at or above their size. And torch keeps kernels per matmul shape (:func:`padded_rows`).
"""

from __future__ import annotations

import platform
import sys

import numpy as np

# sizeof(std::mutex) (a pthread mutex) where it is not glibc x86-64's 40
MUTEX_BYTES = {("linux", "aarch64"): 48, ("linux", "arm64"): 48, ("darwin", "arm64"): 64, ("darwin", "x86_64"): 64}


def overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` share memory: exactly where numpy can tell within a bounded effort (two interleaved views
    of one buffer do not), else by their bounds, which say yes for arrays that only interleave."""
    try:
        return bool(np.shares_memory(a, b, max_work=1 << 16))
    except np.exceptions.TooHardError:
        return bool(np.may_share_memory(a, b))


def grown_capacity(capacity: int, size: int, added: int) -> int:
    """Capacity of a vector of ``size`` items and ``capacity`` after a resize that appends ``added``."""
    return capacity if size + added <= capacity else size + max(size, added)


def filled_one_by_one(sizes: np.ndarray) -> np.ndarray:
    """Capacities of vectors grown from empty one item at a time to ``sizes``: the power of two at or above each."""
    sizes = np.asarray(sizes, np.int64)
    return np.where(sizes > 0, np.left_shift(1, np.ceil(np.log2(np.maximum(sizes, 1))).astype(np.int64)), 0)


def padded_rows(n: int) -> int:
    """``n`` rounded up to a multiple of 2^(bits(n) - 5): at most 1/16 more, and 16 sizes an octave. torch's CPU
    bfloat16 matmul keeps ~0.6 MB of kernels per distinct 2-D shape for the life of the process (its oneDNN
    primitives; ~0.3 MB even with their cache off): products whose row counts follow the data (a head's keys) pad them
    to these sizes so that a process meets few shapes. (Its float32 products of numpy-made arrays kept nothing.)"""
    step = 1 << max(0, n.bit_length() - 5)
    return -(-n // step) * step


def mutex_bytes() -> int:
    """``sizeof(std::mutex)`` on this platform (:data:`MUTEX_BYTES`, else 40)."""
    return MUTEX_BYTES.get((sys.platform, platform.machine().lower()), 40)
