"""Cheap capture of what attention-based selectors need: recent post-RoPE queries.

A forward pre-hook on every attention module recomputes the step's queries with the layer's own
projection (``q_proj``, or the query slice of a fused ``qkv_proj``), q-norm (Qwen3) and rotary,
and hands them to the cache when its policy asks for them. Attention itself is never patched, so
every attention implementation (sdpa, eager, flash) keeps working and stays exact.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["install_query_capture", "recompute_queries", "attention_modules"]


def attention_modules(model):
    """``[(layer_idx, module)]`` for every module that calls ``cache.update`` (has ``layer_idx`` and a projection)."""
    found = []
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if idx is None or not (hasattr(module, "q_proj") or hasattr(module, "qkv_proj")):
            continue
        found.append((int(idx), module))
    return found


def recompute_queries(module, hidden_states: torch.Tensor, position_embeddings, rotate: bool = True) -> torch.Tensor:
    """Post-RoPE queries ``[B, H_q, n, D]`` exactly as ``module`` computes them.

    ``rotate=False`` stops before the rotary embedding and returns the pre-RoPE queries (projection
    and q-norm only; ``position_embeddings`` may then be ``None``), as TriAttention's calibration needs.
    """
    head_dim = module.head_dim
    if hasattr(module, "q_proj"):
        q = module.q_proj(hidden_states)
    else:  # Phi-3: queries are the first H_q * D outputs of the fused projection
        q = module.qkv_proj(hidden_states)[..., : module.config.num_attention_heads * head_dim]
    q = q.view(*hidden_states.shape[:-1], -1, head_dim)
    if hasattr(module, "q_norm"):
        q = module.q_norm(q)
    q = q.transpose(1, 2)
    if not rotate:
        return q
    cos, sin = position_embeddings
    rotary = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
    if rotary is None:
        raise NotImplementedError(
            f"{type(module).__name__}: no apply_rotary_pos_emb next to it; cannot recompute its queries"
        )
    q, _ = rotary(q, q, cos, sin)
    return q


def _capture_hook(module, args, kwargs):
    from .cache import EvictingCache

    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if not isinstance(cache, EvictingCache) or not cache.needs_queries:
        return None
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    pos_emb = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
    if hidden is None or pos_emb is None:
        raise RuntimeError(
            f"{type(module).__name__} was called without hidden_states/position_embeddings keywords; "
            f"policy {cache.policy.name!r} cannot capture its queries"
        )
    if not cache.wants_queries(int(module.layer_idx), hidden.shape[-2]):
        return None  # too far from the next round for these queries to be in its window
    with torch.no_grad():
        q = recompute_queries(module, hidden, pos_emb)
    cache._observe_queries(int(module.layer_idx), q, module.scaling)
    return None


def install_query_capture(model) -> int:
    """Install the capture hooks once; returns the number of attention modules hooked."""
    mods = attention_modules(model)
    for _, module in mods:
        if getattr(module, "_randattn_capture_handle", None) is None:
            module._randattn_capture_handle = module.register_forward_pre_hook(_capture_hook, with_kwargs=True)
    return len(mods)
