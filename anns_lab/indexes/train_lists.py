"""The training queries' top-k key lists of the query-aware builds: exact, or exact at anchors and re-ranked between.

The exact lists cost m × n inner products (every training query against every key): at 32K keys
and 32K queries of dimension 256 that is ~8 s of one core, most of a roargraph build, and it grows
as n² with the context. Neighbouring prefill queries share most of their top keys (the sinks, the
heavy hitters, the passage being read), so :func:`anchored_topk` computes exact lists only for
*anchor* queries (every ``stride``-th, counted back from the newest, plus the newest ``exact_tail``)
and ranks, for each query between two anchors, the union of the lists of the ``span`` anchors on
either side by its exact inner products: m·n/stride + m·2·span·k products instead of m·n.

Rows of anchors are exact (:func:`topk.topk_ip`'s); rows between them are the exact order of
their candidates, so a key is missed only when no nearby anchor has it in its list.

With ``coarse=True`` the anchors' m·n/stride products, the largest part of the build left, are done in
bfloat16 (:func:`topk_ip_bf16`: ~2.4x the float32 throughput of one core where the CPU has AVX512-BF16 or
AMX) and only each anchor's best ``k + BF16_MARGIN`` by those scores are ranked by their float32 inner
products: an anchor's list then misses a key of its exact top-k only when bfloat16's rounding (~0.1% of a
score) moved it more than BF16_MARGIN ranks, which never happened on the measured heads (BENCHMARKS "Scale").
"""

from __future__ import annotations

import math
import platform

import numpy as np
from numba import njit, prange

from anns_lab.indexes.graph.simd import count_at_least, dot2x4, dot4, dot_rows, indices_at_least
from anns_lab.indexes.graph.utils import run_chunks
from anns_lab.indexes.held_memory import padded_rows
from anns_lab.indexes.topk import topk_ip


def anchor_ids(m: int, stride: int, exact_tail: int) -> np.ndarray:
    """Sorted ids of the anchor queries among ``m``: every ``stride``-th counted back from the newest
    (m - 1), the first, and the newest ``exact_tail`` (decode queries resemble the newest most)."""
    if stride <= 1 or m <= 2:
        return np.arange(m, dtype=np.int64)
    ids = np.r_[0, np.arange(m - 1, -1, -stride), np.arange(max(0, m - exact_tail), m)]
    return np.unique(ids).astype(np.int64)


def anchored_topk(queries: np.ndarray, keys: np.ndarray, k: int, stride: int, span: int = 2,
                  exact_tail: int = 256, n_threads: int = 1, coarse: bool = False,
                  ordered: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(lists (m, k) int32 best first, exact (m,) bool): exact lists at the anchors (:func:`anchor_ids`),
    elsewhere the top ``k`` by exact inner product among the keys listed by the ``span`` anchors on either side.
    ``ordered`` > 0: a row between anchors is best first in its first ``ordered`` keys only, the rest of its top
    k in no set order (a caller that reads only the set past a rank skips most of the sort).

    ``stride`` ≤ 1 is :func:`topk.topk_ip` for every query (all rows exact). ``coarse``: the anchors' lists by
    :func:`topk_ip_bf16` where :func:`bf16_native` (their rows are still flagged in ``exact``: ranked over all keys).
    """
    queries = np.ascontiguousarray(queries, np.float32)
    keys = np.ascontiguousarray(keys, np.float32)
    m = len(queries)
    k = min(k, len(keys))
    anchors = anchor_ids(m, stride, exact_tail)
    exact = np.zeros(m, np.bool_)
    exact[anchors] = True
    if len(anchors) == m:
        return topk_ip_fast(queries, keys, k, coarse, n_threads), exact
    out = np.empty((m, k), np.int32)
    a_lists = topk_ip_fast(queries[anchors], keys, k, coarse, n_threads)
    out[anchors] = a_lists
    gaps = np.flatnonzero(np.diff(anchors) > 1)  # anchor pairs with queries between them
    n_chunks = max(1, min(len(gaps), n_threads))
    widest = int(np.diff(anchors).max()) - 1  # most queries in one gap
    _rerank_gaps(queries, keys, a_lists, anchors, gaps, max(1, span), out, n_chunks, widest, min(ordered or k, k))
    return out, exact


@njit(cache=True, nogil=True, parallel=True)
def _rerank_gaps(queries, keys, a_lists, anchors, gaps, span, out, n_chunks, widest, ordered):
    """For each gap g (queries strictly between anchors[g] and anchors[g + 1], at most ``widest``): candidates = the
    lists of anchors g - span + 1 … g + span (deduplicated), scored against each of the gap's queries; each query
    keeps its top k, its first ``ordered`` best first."""
    n = keys.shape[0]
    na, k = a_lists.shape
    for c in prange(n_chunks):
        stamp = np.full(n, -1, np.int64)
        cand = np.empty(2 * span * k, np.int64)
        s = np.empty((widest + 3, 2 * span * k), np.float32)
        sort_keys = np.empty(2 * span * k, np.uint64)
        order = np.empty(k, np.int64)
        for gi in range(c, gaps.shape[0], n_chunks):
            g = gaps[gi]
            t = 0
            for a in range(max(0, g - span + 1), min(na, g + span + 1)):
                for j in range(k):
                    v = a_lists[a, j]
                    if stamp[v] != g:
                        stamp[v] = g
                        cand[t] = v
                        t += 1
            lo, hi = anchors[g] + 1, anchors[g + 1]
            # Candidate-major: each key row is read once and scored against all the gap's queries, four at a time
            # (graph.simd.dot4: the same bits as dot; a short last group repeats the gap's last query). Not numba's
            # BLAS: on these small blocks its calls cost ~15x more (OpenBLAS's thread pool on a loaded machine).
            # Two key rows at a time against four queries (dot2x4: eight accumulators, where dot4's four wait on the
            # adds' latency), the odd last row by dot4.
            for i in range(0, t - 1, 2):
                row0, row1 = keys[cand[i]], keys[cand[i + 1]]
                for r in range(0, hi - lo, 4):
                    (s[r, i], s[r + 1, i], s[r + 2, i], s[r + 3, i],
                     s[r, i + 1], s[r + 1, i + 1], s[r + 2, i + 1], s[r + 3, i + 1]) = dot2x4(
                        row0, row1, queries[lo + r], queries[min(lo + r + 1, hi - 1)],
                        queries[min(lo + r + 2, hi - 1)], queries[min(lo + r + 3, hi - 1)])
            if t % 2:
                row = keys[cand[t - 1]]
                for r in range(0, hi - lo, 4):
                    s[r, t - 1], s[r + 1, t - 1], s[r + 2, t - 1], s[r + 3, t - 1] = dot4(
                        row, queries[lo + r], queries[min(lo + r + 1, hi - 1)], queries[min(lo + r + 2, hi - 1)],
                        queries[min(lo + r + 3, hi - 1)])
            for r in range(hi - lo):
                _top_sorted(s[r, :t], k, sort_keys, order, ordered)
                for j in range(k):
                    out[lo + r, j] = cand[order[j]]


@njit(cache=True, nogil=True)
def _top_sorted(s, k, keys, out, ordered):
    """``out[:k]`` = indices of the ``k`` largest entries of ``s``, the first ``ordered`` of them largest first, ties
    by smaller index (what a stable sort of −s gives), from 64-bit keys in the caller's buffer ``keys`` (the score's
    bits made order-preserving and negated, above the index): a quickselect at k (:func:`_select_smallest`) and a sort
    of those k (of the ``ordered`` best, selected again, when fewer): :func:`_sort_keys`."""
    u = s.view(np.uint32)
    for i in range(s.shape[0]):
        b = np.uint64(u[i]) if s[i] != 0 else np.uint64(0)  # -0.0 ties with +0.0
        up = (b ^ np.uint64(0xFFFFFFFF)) if b >> np.uint64(31) else (b | np.uint64(0x80000000))  # ascending as s
        keys[i] = ((up ^ np.uint64(0xFFFFFFFF)) << np.uint64(32)) | np.uint64(i)  # descending score, then index
    kk = keys[: s.shape[0]]
    if kk.shape[0] > k:  # keys are distinct (the index is in them): the k smallest, then their order
        _select_smallest(kk, k)
        kk = kk[:k]
    if ordered < k:
        _select_smallest(kk, ordered)
    _sort_keys(kk[:ordered])
    for j in range(k):
        out[j] = np.int64(kk[j] & np.uint64(0xFFFFFFFF))


SMALL_SORT = 64  # keys sorted by insertion below this many (random keys, one core: 8 keys 94 ns against the radix
# sort's 906, 30: 402 / 1270, 64: 1192 / 2594, 100: 2217 / 1959; the stranded keys' lists are 8 long, a gap's order 30)


@njit(cache=True, nogil=True)
def _sort_keys(a):
    """Sort uint64 ``a`` in place: by insertion when short (:data:`SMALL_SORT`), else :func:`_radix_sort`, whose
    256-bucket passes cost the same for 8 keys as for 100."""
    if a.shape[0] >= SMALL_SORT:
        _radix_sort(a)
        return
    for i in range(1, a.shape[0]):
        x = a[i]
        j = i - 1
        while j >= 0 and a[j] > x:
            a[j + 1] = a[j]
            j -= 1
        a[j + 1] = x


@njit(cache=True, nogil=True)
def _radix_sort(a):
    """Sort uint64 ``a`` in place: least significant byte first, skipping the bytes all values share (the re-rank's
    keys vary in their 4 score bytes and 1–2 index bytes); ~1.8x faster than numba's quicksort on 199 keys."""
    n = a.shape[0]
    if n < 2:
        return
    hist = np.empty(256, np.int64)
    src, dst = a, np.empty(n, np.uint64)
    moved = False  # the values are in the scratch array
    for byte in range(8):
        sh = np.uint64(8 * byte)
        hist[:] = 0
        for i in range(n):
            hist[(src[i] >> sh) & np.uint64(255)] += 1
        if hist[(src[0] >> sh) & np.uint64(255)] == n:
            continue
        total = 0
        for b in range(256):
            c = hist[b]
            hist[b] = total
            total += c
        for i in range(n):
            d = (src[i] >> sh) & np.uint64(255)
            dst[hist[d]] = src[i]
            hist[d] += 1
        src, dst = dst, src
        moved = not moved
    if moved:
        a[:] = src


@njit(cache=True, nogil=True, inline="always")
def _partition_at(a, lo, hi, piv):
    """Lomuto partition of ``a[lo:hi]`` around ``a[piv]``, branch-free (every element is swapped; only the count moves):
    returns the pivot's final index, smaller values before it, the others after."""
    p = a[piv]
    a[piv] = a[lo]
    a[lo] = p
    i = lo + 1
    for j in range(lo + 1, hi):
        x = a[j]
        a[j] = a[i]
        a[i] = x
        i += x < p
    i -= 1
    a[lo] = a[i]
    a[i] = p
    return i


@njit(cache=True, nogil=True)
def _select_smallest(a, k):
    """Rearrange ``a`` (distinct values) in place so that ``a[:k]`` holds its ``k`` smallest, in no set order (1 ≤ k ≤
    len(a)): quickselect with a median-of-three pivot and :func:`_partition_at`. numba's ``np.partition`` copies twice and
    mispredicts on every other compare of the re-rank's random scores (~1.6x slower: BENCHMARKS "Scale", fourth pass)."""
    lo, hi = 0, a.shape[0]
    kth = k - 1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        x, y, z = a[lo], a[mid], a[hi - 1]
        if (x < y) != (x < z):
            piv = lo
        elif (y < x) != (y < z):
            piv = mid
        else:
            piv = hi - 1
        pos = _partition_at(a, lo, hi, piv)
        if pos == kth:
            return
        if pos < kth:
            lo = pos + 1
        else:
            hi = pos


BF16_MARGIN = 32  # keys past k handed from the bfloat16 pass to the exact ranking (16 already kept every exact top-198 key of a Gemma 32K head)
BF16_BLOCK = 256  # queries per bfloat16 product: a 256 × n block of 2-byte scores (3.8 MiB at 8K keys, ranked while in the
# caches: 0.82x the CPU of 512 at 8K; at 32K and 128K no different)


def bf16_native() -> bool:
    """Whether torch multiplies bfloat16 matrices natively here (AVX512-BF16 or AMX): elsewhere its bf16
    product is no faster than faiss's float32 one."""
    import torch  # once per process (~1 s; the decoder has it loaded already)

    try:
        ok = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a private probe: a torch without it multiplies on the float32 path
        return False
    if ok and platform.machine().lower() in X86_MACHINES:
        # oneDNN's probe says yes on every AVX512 core, where it emulates bfloat16 (slower than float32)
        return _x86_bf16_instructions()
    return ok


X86_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")


def _x86_bf16_instructions() -> bool:
    """Whether this x86 CPU has AVX512-BF16 or AMX-BF16 (LLVM's host features, which numba already loads)."""
    import llvmlite.binding as llvm

    try:
        features = llvm.get_host_cpu_features()
    except RuntimeError:  # LLVM could not read them: the float32 path is never wrong
        return False
    return bool(features.get("avx512bf16") or features.get("amx-bf16"))


def topk_ip_fast(queries: np.ndarray, keys: np.ndarray, k: int, coarse: bool, n_threads: int = 1,
                 margin: int = BF16_MARGIN) -> np.ndarray:
    """Top-``k`` keys by inner product, best first: :func:`topk_ip_bf16` (with ``margin``) when ``coarse`` and
    :func:`bf16_native`, else faiss's exact kNN (:func:`topk.topk_ip`)."""
    if coarse and bf16_native():
        return topk_ip_bf16(queries, keys, k, margin, n_threads)
    return topk_ip(queries, keys, k)


def topk_ip_bf16(queries: np.ndarray, keys: np.ndarray, k: int, margin: int = BF16_MARGIN, n_threads: int = 1) -> np.ndarray:
    """Top-``k`` keys (int32 ids, best first) of each query by float32 inner product, among its best ``k + margin``
    by a bfloat16 product (torch's, on its threads): the same lists as :func:`topk.topk_ip` unless rounding to
    bfloat16 moved a top-k key more than ``margin`` ranks (order: :func:`graph.simd.dot`'s sums)."""
    import torch

    queries = np.ascontiguousarray(queries, np.float32)
    keys = np.ascontiguousarray(keys, np.float32)
    k = min(k, len(keys))
    if k + margin >= len(keys):
        return topk_ip(queries, keys, k)
    # Every product has one of few shapes (torch keeps kernels per shape: held_memory.padded_rows): a build's last block
    # and its stranded keys gave every head new ones (a SmolLM2 8K decode: 270 builds, ~1.2 MB held after each). So the
    # query blocks are all BF16_BLOCK rows and the keys padded to padded_rows, their scores set to -inf.
    n, d = keys.shape
    kb = torch.zeros((padded_rows(n), d), dtype=torch.bfloat16)
    kb[:n] = torch.tensor(keys, dtype=torch.bfloat16)  # a copy: the keys may be a read-only view of a dump
    qb = torch.zeros((BF16_BLOCK, d), dtype=torch.bfloat16)
    out = np.empty((len(queries), k), np.int32)
    for i in range(0, len(queries), BF16_BLOCK):
        q = queries[i:i + BF16_BLOCK]
        qb[:len(q)] = torch.tensor(q, dtype=torch.bfloat16)  # rows past len(q) hold the previous block's: not ranked
        s = qb @ kb.T
        s[:, n:] = -math.inf  # never among a row's best k + margin < n
        run_chunks(_rank_coarse, (s.view(torch.int16).numpy()[:len(q)], q, keys, k + margin, out[i:i + BF16_BLOCK]),
                   len(q), n_threads)
    return out


@njit(cache=True, nogil=True, inline="always")
def _threshold(row, want, guess):
    """The largest v with at least ``want`` of the bfloat16 scores ``row`` (raw bits as int16) at or above it in
    :func:`signed_order` (their ``want``-th largest), searched from ``guess`` (galloping, then halving): a function of
    the row alone, the guess saves count passes (each a vector compare of the row, in L1 after the first)."""
    lo, hi = guess, guess  # count_at_least(lo) >= want > count_at_least(hi) once bracketed; -32768 counts every score
    step = 1
    if count_at_least(row, guess) >= want:
        while True:
            hi = min(lo + step, 32768)
            if hi == 32768 or count_at_least(row, hi) < want:
                break
            lo = hi
            step *= 2
    else:
        while True:
            lo = max(hi - step, -32768)
            if lo == -32768 or count_at_least(row, lo) >= want:
                break
            hi = lo
            step *= 2
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if count_at_least(row, mid) >= want:
            lo = mid
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True)
def _rank_coarse(s16, queries, keys, want, out, c, n_chunks):
    """Rows r ≡ c (mod n_chunks) of ``out`` (its k = out.shape[1]): the top k by :func:`dot` among the keys whose
    bfloat16 scores ``s16[r]`` (raw bits as int16) are at least the row's ``want``-th largest (ties included:
    :func:`_threshold`; the previous row's is the guess, as neighbouring training queries score alike).
    The threshold's count passes and the selection compare 32 scores at a time (``graph.simd.count_at_least``):
    the sampled histogram and scalar pass before cost ~3x, and left ~1.7x the candidates to re-rank."""
    nb, n = s16.shape
    k = out.shape[1]
    cand = np.empty(n, np.int64)
    sc = np.empty(n, np.float32)
    sort_keys = np.empty(n, np.uint64)
    order = np.empty(k, np.int64)
    guess = 0
    for r in range(c, nb, n_chunks):
        row = s16[r]
        guess = _threshold(row, want, guess)
        t = indices_at_least(row, guess, cand)
        dot_rows(queries[r], keys, cand[:t], sc[:t])
        _top_sorted(sc[:t], k, sort_keys, order, k)
        for j in range(k):
            out[r, j] = cand[order[j]]
