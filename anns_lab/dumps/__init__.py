"""Stage 1: run a real model's prefill and decode steps and capture post-RoPE Q, K and V into Parquet.

:mod:`models` (loading, ``forward_tokens``), :mod:`prompts`, :mod:`tasks` and :mod:`text` build the
model and its input; the decoder uses them too. :mod:`run` (the ``dump`` command), :mod:`capture`
and :mod:`store` (the format) are the capture, which nothing above this floor imports but the
evaluation's reader (``store.open_dump``).
"""
