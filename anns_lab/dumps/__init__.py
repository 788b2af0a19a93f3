"""Stage 1: run a real model's prefill and decode steps and capture post-RoPE Q, K and V into Parquet."""
