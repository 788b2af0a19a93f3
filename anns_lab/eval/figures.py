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


def grid_medians(table: pd.DataFrame) -> pd.DataFrame:
    """Median recall, scanned fraction, bytes and errors over heads, per index, direction and grid point (build and
    search parameters): what one setting gives, drawn as dots."""
    # Build variants of one index share a sweep folder and search parameters: one median must not mix them.
    return (table.groupby(["index", "build_params", "direction", "search_params"], sort=False)
            .agg(recall=("recall", "median"), scanned_fraction=("scanned_fraction", "median"),
                 bytes_read=("bytes_read", "median"),
                 mass_recovered=("mass_recovered", "median"), output_rel_error=("output_rel_error", "median"),
                 latency_us=("latency_us", "median"))
            .reset_index())


def head_median_line(points: pd.DataFrame, x: str, y: str, lower_is_better: bool = False):
    """The line of one index and direction: the median over heads of the best ``y`` each head reaches within each
    ``x`` (:func:`metrics.median_frontier`), so it meets a recall target at the tables' median cost (for an even
    number of heads, between the two middle heads' costs). Where heads' cheapest settings cost apart, it starts
    steep: heads that cannot run so cheaply reach nothing there. ``points`` hold one build of the index (the
    report labels builds apart first: a head must not take the better of two builds)."""
    if points["build_params"].nunique() > 1:
        raise ValueError("head_median_line: several builds of one index; label them apart (findings.label_builds)")
    sign = -1.0 if lower_is_better else 1.0
    heads = [(sign * g[y].to_numpy(dtype=float), g[x].to_numpy(dtype=float))
             for _, g in points.groupby(["layer", "head"], sort=True)]
    xs, ys = metrics.median_frontier(heads)
    return xs, sign * ys


def recall_vs_scanned(table: pd.DataFrame, k: int, kinds: dict[str, str], reference: str | None = None) -> bytes:
    """One panel per top-k index: recall@k against fraction scanned, Q→K solid and K→K dashed.

    The paper's point is the gap between the two directions for the same index, so each index gets its own
    panel with both; the ``reference`` index's Q→K line (the report passes the best attention-aware one) is
    drawn in grey in every other panel for scale. Lines: :func:`head_median_line`; dots: :func:`grid_medians`.
    Estimators are left out (their recall describes only their exact part: see the bytes figure).
    """
    plt, sns = _plots()
    from matplotlib.lines import Line2D

    dots = grid_medians(table)
    styles = _styles(table["index"].unique(), kinds, sns)
    names = sorted(n for n in table["index"].unique() if kinds.get(n) not in ("estimator", "exact"))
    q = table[(table["direction"] == "q2k") & (table["index"] == reference)]
    ref_name = reference if len(q) else None
    ref = head_median_line(q, "scanned_fraction", "recall") if ref_name else None
    # a log axis with nothing on it fails to draw: every panel shares the x axis, so one needs a measured point
    logx = bool((np.isfinite(table["recall"]) & (table["scanned_fraction"] > 0)).any())
    cols = min(4, max(1, len(names)))
    rows = -(-max(1, len(names)) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 2.8 * rows + 0.8), sharex=True, sharey=True,
                             squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        st = styles[name]
        if ref is not None and name != ref_name:
            ax.plot(*ref, color="0.6", lw=2.5, alpha=0.6, zorder=1)
        for direction, (_, ls) in DIRECTIONS.items():
            sub = table[(table["index"] == name) & (table["direction"] == direction)]
            if sub.empty:
                continue
            d = dots[(dots["index"] == name) & (dots["direction"] == direction)]
            ax.plot(d["scanned_fraction"], d["recall"], ls="none", marker=st["marker"], ms=3, color=st["color"],
                    alpha=0.35)
            xs, ys = head_median_line(sub, "scanned_fraction", "recall")
            ax.plot(xs, ys, ls=ls, lw=1.8, color=st["color"], marker=st["marker"] if len(xs) == 1 else None, ms=4)
        ax.axhline(0.95, color="grey", ls=":", lw=1)
        ax.set_title(st["label"], fontsize=10)
        if logx:
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
    # The title stands above the figure (the saved image grows to hold it; a text, which tight_layout leaves where it
    # is) and the panels leave the legend its half inch: at fixed fractions a one-row figure's legend ran into both.
    fig.text(0.5, 1.0, "Recall against keys scanned (paper Fig. 3a / 6)\nlines: at each cost, the median over heads of "
             "each head's best recall, mixing its grid points (the tables' reading: steep where the heads' cheapest "
             "settings cost apart)\ndots: each grid point's median over heads", ha="center", va="bottom", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    return _png(fig)


def recall_vs_bytes(table: pd.DataFrame, k: int, kinds: dict[str, str]) -> bytes:
    """Q→K recall@k (top-k indexes) and attention-output error (every index, estimators too) against bytes read:
    lines :func:`head_median_line`, dots :func:`grid_medians`."""
    plt, sns = _plots()
    from matplotlib.ticker import NullFormatter

    t = table[table["direction"] == "q2k"]
    c = grid_medians(t)
    styles = _styles(table["index"].unique(), kinds, sns)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"wspace": 0.3})
    panels = ((axes[0], "recall", f"recall@{k} (top-k indexes)", False),
              (axes[1], "output_rel_error", "attention output rel. error (every index)", True))
    for ax, y, label, lower in panels:
        for name in sorted(t["index"].unique()):
            if y == "recall" and kinds.get(name) == "estimator":
                continue
            st, exact = styles[name], kinds.get(name) == "exact"
            d = c[c["index"] == name]
            if exact:  # one setting: its median point, large and hollow
                ax.plot(d["bytes_read"], d[y], ls="none", color=st["color"], marker=st["marker"], ms=13, mfc="none",
                        mew=2, zorder=5, label=st["label"])
                if y == "output_rel_error" and np.isfinite(d[y]).any():  # a --quick sweep measures no error: no line
                    # Every top-k set's error stops at the exact top-k's: the line estimators must get under.
                    ax.axhline(float(d[y].min()), color=st["color"], ls=":", lw=1.2, zorder=2,
                               label=_plain(f"exact top-{k} error ({name})"))
                continue
            # The attention-aware index is drawn over the key-only ones, whose error curves pile up on the same floor.
            # A grid that jumps, like retroinfer's last nprobe to every cluster, shows as dots far apart.
            zorder = 4 if kinds.get(name) == "attention-aware" else 3
            ax.plot(d["bytes_read"], d[y], ls="none", color=st["color"], marker=st["marker"], ms=4, alpha=0.45,
                    zorder=zorder)
            xs, ys = head_median_line(t[t["index"] == name], "bytes_read", y, lower_is_better=lower)
            ax.plot(xs, ys, color=st["color"], marker=st["marker"], ms=5, markevery=[-1] if len(xs) else None,
                    zorder=zorder, lw=1.6, label=st["label"])
        shown = c[np.isfinite(c[y]) & (c["bytes_read"] > 0)]
        if len(shown):
            ax.set_xscale("log")
        else:  # a log axis with nothing on it fails to draw (a --quick sweep measures no output error)
            ax.text(0.5, 0.5, "not measured\n(a --quick sweep measures no attention quality)", transform=ax.transAxes,
                    ha="center", va="center", color="0.4")
            ax.set(xticks=[], yticks=[])  # matplotlib's ±0.04 around an empty axis read as a scale
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(xlabel="bytes of index data read per query" + ("\n(log scale)" if len(shown) else ""), ylabel=label)
    axes[0].axhline(0.95, color="grey", ls=":", lw=1)
    if (c["output_rel_error"] > 0).any():
        axes[1].set_yscale("log")
    top = c["output_rel_error"].replace([np.inf, -np.inf], np.nan).max()
    if np.isfinite(top) and top > 0:
        # A line's first steps (heads whose cheapest settings cost more reach nothing there) may rise past every grid
        # point's median: the panel keeps to the points' range.
        axes[1].set_ylim(top=1.5 * top)
    handles, labels = axes[1].get_legend_handles_labels()
    axes[1].legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.suptitle("Q→K: recall and output error against bytes read per query\nlines: at each cost, the median over "
                 "heads of each head's best, mixing its grid points (the tables' reading; a marker ends each line); "
                 "dots: each grid point's median over heads", fontsize=10)
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
           title="Distance of decode queries and held-out keys to the keys' distribution (paper Fig. 3b)")
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
           title=f"Each step's own selection against a fixed one over decode steps (paper Fig. 2); mean of "
                 f"{df['head'].nunique()} heads, band = middle half")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, title=None)
    return _png(fig)
