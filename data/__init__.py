"""The data shipped with randattn: the embedded model's traces and the results behind the docs.

Installed as the package ``randattn_data`` (``pyproject.toml`` maps it to this folder); read it with
``probes.results.shipped("traces/smollm2-135m.jsonl")``.
"""
