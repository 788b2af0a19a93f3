"""Peak memory of a prefill (dump or decode), estimated before it runs, and the refusal when it cannot fit.

A 128K-token prefill that runs out of memory is killed by the kernel after minutes of work, with
nothing said. The big terms are known from the model's config before the first token: the KV cache
(float32, every layer; a sliding-window layer keeps its window), the queries a decode run keeps (all of them
for the attention-aware indexes, the newest only for ``--calibrate``), one chunk's activations (the attention
scores, chunk × heads × context, in case the attention materialises them, its mask and the MLP's), and what a decode mode
adds (a copy of the cache for ``full``; float32 keys, values and graphs of the long-range layers for an index).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from anns_lab.dumps import rope
from anns_lab.errors import AnnsLabError

GIB = 2**30
FLOAT = 4  # the lab runs models in float32
GRAPH_BYTES_PER_KEY = 40 * 4 + 4 + 8  # a graph index's row (roargraph's R = 40 int32), degree and slack, per key per query head
WORKER_BYTES = 400 * 2**20  # a build worker process started and warm (torch, faiss, numba, the kernels): 380 MiB measured
HEADROOM = 1.15  # allocator fragmentation and Python objects on top of the counted arrays


class MemoryEstimateError(AnnsLabError):
    """The estimated peak memory of a run exceeds what this machine has available."""


@dataclass
class Estimate:
    """Named parts (bytes) of a run's peak memory beyond what is already loaded (the model's weights)."""

    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return int(HEADROOM * sum(self.parts.values()))

    def describe(self) -> str:
        """'KV cache 4.7 GiB, queries 1.6 GiB, ...' largest first."""
        items = sorted(self.parts.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{name} {v / GIB:.1f} GiB" for name, v in items if v >= 0.05 * GIB) or "small"


def available_bytes() -> int:
    """Memory this process may still use: ``ANNS_LAB_MEMORY_LIMIT`` (bytes, or with a K/M/G suffix) when set,
    else the smaller of the kernel's MemAvailable and the cgroup's limit minus its usage."""
    limit = os.environ.get("ANNS_LAB_MEMORY_LIMIT")
    if limit:
        return _parse_size(limit)
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        cap = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if cap != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(int(cap) - used)
    except (OSError, ValueError):
        pass
    if not found:
        import psutil

        found.append(int(psutil.virtual_memory().available))
    return min(found)


def _parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        size = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, KeyError, OverflowError):  # OverflowError: an infinite size (infG, 1e400G)
        size = -1
    if size < 0:
        raise AnnsLabError(f"ANNS_LAB_MEMORY_LIMIT={text!r}: write bytes or a size such as 20G")
    return size


def prefill_estimate(cfg, n_tokens: int, chunk: int, query_layers: int = 0, index_layers: int = 0,
                     cache_copy: bool = False, query_tokens: int | None = None, building_layers: int = 0,
                     build_workers: int = 0) -> Estimate:
    """Peak bytes of a chunked prefill of ``n_tokens`` with model config ``cfg``: KV cache, one chunk's
    attention scores, mask and MLP activations; ``query_layers`` layers whose queries are kept (decode's training
    queries; ``query_tokens``: only each head's newest so many, None: every token's); ``index_layers``
    long-range layers held on the CPU with a graph per query head (a decode mode); ``cache_copy``: a second copy
    of the cache (decode's ``full``); ``building_layers``: layers whose attention-aware builds are in flight at once
    (decode ``--build-layers``), each with its training queries moved to the serving positions (at most every
    token's); ``build_workers``: worker processes that build them (decode ``--build-processes``), each holding its
    libraries and one build's keys and queries, the layers in flight spooled to them in memory."""
    n_layers = cfg.num_hidden_layers
    n_heads, n_kv = cfg.num_attention_heads, rope.kv_heads(cfg)
    d = rope.head_dim(cfg)
    window = getattr(cfg, "sliding_window", None) or n_tokens
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * n_layers
    per_token = 2 * n_kv * d * FLOAT  # K and V of one layer
    kv = sum(per_token * (min(window, n_tokens) if t == "sliding_attention" else n_tokens) for t in types)
    c = min(chunk, n_tokens)
    parts = {
        "KV cache": kv,
        f"attention scores of a {c}-token chunk": 2 * c * n_heads * n_tokens * FLOAT,
        f"attention mask of a {c}-token chunk": c * n_tokens * (FLOAT + 1),  # additive, built from a boolean one
        f"activations of a {c}-token chunk": c * (4 * cfg.hidden_size + 3 * getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)) * FLOAT,
    }
    if query_layers:
        kept = n_tokens if query_tokens is None else min(query_tokens, n_tokens)
        parts["prefill queries kept"] = query_layers * n_heads * kept * d * FLOAT
    if index_layers:
        parts["CPU store and indexes"] = index_layers * n_tokens * (per_token + n_heads * GRAPH_BYTES_PER_KEY)
    if cache_copy:
        parts["copy of the KV cache (full)"] = kv
    if building_layers:
        parts[f"{building_layers} layers' builds in flight"] = building_layers * n_heads * n_tokens * d * FLOAT
    if build_workers:
        spooled = max(1, building_layers) * (n_kv + n_heads) * n_tokens * d * FLOAT  # keys once per KV head, queries
        parts[f"{build_workers} build worker processes"] = (build_workers * (WORKER_BYTES + 2 * n_tokens * d * FLOAT)
                                                            + spooled)
    return Estimate(parts)


def check_prefill(cfg, n_tokens: int, chunk: int, what: str, tokens_flag: str, **kwargs) -> Estimate:
    """:func:`prefill_estimate`, refused with :class:`MemoryEstimateError` when it exceeds :func:`available_bytes`:
    the message gives the estimate, its parts, and the ``--chunk`` that would fit (the attention scores grow with
    it) or else ``tokens_flag``, the flag that shortens the prompt."""
    est = prefill_estimate(cfg, n_tokens, chunk, **kwargs)
    have = available_bytes()
    if est.total <= have:
        return est
    fits = next((c for c in (1024, 512, 256, 128) if c < chunk
                 and prefill_estimate(cfg, n_tokens, c, **kwargs).total <= have), None)
    shorter = "give a shorter --prompt" if tokens_flag == "--prompt" else f"lower {tokens_flag}"
    lower = (f"pass --chunk {fits} (about {prefill_estimate(cfg, n_tokens, fits, **kwargs).total / GIB:.1f} GiB)"
             if fits else f"even --chunk 128 would not fit: {shorter}" if chunk > 128 else shorter)
    if kwargs.get("building_layers", 0) > 1:
        lower += f", or build fewer layers at once (--build-layers, {kwargs['building_layers']} here)"
    limit = os.environ.get("ANNS_LAB_MEMORY_LIMIT")
    said = f" (ANNS_LAB_MEMORY_LIMIT={limit})" if limit else ""  # a limit set long ago reads as a machine's size
    raise MemoryEstimateError(f"{what} needs about {est.total / GIB:.1f} GiB ({est.describe()}) but "
                              f"{have / GIB:.1f} GiB is available{said}; {lower}")
