"""Stage 3: evaluate indexes on dumps — ground truth, metrics, the sweep runner, figures and the report."""
