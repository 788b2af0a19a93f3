"""The LLVM intrinsics under every graph kernel: a fixed-order SIMD inner product (one pair, or one row against
four at once with the same bits), a cache prefetch and a population count."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types as nbtypes
from numba.extending import intrinsic, overload

_LANES = 8  # float32 lanes of the explicit SIMD accumulator (one AVX register)


def _emit_dots(context, builder, a, bs) -> list:
    """IR of the inner products of the float32 array ``a`` with each of ``bs`` (same length), in :func:`_simd_dot`'s
    order for every pair: lane j sums elements j, j+8, …; a fixed pairwise tree over the lanes; the tail in order.
    Each pair has its own accumulator; ``a`` is loaded once for all of them."""
    return _emit_dot_grid(context, builder, [a], bs)


def _emit_dot_grid(context, builder, as_, bs) -> list:
    """:func:`_emit_dots` for every pair of ``as_`` × ``bs`` (a-major): each row is loaded once per 8 lanes for all its
    pairs, so r rows against c others cost r + c loads for r·c accumulators."""
    n = builder.extract_value(as_[0].shape, 0)
    vec = ir.VectorType(ir.FloatType(), _LANES)
    width = ir.Constant(n.type, _LANES)
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * _LANES)) for _ in bs] for _ in as_]
    n_vec = builder.udiv(n, width)
    with cgutils.for_range(builder, n_vec) as loop:
        i = builder.mul(loop.index, width)
        xs = [builder.load(builder.bitcast(builder.gep(a.data, [i]), vec.as_pointer()), align=4) for a in as_]
        ys = [builder.load(builder.bitcast(builder.gep(b.data, [i]), vec.as_pointer()), align=4) for b in bs]
        for x, row in zip(xs, accs):
            for acc, y in zip(row, ys):
                builder.store(builder.fadd(builder.load(acc), builder.fmul(x, y)), acc)
    totals = []
    for row in accs:
        for acc in row:
            v = builder.load(acc)
            lanes = [builder.extract_element(v, ir.Constant(ir.IntType(32), j)) for j in range(_LANES)]
            while len(lanes) > 1:
                half = len(lanes) // 2
                lanes = [builder.fadd(lanes[j], lanes[j + half]) for j in range(half)]
            totals.append(cgutils.alloca_once_value(builder, lanes[0]))
    with cgutils.for_range_slice(builder, builder.mul(n_vec, width), n, ir.Constant(n.type, 1), inc=True) as (i, _):
        ys = [builder.load(builder.gep(b.data, [i])) for b in bs]
        for r, a in enumerate(as_):
            x = builder.load(builder.gep(a.data, [i]))
            for c, y in enumerate(ys):
                total = totals[r * len(bs) + c]
                builder.store(builder.fadd(builder.load(total), builder.fmul(x, y)), total)
    return [builder.load(t) for t in totals]


def _f32_rows(*xs) -> bool:
    return all(isinstance(x, nbtypes.Array) and x.ndim == 1 and x.layout == "C" and x.dtype == nbtypes.float32 for x in xs)


@intrinsic
def _simd_dot(typingctx, a, b):
    """Inner product of two C-contiguous float32 vectors with an explicit 8-lane vector accumulator.

    The summation order is written out in the IR (lane j sums elements j, j+8, …; then a fixed
    pairwise tree over the lanes; then the tail in order) and carries no fast-math flags, so LLVM
    may not reorder it: every kernel that calls :func:`dot` gets the same bits, vectorised.
    """
    if not _f32_rows(a, b):
        return None
    sig = nbtypes.float32(a, b)

    def codegen(context, builder, signature, args):
        arrs = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)]
        return _emit_dots(context, builder, arrs[0], arrs[1:])[0]

    return sig, codegen


@intrinsic
def _simd_dot4(typingctx, a, b0, b1, b2, b3):
    """The four inner products ``a``·``b_j``, each bit for bit :func:`_simd_dot`'s: one load of ``a`` feeds four
    independent accumulators (a lone dot waits on its one accumulator's add latency)."""
    if not _f32_rows(a, b0, b1, b2, b3):
        return None
    sig = nbtypes.UniTuple(nbtypes.float32, 4)(a, b0, b1, b2, b3)

    def codegen(context, builder, signature, args):
        arrs = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)]
        return context.make_tuple(builder, signature.return_type, _emit_dots(context, builder, arrs[0], arrs[1:]))

    return sig, codegen


@intrinsic
def _simd_dot2x4(typingctx, a0, a1, b0, b1, b2, b3):
    """The eight inner products a_i·b_j (a0's four, then a1's), each bit for bit :func:`_simd_dot`'s: two rows against
    four share their loads (6 per 8 lanes for 8 accumulators, where :func:`_simd_dot4` needs 5 for 4)."""
    if not _f32_rows(a0, a1, b0, b1, b2, b3):
        return None
    sig = nbtypes.UniTuple(nbtypes.float32, 8)(a0, a1, b0, b1, b2, b3)

    def codegen(context, builder, signature, args):
        arrs = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)]
        return context.make_tuple(builder, signature.return_type, _emit_dot_grid(context, builder, arrs[:2], arrs[2:]))

    return sig, codegen


@intrinsic
def _prefetch(typingctx, arr, i, j):
    """Hint the cache line holding ``arr[i, j]`` (2-D) or ``arr[i]`` (1-D, j ignored) into the caches."""
    if not isinstance(arr, nbtypes.Array) or arr.ndim not in (1, 2):
        return None
    sig = nbtypes.void(arr, i, j)

    def codegen(context, builder, signature, args):
        aryty, ity, jty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = [context.cast(builder, args[1], ity, nbtypes.intp)]
        if aryty.ndim == 2:
            idx.append(context.cast(builder, args[2], jty, nbtypes.intp))
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx, wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


def _u64_intrinsic(name: str, llvm_name: str, flag: int | None = None):
    """A numba intrinsic of one uint64 that returns ``llvm_name``'s i64 (``flag``: its constant i1 second argument)."""

    def op(typingctx, x):
        if x != nbtypes.uint64:
            return None

        def codegen(context, builder, signature, args):
            i64, i1 = ir.IntType(64), ir.IntType(1)
            extra = [] if flag is None else [ir.Constant(i1, flag)]
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64] + [i1] * len(extra)), llvm_name)
            return builder.call(fn, [args[0], *extra])

        return nbtypes.uint64(x), codegen

    op.__name__ = op.__qualname__ = name
    return intrinsic(op)


_ctpop = _u64_intrinsic("_ctpop", "llvm.ctpop.i64")  # set bits of a uint64 (one instruction where the CPU has POPCNT)
_cttz = _u64_intrinsic("_cttz", "llvm.cttz.i64", 1)  # trailing zeros of a non-zero uint64: its lowest set bit's index


ORDER_LANES = 32  # int16 lanes of _order_at_least's compare (one AVX512 register)


@intrinsic
def _order_at_least(typingctx, row, i, v):
    """A uint64 whose bit j says ``signed_order(row[i + j]) >= v`` for j < ORDER_LANES: 32 bfloat16 scores (raw bits as
    int16, from ``i``; ``i + 32 <= len(row)``) compared with a threshold in one vector compare (numba's scalar loop
    cost ~1 ns per score; the anchors' lists compare 15M of them per 8K head)."""
    if not (isinstance(row, nbtypes.Array) and row.ndim == 1 and row.layout == "C" and row.dtype == nbtypes.int16
            and isinstance(i, nbtypes.Integer) and isinstance(v, nbtypes.Integer)):
        return None
    sig = nbtypes.uint64(row, i, v)

    def codegen(context, builder, signature, args):
        aryty, ity, vty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        i16, i32 = ir.IntType(16), ir.IntType(32)
        vec = ir.VectorType(i16, ORDER_LANES)
        ptr = builder.gep(ary.data, [context.cast(builder, args[1], ity, nbtypes.intp)])
        x = builder.load(builder.bitcast(ptr, vec.as_pointer()), align=2)
        # sign-magnitude to two's complement order: a negative value's magnitude bits flipped (signed_order)
        sign = builder.ashr(x, ir.Constant(vec, [15] * ORDER_LANES))
        o = builder.xor(x, builder.and_(sign, ir.Constant(vec, [0x7FFF] * ORDER_LANES)))
        thr = builder.trunc(context.cast(builder, args[2], vty, nbtypes.int64), i16)
        one = builder.insert_element(ir.Constant(vec, ir.Undefined), thr, ir.Constant(i32, 0))
        splat = builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined),
                                       ir.Constant(ir.VectorType(i32, ORDER_LANES), [0] * ORDER_LANES))
        bits = builder.bitcast(builder.icmp_signed(">=", o, splat), ir.IntType(ORDER_LANES))
        return builder.zext(bits, ir.IntType(64))

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def signed_order(b):
    """A bfloat16's raw bits (int16) as an int that orders as the value does (sign-magnitude to two's complement):
    in [-32768, 32767]."""
    return np.int64(b) ^ ((np.int64(b) >> 15) & 0x7FFF)


@njit(cache=True, nogil=True, inline="always")
def count_at_least(row, v):
    """How many of the bfloat16 scores ``row`` (raw bits, int16) have ``signed_order`` ≥ ``v``.

    ``v`` is a threshold in :func:`signed_order` units, i.e. a bfloat16 bit pattern, so scores compare at bfloat16
    precision (floats that round to one bfloat16 tie). It must lie in [-32768, 32767] (-32768 counts every score): the
    vector compare takes its low 16 bits, so 32768 would count every score of the 32-score blocks and none of the tail.
    -0.0 (bits 0x8000) orders as -1, just below +0.0 (0): ``v`` 0 counts +0.0 and not -0.0, where a float compare
    has them equal; a NaN orders beyond its sign's infinity."""
    n = row.shape[0]
    c = 0
    for i in range(0, n - ORDER_LANES + 1, ORDER_LANES):
        c += _ctpop(_order_at_least(row, i, v))
    for j in range(n - n % ORDER_LANES, n):
        c += signed_order(row[j]) >= v
    return c


@njit(cache=True, nogil=True, inline="always")
def indices_at_least(row, v, out):
    """The indices of the scores of ``row`` (as :func:`count_at_least`) with ``signed_order`` ≥ ``v``, ascending, into
    ``out``; returns how many. ``v`` as for :func:`count_at_least`: a bfloat16 bit pattern in [-32768, 32767], -0.0
    below +0.0."""
    n = row.shape[0]
    t = 0
    for i in range(0, n - ORDER_LANES + 1, ORDER_LANES):
        m = _order_at_least(row, i, v)
        while m:
            out[t] = i + np.int64(_cttz(m))
            t += 1
            m &= m - np.uint64(1)
    for j in range(n - n % ORDER_LANES, n):
        if signed_order(row[j]) >= v:
            out[t] = j
            t += 1
    return t


@njit(cache=True, nogil=True, inline="always")
def common_bits(a: np.ndarray, b: np.ndarray) -> int:
    """Bits set in both uint64 arrays (the size of the intersection of two bitsets)."""
    s = 0
    for i in range(a.shape[0]):
        s += _ctpop(a[i] & b[i])
    return s


def _dot_any(a, b):
    """Typing stub of :func:`dot`'s two implementations."""


@overload(_dot_any, inline="always")
def _dot_any_impl(a, b):
    if all(isinstance(x, nbtypes.Array) and x.layout == "C" and x.dtype == nbtypes.float32 for x in (a, b)):
        return lambda a, b: _simd_dot(a, b)

    def sequential(a, b):
        s = np.float32(0.0)
        for i in range(a.shape[0]):
            s += a[i] * b[i]
        return s

    return sequential


@njit(cache=True, nogil=True, inline="always")
def dot(a: np.ndarray, b: np.ndarray) -> float:
    """Inner product of two float32 vectors (no BLAS call overhead): explicit 8-lane SIMD for contiguous rows.

    About 4x faster at d = 64 than the plain sequential loop (which LLVM cannot vectorise without
    fast-math reassociation, and with it vectorises differently in different callers). Here the
    order is fixed (:func:`_simd_dot`), so the query-time searches and the builds agree bit for
    bit. Non-contiguous inputs use the sequential sum.
    """
    return _dot_any(a, b)


@njit(cache=True, nogil=True, inline="always")
def dot4(a: np.ndarray, b0: np.ndarray, b1: np.ndarray, b2: np.ndarray, b3: np.ndarray) -> tuple:
    """(a·b0, a·b1, a·b2, a·b3) for C-contiguous float32 rows, each equal bit for bit to :func:`dot`'s; 1.5x the
    throughput of four dots at d = 256 (``train_lists``'s re-rank, measured in BENCHMARKS "Scale")."""
    return _simd_dot4(a, b0, b1, b2, b3)


@njit(cache=True, nogil=True, inline="always")
def dot2x4(a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray, b2: np.ndarray, b3: np.ndarray) -> tuple:
    """(a0·b0, a0·b1, a0·b2, a0·b3, a1·b0, …, a1·b3) for C-contiguous float32 rows, each equal bit for bit to :func:`dot`'s
    (``train_lists``'s re-rank: two candidate keys against four of a gap's queries)."""
    return _simd_dot2x4(a0, a1, b0, b1, b2, b3)


@njit(cache=True, nogil=True)
def dot_rows(a: np.ndarray, data: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = dot(a, data[ids[i]])`` for every i, four rows per :func:`dot4` (the same bits as one dot each)."""
    m = ids.shape[0]
    for i in range(0, m - 3, 4):
        out[i], out[i + 1], out[i + 2], out[i + 3] = dot4(a, data[ids[i]], data[ids[i + 1]], data[ids[i + 2]],
                                                          data[ids[i + 3]])
    for i in range(m - m % 4, m):
        out[i] = dot(a, data[ids[i]])


@njit(cache=True, nogil=True, inline="always")
def prefetch_keys(data, fresh, m):
    """Prefetch the key rows of the m nodes ``fresh[:m]``."""
    for j in range(m):
        for c in range(0, data.shape[1], 16):
            _prefetch(data, fresh[j], c)


@njit(cache=True, nogil=True, inline="always")
def prefetch_row(nbrs, degree, node):
    """Prefetch ``node``'s adjacency row and degree."""
    _prefetch(degree, node, 0)
    for c in range(0, nbrs.shape[1], 16):
        _prefetch(nbrs, node, c)
