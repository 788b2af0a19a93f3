"""A plain-Python best-first search with a sorted candidate list: the reference the graph kernels are tested against."""

from __future__ import annotations

import math

import numpy as np


def insert_sorted(ids: list, scores: list, done: list, node: int, s: float, L: int) -> bool:
    """Put ``node`` (score ``s``) into the best-first list of at most L (ties after the earlier node, not expanded);
    whether it entered."""
    pos = len(scores)
    while pos > 0 and scores[pos - 1] < s:
        pos -= 1
    if pos >= L:
        return False
    ids.insert(pos, node), scores.insert(pos, s), done.insert(pos, False)
    del ids[L:], scores[L:], done[L:]
    return True


def sorted_list_search(data, nbrs, degree, query, entries, L, dot):
    """Keep the L best nodes scanned in a sorted list, expand the best unexpanded one until all are expanded.

    Returns (ids, scores) of the list (best first), n_scanned and the expanded nodes in order. ``dot`` scores
    a key row against the query (the kernel's own, to compare bits). Ties keep the earlier node first.
    """
    ids, scores, done = [], [], []
    seen = set()
    n_scanned = 0
    expanded = []

    def insert(node):
        nonlocal n_scanned
        seen.add(node)
        n_scanned += 1
        insert_sorted(ids, scores, done, node, dot(data[node], query), L)

    for e in entries:
        if e >= 0 and e not in seen:
            insert(int(e))
    while not all(done):
        cur = done.index(False)
        done[cur] = True
        node = ids[cur]
        expanded.append(node)
        for nb in nbrs[node, : degree[node]]:
            if int(nb) not in seen:
                insert(int(nb))
    return np.array(ids, np.int64), np.array(scores, np.float32), n_scanned, np.array(expanded, np.int64)


def row_stop_search(data, nbrs, degree, query, entries, L, stop, dot):
    """:func:`sorted_list_search` with the row stop (C, ρ, A) of ``graph.search``: an expansion walks its row in stages.

    A stage starts where the last one ended, with need = ⌈C + ρ·hits − misses⌉ (none when need ≤ 0: the row ends
    there); it takes the unscanned neighbours in order, marking them, until they and the misses met on the way
    number ``need``: a neighbour scanned before is a hit when its score is at least the worst of a full list
    (any score while the list holds fewer than L), a miss otherwise; a neighbour marked earlier in the same stage
    is a hit. Then its nodes are scored and inserted in order: a hit when it enters the list, a miss otherwise.
    Where a walk stops before the row's end and A < n, the rest is read and its unscanned keys with ids ≥ A are
    scored and inserted.
    Returns (ids, scores) of the list (best first), the nodes scanned (in order), n_words (1 + row positions read
    per expansion) and the expanded nodes in order.
    """
    c, rho, added = stop
    ids, scores, done = [], [], []
    score_of: dict[int, float] = {}
    expanded = []
    n_words = 0

    def insert(node) -> bool:
        s = score_of[node] = dot(data[node], query)
        return insert_sorted(ids, scores, done, node, s, L)

    for e in entries:
        if e >= 0 and int(e) not in score_of:
            insert(int(e))
    while not all(done):
        cur = done.index(False)
        done[cur] = True
        node = ids[cur]
        expanded.append(node)
        row = [int(v) for v in nbrs[node, : degree[node]]]
        pos = hits = misses = 0
        n_words += 1
        while pos < len(row):
            need = math.ceil(c + rho * hits - misses) if c > 0 else len(row) + 1
            if need <= 0:
                break
            worst = scores[-1] if len(scores) == L else -math.inf
            stage, marked, met = [], set(), 0
            while pos < len(row) and len(stage) + met < need:
                v = row[pos]
                pos += 1
                n_words += 1
                if v < 0:
                    continue
                if v in marked:
                    hits += 1
                elif v in score_of:
                    if score_of[v] >= worst:
                        hits += 1
                    else:
                        misses += 1
                        met += 1
                else:
                    marked.add(v)
                    stage.append(v)
            for v in stage:
                if insert(v):
                    hits += 1
                else:
                    misses += 1
        if pos < len(row) and added < len(data):  # stopped: the added keys of the rest (none: nothing more read)
            n_words += len(row) - pos
            for v in row[pos:]:
                if v >= added and v not in score_of:
                    insert(v)
    return (np.array(ids, np.int64), np.array(scores, np.float32), np.array(list(score_of), np.int64), n_words,
            np.array(expanded, np.int64))
