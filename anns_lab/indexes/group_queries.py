"""Training queries of one graph per KV head: the prefill queries of every query head of its GQA group.

The query heads of a GQA group read the same keys, so one attention-aware graph can serve them all if
it is trained on all their queries (``"group"``), or on as many as one head has, taken round robin over
the heads by position (``"strided"``: position p from head p mod g, counted back from the newest).
``"unlisted"`` is one graph per query head on its own queries, given the other heads' newest queries
(:func:`other_heads`) for the keys its own lists leave out (roargraph's ``group_queries``: those keys' rows only).
``"head"`` is one graph per query head on its own queries: the default, since one graph for a group scanned
13-14% more keys at recall 0.95 on SmolLM2 (3 heads per group) and 32-50% more on Gemma-3 (4) than the heads' own
graphs (median over heads), whatever its degree or co-occurrence rules (BENCHMARKS.md "Query-aware graphs"): the
keys one head's decode queries want are not what the others' lists link.

The index sees only an (m, d) array, and what it assumes of the row order is kept: the newest ``tail``
rows are the latest positions, interleaved by position (the exact tail of :func:`train_lists.anchor_ids`,
the kept queries of ``add``, ``recent_frac``); the rows before them are per head in position order
(head-major), so neighbouring rows are one head's neighbouring queries, as the anchored lists'
re-rank between anchors assumes. That holds while roargraph's ``keep_queries`` and ``recent_frac`` × m stay within
``tail`` (the defaults: 256 and 0): rows past it are the last head's older queries, not the group's newest.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from anns_lab.errors import AnnsLabError

MODES = ("head", "group", "strided", "unlisted")
DEFAULT = "head"
PER_HEAD = ("head", "unlisted")  # modes that build one graph per query head
OTHERS_RECENT = 0.03  # other_heads: newest fraction of each other head's queries (BENCHMARKS "Query-aware graphs")


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`MODES`, else one clear error."""
    if mode not in MODES:
        raise AnnsLabError(f"training queries {mode!r}: choose one of {', '.join(MODES)}")
    return mode


def group_queries(per_head: Sequence[np.ndarray], mode: str, tail: int = 256) -> np.ndarray:
    """The training queries (m, d) of one graph from its group's heads' queries ``per_head`` (each (T, d), the
    same positions 0..T-1): ``group`` all g·T, ``strided`` T (position p from head (T-1-p) mod g), ``head`` the
    first head's own (so does ``unlisted``). The newest ``tail`` rows are interleaved by position, the rest head-major."""
    check_mode(mode)
    T = len(per_head[0])
    if mode == "unlisted":
        return per_head[0]
    if any(q.shape != per_head[0].shape for q in per_head):
        raise AnnsLabError(f"the group's heads hold different query shapes: {[q.shape for q in per_head]}")
    if mode == "head" or len(per_head) == 1:
        return per_head[0]
    g = len(per_head)
    pos = np.repeat(np.arange(T), g)
    head = np.tile(np.arange(g), T)
    if mode == "strided":
        keep = head == (T - 1 - pos) % g
        pos, head = pos[keep], head[keep]
    # pos-major now (by position, then head); the older rows go head-major, the newest `tail` stay as they are
    old = len(pos) - min(tail, len(pos))
    order = np.r_[np.lexsort((pos[:old], head[:old])), np.arange(old, len(pos))]
    stacked = np.stack(per_head)  # (g, T, d)
    return np.ascontiguousarray(stacked[head[order], pos[order]])


def other_heads(per_head: Sequence[np.ndarray], own: int, recent: float = OTHERS_RECENT) -> np.ndarray | None:
    """Rows of the heads of ``per_head`` but ``own`` (each (T, ·), rows by position): each one's newest
    ⌈``recent``·T⌉, head-major; None for a group of one (MHA: the head's own build). Queries or their top lists
    alike (``unlisted``: roargraph's ``group_queries`` and ``group_topk``). The newest prefill queries look most like
    the decode queries, and cost least to list (all of them: +45% of a SmolLM2 build, for no fewer keys scanned)."""
    T = len(per_head[own])
    take = min(T, max(1, int(np.ceil(recent * T))))
    rows = [r[T - take:] for i, r in enumerate(per_head) if i != own]
    return np.ascontiguousarray(np.concatenate(rows)) if rows else None
