"""Reference for physical eviction: a full, uncached forward with evicted positions masked per
layer and per KV head.

Physical eviction is correct exactly when its logits equal these (fp32, within rounding). The
reference swaps the model's attention function for a plain masked softmax attention that looks up
a ``[B, H_kv, T, T]`` visibility mask by the module's ``layer_idx``; everything else in the model
(projections, q/k-norms, fused qkv, rotary) runs unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch
from transformers import AttentionInterface

from .keeplog import KeepLog

__all__ = ["masked_forward_logits", "visible_masks_from_keep_log"]

_IMPL = "randattn_reference"
_masks: dict = {}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    mask = _masks[module.layer_idx].to(query.device)  # [B, H_kv, T, T]
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    mask = mask.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = (query @ key.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = probs @ value
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register(_IMPL, _reference_attention)


@contextlib.contextmanager
def _attention_swapped(model):
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")}
    saved = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = _IMPL
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]


def visible_masks_from_keep_log(keep_log: KeepLog, n_layers: int, seq_len: int, batch: int, kv_heads: int) -> dict:
    """Per-layer ``[B, H_kv, T, T]`` visibility masks implied by a keep-log."""
    return {l: keep_log.visible_mask(l, seq_len, batch, kv_heads) for l in range(n_layers)}


@torch.no_grad()
def masked_forward_logits(model, input_ids: torch.Tensor, masks: "Mapping[int, torch.Tensor] | KeepLog") -> torch.Tensor:
    """Logits ``[B, T, V]`` of one uncached forward where query ``t`` of layer ``l``, KV head ``h``
    sees key ``j`` only if ``masks[l][b, h, t, j]``. ``masks`` may be a :class:`KeepLog`."""
    cfg = model.config.get_text_config(decoder=True)
    b, t = input_ids.shape
    if isinstance(masks, KeepLog):
        masks = visible_masks_from_keep_log(masks, cfg.num_hidden_layers, t, b, cfg.num_key_value_heads)
    _masks.clear()
    _masks.update(masks)
    try:
        with _attention_swapped(model):
            pos = torch.arange(t, device=input_ids.device)[None].expand(b, t)
            out = model(input_ids=input_ids, position_ids=pos, use_cache=False)
    finally:
        _masks.clear()
    return out.logits
