"""The result rules of the index protocol, in one place: the sweep, the decoder and the conformance kit apply them.

A search result breaks the protocol when: its arrays are not ids int64 ``(nq, k)``, scores
float32 ``(nq, k)``, n_scanned int64 ``(nq,)`` (and bytes_read int64 ``(nq,)`` when the result
carries it, as every ``SearchResult`` does); bytes_read is below 1 (every query scans a key); an id is
outside ``[0, n_keys)`` and not the ``-1`` padding, or padding comes before a valid id; a row returns an id
twice; a valid id's score is not finite, padding's is not ``-inf``, or scores are not sorted in descending
order; ``n_scanned`` is below 1 or the number of returned ids, or above the index's ``max_scanned()`` (itself a
whole number ≥ 1); and, when the queries and keys are given, a score differs from q·k of its id. The estimator rules
(an Estimate exactly when the class ``estimates``; valid, disjoint, positively weighted terms) are
:func:`anns_lab.indexes.estimate.estimate_problem`, applied by :func:`check_estimate`.
"""

from __future__ import annotations

import zlib

import numpy as np

from anns_lab.errors import IndexResultError
from anns_lab.io import is_int
from anns_lab.indexes.estimate import estimate_problem


def result_problem(res, nq: int, k: int, n_keys: int, max_scanned: int, queries: np.ndarray | None = None,
                   keys: np.ndarray | None = None, check_scores: bool = True) -> str | None:
    """The first rule ``res`` = (ids, scores, n_scanned[, bytes_read]) breaks, in words, or None when it keeps them all.

    ``check_scores=False`` skips the score rules (the decoder reads only ids and counts); ``queries``
    and ``keys`` (float32, the rows the ids point to) add the check that scores equal q·k.
    """
    if not (is_int(max_scanned) and max_scanned >= 1):  # a NaN bound bounded nothing (n > nan is False), None was a TypeError
        return f"max_scanned() returned {max_scanned!r}, not a whole number ≥ 1 (the most keys a query may scan)"
    ids, scores, scanned = (np.asarray(a) for a in res[:3])
    if ids.shape != (nq, k) or ids.dtype != np.int64:
        return f"ids must be int64 of shape ({nq}, {k}), got {ids.dtype} {ids.shape}"
    if scanned.shape != (nq,) or scanned.dtype != np.int64:
        return f"n_scanned must be int64 of shape ({nq},), got {scanned.dtype} {scanned.shape}"
    lo, hi = int(ids.min()), int(ids.max())
    if lo < -1 or hi >= n_keys:
        return f"ids outside [0, {n_keys}) that are not the -1 padding (e.g. {lo if lo < -1 else hi})"
    valid = ids >= 0
    if lo == -1:  # some padding: it must trail, and counts as no id
        if not (valid[:, :-1] >= valid[:, 1:]).all():
            return "-1 padding must only trail each row"
        # Padding replaced by distinct negatives, so a repeat is two equal neighbours after sorting.
        distinct = np.sort(np.where(valid, ids, -2 - np.arange(k)), axis=1)
        least = np.maximum(valid.sum(axis=1), 1)
    else:  # the common case, a few vectorised calls: the decoder checks every step
        distinct = np.sort(ids, axis=1)
        least = k
    twice = distinct[:, 1:] == distinct[:, :-1]
    if twice.any():
        return f"query {int(np.flatnonzero(twice.any(axis=1))[0])} returns an id twice"
    if not (scanned >= least).all():
        return f"n_scanned {int(scanned.min())} is below 1 or below the number of returned ids"
    if int(scanned.max()) > max_scanned:
        return f"n_scanned {int(scanned.max())} exceeds the index's declared bound max_scanned() = {max_scanned}"
    if len(res) > 3 and res[3] is not None:
        n_bytes = np.asarray(res[3])
        if n_bytes.shape != (nq,) or n_bytes.dtype != np.int64:
            return f"bytes_read must be int64 of shape ({nq},), got {n_bytes.dtype} {n_bytes.shape}"
        if (n_bytes < 1).any():  # n_scanned ≥ 1: a query that computed an inner product read a vector's bytes
            return f"bytes_read {int(n_bytes.min())} is below 1 for a query that scanned keys"
    if not check_scores:
        return None
    if scores.shape != (nq, k) or scores.dtype != np.float32:
        return f"scores must be float32 of shape ({nq}, {k}), got {scores.dtype} {scores.shape}"
    if not np.isfinite(scores[valid]).all():
        return "a returned id has a score that is not finite"
    if not np.isneginf(scores[~valid]).all():
        return "padded slots must have score -inf"
    if not _sorted_rows(scores, valid):
        return "scores must be sorted in descending order"
    if queries is not None and keys is not None:
        true = np.einsum("qd,qkd->qk", queries.astype(np.float64), keys[np.where(valid, ids, 0)].astype(np.float64))
        scale = np.abs(queries).sum(axis=1, keepdims=True) * np.abs(keys).max() + 1e-6
        err = np.where(valid, np.abs(scores - true) / scale, 0.0)
        if err.max() >= 1e-5:
            return f"returned scores differ from q·k of the returned ids (max rel err {err.max():.2e})"
    return None


def declaration_problem(cls) -> str | None:
    """The first inconsistency in an index class's declarations, in words, or None: a default out of its own range, a
    ``search_grid`` naming an undeclared parameter or holding a value out of range, ``calibrated_by`` outside the grid,
    the ``*_before`` / ``*_since`` / ``auto_rules`` tables naming undeclared parameters. The sweep and the decoder ask it before any
    work (else each head's part failed alone, reading like a bad command-line parameter); the kit asserts it."""
    from anns_lab.errors import IndexConfigError

    def undeclared(table: str, name: str, declared: str) -> str:
        return f"{table} names {name!r}, which is not a declared {declared} parameter"

    try:
        for name, p in {**cls.build_params, **cls.search_params}.items():
            p.check(cls.__name__, name, p.default)
        if cls.reads_positions and not cls.own_positions:
            return "reads_positions needs own_positions: the positions are the prefill's, where the queries were never moved"
        if cls.calibrated_by is not None and cls.calibrated_by not in cls.search_grid:
            return f"calibrated_by names {cls.calibrated_by!r}, which is not a search_grid parameter"
        for name, values in cls.search_grid.items():
            if name not in cls.search_params:
                return undeclared("search_grid", name, "search")
            if len(values) == 0:
                return f"search_grid[{name!r}] is empty"
            for v in values:
                cls.search_params[name].check(cls.__name__, name, v)
        # decode --from-sweep puts these into a plan: a wrong one would fail only at the decode's first search
        for kind, before, declared in (("search", cls.search_params_before, cls.search_params),
                                       ("build", cls.build_params_before, cls.build_params)):
            for name, v in before.items():
                if name not in declared:
                    return undeclared(f"{kind}_params_before", name, kind)
                declared[name].check(cls.__name__, name, v)
        for name, build in cls.search_params_since.items():
            if name not in cls.search_params_before:
                return f"search_params_since names {name!r}, which is not in search_params_before"
            if build not in cls.build_params:
                return f"search_params_since[{name!r}] = {build!r} is not a declared build parameter"
        for name, stamp in cls.auto_rules.items():
            if name not in cls.build_params:
                return undeclared("auto_rules", name, "build")
            cls.build_params[name].check(cls.__name__, name, 0)  # 0 is the value that asks for the rule
            if not isinstance(stamp, str) or not stamp:
                return f"auto_rules[{name!r}] must be a non-empty stamp, got {stamp!r}"
    except IndexConfigError as err:
        return str(err)
    return None


def held_bytes(owner: str, index) -> int:
    """``index.nbytes`` as an int; IndexResultError naming ``owner`` unless it is a whole number ≥ 0 (a negative size
    entered the table as measured, a NaN failed with numpy's words)."""
    held = index.nbytes
    if not (is_int(held) and held >= 0):
        raise IndexResultError(f"{owner} broke the index protocol: nbytes is {held!r}, not a whole number of bytes ≥ 0")
    return int(held)


def _sorted_rows(scores: np.ndarray, valid: np.ndarray) -> bool:
    """Whether each row's valid scores descend, tolerating float32 ties that differ in the last bit."""
    # Compare neighbours that are both real results (padding trails, so that is every pair that matters);
    # zeros in the padded slots keep -inf - -inf (a RuntimeWarning) out of the subtraction.
    s = np.where(valid, scores, 0.0).astype(np.float64)
    both = valid[:, :-1] & valid[:, 1:]
    d = np.diff(s, axis=1)[both]
    return bool((d <= 1e-6 * (1 + np.abs(s[:, 1:][both]))).all())


def check_result(owner: str, res, nq: int, k: int, n_keys: int, max_scanned: int, queries: np.ndarray | None = None,
                 keys: np.ndarray | None = None, check_scores: bool = True) -> None:
    """Raise IndexResultError naming ``owner`` and the broken rule when ``res`` breaks the protocol."""
    problem = result_problem(res, nq, k, n_keys, max_scanned, queries, keys, check_scores)
    if problem is not None:
        raise IndexResultError(f"{owner} broke the index protocol: {problem}")


_FROM_INDEX = object()


def check_estimate(owner: str, res, index, summaries=_FROM_INDEX) -> None:
    """Raise IndexResultError when ``res`` (one ``index``'s SearchResult) breaks the estimator rules (estimate_problem).
    ``summaries``: the copy of ``index.summaries()`` a consumer took and checked after the index last changed (its
    own rules are then not checked again); by default the index's, checked."""
    checked = summaries is not _FROM_INDEX
    problem = estimate_problem(res, index.estimates, summaries if checked else index.summaries(), index.n_keys,
                               index.dim, summaries_checked=checked)
    if problem is not None:
        raise IndexResultError(f"{owner} broke the index protocol: {problem}")


def input_sums(*arrays: np.ndarray | None) -> list[int | None]:
    """A crc32 of each array given to an index (None stays None): the protocol forbids writing into them, and a sweep or
    decoder that compares the sums before and after a build or search sees an index that did (normalised in place)."""
    return [None if a is None else zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B")) for a in arrays]


def inputs_changed(owner: str) -> IndexResultError:
    """The error for an index whose inputs' :func:`input_sums` changed."""
    return IndexResultError(f"{owner} broke the index protocol: it modified the keys or queries it was given, in place "
                            "(normalised them?); copy them first, as an index must never write to them")
