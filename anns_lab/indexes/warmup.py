"""Compile (or load from numba's on-disk cache) the search and build kernels of some indexes, once, up front.

numba compiles a kernel on its first call in a fresh installation, which takes minutes on a
small machine. Doing it here, on tiny data, lets a caller say so and time it instead of
leaving a progress bar at zero; workers started afterwards load the cached machine code.
"""

from __future__ import annotations

import time

import numpy as np

from anns_lab.indexes import registry


def warm_up(names: list[str], dim: int, build_params: dict[str, dict] | None = None) -> float:
    """Build and search a tiny index of each of ``names`` once; returns the seconds it took.

    Failures are ignored: the real work reports them with the real data. Only the lab's own indexes are
    warmed (they hold its numba kernels): a plugin's code runs in workers only, where an ``os.abort`` or a
    ``SystemExit`` fails its own part instead of the process that called this.
    """
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((1024, dim)).astype(np.float32)
    queries = rng.standard_normal((64, dim)).astype(np.float32)
    t0 = time.perf_counter()
    for name in names:
        try:
            if not registry.get(name).__module__.startswith("anns_lab."):
                continue
            index = registry.create(name, **(build_params or {}).get(name, {}))
            index.build(keys, queries if index.uses_train_queries else None)
            params = index.grid()[0] if index.grid() else {}
            index.search(queries, 10, **params)
            index.search(queries[:1], 10, **params)
        except Exception:  # noqa: BLE001 - a warm-up only; the sweep or decoder reports real failures
            continue
    return time.perf_counter() - t0
