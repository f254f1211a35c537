"""randattn inside vLLM: the paper's eviction engine on vLLM's paged KV cache (issue 26).

Loaded by vLLM through the ``vllm.general_plugins`` entry point (:func:`register`) in every process (front end,
engine core, worker); it does nothing unless the user's ``additional_config`` has a ``"randattn"`` section
(:mod:`randattn.vllm.config`). Importable without vLLM: vLLM is imported inside the functions that need it.

Pieces: :mod:`~randattn.vllm.config` (the user config and the round arithmetic), :mod:`~randattn.vllm.keys`
(request keys and keep-log names), :mod:`~randattn.vllm.state`
(per-request state, the step plan, the rounds), :mod:`~randattn.vllm.backend` (the CPU attention backend that runs
them), :mod:`~randattn.vllm.flash_backend` (the same on CUDA's FlashAttention), :mod:`~randattn.vllm.runner` (the hooks), :mod:`~randattn.vllm.kv_cache` and :mod:`~randattn.vllm.scheduler`
(block caps and round-boundary chunking), :mod:`~randattn.vllm.checks` (refused engine settings).

What the vLLM engine is, against the HF :class:`randattn.EvictingCache` (which follows the paper's engine,
docs/engine.md): the same rounds at the same lengths, the same candidates, protection, selection, compaction and
keep-log, computed by the same code (each request owns a one-row ``EvictingCache`` used for its policy and its
selection). Deliberate differences:

- draws are always per request: seeded by (seed, request key, layer, round), as an HF cache built with
  ``row_keys=[key]``; the key is ``SamplingParams(extra_args={"randattn_key": ...})``, else
  :func:`default_key` of the prompt token ids and ``SamplingParams.seed`` (never vLLM's request id, which is
  random; :mod:`~randattn.vllm.keys`);
- a query-window selector (``snapkv``, ``rkv``, ...) reads the post-RoPE queries vLLM's own attention layer
  computed, buffered per request and layer, where the HF engine recomputes them with the layer's projection: equal
  up to kernel rounding;
- H2O's accumulated attention is recomputed from the held keys after each layer's attention (vLLM's kernel returns no
  probabilities); TriAttention's keep-set shared by all layers is scored when the first layer reaches the round, from
  every layer's KV cache in the forward context, as the HF cache scores it; its statistics must be given in the
  policy's options (the HF cache can find a model's shipped ones through the HF model, the worker cannot);
- no keep-mask API (pins, forced evictions) and no padded batches: every request is its own row;
- vLLM's CPU attention (``CPU_ATTN``) and, on CUDA, FlashAttention (``FLASH_ATTN``, :mod:`~randattn.vllm.flash_backend`:
  written and layout-tested on CPU, not yet run on a GPU); one device, eager mode; other platforms are refused.
"""

from __future__ import annotations

from .keys import default_key, log_file_name

__all__ = ["register", "default_key", "log_file_name"]


def register() -> None:
    """Install the plugin's pieces into vLLM (called by vLLM's plugin loader in each process; idempotent)."""
    from .runner import install as _install

    _install()
