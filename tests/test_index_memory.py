"""An index's ``nbytes`` is the memory it holds, by the C allocator's own count (glibc's ``mallinfo2``): every index,
plugins included, built and then added to, one after another in a process of the test's (tests/memory_worker.py),
with its inputs dropped by the caller. Uncounted before this test: hnswlib's locks, label map and pointers (40% of
hnsw's memory at 6K keys), faiss's lists grown one entry at a time (IVF 36%), the spare capacity of a key buffer or
faiss's key vector after ``add`` (up to half), and roargraph's kept queries, a view that held the caller's whole
training set."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("memory_worker.py")
ALL = ["flat", "ivf", "hnsw", "vamana", "robust-vamana", "roargraph", "simhash", "pqcache", "clusterkv", "squeezed",
       "quest", "shadowkv", "retroinfer", "magicpig", "vattention", "ngfix", "sparq", "loki", "snapkv", "infllm"]
TOLERANCE = 0.02  # of what the allocator holds, plus SLACK: a library's small objects (faiss's per-list vectors)
SLACK = 64 << 10



def _glibc_counts() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")  # glibc 2.33 on
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _glibc_counts(), reason="counts glibc's allocator (mallinfo2)")


def _run(*args: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict]]:
    """Each installed index's stages, measured in one worker process (its imports paid once)."""
    from anns_lab.indexes import registry

    names = [name for name in ALL if name in registry.available()]
    lines = _run("6000", "2000", "64", "600", *names)
    return {name: [s for s in lines if s["index"] == name] for name in names}


@pytest.mark.parametrize("name", ALL)
def test_nbytes_is_what_the_allocator_holds_for_the_index(name, measured):
    from anns_lab.indexes import registry

    if name not in measured:
        pytest.skip(f"the {name} plugin is not installed (make test installs it)")
    stages = measured[name]
    assert [s["stage"] for s in stages] == (["build", "add"] if registry.create(name).supports_add else ["build"])
    for s in stages:
        assert abs(s["nbytes"] - s["held"]) <= TOLERANCE * s["held"] + SLACK, (
            f"{name} after {s['stage']}: nbytes {s['nbytes']:,} B, the allocator holds {s['held']:,} B for it")
        assert s["held"] >= s["keys"] * 64 * 4  # every index holds the keys: the count saw the index


def test_the_bfloat16_products_leave_no_kernel_behind_per_shape():
    """torch keeps ~0.6 MB of bf16 matmul kernels per distinct shape for the process's life: the lists' products use
    few shapes (blocks of a fixed height, keys padded to a size bucket), so eight calls with eight query and key counts
    of one bucket add nothing after the first (before: 9.1 MB)."""
    (s,) = _run("--bf16-shapes", "8")
    assert s["held"] < 512 << 10, s


def test_padded_rows_buckets():
    from anns_lab.indexes.held_memory import padded_rows

    sizes = range(1, 1 << 17)
    padded = [padded_rows(n) for n in sizes]
    assert all(n <= p <= n + n / 16 for n, p in zip(sizes, padded))
    assert len({p for n, p in zip(sizes, padded) if 1 << 16 <= n < 1 << 17}) == 17  # an octave: 16 sizes and its end


def test_overlaps_tells_interleaved_views_of_one_buffer_apart():
    """The bytes an index or a layer holds are counted once per piece of memory: two interleaved views of one buffer
    are two pieces (their bounds overlap, so numpy's may_share_memory said one), a view and its buffer one."""
    import numpy as np

    from anns_lab.indexes.held_memory import overlaps

    buf = np.zeros((10, 8), np.float32)
    assert not overlaps(buf[:, ::2], buf[:, 1::2]) and np.may_share_memory(buf[:, ::2], buf[:, 1::2])
    assert overlaps(buf[:5], buf) and overlaps(buf[2:7], buf[6:]) and not overlaps(buf[:5], buf[5:])
    assert not overlaps(buf, np.zeros_like(buf))
