"""Accuracy with a 95% interval, and the paired difference of two modes scored on the same samples.

Per-sample scores lie in [0, 1] (1/0 for passkey-style tasks, the fraction of values found for
multi-value ones). Accuracy's interval is Wilson's score interval with the summed scores as
successes. The difference to ``full`` uses Newcombe's hybrid score interval for paired proportions
(Newcombe 1998, Statistics in Medicine 17:873, method 10; no continuity correction), which
combines the two Wilson intervals with the correlation of the paired outcomes; a fractional score
enters the 2x2 table as its expected counts. Both give non-degenerate intervals with few samples,
where a bootstrap would collapse to a point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion (as fractions)."""
    if n <= 0:
        return (math.nan, math.nan)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_difference(a: Sequence[float], b: Sequence[float], z: float = Z95) -> tuple[float, float, float]:
    """Mean of ``a - b`` over paired samples and its interval (Newcombe method 10), as fractions."""
    if len(a) != len(b) or not a:
        raise ValueError("paired scores need the same, non-zero number of samples")
    n = len(a)
    both = sum(x * y for x, y in zip(a, b))
    only_a = sum(x * (1 - y) for x, y in zip(a, b))
    only_b = sum((1 - x) * y for x, y in zip(a, b))
    neither = n - both - only_a - only_b
    p1, p2 = (both + only_a) / n, (both + only_b) / n
    l1, u1 = wilson(both + only_a, n, z)
    l2, u2 = wilson(both + only_b, n, z)
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    phi = (both * neither - only_a * only_b) / math.sqrt(margins) if margins > 0 else 0.0
    d = p1 - p2
    lower = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    upper = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return d, max(-1.0, d - lower), min(1.0, d + upper)
