"""The report's figures (PNG bytes, matplotlib/seaborn), each answering one question of the paper.

- recall against keys scanned, Q→K and K→K overlaid per index (Fig. 3a / 6): the gap between them;
- Mahalanobis distance of decode queries and held-out keys, per head (Fig. 3b): how far out queries lie;
- attention mass of a fixed selection against each step's own top-k, step by step (Fig. 2).
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd

from anns_lab.eval import metrics
from anns_lab.eval.heads import load_head

DIRECTIONS = {"q2k": ("Q→K (decode queries)", "-"), "k2k": ("K→K (held-out keys)", "--")}
MARKERS = "osD^vP*XhpH<>d"


def _plots():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    return plt, sns


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def best_within(points: pd.DataFrame, cost: str, y: str, higher_is_better: bool) -> pd.DataFrame:
    """One index's best ``y`` within each ``cost``: its grid points by cost, each kept where the running best improves.

    A grid of one parameter is already ordered by cost; one of several (vattention's nprobe × ε) is not, and
    drawn point after point it zigzags. The last point stays, so the curve reaches the grid's largest cost.
    """
    s = points.dropna(subset=[y]).sort_values(cost, kind="stable")
    best = s[y].cummax() if higher_is_better else s[y].cummin()
    keep = np.array(best.ne(best.shift()), dtype=bool)
    keep[-1:] = True
    return s.assign(**{y: best})[keep]


def _has_topk(curves: pd.DataFrame, name: str) -> bool:
    """Whether an index returns top-k ids at all (a pure sampler, like magicpig, returns none: recall 0 throughout)."""
    return bool((curves.loc[curves["index"] == name, "recall"] > 0).any())


def recall_vs_scanned(curves: pd.DataFrame, k: int, kinds: dict[str, str]) -> bytes:
    """Median recall@k against median fraction scanned; one colour and marker per index, Q→K solid, K→K dashed."""
    plt, sns = _plots()
    from matplotlib.lines import Line2D

    order = [n for n in sorted(curves["index"].unique()) if _has_topk(curves, n)]
    colours = dict(zip(order, sns.color_palette("tab10", len(order))))
    markers = dict(zip(order, MARKERS))
    fig, ax = plt.subplots(figsize=(8.5, 5))
    for name in order:
        exact = kinds.get(name) == "exact"
        for direction, (_, style) in DIRECTIONS.items():
            sub = best_within(curves[(curves["index"] == name) & (curves["direction"] == direction)],
                              "scanned_fraction", "recall", True)
            if sub.empty:
                continue
            # An exact index is one point at (1, 1), where IVF's exhaustive end lies too: draw it large and hollow, on top.
            ax.plot(sub["scanned_fraction"], sub["recall"], ls=style, color=colours[name], marker=markers[name],
                    ms=13 if exact else 5, mfc="none" if exact else colours[name], mew=2 if exact else 1,
                    lw=1.6, zorder=5 if exact else 3, alpha=0.9)
    ax.set_xscale("log")
    ax.axhline(0.95, color="grey", ls=":", lw=1)
    ax.set(xlabel="fraction of keys scanned (median over heads, log scale)",
           ylabel=f"recall@{k} (median over heads;\nbest grid point within each cost)",
           title="Recall against keys scanned: Q→K solid, K→K dashed (paper Fig. 3a / 6)")
    handles = [Line2D([], [], color=colours[n], marker=markers[n], ls="-", mfc="none" if kinds.get(n) == "exact" else
                      colours[n], label=f"{n} ({kinds.get(n, '?')})") for n in order]
    handles += [Line2D([], [], color="black", ls=style, label=label) for label, style in DIRECTIONS.values()]
    handles.append(Line2D([], [], color="grey", ls=":", label="recall 0.95"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    return _png(fig)


def recall_vs_bytes(curves: pd.DataFrame, k: int, kinds: dict[str, str]) -> bytes:
    """Q→K recall@k and attention-output error against bytes of index data read per query, every index.

    Each index's curve is its best grid point within each byte budget (:func:`best_within`); an index with no
    top-k ids (a pure sampler) is only in the error panel, where estimators and top-k indexes meet.
    """
    plt, sns = _plots()
    from matplotlib.ticker import NullFormatter

    c = curves[curves["direction"] == "q2k"]
    order = sorted(c["index"].unique())
    colours = dict(zip(order, sns.color_palette("tab10" if len(order) <= 10 else "tab20", len(order))))
    markers = dict(zip(order, MARKERS))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"wspace": 0.3})
    for ax, y, label in zip(axes, ("recall", "output_rel_error"),
                            (f"recall@{k}", "attention output rel. error (log scale)")):
        for name in order:
            if y == "recall" and not _has_topk(c, name):
                continue
            sub = best_within(c[c["index"] == name], "bytes_read", y, y == "recall")
            exact = kinds.get(name) == "exact"
            ax.plot(sub["bytes_read"], sub[y], color=colours[name], marker=markers[name], ms=13 if exact else 5,
                    mfc="none" if exact else colours[name], mew=2 if exact else 1, zorder=5 if exact else 3,
                    label=f"{name} ({kinds.get(name, '?')})")
        if (c["bytes_read"] > 0).any():
            ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(xlabel="bytes of index data read per query\n(median over heads, log scale)", ylabel=label)
    axes[0].axhline(0.95, color="grey", ls=":", lw=1)
    if (c["output_rel_error"] > 0).any():
        axes[1].set_yscale("log")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.suptitle("Q→K: recall and attention-output error against bytes read per query\n"
                 "(each index: its best grid point within each byte budget, median over heads)", y=1.02)
    return _png(fig)


def mahalanobis_per_head(dump, pairs: list[tuple[int, int]], window: tuple[int, int]) -> pd.DataFrame:
    """Mahalanobis distance to the indexed keys of every decode query and held-out key, per (layer, head)."""
    frames = []
    for layer, head in pairs:
        d = load_head(dump, layer, head, window)
        for kind, pts in (("Q→K: decode queries", d.test_queries), ("K→K: held-out keys", d.k2k_queries)):
            frames.append(pd.DataFrame({"head": f"L{layer} H{head}", "layer": layer, "kind": kind,
                                        "distance": metrics.mahalanobis(pts, d.keys)}))
    return pd.concat(frames, ignore_index=True)


def mahalanobis_figure(df: pd.DataFrame) -> bytes:
    """Box plots of the distances per head, queries beside held-out keys."""
    plt, sns = _plots()
    n = df["head"].nunique()
    fig, ax = plt.subplots(figsize=(max(7.0, 0.45 * n + 2), 4.8))
    sns.boxplot(data=df, x="head", y="distance", hue="kind", ax=ax, fliersize=1.5, linewidth=0.8)
    ax.tick_params(axis="x", rotation=90)
    ax.set(xlabel="layer and query head", ylabel="Mahalanobis distance to the\nindexed keys' distribution",
           title="Decode queries lie outside the keys' distribution (paper Fig. 3b)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, title=None)
    return _png(fig)


def selection_decay(dump, layer: int, head: int, k: int) -> pd.DataFrame:
    """Per decode step: attention mass of that step's own top-k prefill keys, and of the first step's top-k."""
    q = dump.queries(layer, head, "decode")
    pos = dump.positions("decode")
    keys = dump.keys(layer, dump.kv_head_of(head), "all")
    scale = dump.scaling(layer)
    n_prefill = int(dump.manifest["n_tokens"]["prefill"])
    first = None
    rows = []
    for step, p in enumerate(pos):
        logits = (keys[: p + 1] @ q[step]).astype(np.float64) * scale
        top = np.argpartition(logits[:n_prefill], -k)[-k:]
        first = top if first is None else first
        rows.append({"step": step, "dynamic": metrics.mass_recovered(logits, top),
                     "static": metrics.mass_recovered(logits, first)})
    df = pd.DataFrame(rows)
    df["head"] = f"L{layer} H{head}"
    return df


def selection_decay_figure(df: pd.DataFrame, k: int) -> bytes:
    """Mean over heads, step by step, with the middle half of heads as a band (the paper's Fig. 2 question)."""
    plt, sns = _plots()
    long = df.melt(id_vars=["head", "step"], value_vars=["dynamic", "static"], var_name="selection", value_name="mass")
    long["selection"] = long["selection"].map({"dynamic": f"each step's own top-{k}",
                                               "static": f"first step's top-{k}, kept fixed"})
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    sns.lineplot(data=long, x="step", y="mass", hue="selection", estimator="mean", errorbar=("pi", 50), ax=ax)
    ax.set(xlabel="decode step", ylabel="share of the attention mass recovered",
           title=f"A fixed selection decays over decode steps (paper Fig. 2); mean of {df['head'].nunique()} heads, "
                 "band = middle half")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, title=None)
    return _png(fig)
