"""Analysis of probe rows: pure functions from result rows to tables (no model, no files written).

The probes call these to print their tables; ``figures/`` calls them to plot. Neither depends on the other.

- :mod:`analysis.planted`: planted-fact summaries (Retrieval, Recall R against both tops), head pooling,
  scattered vs intact, two facts, blocks, the passcode.
- :mod:`analysis.survival`: survival curves and keep-log metrics pooled per policy and mode.
- :mod:`analysis.accuracy`: accuracy per arm, paired comparisons with Random, protection gains.
- :mod:`analysis.prompt_protection`: score-only vs protected per policy.
- :mod:`analysis.repeat`: the numbered copies of a repeat-task answer (its grader and the docs' table).
- :mod:`analysis.rows`: reading result files (JSONL rows, CSV summaries).
"""
