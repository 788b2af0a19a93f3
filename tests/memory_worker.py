"""Run by tests/test_index_memory.py: for each index named, one after another, builds it on seeded data (once to warm
its kernels and the libraries' pools, then measured), then adds keys, and prints one JSON line per stage with what
glibc's allocator holds more than before the index existed (``mallinfo2``: bytes in use, mapped chunks included)
and the index's ``nbytes``. The inputs are made inside the measured window and dropped by the caller, so whatever
the index keeps of them is held, and whatever it keeps must be in ``nbytes``."""

from __future__ import annotations

import ctypes
import gc
import json
import sys

import numpy as np


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def allocated() -> int:
    """Bytes glibc's malloc has handed out and not taken back (its arenas' chunks in use and its mmapped chunks)."""
    gc.collect()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def data(seed: int, n: int, m: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, queries) with attention's shape of trouble: queries off the keys' distribution (a shared offset)."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n, d), dtype=np.float32)
    queries = rng.standard_normal((m, d), dtype=np.float32) + 2.0 * rng.standard_normal(d, dtype=np.float32)
    return keys, queries


def build(name: str, seed: int, n: int, m: int, d: int):
    from anns_lab.indexes import registry
    from anns_lab.testing import positions

    keys, queries = data(seed, n, m, d)
    index = registry.create(name)
    return index.build(keys, queries if index.uses_train_queries else None, **positions(type(index), n, m))


def add(index, seed: int, n: int, d: int) -> None:
    index.add(data(seed, n, 1, d)[0])


def main(names: list[str], n: int, m: int, d: int, n_add: int) -> None:
    for name in names:
        measure(name, n, m, d, n_add)


def measure(name: str, n: int, m: int, d: int, n_add: int) -> None:
    """One index's build and add, measured (see the module doc)."""
    from anns_lab.indexes import registry

    registry.get(name)  # imports the plugin before anything is measured
    # the warm-up on the same data: the same shapes for torch's products, whose kernels it keeps for the process
    warm = build(name, 2, n, m, d)
    if warm.supports_add:
        add(warm, 3, n_add, d)
    del warm
    before = allocated()
    index = build(name, 2, n, m, d)
    print(json.dumps({"index": name, "stage": "build", "held": allocated() - before, "nbytes": int(index.nbytes),
                      "keys": n}), flush=True)
    if not index.supports_add:
        return
    add(index, 3, n_add, d)
    print(json.dumps({"index": name, "stage": "add", "held": allocated() - before, "nbytes": int(index.nbytes),
                      "keys": n + n_add}), flush=True)


def bf16_shapes(calls: int) -> None:
    """What ``train_lists.topk_ip_bf16`` leaves held over ``calls`` calls with as many query and key counts (one size
    bucket of ``held_memory.padded_rows``), after a first call: torch keeps its matmul kernels per shape."""
    from anns_lab.indexes.train_lists import topk_ip_bf16

    keys, queries = data(4, 7010, 310, 64)
    topk_ip_bf16(queries[:300], keys[:7000], 20)
    before = allocated()
    for i in range(1, calls + 1):
        topk_ip_bf16(queries[:300 + i], keys[:7000 + i], 20)
    print(json.dumps({"stage": "bf16 shapes", "held": allocated() - before, "calls": calls}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--bf16-shapes":
        bf16_shapes(int(sys.argv[2]))
    else:  # N M D N_ADD NAME...
        main(sys.argv[5:], *map(int, sys.argv[1:5]))
