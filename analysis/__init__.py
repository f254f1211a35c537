"""Analysis of probe rows: pure functions from result rows to tables (no model), and the rules for result files.

The lab's shared layer, above the core and below the probes and figures: the probes call these to print their
tables and name their files; ``figures/`` calls them to plot and to find the shipped results. Neither depends on the
other, and this package imports only the core (``randattn``), never a probe, figure or benchmark
(tests/test_layers.py). It was ``randattn.analysis`` until issue 28 moved it out of the lean core.

- :mod:`analysis.planted`: planted-fact summaries (Retrieval, Recall R against both tops), head pooling,
  scattered vs intact, two facts, blocks, the passcode.
- :mod:`analysis.survival`: survival curves and keep-log metrics pooled per policy and mode.
- :mod:`analysis.accuracy`: accuracy per arm, paired comparisons with Random, protection gains.
- :mod:`analysis.prompt_protection`: score-only vs protected per policy.
- :mod:`analysis.repeat`: the numbered copies of a repeat-task answer (its grader and the docs' table).
- :mod:`analysis.rows`: reading result files (JSONL rows, CSV summaries).
- :mod:`analysis.names`: every result file's name, from the run's configuration (``result_name``), and the shipped
  results' (``shipped_name``).
- :mod:`analysis.files`: writing summaries and figures atomically, over files randattn wrote only.
"""
