"""numba's on-disk cache of the lab's kernels, keyed on every kernel source (``anns_lab.kernel_cache``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from anns_lab.kernel_cache import kernels_digest

RUN = """
import json, sys
import numpy as np
import anns_lab.kernel_cache as kc
if sys.argv[1] == "edited":  # as if another kernel file of the lab had changed since the cache was written
    kc.kernels_digest = lambda: b"another tree"
from anns_lab.indexes.graph import prune
out = np.empty(4, np.int32)
data = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
prune.robust_prune(data, 0, np.arange(1, 20), 1.2, 4, out)
f = prune.robust_prune
print(json.dumps([type(f._cache._impl._locator).__name__, sum(f.stats.cache_hits.values()),
                  sum(f.stats.cache_misses.values())]))
"""


def run(tmp_path, how: str) -> list:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", RUN, how], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_a_cached_kernel_is_compiled_again_when_another_kernel_file_changes(tmp_path):
    """robust_prune (graph/prune.py) calls simd.dot (graph/simd.py): numba keyed its cache on prune.py alone, so an
    edit to simd.py, or to the occlusion rule under a cached vamana_pass, kept the old machine code."""
    assert run(tmp_path, "first") == ["AnnsLabUserProvidedCacheLocator", 0, 1]
    assert run(tmp_path, "again") == ["AnnsLabUserProvidedCacheLocator", 1, 0]  # the cache serves an unchanged tree
    assert run(tmp_path, "edited") == ["AnnsLabUserProvidedCacheLocator", 0, 1]


def test_the_digest_follows_the_kernel_sources_only(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "kernels.py").write_text("from numba import njit\n")
    (tmp_path / "pkg" / "plain.py").write_text("x = 1\n")
    before = kernels_digest.__wrapped__(tmp_path)
    (tmp_path / "pkg" / "plain.py").write_text("x = 2\n")
    assert kernels_digest.__wrapped__(tmp_path) == before
    (tmp_path / "pkg" / "kernels.py").write_text("from numba import njit  # edited\n")
    assert kernels_digest.__wrapped__(tmp_path) != before
