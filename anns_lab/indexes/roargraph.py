"""``roargraph``: an attention-aware key graph built from the prefill queries (RoarGraph, Chen et al. VLDB 2024).

Build, on keys K (n, d) and training queries Q (m, d) (kernels in :mod:`graph.roar`):

1. **Bipartite graph** of at most ``max_train`` training queries (auto: max(2048, n/4), :func:`auto_train`; the
   newest ``keep_queries`` all, an even stride over the older: :func:`subsample`): each one's top-``M_sq`` keys:
   exact for every ``list_stride``-th query (auto: :func:`auto_stride`; with the auto ``max_train`` a stride of ~n/8192:
   every list exact below ~12K keys, 4 at 32K, 16 at 128K) and the newest
   ``keep_queries``, the others ranking the keys of the neighbouring exact lists
   (``train_lists.anchored_topk``: exact lists for all grow as n²; the exact ones from a bfloat16 product's
   best M_sq + 32, re-ranked in float32, ``coarse_bf16``); or the lists given to ``build``
   as ``train_topk`` (computed where they are cheap: ``decode.device_lists`` on the accelerator).
2. **Projection onto keys.** RoarGraph hangs a query's keys on its top-1 key (the pivot); on real
   attention the top-1 keys are a few hundred sinks and heavy hitters, which starves every other
   key, so here each of a query's first ``n_pivots`` keys is a pivot (``n_pivots = 1`` is the
   published rule; sizes grow with n, :func:`auto_lists`). A pivot's candidates are the other keys
   of its queries, weighted by co-occurrence × (occurrences in all lists)^−``idf`` (sinks sit in
   every list), the ``max_cand`` heaviest RobustPruned to ``M`` in that order.
3. **Reverse edges**, rows capped at ``R`` > ``M`` so a heavy hitter links back to the keys that chose it.
4. **Query-judged edges** (``min_cooc``): an edge p → u that fewer than 10% of the training lists holding
   p also hold is dropped (:func:`graph.roar.drop_rare_edges`): a search that reaches p for such a query
   scans u in vain (at recall 0.95 most inner products go to keys outside the query's top-100 reached from
   keys inside it: ``benchmarks/diag_graph_search.py``).
5. **Descent links**: a search for a training query expands the keys above rank r of its list
   before rank r, so a key with no in-neighbour ranked above it is found only by luck; it gets
   in-edges from the keys above it most like it (``descent_links`` per key); this also restores the
   ways down that step 4 cut. Drawn from the anchors' lists only (step 1's exact ones; lists given as
   ``train_topk`` are read at the same rows).
6. **Keys in no own list, from the group's other heads** (only when ``build`` is given ``group_queries``, the
   other query heads' prefill queries of the keys' GQA group, or their lists ``group_topk``): such a key's row is
   projected from the other heads' lists as step 2 projects (every rank a pivot), and the first ``group_in`` keys of
   that row gain it at their row's end where there is room (:func:`graph.roar.link_unlisted`). The rows of the keys
   the own lists hold keep their edges and order: mixing other heads' lists into their projection cost every head
   (BENCHMARKS "Query-aware graphs").
7. **Reachability**: keys in no list (empty rows) get their nearest keys as out-edges
   (:func:`link_stranded`), then every key unreachable from the entry points gets an in-edge.
   The published connectivity enhancement (``enhance_L``) is off by default: on real heads it
   links keys no query wants.
8. **Row order** (``cooc_order``): each row sorted by how many of the key's training lists also hold the
   neighbour, most first (:func:`graph.roar.order_rows_by_cooc`): the order the search's row stop walks.

Search: the best-first search of :mod:`graph.search` with beam ``L`` from all entry points at once;
the k best of every node scanned are returned, so ``L`` < k is a valid, cheaper operating point.
An expansion walks its node's row in order and stops once its misses (neighbours outside the beam)
reach ``row_misses`` + ``row_credit`` × hits (neighbours in it): a row whose first neighbours fall
outside the beam leads out of the query's region (``graph.search``, "Row stop"; 0 = full rows). Keys
added after the build are scanned wherever a walk stops short of them (their in-edges sit at the rows' ends).
The entry points, each counted like any node, are up to ``n_hubs`` + 1 hub keys (the top key of each k-means
centroid of the training queries, and of their mean) plus the ``recent_entries`` newest keys. ``bytes_read``
(``graph.search.bytes_read``): each scanned key (4·dim bytes), each expanded node's adjacency row (its
degree and neighbour ids, 4 bytes each) and the entry list (8 bytes per entry). The newest
``recent_frac`` of the training queries may weigh ``recent_weight`` times more (decode queries look
like late prefill queries: post-RoPE drift).

``add`` costs what the new keys cost, not what the index holds: the kept recent queries'
(``keep_queries``) exact top-``M_sq`` lists are cached; a new key that enters a list is projected
from those lists as the build projects, its neighbours get reverse edges, every new key is
searched for and linked from what it finds, and reachability is restored (a row pruned on the way keeps
its order, new edges last). Only new rows and their
neighbours' rows are written, in place, into an adjacency grown with spare capacity. Keys are read from the
:class:`key_store.KeyStore` given to ``build`` (the decoder's, one per layer for all heads), or one of
the index's own. Design history and measurements: ``docs/notes/graph-indexes.md``.
"""

from __future__ import annotations

import numba
import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.indexes.base import KeyRowsIndex, Param
from anns_lab.indexes.graph import Graph, HoldsAdjacency, roar, saved_graph
from anns_lab.indexes.graph.edges import FAR_POOL, add_reverse_edges, link_back, link_unreachable, reachable_from
from anns_lab.indexes.graph.hubs import query_hubs, saved_hubs
from anns_lab.indexes.graph.multi import search_graphs
from anns_lab.indexes.graph.search import bytes_read, search_batch, search_single
from anns_lab.indexes.persist import expect, expect_ids
from anns_lab.indexes.train_lists import anchor_ids, anchored_topk, topk_ip_fast

MIN_TRAIN = 2048  # auto_train's floor: below it every query is kept (4096 at 8K: ~2x the build, the same scans: BENCHMARKS "Scale")
STRANDED_POOL = 2048  # candidate out-neighbours of a stranded key at most (see link_stranded; 8192 scanned the same at 8K, cost +1.2 s per head at 32K)
STRANDED_SHARE = 15  # below ~31K keys the pool is one key in this many, at least STRANDED_MIN (512 at 8K: half the links' CPU, +0.6% scans)
STRANDED_MIN = 512
STRANDED_MARGIN = 8  # with coarse_bf16, a stranded key's k out-edges are ranked in float32 among its best k + this by bfloat16 (32: 1.2-1.3x the time, the same sets on real heads)
ADD_SERIAL = 1024  # adds of up to this many keys run on the calling thread: a thread-pool launch costs ms on a loaded machine
ADD_SEARCH_L = 16  # beam of the search that links each added key (wider: the same recall, slower)
LIST_PARAMS = ("M_sq", "n_pivots", "n_cand")  # the sizes build resolves (0 = auto), kept in self.lists and saved
KEYS_PER_ANCHOR = 4096  # auto list_stride: one exact list per this many keys' worth of queries (2048 scanned ~10% more at 32K)
MAX_STRIDE = 64  # auto list_stride at most
LISTS_FLOOR = (150, 30)  # auto_lists' least (M_sq, n_pivots)
LIST_SPAN = 1  # anchors on either side whose lists a query between them ranks (2 doubles the re-rank; not better in the runs of BENCHMARKS "Scale")


def subsample(m: int, at_most: int, newest: int = 0) -> np.ndarray | None:
    """Rows to keep of ``m`` training queries: at most ``at_most``, the ``newest`` rows all (add()'s kept queries:
    for a GQA group, ``group_queries``' interleaved tail, which a stride would cut to one head's rows) and an even
    stride over the older ones, counted back from the newest of them; None when all are kept. Neighbouring prefill
    queries select nearly the same keys, so a stride loses little of the bipartite graph."""
    if m <= at_most:
        return None
    newest = min(newest, at_most)
    older = np.unique(np.round(np.linspace(m - newest - 1, 0, at_most - newest)).astype(np.int64))
    return np.r_[older, np.arange(m - newest, m)]


def auto_train(n: int) -> int:
    """Training queries used for ``n`` keys: max(2048, n/4). With the queries moved to the positions the index serves
    (``dumps.rope``), a quarter of them scans as all do at 8K-128K for ~0.55x the build (BENCHMARKS "Query-aware
    graphs"); at their own positions each dropped query cost scans (their lists lean on the keys near them)."""
    return max(MIN_TRAIN, n // 4)


def auto_stride(m: int, n: int) -> int:
    """Training queries per exact list (:mod:`train_lists`) for ``m`` queries over ``n`` keys: √(m·n) / KEYS_PER_ANCHOR,
    in [1, MAX_STRIDE] (with :func:`auto_train`'s m: 1 = every list exact at 8K, 2 at 16K, 4 at 32K, 16 at 128K): the exact part then
    costs ~KEYS_PER_ANCHOR × m products, linear in the context instead of quadratic. Measured at 8K and 32K
    against the exact lists (BENCHMARKS "Scale": build cost and time to first token)."""
    return int(min(MAX_STRIDE, max(1, round((m * n) ** 0.5 / KEYS_PER_ANCHOR))))


def auto_lists(n_keys: int) -> tuple[int, int]:
    """(M_sq, n_pivots) for ``n_keys`` keys: M_sq 100·√(n/8192) and the pivot rank 20·n/8192, each at least its
    :data:`LISTS_FLOOR` value (150: up to ~18K keys; 30: up to ~12K), the pivot rank at most M_sq / 2 (198 and 78 at 32K).

    An empirical rule from the sizes measured (8K, 32K, 128K keys; ``docs/notes/graph-indexes.md``): with more keys the
    lists hold fewer of the keys a query needs, so longer lists and deeper pivots win. The floor: at 8K, (150, 30) with
    rows of 40 scanned 4-6% fewer keys at recall 0.95 than (100, 20) with rows of 24 on four texts (the rows alone
    1-2%), for ~5% more build; at 32K the √n rule's 198 beat 297 (BENCHMARKS "Two more held-out texts, then the row
    capacity and the lists' floor").
    """
    scale = max(1.0, n_keys / 8192)
    m_sq = max(LISTS_FLOOR[0], int(round(100 * scale ** 0.5)))
    return m_sq, min(m_sq // 2, max(LISTS_FLOOR[1], int(round(20 * scale))))


def stranded_pool(n: int) -> int:
    """Size of the pool a stranded key's out-edges come from among ``n`` keys (:func:`link_stranded`'s stride):
    n / STRANDED_SHARE within [STRANDED_MIN, STRANDED_POOL]: 512 at 8K, ~1K at 16K, 2048 from ~31K keys on. At 8K the kNN of
    the ~4K stranded keys against 2048 was a quarter of the build; against 512 the median scanned fraction at recall
    0.95 moved +0.6% (BENCHMARKS "Scale": the decoder's per-layer build)."""
    return min(STRANDED_POOL, max(STRANDED_MIN, n // STRANDED_SHARE))


def link_stranded(keys: np.ndarray, nbrs: np.ndarray, degree: np.ndarray, entries: np.ndarray, k: int,
                  coarse: bool = False, threads: int = 1) -> None:
    """Out-edges for the keys that the projection left unreachable with an empty row (keys in no training
    query's top list: about half of them on real heads): their ``k`` nearest keys by inner product, one
    blocked kNN for all of them (``coarse``: the best k + STRANDED_MARGIN of a bfloat16 product ranked in float32 on
    ``threads``, :func:`train_lists.topk_ip_fast`). ``link_unreachable`` then finds each an in-edge among its (or its
    neighbours') reachable neighbours instead of scanning every key per stranded key."""
    reach = reachable_from(Graph(keys, nbrs, degree), entries)
    stranded = np.flatnonzero(~reach & (degree == 0))
    if len(stranded) == 0:
        return
    # Nearest among a stride of the reachable keys (about stranded_pool(n) of them): these keys are in no query's
    # list, so they need a way in, not a fine neighbourhood; at 32K a full kNN of 27K stranded keys
    # cost as much as the bipartite graph itself.
    pool = np.flatnonzero(reach)
    pool = pool[:: max(1, len(pool) // stranded_pool(len(keys)))]
    # The bfloat16 product and float32 re-rank: 0.61x faiss's float32 kNN at 32K (dimension 256, ~30K stranded keys
    # against 1-3K), ~0.8x at 8K (a sixth of a build there), the same neighbour sets (BENCHMARKS "The stranded keys'
    # out-edges from a bfloat16 product"). A stranded key is unreachable, so never in the pool.
    near = pool[topk_ip_fast(keys[stranded], keys[pool], k, coarse, threads, STRANDED_MARGIN)]
    nbrs[stranded, : near.shape[1]] = near
    degree[stranded] = near.shape[1]


class RoarGraphIndex(HoldsAdjacency, KeyRowsIndex):
    """Projected query→key bipartite graph (pivots beyond top-1, reverse edges, descent links); counted multi-entry beam search."""

    name = "roargraph"
    restores_exactly = True  # tests/test_build_processes.py
    uses_train_queries = True
    accepts_train_topk = True
    accepts_group_queries = True
    takes_hints = True
    build_params = {
        "M": Param(12, 2, 512, help="out-degree of the projection (RobustPrune target)"),
        "R": Param(40, 2, 1024, help="row capacity after reverse edges and linking (≥ M): heavy hitters keep more of the keys that chose them (the row stop walks the rows in order)"),
        "M_sq": Param(0, 0, 4096, help="keys per training query in the bipartite graph (its exact top-M_sq); 0 = auto: 150 up to ~18K keys, ∝ √n above (198 at 32K)"),
        "n_pivots": Param(0, 0, 4096, help="pivot rank: each of a query's first n_pivots keys takes its other keys as candidates (1 = RoarGraph); 0 = auto: 30 up to ~12K keys, ∝ n above, ≤ M_sq/2 (78 at 32K)"),
        "idf": Param(0.25, 0.0, 4.0, help="candidate weight = co-occurrence × (key's total occurrences)^-idf"),
        "descent_links": Param(2, 0, 64, help="in-edges per key from the key ranked above it that is most like it, where a training query's list has no way down to it (0 = off)"),
        "descent_rank": Param(100, 2, 4096, help="how deep into each training query's list descent_links looks"),
        "min_cooc": Param(0.1, 0.0, 1.0, help="drop edge p→u when fewer than this fraction of the training lists holding p also hold u (0 = keep all)"),
        "cooc_order": Param(1, 0, 1, help="1: each row sorted by how many of the key's training lists hold the neighbour, most first (the order a partial expansion scans)"),
        "n_sel": Param(32, 1, 1 << 20, help="queries per pivot key (those where it ranks best; newest first on ties)"),
        "n_cand": Param(0, 0, 4096, help="how many of a query's keys are candidates of its pivots (≤ M_sq); 0 = M_sq"),
        "max_cand": Param(128, 2, 1 << 16, help="candidates per key kept (heaviest co-occurrence) before pruning"),
        "alpha": Param(1.2, 0.0, 4.0, help="RobustPrune α of the projection (inner-product rule; > 1 prunes less; 0 = no pruning)"),
        "max_train": Param(0, 0, 1 << 30, help="training queries used at most: the newest keep_queries all, an even stride over the older; "
                                               "0 = auto: max(2048, n/4) for n keys (build time)"),
        "list_stride": Param(0, 0, 4096, help="training queries per exact top-M_sq list: the others rank their neighbouring exact lists' keys (1 = all exact; 0 = auto: √(m·n)/4096, 1 at 8K, 4 at 32K, ≤ 64)"),
        "coarse_bf16": Param(1, 0, 1, help="1: the exact lists rank the best M_sq + 32 keys of a bfloat16 product in float32, the stranded keys' out-edges the best M_link + 8 (where the CPU multiplies bf16 natively; ~1.6x faster); 0: faiss's float32 kNN"),
        "enhance_L": Param(0, 0, 4096, help="beam width of the connectivity-enhancement search (0 = skip it)"),
        "M_link": Param(8, 1, 512, help="links per key from the enhancement search / out-edges of a stranded key"),
        "n_hubs": Param(32, 1, 4096, help="entry hubs: top key of each k-means centroid of the training queries, and of their mean (all counted)"),
        "recent_entries": Param(0, 0, 4096, help="the newest keys (highest ids) also used as entry points (counted)"),
        "recent_frac": Param(0.0, 0.0, 1.0, help="newest fraction of training queries given recent_weight"),
        "recent_weight": Param(1.0, 0.0, 1000.0, help="weight of those queries in the co-occurrence merge (0 drops them)"),
        "group_in": Param(2, 0, 64, help="with group_queries: in-edges per key in no own list from the first keys of its row "
                                          "(appended where a row has room; 0 = its out-edges only)"),
        "keep_queries": Param(256, 0, 1 << 20, help="newest training queries kept for add() (0 = link new keys by key search only)"),
        "seed": Param(0, 0, 2**31 - 1, help="k-means seed of the hubs"),
    }
    search_params = {
        "L": Param(100, 1, 1 << 16, help="beam width (L < k allowed: the k best of all scanned are returned)"),
        "row_misses": Param(6, 0, 1 << 16, help="row stop: an expansion walks the node's row (most co-occurring first) until its misses "
                                                "(neighbours outside the beam) reach row_misses + row_credit × hits (0 = every row in full)"),
        "row_credit": Param(0.3, 0.0, 1024.0, help="row stop: misses allowed per hit (neighbour in the beam) of the walk"),
    }
    search_grid = {"L": (50, 60, 70, 80, 90, 100, 120, 150, 200, 250, 300, 400, 500, 600, 800, 1200)}
    search_params_before = {"row_misses": 0}  # tables swept before the row stop searched every row in full
    search_params_since = {"row_misses": "cooc_order"}  # the row order came with the row stop: rows naming it measured it
    # the dates auto_train (MIN_TRAIN), auto_stride (KEYS_PER_ANCHOR) and auto_lists last changed
    auto_rules = {"max_train": "2026-12-01", "list_stride": "2026-11-30", "M_sq": "2026-12-02", "n_pivots": "2026-12-02"}

    # -- build -------------------------------------------------------------------------------------

    def check_keys(self, n_keys: int) -> None:
        p = self.params
        if p["M"] >= n_keys:
            raise IndexConfigError(f"{self._owner()}: M={p['M']} must be smaller than the number of keys ({n_keys})")
        if p["R"] < p["M"]:
            raise IndexConfigError(f"{self._owner()}: R={p['R']} must be at least M={p['M']}")
        if p["M_link"] > p["R"]:  # link_stranded writes M_link out-edges into a row of R
            raise IndexConfigError(f"{self._owner()}: M_link={p['M_link']} must be at most R={p['R']}")

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None, train_topk: np.ndarray | None = None,
               group_queries: np.ndarray | None = None, group_topk: np.ndarray | None = None) -> None:
        p = self.params
        n = len(keys)
        threads = numba.get_num_threads()
        self.lists = self._list_sizes(n)
        m_sq = min(self.lists["M_sq"], n)
        rows = self.train_rows(n, len(train_queries))
        if rows is not None:
            train_queries = np.ascontiguousarray(train_queries[rows])
            train_topk = None if train_topk is None else train_topk[rows]
        knn = self._train_lists(keys, train_queries, m_sq, threads, train_topk)
        weights = np.ones(len(train_queries), np.float32)
        if p["recent_frac"] > 0:
            weights[len(weights) - int(round(p["recent_frac"] * len(weights))):] = p["recent_weight"]
        g = Graph(keys, np.full((n, p["R"]), -1, np.int32), np.zeros(n, np.int32))
        bip = roar.bipartite(knn, weights, n, m_sq, p["idf"])
        roar.project_rows(g, bip, self._sizes(self.lists["n_pivots"]), p["alpha"], threads)
        pa = max(p["alpha"], 1.0)  # the reverse/enhancement prunes always use the RobustPrune rule
        add_reverse_edges(g, pa, p["R"], threads)
        if p["min_cooc"] > 0:  # before the descent links, which then restore a way down where it cut one
            roar.drop_rare_edges(g, bip, p["min_cooc"], threads)
        if p["descent_links"] > 0:
            # From the anchors' lists only (train_lists.anchor_ids: the exact ones where the build lists them itself):
            # an anchored list's order between anchors is approximate, and the anchors alone cost 1/stride (at 32K:
            # 1.0 s -> 0.1 s per head). Lists given exact for every query (decode.device_lists) are read at the same
            # rows: from all of them the descent cost 3.2x the CPU at 32K (bench_decoder_build.py --given-lists).
            seeds = anchor_ids(len(knn), self._stride(len(knn), n), p["keep_queries"])
            roar.link_descent(g, knn if len(seeds) == len(knn) else knn[seeds], p["descent_rank"],
                              p["descent_links"], (pa, p["R"]), threads)
        self.hubs = query_hubs(keys, train_queries, p["n_hubs"], p["seed"])
        if p["enhance_L"] > 0:
            roar.connect_by_search(g, self.hubs, p["enhance_L"], (pa, p["R"], p["M_link"]), threads)
        if group_queries is not None:  # the keys no own list holds: rows from the group's other heads' lists
            knn_g = self._train_lists(keys, group_queries, m_sq, threads, group_topk)
            group = roar.bipartite(knn_g, np.ones(len(knn_g), np.float32), n, m_sq, p["idf"])
            # every rank of another head's list makes an unlisted key a pivot: past the pivot rank it would keep no row
            roar.link_unlisted(g, bip, group, self._sizes(m_sq), p["alpha"], p["group_in"], threads)
        nbrs, degree = g.nbrs, g.degree
        link_stranded(keys, nbrs, degree, self.hubs, p["M_link"], bool(p["coarse_bf16"]), threads)
        link_unreachable(g, self.hubs, p["R"], FAR_POOL)
        if p["cooc_order"]:
            roar.order_rows_by_cooc(g, bip, threads)
        self._hold_keys(keys)
        self.n_built = n  # keys added later (ids ≥ n_built) have their in-edges at the rows' ends: the row stop scans them
        self._hold_graph(nbrs, degree, n)
        keep = min(p["keep_queries"], len(train_queries))
        # copies, not views: a view keeps the caller's whole query array alive (the decoder's stacked training queries
        # of a layer, 133 MB per Gemma 128K layer) as long as the index, while nbytes counts the kept rows
        self._recent_q = np.array(train_queries[len(train_queries) - keep:], np.float32, order="C")
        self._cache_lists(keys, knn[len(knn) - keep:], weights[len(weights) - keep:])

    def train_rows(self, n_keys: int, m: int) -> np.ndarray | None:
        """:func:`subsample`'s rows for ``max_train`` (or :func:`auto_train`) and ``keep_queries``: given only these, a
        build keeps them all."""
        return subsample(m, self.params["max_train"] or auto_train(n_keys), self.params["keep_queries"])

    def _train_lists(self, keys, queries, m_sq: int, threads: int, given: np.ndarray | None) -> np.ndarray:
        """Each training query's top-``m_sq`` keys, best first: ``given`` (precomputed, e.g. on the accelerator during
        the prefill) when it has the columns, else :func:`train_lists.anchored_topk` (exact at the anchors of
        :meth:`_stride`, between them ranked among the neighbouring anchors' keys)."""
        if given is not None:
            if given.shape[1] < m_sq:
                raise IndexConfigError(f"{self._owner()}: train_topk has {given.shape[1]} keys per query; this build needs "
                                       f"M_sq = {m_sq} ({type(self).__name__}.train_topk_width({len(keys)}))")
            return np.ascontiguousarray(given[:, :m_sq], np.int32)
        # The build reads a list's order only below the pivot rank, and below n_cand when that cuts the list.
        ordered = max(self.lists["n_pivots"], self.lists["n_cand"] if self.lists["n_cand"] < m_sq else 0)
        lists, _ = anchored_topk(queries, keys, m_sq, self._stride(len(queries), len(keys)), LIST_SPAN,
                                 self.params["keep_queries"], threads, coarse=bool(self.params["coarse_bf16"]),
                                 ordered=ordered)
        return lists

    def _stride(self, m: int, n: int) -> int:
        """Training queries per anchor (exact list) for ``m`` queries over ``n`` keys: ``list_stride``, else
        :func:`auto_stride`."""
        return self.params["list_stride"] or auto_stride(m, n)

    @classmethod
    def train_topk_width(cls, n_keys: int, **build_params) -> int:
        """How many keys per training query (M_sq) a build over ``n_keys`` keys uses: the width a precomputed
        ``train_topk`` must have at least."""
        return min(cls(**build_params)._list_sizes(n_keys)["M_sq"], n_keys)

    def _list_sizes(self, n: int) -> dict[str, int]:
        """``M_sq``, ``n_pivots`` and ``n_cand`` as given, the ones left at 0 from :func:`auto_lists` (n keys)."""
        p = self.params
        auto_m_sq, auto_pivots = auto_lists(n)
        m_sq = p["M_sq"] or auto_m_sq
        return {"M_sq": m_sq, "n_pivots": p["n_pivots"] or auto_pivots, "n_cand": min(p["n_cand"] or m_sq, m_sq)}

    def _sizes(self, n_pivots: int) -> tuple:
        """(n_pivots, n_sel, n_cand, max_cand, M) of :func:`roar.project_rows`."""
        p = self.params
        return n_pivots, p["n_sel"], self.lists["n_cand"], p["max_cand"], p["M"]

    def _cache_lists(self, keys: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> None:
        """Keep each kept query's top keys ``ids`` with their scores, best first, padded to M_sq (-1 / -inf)
        for the keys to come: ``add`` compares a new key with the last of them."""
        q, K = self._recent_q, self.lists["M_sq"]
        self._q_ids = np.full((len(q), K), -1, np.int32)
        self._q_scores = np.full((len(q), K), -np.inf, np.float32)
        if len(q):
            s = np.empty(ids.shape, np.float32)
            roar.list_scores(q, keys, ids, s)
            order = np.argsort(-s, axis=1, kind="stable")
            self._q_ids[:, : ids.shape[1]] = np.take_along_axis(ids, order, 1)
            self._q_scores[:, : ids.shape[1]] = np.take_along_axis(s, order, 1)
        self._q_w = np.array(weights, np.float32, order="C")  # a copy, as _recent_q

    # -- add ---------------------------------------------------------------------------------------

    def _add(self, keys: np.ndarray) -> None:
        p = self.params
        pa = max(p["alpha"], 1.0)
        n0, t = self.n_keys, len(keys)
        n = n0 + t
        data = self._append_keys(keys)
        self._expose(n)
        g = Graph(data, self._nbrs, self._degree)  # written in place: only the new rows and their neighbours' change
        threads = 1 if t <= ADD_SERIAL else numba.get_num_threads()
        new = np.arange(n0, n, dtype=np.int64)
        if len(self._recent_q):
            changed = roar.merge_topk(self._q_ids, self._q_scores, self._recent_q, data[n0:], n0)
            if changed.any():
                m_sq = min(self.lists["M_sq"], n)
                sel = np.ascontiguousarray(self._q_ids[changed, :m_sq])  # the selecting queries' updated lists
                bip = roar.bipartite(sel, self._q_w[changed], n, m_sq, p["idf"])  # idf as the build, from these lists
                rows = new[bip.ptr[new + 1] > bip.ptr[new]]
                roar.project_rows(g, bip, self._sizes(m_sq), p["alpha"], threads, rows=rows)
                link_back(g, rows, pa, p["R"], threads, keep_order=True)
        # Every new key is also searched for and linked from the keys it finds (out-edges too for those no
        # kept query selected): in-edges from its own neighbourhood reach it from queries unlike the kept
        # ones (decode queries drift).
        # keep_order: a row pruned here keeps the build's co-occurrence order (the search walks rows in order); the
        # new keys' in-edges come last, where the row stop scans them anyway (ids ≥ n_built).
        roar.connect_by_search(g, self.hubs, max(p["enhance_L"], ADD_SEARCH_L), (pa, p["R"], p["M_link"]), threads,
                               targets=new, prune_full=True, keep_order=True)
        link_unreachable(g, self.hubs, p["R"], FAR_POOL)  # a pruned row may have cut a key's only way in

    # -- search ------------------------------------------------------------------------------------

    def entries(self) -> np.ndarray:
        """Entry points of every search: the hubs, then the newest keys (cached per key count: a batch-1
        search should not rebuild them)."""
        cached = self.__dict__.get("_entries")
        if cached is not None and cached[0] == self.n_keys and cached[1] is self.hubs:
            return cached[2]
        r = min(self.params["recent_entries"], self.n_keys)
        recent = np.arange(self.n_keys - r, self.n_keys, dtype=np.int64)
        e = np.array(list(dict.fromkeys([*self.hubs.tolist(), *recent.tolist()])), np.int64)
        self._entries = (self.n_keys, self.hubs, e)
        return e

    def entries_for(self, queries: np.ndarray) -> np.ndarray:
        """Entry nodes (nq, E) int64 of each query's search (every one is counted as scanned)."""
        e = self.entries()
        return np.ascontiguousarray(np.broadcast_to(e, (len(queries), len(e))))

    def graph_arrays(self) -> Graph:
        """(keys, nbrs, degree) as the search kernels take them (:class:`graph.Graph`; kept between searches)."""
        g = self.__dict__.get("_graph")
        if g is None or g.nbrs is not self._nbrs or len(g.data) != self.n_keys:  # an add has replaced them
            g = self._graph = Graph(self._keys, self._nbrs, self._degree)
        return g

    def _search(self, queries: np.ndarray, k: int, L: int, row_misses: int, row_credit: float):
        stop = (row_misses, row_credit, self.n_built)
        if len(queries) == 1:  # batch 1 (decoding): on this thread, with its reused workspace
            ids, scores, scanned, words = search_single(self.graph_arrays(), queries[0], self.entries(), L, k, stop)
        else:
            ids, scores, scanned, words = search_batch(self.graph_arrays(), queries, self.entries_for(queries), L, k,
                                                       numba.get_num_threads(), stop)
        return ids, scores, scanned, bytes_read(self.dim, scanned, words, len(self.entries()))

    @classmethod
    def search_group(cls, indexes, queries, k, hints=None, **params):
        """One kernel call for the query heads of a layer (the decoder's per-step search).

        ``graph.multi.search_graphs`` runs the heads' searches interleaved in one kernel: the same
        nodes and results as :meth:`search` (``graph.search.search_one``), L < k included. ``hints``: key ids
        every head's search also enters at (the decoder's copy hints), after the hubs."""
        p = indexes[0]._search_params_for(params)
        return search_graphs(indexes, queries, k, p["L"], (p["row_misses"], p["row_credit"]), hints)

    # -- persistence -------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return (self._rows.held(self.n_keys).nbytes + self._adjacency.nbytes + self.hubs.nbytes  # spare rows included
                + self._recent_q.nbytes + self._q_ids.nbytes + self._q_scores.nbytes + self._q_w.nbytes)

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys, "nbrs": self._nbrs, "degree": self._degree, "hubs": self.hubs,
                "n_built": np.array([self.n_built], np.int64),
                "recent_q": self._recent_q, "q_ids": self._q_ids, "q_scores": self._q_scores, "q_w": self._q_w,
                "lists": np.array([self.lists[k] for k in LIST_PARAMS], np.int64)}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        p, n = self.params, self.n_keys
        if p["R"] < p["M"]:
            raise IndexConfigError(f"parameter R={p['R']} is smaller than M={p['M']}")
        keys, nbrs, degree = saved_graph(arrays, n, self.dim, p["R"])
        self._hold_graph(nbrs, degree, n)
        self._hold_keys(keys)
        self.hubs = saved_hubs(arrays, n)
        # A save from before the row order has no n_built: its rows are in build order (the default row stop would
        # walk them as if by co-occurrence) and its added keys are not known. No shim: refused.
        if "n_built" not in arrays:
            raise IndexConfigError("it has no array 'n_built' (saved before rows were stored in co-occurrence order, "
                                   "which the row stop walks); build and save the index again")
        self.n_built = int(expect(arrays, "n_built", np.int64, (1,))[0])
        if not 1 <= self.n_built <= n:
            raise IndexConfigError(f"array 'n_built' holds {self.n_built}, not a key count in [1, {n}]")
        self.lists = dict(zip(LIST_PARAMS, expect(arrays, "lists", np.int64, (len(LIST_PARAMS),)).tolist()))
        m_sq = self.lists["M_sq"]
        if not (1 <= m_sq <= self.build_params["M_sq"].high and 1 <= self.lists["n_cand"] <= m_sq
                and 1 <= self.lists["n_pivots"] <= m_sq):
            raise IndexConfigError(f"array 'lists' holds impossible list sizes {self.lists}")
        self._recent_q = expect(arrays, "recent_q", np.float32, (None, self.dim), finite=True)
        m = len(self._recent_q)
        self._q_ids = expect_ids("q_ids", expect(arrays, "q_ids", np.int32, (m, m_sq)), -1, n)
        self._q_scores = expect(arrays, "q_scores", np.float32, (m, m_sq))
        if np.isnan(self._q_scores).any() or np.isposinf(self._q_scores).any():
            raise IndexConfigError("array 'q_scores' holds NaN or +inf")
        self._q_w = expect(arrays, "q_w", np.float32, (m,), finite=True)
