"""The report's figures (PNG bytes, matplotlib/seaborn), each answering one question of the paper.

- recall against keys scanned, Q→K and K→K overlaid in one panel per index (Fig. 3a / 6): the gap between them;
- recall and attention-output error against bytes read per query, every index on one cost;
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


def _styles(names, kinds: dict[str, str], sns) -> dict[str, dict]:
    """One colour and marker per index, the same in every figure of a report (tab20 has room for 20 names)."""
    order = sorted(names)
    palette = sns.color_palette("tab10" if len(order) <= 10 else "tab20", len(order))
    return {n: {"color": c, "marker": MARKERS[i % len(MARKERS)], "label": _plain(f"{n} ({kinds.get(n, '?')})")}
            for i, (n, c) in enumerate(zip(order, palette))}


def _plain(text: str) -> str:
    """``text`` drawn as written: matplotlib reads a ``$`` as the start of a formula (a build parameter's value in a
    label, ``$\\frac{$``, failed the report with a parse error, ``$a^2$`` was drawn as one)."""
    return text.replace("$", r"\$")


def frontier(points: pd.DataFrame, x: str, y: str, lower_is_better: bool = False) -> pd.DataFrame:
    """The operating points no cheaper point beats: the best ``y`` reached at or below each ``x``.

    Grids with several parameters put points of worse recall at higher cost; the frontier is what a user
    tuning the index would pick, and what "least cost to reach a target" reads off.
    """
    p = points.sort_values([x, y], ascending=[True, lower_is_better])
    best = p[y].cummin() if lower_is_better else p[y].cummax()
    keep = p[y] == best
    keep &= ~best.duplicated()
    return p[keep]


def mixture_line(x, y, per_segment: int = 24) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The line between consecutive points ``(x, y)`` sampled evenly in linear space (``per_segment`` steps a
    segment), and the sampled positions of the points themselves (for ``markevery``): on a log axis the mixture of
    two settings (each query searched at one of them) is this curve, not the straight stroke between their markers,
    which looks better than any mix reaches (by 2.4x in error on magicpig's last segment)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2:
        return x, y, list(range(len(x)))
    t = np.linspace(0.0, 1.0, per_segment, endpoint=False)
    xs = np.concatenate([x[i] + t * (x[i + 1] - x[i]) for i in range(len(x) - 1)] + [x[-1:]])
    ys = np.concatenate([y[i] + t * (y[i + 1] - y[i]) for i in range(len(y) - 1)] + [y[-1:]])
    return xs, ys, list(range(0, len(xs), per_segment))


def recall_vs_scanned(curves: pd.DataFrame, k: int, kinds: dict[str, str], reference: str | None = None) -> bytes:
    """One panel per top-k index: median recall@k against median fraction scanned, Q→K solid and K→K dashed.

    The paper's point is the gap between the two directions for the same index, so each index gets its own
    panel with both; the ``reference`` index's Q→K frontier (the report passes the best attention-aware one) is
    drawn in grey in every other panel for scale.
    Estimators are left out (their recall describes only their exact part: see the bytes figure).
    """
    plt, sns = _plots()
    from matplotlib.lines import Line2D

    styles = _styles(curves["index"].unique(), kinds, sns)
    names = sorted(n for n in curves["index"].unique() if kinds.get(n) not in ("estimator", "exact"))
    q = curves[(curves["direction"] == "q2k") & (curves["index"] == reference)]
    ref_name = reference if len(q) else None
    ref = frontier(q, "scanned_fraction", "recall") if ref_name else None
    cols = min(4, max(1, len(names)))
    rows = -(-max(1, len(names)) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 2.8 * rows + 0.8), sharex=True, sharey=True,
                             squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        st = styles[name]
        if ref is not None and name != ref_name:
            ax.plot(*mixture_line(ref["scanned_fraction"], ref["recall"])[:2], color="0.6", lw=2.5, alpha=0.6, zorder=1)
        for direction, (_, ls) in DIRECTIONS.items():
            sub = curves[(curves["index"] == name) & (curves["direction"] == direction)]
            if sub.empty:
                continue
            ax.plot(sub["scanned_fraction"], sub["recall"], ls="none", marker=st["marker"], ms=3, color=st["color"],
                    alpha=0.35)
            f = frontier(sub, "scanned_fraction", "recall")
            xs, ys, at = mixture_line(f["scanned_fraction"], f["recall"])
            ax.plot(xs, ys, ls=ls, lw=1.8, color=st["color"], marker=st["marker"], ms=4, markevery=at)
        ax.axhline(0.95, color="grey", ls=":", lw=1)
        ax.set_title(st["label"], fontsize=10)
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.02)
    for col in range(cols):
        # The lowest panel in use in each column carries the axis (the last row may be short).
        ax = axes[max(0, len(names) - 1 - col) // cols, col]
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.set_xlabel("fraction of keys scanned")
    for ax in axes[:, 0]:
        ax.set_ylabel(f"recall@{k}")
    handles = [Line2D([], [], color="black", ls=ls, label=label) for label, ls in DIRECTIONS.values()]
    if ref is not None:
        handles.append(Line2D([], [], color="0.6", lw=2.5, alpha=0.6, label=_plain(f"{ref_name} Q→K (reference)")))
    handles.append(Line2D([], [], color="grey", ls=":", label="recall 0.95"))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), frameon=False, bbox_to_anchor=(0.5, 1.0))
    fig.suptitle("Recall against keys scanned, medians over heads; lines: mixes of the grid points no cheaper point "
                 "beats, dots: every grid point (paper Fig. 3a / 6)", y=1.04, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return _png(fig)


def recall_vs_bytes(curves: pd.DataFrame, k: int, kinds: dict[str, str]) -> bytes:
    """Q→K recall@k (top-k indexes) and attention-output error (every index, estimators too) against bytes read."""
    plt, sns = _plots()
    from matplotlib.ticker import NullFormatter

    c = curves[curves["direction"] == "q2k"]
    styles = _styles(curves["index"].unique(), kinds, sns)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"wspace": 0.3})
    panels = ((axes[0], "recall", f"recall@{k} (top-k indexes)", False),
              (axes[1], "output_rel_error", "attention output rel. error (every index)", True))
    for ax, y, label, lower in panels:
        for name in sorted(c["index"].unique()):
            if y == "recall" and kinds.get(name) == "estimator":
                continue
            st, exact = styles[name], kinds.get(name) == "exact"
            f = frontier(c[c["index"] == name], "bytes_read", y, lower_is_better=lower)
            # The attention-aware index is drawn over the key-only ones, whose error curves pile up on the same floor.
            # Lines between the grid points (markers): searching each query at one of two settings reaches every
            # point between them, what the tables read off at a target (metrics.at_recall); a grid that jumps, like
            # retroinfer's last nprobe to every cluster, shows as two markers far apart.
            xs, ys, at = mixture_line(f["bytes_read"], f[y])
            ax.plot(xs, ys, color=st["color"], marker=st["marker"], ms=13 if exact else 5, markevery=at,
                    mfc="none" if exact else st["color"], mew=2 if exact else 1,
                    zorder=5 if exact else 4 if kinds.get(name) == "attention-aware" else 3, lw=1.6, label=st["label"])
            if exact and y == "output_rel_error" and len(f):
                # Every top-k set's error stops at the exact top-k's: the line estimators must get under.
                ax.axhline(float(f[y].min()), color=st["color"], ls=":", lw=1.2, zorder=2,
                           label=_plain(f"exact top-{k} error ({name})"))
        if (c["bytes_read"] > 0).any():
            ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(xlabel="bytes of index data read per query\n(median over heads, log scale)", ylabel=label)
    axes[0].axhline(0.95, color="grey", ls=":", lw=1)
    if (c["output_rel_error"] > 0).any():
        axes[1].set_yscale("log")
    handles, labels = axes[1].get_legend_handles_labels()
    axes[1].legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.suptitle("Q→K: recall and output error against bytes read per query (each line: the mixes of the grid points "
                 "no cheaper point beats)")
    return _png(fig)


def mahalanobis_per_head(dump, pairs: list[tuple[int, int]], window: tuple[int, int]) -> pd.DataFrame:
    """Mahalanobis distance to the indexed keys of every decode query and held-out key, per (layer, head)."""
    frames = []
    for layer, head in pairs:
        d = load_head(dump, layer, head, window, train_positions="own")  # no training queries used: nothing to move
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
