"""The index protocol: what every index (built-in or plugin) declares, accepts and returns.

A subclass declares ``build_params`` / ``search_params`` (each a :class:`Param` with a default
and a valid range), a default ``search_grid`` and ``uses_train_queries``, and implements
``_build`` and ``_search``. The base class validates every input, so the subclass only ever
sees clean float32 arrays and in-range parameters.

Result policy (the conformance kit checks it): ids are int64 row numbers of the keys passed
to ``build`` (then ``add``), sorted by descending score; if an index finds fewer than ``k``
keys, the tail of the row is padded with id ``-1`` and score ``-inf``. ``n_scanned[i]`` is the
number of vectors whose inner product with query ``i`` was computed, repeats included
(centroids, hyperplanes and graph nodes all count). ``bytes_read[i]`` is the bytes of index data
query ``i`` read: by default ``n_scanned[i] × dim × 4`` (every scanned vector read as a float32 key);
an index that reads more (graph rows, inverted-list ids) or less (codes, page bounds) returns its
own count as a fourth array from ``_search`` (each index's docstring says what it counts).

Estimators (``estimates = True``) also return an :class:`~anns_lab.indexes.estimate.Estimate` of the
softmax over the keys outside ``ids`` (weighted samples and/or summary terms) as a fifth item of
``_search`` (``bytes_read`` may then be ``None`` for the default); its cost is part of ``n_scanned`` and
``bytes_read``. An index with summary terms returns them from ``summaries()``. See docs/estimators.md.
"""

from __future__ import annotations

import difflib
import itertools
import math
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping, NamedTuple, Sequence

import numpy as np

from anns_lab.errors import IndexConfigError, IndexResultError
from anns_lab.indexes.estimate import Estimate, Summaries
from anns_lab.indexes.held_memory import overlaps
from anns_lab.indexes.key_store import KeyRows, KeyStore
from anns_lab.indexes.persist import load_index, save_index

#: Largest magnitude accepted in keys and queries: any inner product of two such vectors (|q·k| ≤ d·1e30) stays
#: far inside float32 (3.4e38) up to d = 10^8, so no index can overflow. Real activations are below 1e5.
MAX_ABS = 1e15


@dataclass(frozen=True)
class Param:
    """One build or search parameter: its default, valid range (inclusive) or choices, and a help line."""

    default: Any
    low: float | None = None
    high: float | None = None
    choices: tuple | None = None
    help: str = ""

    def check(self, owner: str, name: str, value: Any) -> Any:
        """Return ``value`` coerced to the default's type, or raise IndexConfigError."""
        kind = type(self.default)
        if kind is bool:
            ok = isinstance(value, (bool, np.bool_))
        elif kind is int:
            ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:  # the command line reads values as JSON: a bool is true or false there, not True
            spelled = " (true or false)" if kind is bool else ""
            raise IndexConfigError(f"{owner}: parameter {name}={value!r} must be {kind.__name__}{spelled}")
        value = kind(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise IndexConfigError(f"{owner}: parameter {name}={value!r} must be finite")
        if self.choices is not None and value not in self.choices:
            raise IndexConfigError(f"{owner}: parameter {name}={value!r} must be one of {list(self.choices)}")
        if self.low is not None and value < self.low or self.high is not None and value > self.high:
            raise IndexConfigError(f"{owner}: parameter {name}={value!r} is out of range {self.range_text()}")
        return value

    def range_text(self) -> str:
        """The valid range as text, e.g. ``[1, 512]`` or ``[0, inf)``."""
        if self.choices is not None:
            return "{" + ", ".join(map(str, self.choices)) + "}"
        if self.low is None and self.high is None:
            return "any"
        lo = "(-inf" if self.low is None else f"[{_num(self.low)}"
        hi = "inf)" if self.high is None else f"{_num(self.high)}]"
        return f"{lo}, {hi}"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


class SearchResult(NamedTuple):
    """What ``search`` returns: ids (nq, k) int64, scores (nq, k) float32, n_scanned (nq,) int64, bytes_read (nq,) int64."""

    ids: np.ndarray
    scores: np.ndarray
    n_scanned: np.ndarray
    bytes_read: np.ndarray | None = None  # search() always fills it; other constructors may leave it out
    #: Estimators only: the estimate of the softmax over the keys outside ``ids`` (None for a top-k index).
    estimate: Estimate | None = None


def resolve_params(owner: str, declared: Mapping[str, Param], given: Mapping[str, Any]) -> dict[str, Any]:
    """Fill defaults and check every given parameter is declared and in range."""
    for name in given:
        if name not in declared:
            close = difflib.get_close_matches(name, list(declared), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            known = ", ".join(declared) or "none"
            raise IndexConfigError(f"{owner}: unknown parameter {name!r} (known: {known}){hint}")
    return {name: p.check(owner, name, given.get(name, p.default)) for name, p in declared.items()}


def as_matrix(owner: str, what: str, x: Any, dim: int | None = None) -> np.ndarray:
    """Return ``x`` as a C-contiguous float32 (n, d) array with finite values, or raise."""
    arr = np.asarray(x)
    if arr.ndim == 1 and what == "queries":
        arr = arr[None, :]  # one query vector is a batch of one
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise IndexConfigError(f"{owner}: {what} must be a non-empty 2-D array (n, dim), got shape {arr.shape}")
    if arr.dtype != np.float32 or not arr.flags.c_contiguous:  # the common case skips these checks (batch-1 latency)
        if not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
            raise IndexConfigError(f"{owner}: {what} must be real numbers, got dtype {arr.dtype}")
        arr = np.ascontiguousarray(arr, dtype=np.float32)
    if dim is not None and arr.shape[1] != dim:
        raise IndexConfigError(f"{owner}: {what} have dimension {arr.shape[1]} but the index was built with dimension {dim}")
    # Two reductions: a NaN fails both comparisons, so this one test catches NaN, inf and too large.
    if not (arr.max() <= MAX_ABS and arr.min() >= -MAX_ABS):
        finite = np.isfinite(arr).all(axis=1)
        if not finite.all():
            bad = int(np.flatnonzero(~finite)[0])
            raise IndexConfigError(f"{owner}: {what} contain NaN or infinite values (first at row {bad})")
        bad = int(np.flatnonzero((np.abs(arr) > MAX_ABS).any(axis=1))[0])
        raise IndexConfigError(f"{owner}: {what} have values beyond ±{MAX_ABS:.0e} (first at row {bad}): inner "
                               "products of such vectors overflow float32; rescale them")
    return arr


class Index:
    """Base class of every index; subclasses implement ``_build`` and ``_search`` (and optionally more)."""

    #: Registry name; the registry sets it from the entry-point name when it differs.
    name: ClassVar[str] = ""
    build_params: ClassVar[Mapping[str, Param]] = {}
    search_params: ClassVar[Mapping[str, Param]] = {}
    #: Values of each search parameter to sweep, cheapest first; the last point is the most thorough.
    search_grid: ClassVar[Mapping[str, Sequence[Any]]] = {}
    #: Where the grid has several parameters: the one the decoder's calibration raises (its values in the grid's order,
    #: cheapest first), the others held at the search given (sparq, loki: ``budget`` at the given ``rank``).
    calibrated_by: ClassVar[str | None] = None
    #: Search parameters added after results tables were swept, each with the value that searches as the index did
    #: before it existed: ``decode --from-sweep`` runs a swept row that lacks one with that value (what it measured).
    search_params_before: ClassVar[Mapping[str, Any]] = {}
    #: For a parameter of ``search_params_before``, a build parameter added in the same version: a swept row records only
    #: its grid's search parameters but every build parameter, so a row naming that build parameter was swept after the
    #: search parameter existed (measured with its default); none: every row that lacks the search parameter predates it.
    search_params_since: ClassVar[Mapping[str, str]] = {}
    #: Build parameters added after results tables were swept, each with the value that builds as the index did before
    #: it existed: a swept row or a saved index that lacks one was built with that value (a sweep's resume builds such a
    #: part again where today's value differs; ``decode --from-sweep`` runs the row with it, what it measured; ``load``
    #: restores the save with it).
    build_params_before: ClassVar[Mapping[str, Any]] = {}
    #: Build parameters whose 0 means "auto" (resolved at build time, e.g. from the number of keys), each with a short
    #: stamp of its rule's version (the date it last changed; a suffix for a second change that day): change the stamp
    #: with the rule. The sweep records them in every row; ``decode --from-sweep`` notes a row swept by other rules.
    auto_rules: ClassVar[Mapping[str, str]] = {}
    #: True when ``build`` uses ``train_queries`` (attention-aware indexes); others ignore them.
    uses_train_queries: ClassVar[bool] = False
    #: True when the build reads the training queries where the prefill had them (SnapKV: the prompt's last queries
    #: score the context as they attended it): the sweep and the decoder never move them (``--train-positions`` moves
    #: them for the indexes that learn what the decode steps will ask).
    own_positions: ClassVar[bool] = False
    #: With ``own_positions``: True when ``build`` also takes ``key_positions`` (n,) and ``train_positions`` (m,), each
    #: key's and each training query's token position (InfLLM: a key is scored by the queries that follow it closely).
    reads_positions: ClassVar[bool] = False
    #: True when ``build`` also takes ``train_topk``, the training queries' top keys computed elsewhere.
    accepts_train_topk: ClassVar[bool] = False
    #: True when ``build`` also takes ``group_queries``: the prefill queries of the other query heads of the GQA group.
    accepts_group_queries: ClassVar[bool] = False
    #: True when ``search_group`` also takes ``hints``: key ids its searches enter at besides their own entry points
    #: (scanned and counted), e.g. the decoder's copy hints (``decode.copy_hints``); others are never given them.
    takes_hints: ClassVar[bool] = False
    #: The search parameter that takes the softmax scale of the attention the index serves (an estimator may size its
    #: sample by it), or None: the sweep and the decoder give it the layer's scale where the search leaves it at 0.
    scale_param: ClassVar[str | None] = None
    #: True when ``search`` also returns an Estimate of the rest of the softmax (docs/estimators.md).
    estimates: ClassVar[bool] = False
    #: True when the estimate's normaliser and numerator are unbiased over the ``seed`` build parameter.
    unbiased: ClassVar[bool] = False
    #: True when ``_restore`` of ``_arrays()`` gives an index that behaves as the built one ever after, ``add`` included
    #: (hnswlib's reload restarts its level generator: not so): it may then be built in a worker process
    #: (:mod:`indexes.build_processes`), where the decoder gets it back that way.
    restores_exactly: ClassVar[bool] = False

    def __init__(self, **build_params: Any) -> None:
        self.params: dict[str, Any] = resolve_params(self._owner(), self.build_params, build_params)
        self.n_keys = 0
        self.dim: int | None = None

    # -- the protocol ---------------------------------------------------------------------------

    def build(self, keys: Any, train_queries: Any | None = None, train_topk: Any | None = None,
              group_queries: Any | None = None, group_topk: Any | None = None, key_positions: Any | None = None,
              train_positions: Any | None = None) -> "Index":
        """Index ``keys`` (n, d); attention-aware indexes also learn from ``train_queries`` (m, d), and those that
        accept it take ``train_topk`` (m, c): each training query's top-c key ids by inner product, best first,
        computed elsewhere (e.g. on the accelerator during the prefill) so the build need not. Those that accept
        ``group_queries`` (m', d), the other query heads' prefill queries of the keys' GQA group, use them where the
        head's own lists leave keys out (``group_topk`` (m', c): their top keys, as ``train_topk``). Those that
        read positions (``reads_positions``) take ``key_positions`` (n,) and ``train_positions`` (m,): each key's and
        each training query's token position, both ascending.

        ``keys`` may be :class:`KeyRows`, one head of a growable :class:`KeyStore` the caller owns (the
        decoder's): an index that keeps float32 key rows reads them there instead of a copy of its own,
        and the owner appends new rows to the store before calling ``add`` with them.
        """
        given = keys if isinstance(keys, KeyRows) else None
        keys = as_matrix(self._owner(), "keys", keys.view(keys.n) if given is not None else keys)
        if train_queries is not None:
            train_queries = as_matrix(self._owner(), "train_queries", train_queries, keys.shape[1])
        elif self.uses_train_queries:
            raise IndexConfigError(f"{self._owner()}: this index is built from train_queries; pass them to build()")
        self.check_dim(keys.shape[1])
        self.check_keys(len(keys))
        self._given_rows = given
        extra = {}
        if train_topk is not None:
            extra["train_topk"] = self._check_topk(train_topk, train_queries, len(keys))
        if group_queries is not None or group_topk is not None:
            extra.update(self._check_group(keys, train_queries, group_queries, group_topk))
        if self.reads_positions or key_positions is not None or train_positions is not None:
            extra.update(self._check_positions(len(keys), train_queries, key_positions, train_positions))
        self._build(keys, train_queries, **extra)
        self.__dict__.pop("_given_rows", None)
        self.n_keys, self.dim = keys.shape
        return self

    def check_keys(self, n_keys: int) -> None:
        """Raise IndexConfigError when these build parameters cannot index ``n_keys`` keys (e.g. more lists than
        keys): ``build`` calls it, and so do the sweep and the decoder before any work, so that the mistake is one
        error up front rather than one per head."""

    def check_dim(self, dim: int) -> None:
        """Raise IndexConfigError when these build parameters cannot index keys of ``dim`` dimensions (pqcache: ``M``
        not dividing it): called where ``check_keys`` is."""

    def train_rows(self, n_keys: int, m: int) -> np.ndarray | None:
        """The rows of ``m`` training queries that a build over ``n_keys`` keys learns from (None: all): a caller may
        prepare and pass only those (the decoder's RoPE move), for the same index."""
        return None

    def newest_train_queries(self) -> int | None:
        """At most how many of the newest training queries a build reads, however many it is given (None: any of
        them): a decoder keeps only so many of the prefill's (SnapKV: its observation window), and a build given only
        those behaves as one given all (``testing.check_index``)."""
        return None

    @classmethod
    def train_topk_width(cls, n_keys: int, **build_params: Any) -> int:
        """Top keys per training query that a build over ``n_keys`` keys reads from ``train_topk`` (indexes that
        accept it): the width to compute elsewhere."""
        raise IndexConfigError(f"{cls.name or cls.__name__}: this index does not take train_topk")

    def _check_topk(self, topk: Any, train_queries: np.ndarray | None, n_keys: int, what: str = "train_topk") -> np.ndarray:
        """``train_topk`` (or ``what``) as a C-contiguous int32 (m, c) array of key ids, one row per query, or raise."""
        owner = self._owner()
        if not self.accepts_train_topk:
            raise IndexConfigError(f"{owner}: this index does not take {what}")
        if train_queries is None:
            raise IndexConfigError(f"{owner}: {what} needs the train_queries it was computed from")
        arr = np.asarray(topk)
        if not np.issubdtype(arr.dtype, np.integer):
            raise IndexConfigError(f"{owner}: {what} must hold integer key ids, got dtype {arr.dtype}")
        if arr.ndim != 2 or arr.shape[0] != len(train_queries) or arr.shape[1] == 0:
            raise IndexConfigError(f"{owner}: {what} must have shape ({len(train_queries)}, c ≥ 1), one row per "
                                   f"query, got {arr.shape}")
        if arr.min() < 0 or arr.max() >= n_keys:
            raise IndexConfigError(f"{owner}: {what} holds ids outside [0, {n_keys}) (the keys given to build)")
        return np.ascontiguousarray(arr, dtype=np.int32)

    def _check_positions(self, n_keys: int, train_queries: np.ndarray | None, key_positions: Any | None,
                         train_positions: Any | None) -> dict[str, np.ndarray]:
        """``key_positions`` and ``train_positions`` as int64 arrays, one per key and per training query, ascending
        (strictly for the keys: one key a position), or raise: for an index that reads them, none other."""
        owner = self._owner()
        if not self.reads_positions:
            raise IndexConfigError(f"{owner}: this index does not take key_positions or train_positions")
        given = {"key_positions": (key_positions, n_keys),
                 "train_positions": (train_positions, None if train_queries is None else len(train_queries))}
        out = {}
        for what, (arr, n) in given.items():
            if arr is None or n is None:
                raise IndexConfigError(f"{owner}: this index reads each key's and each training query's token position; "
                                       f"pass {what} to build() (with the train_queries)")
            arr = np.asarray(arr)
            if not np.issubdtype(arr.dtype, np.integer) or arr.shape != (n,) or (
                    arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max):
                raise IndexConfigError(f"{owner}: {what} must be {n} integer positions (int64), got {arr.dtype} "
                                       f"{arr.shape}")
            steps = np.diff(arr)
            if (arr < 0).any() or (steps < (1 if what == "key_positions" else 0)).any():
                raise IndexConfigError(f"{owner}: {what} must be non-negative and ascending"
                                       f"{' (one key a position)' if what == 'key_positions' else ''}")
            out[what] = np.array(arr, dtype=np.int64)  # a copy: the caller's (HeadData.key_pos) stay as given
        return out

    def _check_group(self, keys: np.ndarray, train_queries: np.ndarray | None, group_queries: Any | None,
                     group_topk: Any | None) -> dict[str, np.ndarray]:
        """``group_queries`` (and ``group_topk``) checked as :meth:`build` takes them, or IndexConfigError."""
        owner = self._owner()
        if not self.accepts_group_queries:
            raise IndexConfigError(f"{owner}: this index does not take group_queries")
        if group_queries is None:
            raise IndexConfigError(f"{owner}: group_topk needs the group_queries it was computed from")
        out = {"group_queries": as_matrix(owner, "group_queries", group_queries, keys.shape[1])}
        if group_topk is not None:
            out["group_topk"] = self._check_topk(group_topk, out["group_queries"], len(keys), "group_topk")
        return out

    def search(self, queries: Any, k: int, **params: Any) -> SearchResult:
        """Top-``k`` keys by inner product for each query, and how many vectors each query scanned."""
        self._require_built()
        q = as_matrix(self._owner(), "queries", queries, self.dim)
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
            raise IndexConfigError(f"{self._owner()}: k must be a positive integer, got {k!r}")
        if k > self.n_keys:
            raise IndexConfigError(f"{self._owner()}: k={k} is larger than the number of keys ({self.n_keys})")
        full = self._search_params_for(params)
        out = self._search(q, int(k), **full)
        if not isinstance(out, (tuple, list)) or not 3 <= len(out) <= 5:  # else a raw unpacking or subscript error
            raise IndexResultError(f"{self._owner()} broke the index protocol: _search must return (ids, scores, "
                                   f"n_scanned[, bytes_read[, estimate]]), got {type(out).__name__}"
                                   + (f" of {len(out)}" if isinstance(out, (tuple, list)) else ""))
        ids, scores, n_scanned = out[:3]
        bytes_read = out[3] if len(out) > 3 and out[3] is not None else None
        self._check_integral(ids=ids, n_scanned=n_scanned, bytes_read=bytes_read)
        if np.asarray(scores).dtype.kind not in "fiu":  # complex: the cast dropped the imaginary part with a warning
            raise IndexResultError(f"{self._owner()} broke the index protocol: scores must be real numbers, got dtype "
                                   f"{np.asarray(scores).dtype}")
        n_scanned = np.ascontiguousarray(n_scanned, dtype=np.int64)
        bytes_read = n_scanned * self.key_bytes() if bytes_read is None else bytes_read
        estimate = out[4] if len(out) > 4 else None
        return SearchResult(
            np.ascontiguousarray(ids, dtype=np.int64),
            np.ascontiguousarray(scores, dtype=np.float32),
            n_scanned,
            np.ascontiguousarray(bytes_read, dtype=np.int64),
            estimate,
        )

    @classmethod
    def moves_train_queries(cls) -> bool:
        """Whether the sweep and the decoder move this index's training queries (``--train-positions``): it learns
        from them (``uses_train_queries``) and not where the prefill had them (``own_positions``)."""
        return cls.uses_train_queries and not cls.own_positions

    @classmethod
    def scaled(cls, params: Mapping[str, Any], scaling: float) -> dict[str, Any]:
        """``params`` with the layer's softmax ``scaling`` given to ``scale_param``, where the class has one and
        ``params`` leaves it unset (absent or 0): what the sweep and the decoder search with."""
        if cls.scale_param is None or params.get(cls.scale_param):
            return dict(params)
        return {**params, cls.scale_param: float(scaling)}

    def _check_integral(self, **arrays: Any) -> None:
        """Refuse ids and counts that are not integers before they are cast to int64: the cast would quietly truncate
        a float id (2.7 → key 2) or count, and turn a NaN or an unsigned 2**64 - 1 into another number."""
        for name, a in arrays.items():
            a = None if a is None else np.asarray(a)
            if a is not None and a.dtype.kind not in "iu":
                raise IndexResultError(f"{self._owner()} broke the index protocol: {name} must be integers, got "
                                       f"dtype {a.dtype}")
            if a is not None and a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max:
                raise IndexResultError(f"{self._owner()} broke the index protocol: {name} holds values past int64")

    def key_bytes(self) -> int:
        """Bytes of one stored key (float32): what the default ``bytes_read`` charges per vector scanned."""
        return 4 * int(self.dim)

    @classmethod
    def search_group(cls, indexes: Sequence["Index"], queries: np.ndarray, k: int, **params: Any) -> SearchResult:
        """Search ``indexes[i]`` (all of this class) with ``queries[i]``: one row per index, as ``search`` returns it.

        The decoder's only search: once per layer and step, one index per query head (an index
        shared by a GQA group appears once per head of the group). The default searches each
        distinct index once, with the queries of its rows in one batch. A class for which one
        call over all the indexes is cheaper (the graph indexes: every head's beam search in
        one kernel) overrides it; the result must be what the one-at-a-time searches return.
        """
        rows: dict[int, list[int]] = {}
        for i, index in enumerate(indexes):
            rows.setdefault(id(index), []).append(i)
        out, estimates = None, [None] * len(indexes)
        for heads in rows.values():
            res = indexes[heads[0]].search(queries[heads], k, **params)
            if out is None:
                out = [np.empty((len(indexes), *col.shape[1:]), col.dtype) for col in res[:4]]
            for col, part in zip(out, res[:4]):
                col[heads] = part
            if res.estimate is not None:
                for j, h in enumerate(heads):
                    estimates[h] = res.estimate.rows([j])
        return SearchResult(*out, None if any(e is None for e in estimates) else Estimate.concat(estimates))

    def summaries(self) -> Summaries | None:
        """The summary terms an estimate may use (centroid keys and their members); None when it uses none."""
        return None

    def _search_params_for(self, params: dict[str, Any]) -> dict[str, Any]:
        """``resolve_params`` for search, remembered per distinct parameter set (batch-1 latency)."""
        cache = self.__dict__.setdefault("_resolved", {})
        try:
            key = tuple((k, type(v), v) for k, v in params.items())  # 7.0 is refused where 7 is not: not one key
            full = cache.get(key)
        except TypeError:  # an unhashable value: checked every time
            return resolve_params(self._owner(), self.search_params, params)
        if full is None:
            full = resolve_params(self._owner(), self.search_params, params)
            if len(cache) < 64:
                cache[key] = full
        return full

    def add(self, keys: Any) -> None:
        """Insert more keys; their ids continue after the existing ones."""
        self._require_built()
        keys = as_matrix(self._owner(), "keys", keys, self.dim)
        self._add(keys)
        self.n_keys += keys.shape[0]

    def grid(self) -> list[dict[str, Any]]:
        """The default sweep as a list of search-parameter dicts, cheapest first (may depend on the built index)."""
        names = list(self.search_grid)
        return [dict(zip(names, values)) for values in itertools.product(*(self.search_grid[n] for n in names))]

    def max_scanned(self) -> int:
        """An upper bound on ``n_scanned`` per query (keys plus any fixed overhead such as centroids)."""
        return self.n_keys

    @property
    def nbytes(self) -> int:
        """Bytes held by the index structures, keys included: :meth:`held_arrays` (override where a library holds
        memory that neither its attributes nor ``_arrays()`` show)."""
        return sum(a.nbytes for a in self.held_arrays())

    def held_arrays(self) -> list[np.ndarray]:
        """The numpy arrays the index holds, each piece of memory once: its attributes' (inside tuples, lists,
        dicts, dataclasses; key rows as their rows) and, where it saves, ``_arrays()``' (a library's state, as faiss's
        lists). What ``save`` writes alone left out what an index derives on load (page bounds, hash codes)."""
        found = list(_arrays_in(vars(self).values(), self.n_keys))
        if self.supports_save:
            found += [a for a in self._arrays().values() if isinstance(a, np.ndarray)]
        kept: dict[int, list[np.ndarray]] = {}  # by the memory an array views: only those can overlap
        for a in sorted(found, key=lambda a: -a.nbytes):
            root = a
            while isinstance(root.base, np.ndarray):
                root = root.base
            group = kept.setdefault(id(root if root.base is None else root.base), [])
            if not any(overlaps(a, b) for b in group):
                group.append(a)
        return [a for group in kept.values() for a in group]

    @property
    def supports_add(self) -> bool:
        return type(self)._add is not Index._add

    @property
    def supports_save(self) -> bool:
        return type(self).saves()

    @classmethod
    def saves(cls) -> bool:
        """Whether the class implements ``_arrays`` (``save``), asked of the class: ``supports_save`` needs an index."""
        return cls._arrays is not Index._arrays

    # -- persistence: .npy files (allow_pickle=False) plus one JSON file, never pickle ------------

    def save(self, path: str | Path) -> None:
        """Write the index to folder ``path`` (``index.json`` with a sha256 per array, one ``.npy`` per array)."""
        self._require_built()
        if not self.supports_save:
            raise IndexConfigError(f"{self._owner()}: this index does not support save()")
        save_index(self, path)

    @classmethod
    def load(cls, path: str | Path) -> "Index":
        """Read an index written by ``save``; anything missing, corrupt or inconsistent is one IndexConfigError."""
        return load_index(cls, path)

    # -- for subclasses ----------------------------------------------------------------------------

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _build(keys, train_queries)")

    def _search(self, queries: np.ndarray, k: int, **params: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise NotImplementedError(f"{type(self).__name__} does not implement _search(queries, k, **search_params)")

    def _add(self, keys: np.ndarray) -> None:
        raise IndexConfigError(f"{self._owner()}: this index does not support add()")

    def _arrays(self) -> dict[str, np.ndarray]:
        """Everything ``load`` needs, as named numpy arrays (numeric dtypes only)."""
        raise NotImplementedError

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Set the index up from ``_arrays()``'s arrays (``n_keys``/``dim`` already set); check each array's
        dtype, shape and id range first (``persist.expect``), raising IndexConfigError: they come from a file."""
        raise NotImplementedError

    def restored_on(self, rows: KeyRows | None, arrays: dict[str, np.ndarray], n_keys: int, dim: int) -> "Index":
        """Set this unbuilt index up from ``_arrays()``'s arrays of one built elsewhere (a worker process:
        :mod:`indexes.build_processes`), as ``load`` does and with its checks; an index that keeps its key rows reads
        them from ``rows`` (the caller's store, as ``build`` on them would), if given."""
        self.n_keys, self.dim = n_keys, dim
        self._given_rows = rows
        try:
            self._restore(arrays)
        finally:
            self.__dict__.pop("_given_rows", None)
        return self

    def _key_rows(self, keys: np.ndarray) -> KeyRows:
        """Where to keep the float32 key rows (call from ``_build`` and ``_restore``): the caller's store given to
        ``build`` (or :meth:`restored_on`), else a store of the index's own around ``keys`` (no copy until ``add`` grows
        it)."""
        given = self.__dict__.get("_given_rows")
        return given if given is not None else KeyStore.own(keys)

    def _owner(self) -> str:
        return self.name or type(self).__name__

    def _require_built(self) -> None:
        if self.dim is None:
            raise IndexConfigError(f"{self._owner()}: call build() before using the index")


def concat_results(parts: Sequence[SearchResult]) -> SearchResult:
    """The rows of ``parts`` one after another (estimates concatenated too, when the parts have them)."""
    arrays = [None if any(c is None for c in column) else np.concatenate(column) for column in zip(*(p[:4] for p in parts))]
    estimates = [p.estimate for p in parts]
    return SearchResult(*arrays, None if any(e is None for e in estimates) else Estimate.concat(estimates))


class KeyRowsIndex(Index):
    """An :class:`Index` that reads its float32 key rows as ``self._keys``: held by :meth:`_hold_keys` in the
    caller's store given to ``build`` (the decoder's: the rows once for a GQA group's heads, whatever reads them) or a
    store of the index's own, and grown by :meth:`_append_keys` in ``_add``, which copies the new rows only (a copy
    of every key an add cost the decoder each index's own duplicate of the keys and O(n·d) a batch)."""

    def _hold_keys(self, keys: np.ndarray) -> None:
        """Hold ``keys`` (n, d) as the index's rows: call from ``_build`` and ``_restore``."""
        self._rows = self._key_rows(keys)

    @property
    def _keys(self) -> np.ndarray:
        """Rows ``[0, n_keys)``, a fresh view each time (the store's buffer is replaced as it grows)."""
        return self._rows.view(self.n_keys or self._rows.n)

    def _append_keys(self, keys: np.ndarray) -> np.ndarray:
        """Append ``keys`` (t, d) from ``_add`` (a caller's store already holds them: checked there); returns every
        row, the old and the new."""
        self._rows.append(self.n_keys, keys)
        return self._rows.view(self.n_keys + len(keys))


def pad_topk(ids: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Apply the padding policy: any id < 0 becomes -1 with score -inf (faiss pads with -1 / -FLT_MAX)."""
    ids = np.asarray(ids, dtype=np.int64)
    scores = np.asarray(scores, dtype=np.float32).copy()
    missing = ids < 0
    if missing.any():
        ids = np.where(missing, -1, ids)
        scores[missing] = -np.inf
    return ids, scores


def _arrays_in(values, n_keys: int, depth: int = 3):
    """The numpy arrays among ``values`` and inside their containers, ``depth`` levels down; key rows as their first
    ``n_keys`` rows (a store its owner appends to holds rows the index has not had yet), an index's own store whole."""
    for v in values:
        if isinstance(v, np.ndarray):
            yield v
        elif isinstance(v, KeyRows):
            yield v.held(min(v.n, n_keys))
        elif depth and isinstance(v, (tuple, list)):
            yield from _arrays_in(v, n_keys, depth - 1)
        elif depth and isinstance(v, dict):
            yield from _arrays_in(v.values(), n_keys, depth - 1)
        elif depth and is_dataclass(v) and not isinstance(v, type):
            yield from _arrays_in((getattr(v, f.name) for f in fields(v)), n_keys, depth - 1)
