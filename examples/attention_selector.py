"""A selector in ~20 lines: keep what the last 16 queries attended to (a bare-bones SnapKV).

    python -m probes.challenge --policy examples/attention_selector.py:recent_attention --quick
"""

import torch

import randattn


@randattn.score_function(needs=("queries",), window=16)
def recent_attention(view: randattn.CacheView) -> torch.Tensor:
    q, k = view.queries, view.keys  # [B, H_q, w, D] and [B, H_kv, S, D], both post-RoPE
    group = q.shape[1] // k.shape[1]  # query heads per KV head (GQA)
    logits = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) * view.scaling  # [B, H_q, w, S]
    # A query saw only the positions up to its own.
    future = view.positions.repeat_interleave(group, dim=1)[:, :, None, :] > view.query_positions[:, None]
    attention = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
    received = attention.sum(dim=2)  # [B, H_q, S]: attention each slot received from the window
    return received.unflatten(1, (k.shape[1], group)).mean(dim=2)  # per KV head: mean over its query heads
