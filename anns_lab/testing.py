"""The conformance kit: ``check_index(MyIndex, **build_params)`` checks an index class against the protocol.

Plugin authors call it from their own tests; every built-in passes it. It raises
``AssertionError`` naming the first broken rule, and returns a few measurements otherwise.

Rules checked (``anns_lab.indexes.base`` states the result policy):

- declarations: defaults in range, every grid value a valid search parameter;
- results at every grid point: shapes and dtypes; ids in [0, n) or -1 padding that only
  trails; no id twice in a row; scores sorted and equal to q·k of the returned ids (padding
  scores -inf); ``#returned ≤ n_scanned ≤ max_scanned()``; ``bytes_read`` int64 (nq,) and
  at least 1; a batch gives the same ids, counts and estimate as its queries one at a time,
  scores within float32 rounding;
- at the last (most thorough) grid point on easy data, recall@k against exact search
  ≥ ``min_recall`` (1.0 = exact; ties at the k-th score count as hits);
- counts that explain the recall: on structureless data (Gaussian keys in 128 dimensions) no grid point
  finds more than ``plausible_gain`` (default 0.6) of the top-k beyond its scanned fraction (the zoo's best at its
  defaults: 0.40; an index ranking by compressed codes may need more, or None);
- determinism: two builds with the same parameters give identical ids, scores and counts;
- searches from several threads at once give what each gives alone (the decoder builds and
  calibrates several layers' indexes side by side);
- ``save``/``load`` and ``add`` when the class supports them;
- clear ``IndexConfigError`` for hostile input: NaN, infinite or overflowing (beyond
  ``MAX_ABS``) keys, queries, train queries or added keys, a dimension mismatch, queries that
  are not a non-empty 2-D numeric array, k > n, k not a positive integer, search before build,
  unknown or out-of-range parameters; and the index answers as before afterwards;
- estimators (``estimates = True``, see ``anns_lab.indexes.estimate``): every search returns an
  Estimate (a top-k index none); sample ids valid, unique and disjoint from the exact ids,
  weights positive and finite (0 at padding); summary ids valid and unique, each used summary
  non-empty, its members disjoint from the exact and sample ids; ``summaries()`` a CSR grouping
  of distinct key ids with one centroid key each; ``n_scanned`` ≥ exact + sampled + summary
  terms; where the class claims ``unbiased``, the mean over seeds of the estimated normaliser
  and numerator matches the exact one within 4 standard errors (synthetic data).
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.indexes import protocol
from anns_lab.indexes.base import MAX_ABS, Index, SearchResult, concat_results
from anns_lab.indexes.estimate import estimate_problem, estimate_terms
from anns_lab.indexes.protocol import result_problem
from anns_lab.io import is_int


def easy_data(n_keys: int = 1000, dim: int = 16, n_queries: int = 40, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Gaussian keys, test queries and separate training queries (queries drawn like the keys)."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n_keys, dim)).astype(np.float32)
    queries = rng.standard_normal((n_queries, dim)).astype(np.float32)
    train = rng.standard_normal((4 * n_queries, dim)).astype(np.float32)
    return keys, queries, train


def positions(cls: type[Index], n_keys: int, n_train: int) -> dict[str, np.ndarray]:
    """``build``'s position arguments for a class that reads them (``reads_positions``), else none: the keys at
    positions 0..n-1, the training queries spread evenly over them (as the prefill's, among the keys)."""
    if not cls.reads_positions:
        return {}
    return {"key_positions": np.arange(n_keys), "train_positions": np.linspace(0, n_keys - 1, n_train).astype(np.int64)}


PLAUSIBLE_GAIN = 0.6  # recall@k above the scanned fraction on structureless data: at their default parameters the zoo's
# largest is 0.40 (pqcache; 0.25-0.33 for the graphs, IVF and the other plugins, on several seeds), one that scores every
# key and reports a tenth scanned gains 0.9. An index that ranks every key by compressed codes counts no inner product
# for them and may gain more (pqcache with 16 sub-quantizers of 8 bits: 0.77): such a class passes its own bound.


def structureless_data(n_keys: int = 2000, dim: int = 128, n_queries: int = 50,
                       seed: int = 7) -> tuple[np.ndarray, ...]:
    """Keys with no structure an index could exploit (Gaussian in 128 dimensions: every key about as far from every
    query), test queries drawn alike and separate training queries."""
    return easy_data(n_keys, dim, n_queries, seed)


def check_counts_plausible(cls: type[Index], k: int = 10, gain: float = PLAUSIBLE_GAIN,
                           **build_params: Any) -> list[tuple[float, float]]:
    """Assert that no grid point finds more of the top-``k`` than its reported ``n_scanned`` can explain, on
    :func:`structureless_data`: there a search that picks a fraction f of the keys finds about f of the top-k, and the
    zoo's indexes at their defaults find at most f + 0.40; above f + ``gain`` the counts likely leave out inner products
    the search computed (an index that scores every key and reports k scans finds all with f = k/n). A plausibility
    bound, not a proof: it catches counts several times too low; an index that ranks by compressed codes (which count
    no inner product) may need a larger ``gain``. Returns (scanned fraction, recall) per grid point."""
    keys, queries, train = structureless_data()
    index = cls(**build_params).build(keys, train if cls.uses_train_queries else None,
                                      **positions(cls, len(keys), len(train)))
    points = []
    for params in index.grid():
        res = index.search(queries, k, **params)
        scanned, recall = float(res.n_scanned.mean()) / len(keys), recall_at_k(res.ids, queries, keys, k)
        assert recall <= scanned + gain, (
            f"search{params} on structureless data (Gaussian keys in {keys.shape[1]} dimensions) found "
            f"{recall:.1%} of the top-{k} with {scanned:.1%} of the keys scanned: more than {gain:.0%} "
            f"above what its scans explain. n_scanned must count every inner product the search computed "
            f"(anns_lab.indexes.base: the result policy); an index that ranks by compressed codes may pass "
            f"check_index(..., plausible_gain=...) a larger bound, or None (`anns-lab indexes --check NAME "
            f"--plausible-gain X|none`)")
        points.append((scanned, recall))
    return points


def recall_at_k(ids: np.ndarray, queries: np.ndarray, keys: np.ndarray, k: int) -> float:
    """Mean recall@k against exact inner-product search, ties at the k-th score counted as hits."""
    exact = queries.astype(np.float64) @ keys.astype(np.float64).T
    kth = -np.partition(-exact, k - 1, axis=1)[:, k - 1]
    hits = 0
    for row, ids_row in enumerate(ids):
        valid = ids_row[ids_row >= 0]
        hits += int((exact[row, valid] >= kth[row] - 1e-5 * (1 + abs(kth[row]))).sum())
    return hits / (len(ids) * k)


def check_result(index: Index, res: SearchResult, queries: np.ndarray, keys: np.ndarray, k: int, where: str) -> None:
    """Assert the result policy for one search (``anns_lab.indexes.protocol``): shapes, ids, scores and counts."""
    problem = result_problem(res, len(queries), k, len(keys), index.max_scanned(), queries, keys)
    assert problem is None, f"{where}: {problem}"
    check_estimate(index, res, len(keys), where)


def check_estimate(index: Index, res: SearchResult, n: int, where: str) -> None:
    """Assert the estimator rules for one search (:func:`anns_lab.indexes.estimate.estimate_problem`)."""
    problem = estimate_problem(res, index.estimates, index.summaries(), n, index.dim)
    assert problem is None, f"{where}: {problem}"


def estimated_sums(index: Index, res: SearchResult, queries: np.ndarray, keys: np.ndarray, values: np.ndarray,
                   scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """Per query, the estimated normaliser Σ e^l and numerator Σ e^l v (exact ids plus the estimate), float64."""
    summ = index.summaries()
    sums = summ.value_sums(values) if summ is not None else None
    zs, nums = [], []
    for row, q in enumerate(queries):
        exact = res.ids[row][res.ids[row] >= 0]
        l, w, v = estimate_terms(q, keys, values, scaling, *res.estimate.row(row), summ, sums)
        l = np.concatenate([(keys[exact].astype(np.float64) @ q.astype(np.float64)) * scaling, l])
        w = np.concatenate([np.ones(len(exact)), w])
        v = np.concatenate([values[exact].astype(np.float64), v])
        p = w * np.exp(l)
        zs.append(p.sum())
        nums.append(p @ v)
    return np.array(zs), np.array(nums)


def check_unbiased(cls: type[Index], params: dict, seeds: int = 200, k: int = 5, **build_params: Any) -> None:
    """Assert the mean over ``seeds`` builds of the estimated normaliser and numerator is the exact one (4 std errors)."""
    assert "seed" in cls.build_params, f"{cls.__name__} claims unbiased but has no seed build parameter"
    rng = np.random.default_rng(7)
    keys = rng.standard_normal((300, 8)).astype(np.float32)
    values = rng.standard_normal((300, 3)).astype(np.float32)
    queries = rng.standard_normal((4, 8)).astype(np.float32)
    scaling = 0.5
    logits = (queries.astype(np.float64) @ keys.astype(np.float64).T) * scaling
    true_z = np.exp(logits).sum(axis=1)
    true_num = np.exp(logits) @ values.astype(np.float64)
    zs, nums = [], []
    for seed in range(seeds):
        index = cls(**{**build_params, "seed": seed}).build(keys)
        z, num = estimated_sums(index, index.search(queries, k, **params), queries, keys, values, scaling)
        zs.append(z)
        nums.append(num)
    zs, nums = np.array(zs), np.array(nums)
    for what, got, true in (("normaliser", zs, true_z), ("numerator", nums, true_num)):
        err = np.abs(got.mean(axis=0) - true)
        bound = 4 * got.std(axis=0) / np.sqrt(seeds) + 1e-9 * np.abs(true)
        assert (err <= bound).all(), f"{cls.__name__} {params}: the estimated {what} is biased " \
                                     f"(|mean − exact| {err.max():.3g} > 4 std errors {bound.max():.3g})"


def _sorted_rows(scores: np.ndarray, valid: np.ndarray) -> bool:
    # Compare neighbours that are both real results (padding trails, so that is every pair that matters);
    # zeros in the padded slots keep -inf - -inf (a RuntimeWarning) out of the subtraction.
    # Tolerate float32 ties that differ in the last bit.
    s = np.where(valid, scores, 0.0).astype(np.float64)
    both = valid[:, :-1] & valid[:, 1:]
    d = np.diff(s, axis=1)[both]
    return bool((d <= 1e-6 * (1 + np.abs(s[:, 1:][both]))).all())


def _score_scale(queries: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """(nq, 1) bound on |q·k| for any key: float32 rounding of a score is a small fraction of it."""
    return np.abs(queries).sum(axis=1, keepdims=True) * np.abs(keys).max() + 1e-6


def _same(a: SearchResult, b: SearchResult, what: str, scale: np.ndarray | None = None) -> None:
    """Equal ids and counts; scores equal to the last bit, or within float32 rounding of ``scale`` when given."""
    assert np.array_equal(a.ids, b.ids), f"{what}: ids differ"
    assert np.array_equal(a.n_scanned, b.n_scanned), f"{what}: n_scanned differs"
    assert np.array_equal(a.bytes_read, b.bytes_read), f"{what}: bytes_read differs"
    if scale is None:
        assert np.array_equal(a.scores, b.scores), f"{what}: scores differ"
    else:
        valid = a.ids >= 0  # padding's -inf minus -inf would be NaN: compared as zeros
        diff = np.where(valid, np.abs(np.where(valid, a.scores, 0).astype(np.float64) - np.where(valid, b.scores, 0))
                        / scale, 0.0)
        assert diff.max() < 1e-5, f"{what}: scores differ beyond float32 rounding (max rel diff {diff.max():.2e})"
    assert np.array_equal(a.bytes_read, b.bytes_read), f"{what}: bytes_read differs"
    assert (a.estimate is None) == (b.estimate is None), f"{what}: one has an estimate, the other not"
    if a.estimate is not None:  # compared row by row: the padded widths of a batch and of one query differ
        for i in range(len(a.ids)):
            for x, y in zip(a.estimate.row(i), b.estimate.row(i)):
                assert np.array_equal(x, y), f"{what}: the estimates of query {i} differ"


def _expect_error(what: str, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except IndexConfigError:
        return
    except Exception as err:  # noqa: BLE001 - a wrong error type is a failure to report, not to raise
        raise AssertionError(f"{what}: expected IndexConfigError, got {type(err).__name__}: {err}") from err
    raise AssertionError(f"{what}: expected IndexConfigError, nothing was raised")


def check_declarations(cls: type[Index]) -> None:
    """Assert the class's parameter declarations and grid are consistent (:func:`protocol.declaration_problem`)."""
    problem = protocol.declaration_problem(cls)
    assert problem is None, problem


def check_errors(cls: type[Index], index: Index, keys: np.ndarray, queries: np.ndarray, build_params: dict) -> None:
    """Assert clear IndexConfigErrors for bad and hostile input, and that none of it changes what the index answers."""
    train = queries if cls.uses_train_queries else None
    before = index.search(queries, 5)
    for what, value in (("NaN", np.nan), ("infinity", np.inf), (f"magnitude beyond MAX_ABS ({MAX_ABS:.0e})", 1e30)):
        bad_keys = keys.copy()
        bad_keys[3, 1] = value
        where = positions(cls, len(keys), len(queries))
        _expect_error(f"keys with {what}", cls(**build_params).build, bad_keys, train, **where)
        bad_q = queries.copy()
        bad_q[1, 0] = -value
        _expect_error(f"queries with {what}", index.search, bad_q, 5)
        if train is not None:
            _expect_error(f"train_queries with {what}", cls(**build_params).build, keys, bad_q, **where)
        if index.supports_add:
            _expect_error(f"add() of keys with {what}", index.add, bad_keys[:5])
    _expect_error("queries of another dimension", index.search, np.zeros((2, keys.shape[1] + 1), np.float32), 5)
    _expect_error("queries that are not 2-D", index.search, np.zeros((2, 3, keys.shape[1]), np.float32), 5)
    _expect_error("no queries", index.search, np.zeros((0, keys.shape[1]), np.float32), 5)
    _expect_error("text queries", index.search, np.full((2, keys.shape[1]), "a"), 5)
    if index.supports_add:
        _expect_error("add() of keys of another dimension", index.add, np.zeros((2, keys.shape[1] + 1), np.float32))
    _expect_error("k larger than the number of keys", index.search, queries, index.n_keys + 1)
    _expect_error("k = 0", index.search, queries, 0)
    _expect_error("k not an integer", index.search, queries, 2.5)
    _expect_error("search before build()", cls(**build_params).search, queries, 5)
    _expect_error("unknown search parameter", index.search, queries, 5, no_such_param=1)
    _expect_error("unknown build parameter", cls, no_such_param=1)
    for name, p in cls.build_params.items():
        if p.low is not None and isinstance(p.default, (int, float)) and not isinstance(p.default, bool):
            _expect_error(f"build parameter {name} below its range", cls, **{**build_params, name: p.low - 1})
    for name, p in cls.search_params.items():
        if p.low is not None and isinstance(p.default, (int, float)) and not isinstance(p.default, bool):
            _expect_error(f"search parameter {name} below its range", index.search, queries, 5, **{name: p.low - 1})
    assert index.n_keys == len(keys), "a refused add() changed n_keys"
    _same(before, index.search(queries, 5), "search after refused hostile input")


def _same_from_threads(index: Index, queries: np.ndarray, k: int, grid: list[dict], threads: int = 4,
                       each: int = 50) -> None:
    """Searches from ``threads`` threads at once, alternating the ``grid`` points, give what each gives alone: the
    decoder builds and calibrates several layers' indexes side by side, so no search may share state with another
    (faiss's IVF scan counter is one per process: the built-in IVF locks around it)."""
    alone = [index.search(queries, k, **params) for params in grid]

    def many(i: int) -> None:
        for j in range(each):
            _same(index.search(queries, k, **grid[(i + j) % len(grid)]), alone[(i + j) % len(grid)],
                  f"searches from {threads} threads at once, at {grid[(i + j) % len(grid)]}")

    with ThreadPoolExecutor(threads) as pool:
        for done in [pool.submit(many, i) for i in range(threads)]:
            done.result()


def check_index(cls: type[Index], min_recall: float = 1.0, k: int = 10, unbiased_at: dict | None = None,
                plausible_gain: float | None = PLAUSIBLE_GAIN, **build_params: Any) -> dict[str, Any]:
    """Run every conformance rule on ``cls`` built with ``build_params``; return recall and scan measurements.

    A class that claims ``unbiased`` is checked at search parameters ``unbiased_at`` (default: its first grid point).
    ``plausible_gain``: :func:`check_counts_plausible`'s bound (None skips it: an index ranking by compressed codes).
    """
    check_declarations(cls)
    keys, queries, train = easy_data()
    given = [a.copy() for a in (keys, queries, train)]
    train_q = train if cls.uses_train_queries else None
    where = positions(cls, len(keys), len(train))
    index = cls(**build_params).build(keys, train_q, **where)
    assert index.n_keys == len(keys) and index.dim == keys.shape[1], "n_keys / dim not set by build()"
    grid = index.grid()
    assert grid, "grid() is empty"
    points = []
    for params in grid:
        res = index.search(queries, k, **params)
        check_result(index, res, queries, keys, k, f"search{params}")
        points.append((recall_at_k(res.ids, queries, keys, k), float(res.n_scanned.mean())))
    top = grid[-1]
    recall = points[-1][0]
    assert recall >= min_recall, f"recall@{k} at the most thorough setting {top} is {recall:.4f} < {min_recall}"

    one_by_one = [index.search(q[None], k, **top) for q in queries[:8]]
    batch = index.search(queries[:8], k, **top)
    # A batch may score through another BLAS kernel than one query (gemm vs gemv): ids and counts must agree,
    # scores within float32 rounding (the built-ins' own tests ask them to agree to the last bit).
    _same(concat_results(one_by_one), batch, "batch vs one query at a time", _score_scale(queries[:8], keys))
    check_result(index, index.search(queries, 1, **top), queries, keys, 1, "k=1")
    check_result(index, index.search(queries[:4], len(keys), **top), queries[:4], keys, len(keys), "k=n_keys")

    mid = grid[len(grid) // 2]
    again = cls(**build_params).build(keys, train_q, **where)
    _same(index.search(queries, k, **mid), again.search(queries, k, **mid), "two seeded builds")
    _same(index.search(queries, k, **mid), index.search(queries, k, **mid), "two searches")
    _same_from_threads(index, queries[:8], k, [grid[0], top])
    newest = index.newest_train_queries() if cls.uses_train_queries else None
    if newest is not None:  # a decoder keeps only these of the prefill's queries
        assert is_int(newest) and newest > 0, f"newest_train_queries() must be a positive whole number, got {newest!r}"
        tail = {key: rows[-newest:] if key == "train_positions" else rows for key, rows in where.items()}
        alone = cls(**build_params).build(keys, train[-newest:], **tail)
        for params in (grid[0], top):
            _same(index.search(queries, k, **params), alone.search(queries, k, **params),
                  f"a build from the newest {newest} training queries alone (newest_train_queries) at {params}")
    held = index.nbytes
    assert is_int(held) and held > 0, (f"nbytes must be a positive whole number of bytes (a built index holds its keys "
                                       f"or something of them; the sweep refuses a negative or fractional one), got {held!r}")
    for a, b, what in zip((keys, queries, train), given, ("keys", "queries", "train_queries")):
        assert np.array_equal(a, b), f"build() or search() wrote into the {what} it was given: copy before changing them"

    if index.supports_save:
        with tempfile.TemporaryDirectory() as tmp:
            index.save(tmp)
            loaded = cls.load(tmp)
        for params in (grid[0], top):
            _same(index.search(queries, k, **params), loaded.search(queries, k, **params), f"save/load at {params}")

    if index.supports_add:
        part = cls(**build_params).build(keys[:800], train_q, **positions(cls, 800, len(train)))
        part.add(keys[800:])
        assert part.n_keys == len(keys), "add() did not grow n_keys"
        res = part.search(queries, k, **part.grid()[-1])
        check_result(part, res, queries, keys, k, "after add()")
        added_recall = recall_at_k(res.ids, queries, keys, k)
        assert added_recall >= min_recall - 0.05, f"recall@{k} after add() is {added_recall:.4f}"

    check_errors(cls, index, keys, queries, build_params)
    if plausible_gain is not None:
        check_counts_plausible(cls, k, plausible_gain, **build_params)
    if cls.unbiased:
        check_unbiased(cls, unbiased_at if unbiased_at is not None else grid[0], **build_params)
    return {"grid": grid, "recall": [p[0] for p in points], "mean_scanned": [p[1] for p in points]}
