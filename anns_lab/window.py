"""The static window: the first ``sink`` and the most recent ``recent`` tokens, attended exactly on the accelerator.

Every position outside it is the retrieval's (the decoder's CPU store, the evaluation's index).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from anns_lab.errors import AnnsLabError


class WindowError(AnnsLabError):
    """A window that is not two non-negative token counts."""


class Window(namedtuple("Window", "sink recent")):
    """``(sink, recent)`` token counts, validated once here; a tuple, so ``sink, recent = window`` and JSON work."""

    __slots__ = ()

    def __new__(cls, sink: int = 128, recent: int = 512) -> "Window":
        for v in (sink, recent):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise WindowError(f"window {sink},{recent}: SINK,RECENT must be non-negative token counts")
        return super().__new__(cls, int(sink), int(recent))

    @classmethod
    def parse(cls, text: str) -> "Window":
        """``"128,512"`` → ``Window(128, 512)``."""
        try:
            sink, recent = (int(x) for x in str(text).split(","))
        except ValueError:
            raise WindowError(f"{text!r}: write SINK,RECENT token counts, e.g. 128,512") from None
        return cls(sink, recent)

    def __str__(self) -> str:
        return f"{self.sink},{self.recent}"

    @property
    def size(self) -> int:
        """Tokens the window holds once the sequence is longer than it."""
        return self.sink + self.recent

    def outside(self, n: int) -> tuple[int, int]:
        """Positions ``[lo, hi)`` of a sequence of ``n`` tokens that lie outside the window (possibly empty)."""
        return self.sink, max(self.sink, n - self.recent)

    def slot(self, position):
        """Ring slot of ``position`` ≥ sink in a cache of ``size`` slots: sinks first, then a ring of ``recent``
        (int, numpy or torch)."""
        return self.sink + (position - self.sink) % self.recent

    def positions(self, pos: int, recent_from: int) -> np.ndarray:
        """Positions attended exactly by a query at ``pos``: the sinks and ``[max(recent_from, sink), pos]``."""
        return np.concatenate([np.arange(min(self.sink, pos + 1)), np.arange(max(recent_from, self.sink), pos + 1)])
