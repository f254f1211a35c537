"""randattn inside vLLM: the paper's eviction engine on vLLM's paged KV cache (issue 26).

Loaded by vLLM through the ``vllm.general_plugins`` entry point (:func:`register`) in every process; it does
nothing unless the user's ``additional_config`` has a ``"randattn"`` section (:mod:`randattn.vllm.config`).
Importable without vLLM: vLLM is imported inside the functions that need it.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Install the plugin's pieces into vLLM (called by vLLM's plugin loader in each process)."""
    from .runner import install as _install

    _install()
