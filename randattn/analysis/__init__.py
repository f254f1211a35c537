"""Analysis of probe rows: pure functions from result rows to tables (no model, no files written).

The probes call these to print their tables; ``figures/`` calls them to plot. Neither depends on the other.

- :mod:`randattn.analysis.planted`: planted-fact summaries (Retrieval, Recall R against both tops), head pooling,
  scattered vs intact, two facts, blocks, the passcode.
- :mod:`randattn.analysis.survival`: survival curves and keep-log metrics pooled per policy and mode.
- :mod:`randattn.analysis.accuracy`: accuracy per arm, paired comparisons with Random, protection gains.
- :mod:`randattn.analysis.prompt_protection`: score-only vs protected per policy.
- :mod:`randattn.analysis.repeat`: the numbered copies of a repeat-task answer (its grader and the docs' table).
- :mod:`randattn.analysis.rows`: reading result files (JSONL rows, CSV summaries).
"""
