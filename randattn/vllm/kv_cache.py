"""Blocks a request never needs are never allocated: the evicting KV-cache spec and its manager (issue 26).

Under eviction a request's layer holds at most :func:`randattn.vllm.config.max_held_pairs` pairs per KV head
(``max(prompt_len, T + r)``, in the forward that runs a round), compacted by the engine's attention backend into
slots ``0 .. held - 1`` of the request's own blocks. So a request needs ``ceil(max_held / block_size)`` blocks,
however long it generates; full attention needs ``ceil(length / block_size)``. The freed blocks stay in vLLM's
pool, where they admit more requests at once (the point of eviction at serving time).

Two vLLM 0.32.0 extension points carry this, neither a patch:

- :class:`EvictingAttentionSpec`, a :class:`~vllm.v1.kv_cache_interface.FullAttentionSpec` subclass registered
  through ``KVCacheSpecRegistry`` with :class:`EvictingManager` and grouped with full attention (same page layout,
  same kernels). Its :meth:`~EvictingAttentionSpec.max_memory_usage_bytes` is what vLLM's start-up check
  (``_check_enough_kv_cache_memory``) sizes one request of ``max_model_len`` tokens by: with a protected prompt
  (which must fit in T) that is ``ceil(min(max_model_len, T + r) / block_size)`` blocks, so ``max_model_len`` may
  exceed what full attention could hold. With an unprotected prompt a request may be all prompt, so the check stays
  at full attention's size (the per-request cap below still applies).
- :class:`EvictingManager`, a ``FullAttentionManager`` that clamps every allocation of a request to its cap.
  It learns the request's prompt length from the scheduler (:meth:`EvictingManager.note_request`, called by
  :class:`randattn.vllm.scheduler.EvictionScheduler` when a request is added) and from
  ``remove_skipped_blocks(..., num_prompt_tokens=)``, which ``KVCacheManager.allocate_slots`` calls before every
  allocation; until then (only vLLM's admission estimate asks that early) it assumes the worst prompt.

The worker-side block table keeps its full width (``ceil(max_model_len / block_size)`` entries per request row,
:meth:`max_num_blocks_per_req` is not overridden): vLLM's runner first computes a default slot mapping
``block_table[pos // block_size]`` for absolute positions, and a full-width row keeps that lookup in range; the
entries past the cap are stale and never read, since the backend writes and reads at held indices only.

Hooking it up (the engine part does both, in ``randattn.vllm.runner.install``): :func:`register_spec` once per
process, and every attention layer's ``get_kv_cache_spec`` returns :func:`evicting_spec` of its spec when the
config has a ``"randattn"`` key (a wrap of ``Attention.get_kv_cache_spec``: the backend's own hook,
``customize_spec``, is called without the engine config, so it cannot know T and r).

Imports vLLM at module level: import it only in the vLLM environment.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, fields
from typing import Any, Optional

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, MLAAttentionSpec

from .config import EngineConfig, max_held_pairs, read_config

__all__ = ["EvictingAttentionSpec", "EvictingManager", "register_spec", "evicting_spec", "capped_blocks",
           "evicting_managers"]

# What the round arithmetic of .config reads from an EngineConfig (the spec carries T and r, not the config).
_Rounds = namedtuple("_Rounds", "budget buffer")


@dataclass(frozen=True, kw_only=True)
class EvictingAttentionSpec(FullAttentionSpec):
    """Full attention whose requests hold at most ``max(prompt_len, T + r)`` pairs per layer and head."""

    budget: int = 0
    buffer: int = 0
    protect_prompt: bool = True

    def worst_held(self, max_model_len: int) -> int:
        """The most pairs any request of at most ``max_model_len`` tokens holds: a protected prompt fits in T, so
        ``T + r``; an unprotected one may be ``max_model_len - 1`` tokens long."""
        held = self.budget + self.buffer if self.protect_prompt else max(max_model_len, self.budget + self.buffer)
        return min(int(max_model_len), held)

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return cdiv(self.worst_held(vllm_config.model_config.max_model_len), self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list) -> "EvictingAttentionSpec":
        first = specs[0]
        if any((s.budget, s.buffer, s.protect_prompt) != (first.budget, first.buffer, first.protect_prompt)
               for s in specs):
            raise AssertionError("all evicting attention layers in one KV cache group must share T, r and "
                                 "prompt protection")
        base = FullAttentionSpec.merge(specs)
        return cls(**{f.name: getattr(base, f.name) for f in fields(base)}, budget=first.budget,
                   buffer=first.buffer, protect_prompt=first.protect_prompt)


def capped_blocks(prompt_len: int, cfg: Any, block_size: int) -> int:
    """The blocks one request with a ``prompt_len``-token prompt ever holds under ``cfg`` (T, r)."""
    return cdiv(max_held_pairs(prompt_len, cfg), block_size)


class EvictingManager(FullAttentionManager):
    """``FullAttentionManager`` that never gives a request more than ``ceil(max_held / block_size)`` blocks."""

    def __init__(self, kv_cache_spec: EvictingAttentionSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self._rounds = _Rounds(kv_cache_spec.budget, kv_cache_spec.buffer)
        self._prompt_len: dict[str, int] = {}
        # The most tokens any request may be; vLLM does not pass max_model_len to managers, so take the width
        # the unknown-prompt case needs from the spec's own bound (set by note_max_model_len).
        self._max_model_len: Optional[int] = None

    # -- what the manager knows about a request ---------------------------------------------------------------
    def note_request(self, request_id: str, prompt_len: int) -> None:
        self._prompt_len[request_id] = int(prompt_len)

    def note_max_model_len(self, max_model_len: int) -> None:
        self._max_model_len = int(max_model_len)

    def cap_tokens(self, request_id: str) -> Optional[int]:
        """The slots request ``request_id`` may hold (a multiple of nothing; blocks are its ceil), or ``None``
        for no cap (an unknown request with an unprotected prompt and no known ``max_model_len``)."""
        prompt_len = self._prompt_len.get(request_id)
        if prompt_len is not None:
            return max_held_pairs(prompt_len, self._rounds)
        if self.kv_cache_spec.protect_prompt:
            return self._rounds.budget + self._rounds.buffer
        return None if self._max_model_len is None else self.kv_cache_spec.worst_held(self._max_model_len)

    def _capped(self, request_id: str, num_tokens: int) -> int:
        cap = self.cap_tokens(request_id)
        return num_tokens if cap is None else min(int(num_tokens), cap)

    # -- FullAttentionManager, with every request's slots clamped to its cap ------------------------------------
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, **kwargs) -> int:
        return super().get_num_blocks_to_allocate(request_id, self._capped(request_id, num_tokens), *args, **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        capped = self._capped(request_id, num_tokens)
        return super().allocate_new_blocks(request_id, capped, min(num_tokens_main_model, capped))

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: Optional[int] = None) -> None:
        # allocate_slots calls this before it sizes the allocation: the moment to learn the prompt length.
        if num_prompt_tokens is not None:
            self._prompt_len[request_id] = int(num_prompt_tokens)
        return super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def pop_blocks_for_free(self, request_id: str):
        # Called on finish and on preemption; a resumed request is noted again by remove_skipped_blocks.
        self._prompt_len.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)


def register_spec() -> None:
    """Register :class:`EvictingAttentionSpec` with :class:`EvictingManager`, grouped with full attention.

    vLLM registers its built-in specs lazily, on the first registry lookup; registering before that would make the
    registry look already filled and skip them, so the built-ins are registered first (``_ensure_registered``)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(EvictingAttentionSpec, EvictingManager, uniform_type_base_spec=FullAttentionSpec)


def evicting_spec(spec: AttentionSpec, cfg: Optional[EngineConfig] = None) -> AttentionSpec:
    """The evicting version of one attention layer's spec (what the backend's ``customize_spec`` returns).

    ``cfg`` defaults to the plugin config of the current vLLM config; without one (no ``"randattn"`` key) the spec
    is returned unchanged. Only plain full attention is converted: a sliding-window, chunked-local or MLA spec is
    refused (:mod:`randattn.vllm.checks` refuses such models before this is reached)."""
    if cfg is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        cfg = read_config(getattr(vllm_config, "additional_config", None)) if vllm_config is not None else None
    if cfg is None or isinstance(spec, EvictingAttentionSpec):
        return spec
    if type(spec) is not FullAttentionSpec or isinstance(spec, MLAAttentionSpec) or spec.sliding_window \
            or spec.attention_chunk_size or spec.non_causal:
        raise ValueError(f"randattn.vllm evicts plain causal full attention only; this layer's KV-cache spec is "
                         f"{type(spec).__name__} (sliding_window={getattr(spec, 'sliding_window', None)}, "
                         f"attention_chunk_size={getattr(spec, 'attention_chunk_size', None)}); use a model whose "
                         "layers are all full attention, or drop the 'randattn' key of additional_config")
    return EvictingAttentionSpec(**{f.name: getattr(spec, f.name) for f in fields(spec)}, budget=cfg.budget,
                                 buffer=cfg.buffer, protect_prompt=cfg.spec.protects_prompt)


def evicting_managers(kv_cache_manager: Any) -> list:
    """The :class:`EvictingManager` s behind a scheduler's ``KVCacheManager`` (empty under full attention)."""
    coordinator = getattr(kv_cache_manager, "coordinator", None)
    return [m for m in getattr(coordinator, "single_type_managers", ()) if isinstance(m, EvictingManager)]
