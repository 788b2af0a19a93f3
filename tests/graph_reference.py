"""A plain-Python best-first search with a sorted candidate list: the reference the graph kernels are tested against."""

from __future__ import annotations

import numpy as np


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
        s = dot(data[node], query)
        pos = len(scores)
        while pos > 0 and scores[pos - 1] < s:
            pos -= 1
        if pos < L:
            ids.insert(pos, node), scores.insert(pos, s), done.insert(pos, False)
            del ids[L:], scores[L:], done[L:]

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
