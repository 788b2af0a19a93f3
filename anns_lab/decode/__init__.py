"""``anns-lab decode``: RetrievalAttention generation (docs/decoder.md) and the modes it is compared with.

- :mod:`kernels` — partial attention (numba CPU side, torch accelerator side) and the exact merge;
- :mod:`placement` — a long-range layer's CPU keys/values, its indexes and the side-buffer;
- :mod:`attention` — the registered attention function and the per-generation controller;
- :mod:`engine` — prefill, per-mode decoding, timing summary, input checks;
- :mod:`modes` — ``--mode`` / ``--param`` parsing and the ``--from-sweep`` pick;
- :mod:`runner` — tasks, free prompts and fidelity against full attention; the table;
- :mod:`cli` — the click command.
"""
