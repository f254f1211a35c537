"""Driving a model with an EvictingCache: HF ``generate``, a manual decode loop, and teacher-forced replay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tqdm.auto import tqdm

from .cache import EvictingCache
from .models import cache_argument_name, install_guards

__all__ = ["generate", "decode_step", "replay", "replay_tokenwise", "ReplayResult"]


def _check_fresh(cache: EvictingCache) -> None:
    if not isinstance(cache, EvictingCache):
        raise TypeError(f"cache must be a randattn.EvictingCache, got {type(cache).__name__}")
    if cache.get_seq_length() != 0:
        raise ValueError("this EvictingCache has already been used; create a fresh one per sequence (or batch)")


def generate(model, input_ids: torch.Tensor, cache: EvictingCache, *, attention_mask=None, **generate_kwargs) -> torch.Tensor:
    """``model.generate`` with ``cache``, checked first: equal-length (unpadded) prompts only,
    budget large enough for a protected prompt, the cache passed under the right keyword for this
    transformers version. Returns the generated ids (prompt included), like ``model.generate``."""
    _check_fresh(cache)
    install_guards(model)
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "attention_mask has padding: EvictingCache needs equal-length prompts in a batch (left padding would be "
            "mapped onto evicted slots wrongly). Generate prompts of different lengths separately."
        )
    if cache.protect_prompt and cache.prompt_len is None:
        cache._check_prompt_fits(input_ids.shape[1])
    if generate_kwargs.get("assistant_model") is not None or generate_kwargs.get("prompt_lookup_num_tokens"):
        raise ValueError("assisted / prompt-lookup decoding rolls the cache back, which eviction makes impossible")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    generate_kwargs[cache_argument_name(model)] = cache
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)


@torch.no_grad()
def decode_step(model, input_ids: torch.Tensor, cache: EvictingCache) -> torch.Tensor:
    """One forward of new tokens ``[B, n]`` through ``cache``; returns logits ``[B, n, V]``.

    Positions come from the cache's absolute length, so this is all a manual decode loop needs::

        logits = decode_step(model, prompt_ids, cache)
        for _ in range(n):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            logits = decode_step(model, nxt, cache)
    """
    start = cache.get_seq_length()
    pos = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
    out = model(input_ids=input_ids, position_ids=pos, use_cache=True, **{cache_argument_name(model): cache})
    return out.logits


@dataclass
class ReplayResult:
    """Per-token results of teacher forcing a sequence ``x[B, T]``.

    logprobs[b, t] = log p(x_t | x_<t) for t >= 1 (NaN at t = 0); argmax[b, t] is the greedy
    prediction for position t (-1 at t = 0); last_logits are the logits after the final token.
    """

    logprobs: torch.Tensor
    argmax: torch.Tensor
    last_logits: torch.Tensor
    forwards: int


class _Collector:
    def __init__(self, input_ids: torch.Tensor):
        b, t = input_ids.shape
        self.ids = input_ids
        self.logprobs = torch.full((b, t), float("nan"), dtype=torch.float32)
        self.argmax = torch.full((b, t), -1, dtype=torch.long)
        self.prev: Optional[torch.Tensor] = None  # logits predicting the next chunk's first token

    def add(self, start: int, logits: torch.Tensor) -> None:
        n = logits.shape[1]
        rows = logits[:, :-1] if self.prev is None else torch.cat([self.prev[:, None], logits[:, :-1]], dim=1)
        first = start + 1 if self.prev is None else start
        targets = self.ids[:, first : start + n]
        lp = torch.log_softmax(rows.float(), dim=-1)
        self.logprobs[:, first : start + n] = torch.gather(lp, -1, targets[..., None].to(lp.device))[..., 0].cpu()
        self.argmax[:, first : start + n] = rows.argmax(-1).cpu()
        self.prev = logits[:, -1]

    def result(self, forwards: int) -> ReplayResult:
        return ReplayResult(self.logprobs, self.argmax, self.prev.float().cpu(), forwards)


def _prefill(model, input_ids, cache, prompt_len):
    _check_fresh(cache)
    install_guards(model)
    t = input_ids.shape[1]
    if not 1 <= prompt_len <= t:
        raise ValueError(f"prompt_len must be between 1 and the sequence length {t}, got {prompt_len}")
    if cache.prompt_len is None:
        cache.prompt_len = int(prompt_len)
        cache._check_prompt_fits(cache.prompt_len)
    elif cache.prompt_len != prompt_len:
        raise ValueError(f"cache was built with prompt_len={cache.prompt_len} but replay got prompt_len={prompt_len}")
    col = _Collector(input_ids)
    col.add(0, decode_step(model, input_ids[:, :prompt_len], cache))
    return col


@torch.no_grad()
def replay(
    model,
    input_ids: torch.Tensor,
    cache: EvictingCache,
    *,
    prompt_len: int,
    max_chunk: Optional[int] = None,
    progress: bool = False,
) -> ReplayResult:
    """Teacher-force ``input_ids[B, T]`` through ``cache`` with eviction rounds exactly where
    token-by-token decoding has them.

    The prompt ``[:prompt_len]`` is prefilled; then each chunk runs up to the next round (the
    cache rounds when it holds ``K + r`` pairs, so chunks are ``r`` tokens once rounds start). Within
    a chunk no round can happen, so every token sees the same cache it would see when decoded one
    at a time; ``max_chunk`` caps chunk length for memory.
    """
    if max_chunk is not None and max_chunk <= 0:
        raise ValueError(f"max_chunk must be positive or None, got {max_chunk}")
    col = _prefill(model, input_ids, cache, prompt_len)
    t, pos, forwards = input_ids.shape[1], prompt_len, 1
    limit = cache.budget + cache.buffer
    bar = tqdm(total=t, initial=pos, desc="replay", unit="tok", disable=not progress, leave=False)
    while pos < t:
        n = limit - cache.physical_length(0)  # tokens until the next round fires
        n = min(n, t - pos, max_chunk or n)
        col.add(pos, decode_step(model, input_ids[:, pos : pos + n], cache))
        pos += n
        forwards += 1
        bar.update(n)
    bar.close()
    return col.result(forwards)


@torch.no_grad()
def replay_tokenwise(model, input_ids: torch.Tensor, cache: EvictingCache, *, prompt_len: int) -> ReplayResult:
    """Reference for :func:`replay`: prefill the prompt, then feed one token per forward."""
    col = _prefill(model, input_ids, cache, prompt_len)
    for pos in range(prompt_len, input_ids.shape[1]):
        col.add(pos, decode_step(model, input_ids[:, pos : pos + 1], cache))
    return col.result(1 + input_ids.shape[1] - prompt_len)
