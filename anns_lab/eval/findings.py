"""The report's findings: one sentence per rule, each computed from the sweep's numbers and the paper's.

Every rule returns a :class:`Finding` whose verdict is "agrees", "disagrees" or "not measured"
and whose sentence carries both numbers (ours and the paper's). Nothing here is a template
filled in regardless of the data: a sweep without the indexes a rule needs says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pandas as pd

from anns_lab.eval import markdown, paper
from anns_lab.io import loads_json

AGREES, DISAGREES, NOT_MEASURED = "agrees", "disagrees", "not measured"
TARGET = 0.95  # the paper's recall@100 target


@dataclass(frozen=True)
class Finding:
    """One finding: a short topic, the verdict against the paper, and the sentence with the numbers."""

    topic: str
    verdict: str
    text: str

    def markdown(self) -> str:
        """One list item: topic, verdict in bold, sentence (index labels in them carry build-parameter values: as
        written, :func:`markdown.cell`)."""
        return f"- **{markdown.cell(self.topic)}: {self.verdict}.** {markdown.cell(self.text)}"


def fmt_fraction(v: float) -> str:
    """A scanned fraction as a percentage, or "not reached" for inf/NaN."""
    return "not reached" if not np.isfinite(v) else f"{100 * v:.1f}%"


def label_builds(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with each build of an index that has several in it (``sweep --build-param`` adds one to a folder) under
    a name of its own: the index's name and the build parameters in which its builds differ, e.g. ``roargraph (M=16)``;
    the build of the index's declared defaults keeps the plain name. Every median is then over the heads of one build:
    grouped by the plain name, each head would take the best of the builds, a per-head choice no one build makes."""
    from anns_lab.indexes import registry

    installed = registry.available()
    names = table["index"].copy()
    for name, g in table.groupby("index"):
        builds = g["build_params"].unique()
        if len(builds) < 2:
            continue
        parsed = {b: loads_json(b) for b in builds}
        differ = sorted({k for b in parsed.values() for k in b if len({json.dumps(p.get(k)) for p in parsed.values()}) > 1})
        defaults = json.dumps(registry.create(name).params, sort_keys=True) if name in installed else None
        for b, params in parsed.items():
            if b != defaults:
                names[(table["index"] == name) & (table["build_params"] == b)] = \
                    f"{name} ({', '.join(f'{k}={params.get(k)}' for k in differ)})"
    return table.assign(index=names)


def base_index(label: str) -> str:
    """The registered index name of a :func:`label_builds` label."""
    return label.split(" (", 1)[0]


def index_kinds(table: pd.DataFrame) -> dict[str, str]:
    """Each index of the table as "exact", "estimator", "attention-aware", "key-only" or "unknown" (not installed).

    Exact: every row scans all keys with recall 1 (flat). Estimator: its class estimates the softmax
    beyond its ids (``estimates``; recall describes only its exact part). Attention-aware: its class
    builds with the prefill queries (``uses_train_queries``). Key-only: any other registered index.
    """
    from anns_lab.indexes import registry

    classes = registry.available()
    kinds = {}
    for name, g in table.groupby("index"):
        if (g["scanned_fraction"] >= 0.999).all() and (g["recall"] >= 0.999).all():
            kinds[name] = "exact"
        elif base_index(name) in classes:
            cls = classes[base_index(name)]
            kinds[name] = "estimator" if cls.estimates else "attention-aware" if cls.uses_train_queries else "key-only"
        else:
            kinds[name] = "unknown"
    return kinds


@dataclass(frozen=True)
class Scan:
    """The Pareto summary of one index in one direction at the target recall."""

    index: str
    fraction: float  # median over heads; inf when most heads never reach the target
    reached: int
    heads: int
    best_recall: float  # median over heads of the best recall on the grid
    first: int = 0  # heads that reach the target at their grid's cheapest point

    @property
    def bound(self) -> bool:
        """The median is an upper bound: at least half of the heads reach the target at their grid's cheapest point,
        below which the grid cannot read (the Pareto table's "≤")."""
        return bool(np.isfinite(self.fraction)) and 2 * self.first >= self.heads > 0

    @property
    def text(self) -> str:
        if self.bound:
            return (f"at most {fmt_fraction(self.fraction)} of the keys ({self.reached}/{self.heads} heads reach it, "
                    f"{self.first} already at their grid's cheapest point)")
        if np.isfinite(self.fraction):
            return f"{fmt_fraction(self.fraction)} of the keys ({self.reached}/{self.heads} heads reach it)"
        return (f"more than all the keys on {_most(self.heads - self.reached, self.heads)} ({self.heads - self.reached} "
                f"of {self.heads} heads never reach it; median best recall {self.best_recall:.2f})")


def _most(count: int, heads: int) -> str:
    """``count`` of ``heads`` in words, where it is at least half (the median is then unreached)."""
    return "half the heads" if 2 * count == heads else "most heads"


def scan(par: pd.DataFrame, index: str, direction: str) -> Scan | None:
    """The :class:`Scan` of ``index`` in ``direction`` from :func:`report.pareto`'s table, or None if absent."""
    row = par[(par["index"] == index) & (par["direction"] == direction)]
    if row.empty:
        return None
    r = row.iloc[0]
    return Scan(index, float(r[f"scan@{TARGET:.2f}"]), int(r[f"reached@{TARGET:.2f}"]), int(r["heads"]),
                float(r["best_recall"]), int(r.get(f"first@{TARGET:.2f}", 0)))


def _best(par: pd.DataFrame, names: list[str], direction: str = "q2k") -> Scan | None:
    scans = [s for s in (scan(par, n, direction) for n in names) if s is not None]
    if not scans:
        return None
    return min(scans, key=lambda s: (s.fraction, -s.best_recall))


def _of_kind(kinds: dict[str, str], kind: str) -> list[str]:
    return sorted(n for n, k in kinds.items() if k == kind)


def _places(s: Scan, span: paper.Span) -> set[str]:
    """Where ``s``'s fraction may lie against ``span``: one place, or where it is a bound (:attr:`Scan.bound`,
    the true median at most the printed one) every place at or below it."""
    place = span.place(s.fraction)
    return set(PLACES[: PLACES.index(place) + 1]) if s.bound else {place}


PLACES = ("below", "within", "above")


def _words(places: set[str]) -> str:
    """:func:`_places`' answer in words: "below", "below or within", ..."""
    return " or ".join(p for p in PLACES if p in places)


def _where(places: set[str]) -> str:
    """", below the paper's range" and the like for :func:`_places`' answer; "" for within alone."""
    return "" if places == {"within"} else f", {_words(places)} the paper's range"


def attention_aware_q2k(par: pd.DataFrame, kinds: dict[str, str], n_keys: int) -> Finding:
    """The best attention-aware index on Q→K against the paper's 1–3%."""
    topic = "Attention-aware index on Q→K (Fig. 6)"
    best = _best(par, _of_kind(kinds, "attention-aware"))
    ref = paper.Q2K_ATTENTION_AWARE
    if best is None:
        return Finding(topic, NOT_MEASURED, "No index built with the prefill queries (such as roargraph) is in this "
                       f"sweep, so the paper's {ref} for one is not compared with anything here.")
    places = _places(best, ref)
    verdict = DISAGREES if places == {"above"} else NOT_MEASURED if "above" in places else AGREES
    where = _where(places) + (" (fewer keys still)" if places == {"below"} else "")
    text = (f"{best.index} reaches recall {TARGET} on Q→K with {best.text}, median over heads; the paper reports "
            f"{ref} ({ref.source}){where}.")
    if verdict == NOT_MEASURED:
        text += " A median at the grid's cheapest point is a bound: a grid starting lower would place it."
    if verdict == DISAGREES:
        text += (f" This sweep indexes {n_keys:,} keys per head against the paper's ~128K; the keys a query needs do "
                 "not shrink with the context, so a shorter one needs a larger fraction.")
    return Finding(topic, verdict, text)


def ivf_q2k(par: pd.DataFrame) -> Finding:
    """IVF on Q→K against the paper's 30–50%."""
    topic = "IVF on Q→K (Fig. 3a)"
    ref = paper.Q2K_IVF
    s = scan(par, "ivf", "q2k")
    if s is None:
        return Finding(topic, NOT_MEASURED, f"IVF is not in this sweep; the paper's IVF needs {ref} on Q→K.")
    places = _places(s, ref)
    verdict = AGREES if places == {"within"} else NOT_MEASURED if "within" in places else DISAGREES
    return Finding(topic, verdict, f"IVF reaches recall {TARGET} on Q→K with {s.text}; the paper reports {ref} "
                   f"({ref.source}){_where(places)}."
                   + (" A median at the grid's cheapest point is a bound: a grid starting lower would place it."
                      if verdict == NOT_MEASURED else ""))


# The paper's gaps are 6–50× between Q→K and K→K (IVF 30–50% against 1–5%) and 10–50× between the attention-aware
# index and IVF (1–3% against 30–50%); a ratio under 1.5 is within what separates one head from another, so no
# finding calls it a gap in either direction (nor the queries' distance against the keys', Fig. 3b, nor a fixed
# selection's loss against the paper's, Fig. 2).
GAP = 1.5


def _gap(ratio: float) -> int:
    """+1 where ``ratio`` is a gap of at least GAP, -1 one the other way, 0 within it; 1.5 itself (0.3 / 0.2 is
    1.4999... in binary) reads as the gap it is printed as."""
    if ratio >= GAP * (1 - 1e-9):
        return 1
    return -1 if ratio <= (1 + 1e-9) / GAP else 0


def _ratio(num: Scan, den: Scan) -> float:
    """``num``'s fraction over ``den``'s; inf or 0 where one of them never reaches the target, 1 where neither does."""
    if np.isfinite(num.fraction) and np.isfinite(den.fraction) and min(num.fraction, den.fraction) > 0:
        return num.fraction / den.fraction
    return 1.0 if num.fraction == den.fraction else np.inf if num.fraction > den.fraction else 0.0


def _bounded(num: Scan, den: Scan) -> str:
    """How :func:`_ratio` reads where a median is a bound (:attr:`Scan.bound`): "" exact, "at most " (the
    numerator's bound: the true ratio may be lower), "at least " (the denominator's) or "unknown" (both)."""
    if num.bound and den.bound:
        return "unknown"
    return "at most " if num.bound else "at least " if den.bound else ""


def _gap_verdict(ratio: float, bounded: str) -> tuple[str, str]:
    """The verdict of a gap finding (the paper's gap: ``ratio`` ≥ GAP) and, where a bound leaves it open, the
    sentence that says so (else "")."""
    agrees = _gap(ratio) > 0
    if bounded == "unknown" or (bounded == "at most " and agrees) or (bounded == "at least " and not agrees):
        return NOT_MEASURED, (" A median at the grids' cheapest point is a bound, not a measurement, so the gap is "
                              "not read here: a grid starting lower would read it.")
    return (AGREES if agrees else DISAGREES), ""


def direction_gap(par: pd.DataFrame, index: str, reason: str = "") -> Finding | None:
    """Q→K against K→K for one key-only index: the paper finds Q→K the far harder search.

    ``reason``: measured sentences on why (for IVF, :func:`ivf_reason`), appended to the finding.
    """
    q, k = scan(par, index, "q2k"), scan(par, index, "k2k")
    if q is None or k is None:
        return None
    topic = f"{index}: Q→K against K→K (Fig. 3a)"
    ref = f"IVF {paper.Q2K_IVF} against {paper.K2K_IVF}"
    if not np.isfinite(q.fraction) and not np.isfinite(k.fraction):
        return Finding(topic, NOT_MEASURED, f"{index} reaches recall {TARGET} in neither direction on "
                       f"{_most(max(q.heads - q.reached, k.heads - k.reached), q.heads)} "
                       f"(median best recall {q.best_recall:.2f} on Q→K, {k.best_recall:.2f} on K→K), so the gap the "
                       f"paper reports ({ref}) cannot be read here.")
    ratio, bounded = _ratio(q, k), _bounded(q, k)
    verdict, open_ = _gap_verdict(ratio, bounded)
    digits = 2 if _gap(ratio) == 0 else 1  # within the margin to the hundredth: 1.47x is not printed as the 1.5x gap
    # a bound on Q→K bounds the ratio from above, on K→K its inverse (K→K's lead) from above
    size = max(ratio, 1 / ratio) if 0 < ratio < np.inf else 0.0
    word = "" if bounded == "unknown" else bounded if ratio >= 1 else {"at most ": "at least ", "at least ": "at most "}.get(bounded, "")
    how = f" ({word}{size:.{digits}f}× the keys)" if size else ""
    if verdict == NOT_MEASURED:
        which = "both medians are bounds" if bounded == "unknown" else f"Q→K needs {bounded}{ratio:.2f}× K→K's keys"
    elif _gap(ratio) > 0:
        which = f"Q→K is the harder search{how}, as in the paper"
    elif _gap(ratio) < 0:
        which = f"K→K is the harder search{how}, the reverse of the paper"
    elif bounded:  # a bound below the gap: the reverse is not ruled out, only the paper's gap
        which = f"Q→K needs {bounded}{ratio:.2f}× K→K's keys, so the paper's gap does not show here"
    else:
        which = (f"the two directions need about as many keys{how.replace(' the keys', '')}, so the paper's gap does "
                 "not show here")
    text = f"{index} needs {q.text} on Q→K and {k.text} on K→K: {which} ({ref}).{open_}"
    if index == "ivf" and np.isfinite(k.fraction):
        text += f" Its K→K figure is {_words(_places(k, paper.K2K_IVF))} the paper's {paper.K2K_IVF}."
    return Finding(topic, verdict, text + (" " + reason if reason else ""))


def ivf_reason(diag: pd.DataFrame, q_grid: float, k_grid: float) -> str:
    """Why IVF's two directions compare as they do, from :func:`anns_lab.eval.ivf_gap.diagnose` rows (one per head).

    ``q_grid`` / ``k_grid``: the sweep's own fractions (read between the two points of its nprobe grid around 0.95).
    """
    m = diag.median(numeric_only=True)
    pct = lambda v: fmt_fraction(float(v))  # noqa: E731
    parts = [f"Why, measured on {len(diag)} of the heads with IVF's recall at every nprobe (the sweep doubles nprobe, "
             f"so its fractions {pct(q_grid)} and {pct(k_grid)} lie on lines between grid points a doubling apart): "
             f"Q→K needs {pct(m['q2k'])} and K→K {pct(m['k2k'])} (medians)."]
    parts.append(f"The exact top-{int(diag['k'].iloc[0])} of a decode query lies in {m['q2k_lists']:.0f} of the "
                 f"{int(m['nlist'])} lists, that of a held-out key in {m['k2k_lists']:.0f}: the list count a search must "
                 "probe follows how scattered the answers are.")
    parts.append(f"A held-out key's inner-product top-{int(diag['k'].iloc[0])} is not its neighbourhood: "
                 f"{100 * m['k2k_top_big_norm']:.0f}% of it lies among the 10% largest-norm keys (Q→K: "
                 f"{100 * m['q2k_top_big_norm']:.0f}%), spread over many lists; by L2 distance, the in-distribution "
                 f"search ANN benchmarks measure, K→K needs {pct(m['k2k_l2'])}.")
    parts.append(f"The paper asks for the top 100 of ~128K keys; the same share here is the top {int(m['k_share'])} "
                 f"of {int(m['n_keys']):,}, for which K→K needs {pct(m['k2k_share'])} and Q→K {pct(m['q2k_share'])}: "
                 "at this context length a top-100 covers a far larger part of the keys than in the paper.")
    return " ".join(parts)


def hnsw_q2k(par: pd.DataFrame) -> Finding | None:
    """HNSW on Q→K: the paper's curve never reaches 0.95."""
    s = scan(par, "hnsw", "q2k")
    if s is None:
        return None
    topic = "HNSW on Q→K (Fig. 3a)"
    if np.isfinite(s.fraction):
        return Finding(topic, DISAGREES, f"HNSW reaches recall {TARGET} on Q→K with {s.text}; in the paper its Q→K "
                       f"curve never reaches {TARGET}.")
    return Finding(topic, AGREES, f"HNSW does not reach recall {TARGET} on Q→K on {_most(s.heads - s.reached, s.heads)}: "
                   f"{s.reached} of {s.heads} heads reach it within the grid, median best recall {s.best_recall:.2f}; "
                   f"in the paper its Q→K curve never reaches {TARGET}.")


def aware_vs_key_only(par: pd.DataFrame, kinds: dict[str, str]) -> Finding:
    """The paper's central result: an index built with the queries needs far fewer keys on Q→K than key-only ones."""
    topic = "Attention-aware against key-only indexes on Q→K (the central result)"
    ref = f"{paper.Q2K_ATTENTION_AWARE} against IVF's {paper.Q2K_IVF}"
    aware = _best(par, _of_kind(kinds, "attention-aware"))
    key_only = _best(par, _of_kind(kinds, "key-only"))
    if aware is None or key_only is None:
        missing = "attention-aware index (such as roargraph)" if aware is None else "index built from keys alone"
        return Finding(topic, NOT_MEASURED, f"This sweep has no {missing}, so the paper's comparison ({ref}) is not "
                       "measured.")
    if not (np.isfinite(aware.fraction) or np.isfinite(key_only.fraction)):
        return Finding(topic, NOT_MEASURED, f"Neither the best attention-aware index, {aware.index} ({aware.text}), nor "
                       f"the best key-only one, {key_only.index} ({key_only.text}), reaches recall {TARGET} on Q→K on "
                       f"most heads within this sweep's search grid, so the paper's comparison ({ref}) is not measured "
                       "here.")
    ratio, bounded = _ratio(key_only, aware), _bounded(key_only, aware)
    verdict, open_ = _gap_verdict(ratio, bounded)
    gap = ""
    if verdict == NOT_MEASURED:
        gap = (" (both medians are bounds)" if bounded == "unknown"
               else f" ({bounded}{ratio:.2f}× the attention-aware index's keys)")
    elif _gap(ratio) == 0 and bounded:  # a bound below the gap: the reverse is not ruled out, only the paper's gap
        gap = f" ({bounded}{ratio:.2f}× the attention-aware index's keys, so the paper's gap does not show here)"
    elif _gap(ratio) == 0:  # the margin of the directions' finding: 1.01x fewer keys is no sign of the paper's 10-50x
        gap = f" (about as many keys: {max(ratio, 1 / ratio):.2f}×, so the paper's gap does not show here)"
    elif _gap(ratio) > 0 and ratio < np.inf:
        gap = f" ({bounded}{ratio:.1f}× fewer keys)"
    others = _of_kind(kinds, "key-only")
    which = (f"the best of the key-only indexes ({', '.join(others)}), {key_only.index}," if len(others) > 1
             else f"the key-only index, {key_only.index},")  # before: "(ivf), ivf" where it was the only one
    text = (f"The best attention-aware index, {aware.index}, reaches recall {TARGET} on Q→K with {aware.text}; {which} "
            f"needs {key_only.text}{gap}. The paper: {ref}.{open_}")
    return Finding(topic, verdict, text)


def out_of_distribution(q_median: float, k_median: float, queries: str = "Decode queries") -> Finding:
    """Mahalanobis distance of decode queries against held-out keys (Fig. 3b): queries lie far out. ``queries``
    names them ("Test queries" where held-out prefill queries make them up)."""
    topic = "Queries are out of distribution (Fig. 3b)"
    if not (np.isfinite(q_median) and np.isfinite(k_median)):
        return Finding(topic, NOT_MEASURED, "No Mahalanobis distances could be computed.")
    if k_median <= 0:
        return Finding(topic, NOT_MEASURED, "Held-out keys lie at distance 0 from the keys' distribution: no ratio.")
    ratio = q_median / k_median
    text = (f"{queries} lie at a median Mahalanobis distance of {q_median:.1f} from the indexed keys' "
            f"distribution, held-out keys at {k_median:.1f} ({ratio:.{2 if _gap(ratio) == 0 else 1}f}×"
            + (", within the findings' 1.5× margin: about as far" if _gap(ratio) == 0 else "")
            + "); the paper finds queries far outside the keys' distribution.")
    return Finding(topic, AGREES if _gap(ratio) > 0 else DISAGREES, text)


def dynamic_vs_static(dynamic: float, static: float, steps: int, k: int) -> Finding:
    """Attention mass of each step's own top-k against the first step's kept fixed (Fig. 2). Each step's own top-k
    holds at least the fixed one's mass by construction, so what is judged is how much of it a fixed selection
    loses: agrees where that share is at least the paper's (1 - 0.71 / 0.89) within the findings' 1.5× margin."""
    topic = "Dynamic against static selection (Fig. 2)"
    if steps < 2 or not (np.isfinite(dynamic) and np.isfinite(static)):
        return Finding(topic, NOT_MEASURED, f"The dump has {steps} decode step(s); a fixed selection needs at least "
                       "two to decay.")
    if dynamic <= 0:
        return Finding(topic, NOT_MEASURED, f"Each step's own top-{k} holds no attention mass, so no loss can be read.")
    lost, paper_lost = 1 - static / dynamic, 1 - paper.STATIC_MASS / paper.DYNAMIC_MASS
    agrees = lost * GAP >= paper_lost * (1 - 1e-9)
    text = (f"Each decode step's own top-{k} keeps {dynamic:.2f} of the attention mass on average, the first step's "
            f"top-{k} kept for all {steps} steps {static:.2f}: the fixed selection loses {100 * lost:.0f}% of the mass "
            f"each step's own holds (which never holds less, by construction); in the paper it loses "
            f"{100 * paper_lost:.0f}% ({paper.DYNAMIC_MASS:.2f} against {paper.STATIC_MASS:.2f}; {paper.FIG2_SETTING})"
            + ("" if agrees else ", more than the findings' 1.5× margin above ours: the decay the paper shows is "
               "small here") + ".")
    return Finding(topic, AGREES if agrees else DISAGREES, text)


def from_sweep(par: pd.DataFrame, kinds: dict[str, str], n_keys: int, reasons: dict[str, str] | None = None
               ) -> list[Finding]:
    """The findings that the results table decides, central result first; ``reasons`` per index for the gap."""
    out = [aware_vs_key_only(par, kinds), attention_aware_q2k(par, kinds, n_keys), ivf_q2k(par)]
    out += [f for f in (hnsw_q2k(par),) if f is not None]
    out += [f for f in (direction_gap(par, n, (reasons or {}).get(n, "")) for n in _of_kind(kinds, "key-only"))
            if f is not None]
    return out
