"""Driving a model with an EvictingCache: HF ``generate``, a manual decode loop, and teacher-forced replay."""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm.auto import tqdm

from ._memory import release_free_memory
from .cache import EvictingCache, set_model_check
from .models import _refuse_cache_misuse, cache_argument_name, check_model, install_guards, refuse_used_cache

set_model_check(check_model)  # the cache checks an unguarded model as the guarded paths do (it cannot import models)

__all__ = ["generate", "decode_step", "replay", "replay_tokenwise", "Replay", "ReplayResult"]


def _check_fresh(cache: EvictingCache, where: str) -> None:
    if not isinstance(cache, EvictingCache):
        raise TypeError(f"cache must be a randattn.EvictingCache, got {type(cache).__name__}")
    refuse_used_cache(cache, where)


def _check_ids(model, input_ids, where: str) -> None:
    # An empty batch or prompt would fail deep inside the model (a reshape of 0 elements) with no hint; float ids or
    # ids outside the embedding table fail inside the embedding lookup (on CUDA as a device-side assert).
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.numel() == 0:
        got = f"shape {tuple(input_ids.shape)}" if torch.is_tensor(input_ids) else f"a {type(input_ids).__name__}"
        raise ValueError(f"{where}: input_ids must be [batch, tokens] with at least one row and one token, got {got}")
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"{where}: input_ids must hold integer token ids (torch.long), got a {input_ids.dtype} tensor")
    vocab = _vocab_size(model)
    if vocab is not None:
        low, high = (int(v) for v in torch.stack([input_ids.min(), input_ids.max()]).tolist())  # one sync
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"{where}: input_ids holds token id {bad}, outside the model's vocabulary "
                             f"(ids 0..{vocab - 1})")


def _vocab_size(model):
    """Rows of the model's input embedding (what a token id indexes), else the config's vocab_size, else None."""
    try:
        rows = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError, TypeError):
        rows = getattr(getattr(model, "config", None), "vocab_size", None)
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows > 0 else None


def generate(model, input_ids: torch.Tensor, cache: EvictingCache, *, attention_mask=None, **generate_kwargs) -> torch.Tensor:
    """``model.generate`` with ``cache``, checked first: a left-padded ``attention_mask`` (each row then runs exactly
    as its prompt alone; right padding is refused), a budget large enough for every row's protected prompt, the
    cache passed under the right keyword for this transformers version. Returns the generated ids (prompt
    included), like ``model.generate``.

    ``cache`` must be fresh (a new EvictingCache, or one after ``cache.reset()``): one that already holds a
    sequence is refused, as ``model.generate`` refuses it once :func:`randattn.install_guards` ran."""
    _check_fresh(cache, "randattn.generate")
    _check_ids(model, input_ids, "randattn.generate")
    _refuse_cache_misuse(model, {**generate_kwargs, "cache": cache}, "randattn.generate", forward=False)
    install_guards(model)
    if attention_mask is not None:
        if not torch.is_tensor(attention_mask) or tuple(attention_mask.shape) != tuple(input_ids.shape):
            shape = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
            raise ValueError(f"attention_mask must match input_ids {tuple(input_ids.shape)}, got {shape}")
        cache.set_padding(attention_mask)  # refuses right padding, all-padding rows, prompts T cannot protect
    if cache.protect_prompt and cache.prompt_len is None:
        cache._check_prompt_fits(input_ids.shape[1] - (min(cache.pads) if cache.pads else 0))
    if generate_kwargs.get("assistant_model") is not None or generate_kwargs.get("prompt_lookup_num_tokens"):
        raise ValueError("assisted / prompt-lookup decoding rolls the cache back, which eviction makes impossible")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    generate_kwargs[cache_argument_name(model)] = cache
    try:
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
    finally:
        release_free_memory()  # short generations never reach the cache's every-16-rounds trim


@torch.no_grad()
def decode_step(model, input_ids: torch.Tensor, cache: EvictingCache, *, logits_to_keep: int = 0,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One forward of new tokens ``[B, n]`` through ``cache``; returns logits ``[B, n, V]``.

    Positions come from the cache's absolute length, so this is all a manual decode loop needs::

        logits = decode_step(model, prompt_ids, cache)
        for _ in range(n):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            logits = decode_step(model, nxt, cache)

    ``logits_to_keep=n`` computes logits for the last ``n`` tokens only (0: all of them).

    A left-padded batch: pass the prompt's ``attention_mask[B, n]`` with the first call (later calls need none; a
    mask given then must cover cached + new tokens). Each row then gets its own positions (first real token at 0)
    and runs as its prompt alone. 4D masks are refused.
    """
    _check_ids(model, input_ids, "randattn.decode_step")
    if getattr(model, "_randattn_checks_handle", None) is None:
        install_guards(model)  # once: a model loaded without randattn gets the same checks and warnings
    start = cache.get_seq_length()
    if start == 0 and attention_mask is not None:
        if not torch.is_tensor(attention_mask) or tuple(attention_mask.shape) != tuple(input_ids.shape):
            shape = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
            raise ValueError(f"attention_mask of the prompt must match input_ids {tuple(input_ids.shape)}, got {shape}")
        cache.set_padding(attention_mask)
    pos = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
    if cache.pads is not None:  # each row's own positions; its padding (masked) at 0
        pos = (pos - torch.tensor(cache.pads, device=input_ids.device)[:, None]).clamp_min(0)
    extra = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
    if attention_mask is not None:
        extra["attention_mask"] = attention_mask
    out = model(input_ids=input_ids, position_ids=pos, use_cache=True, **{cache_argument_name(model): cache}, **extra)
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

    def skip(self, last_logits: torch.Tensor) -> None:
        """A chunk whose tokens are not scored: only its last logits (predicting the next token) are kept."""
        self.prev = last_logits[:, -1]

    def copy(self) -> "_Collector":
        new = copy.copy(self)
        new.logprobs, new.argmax = self.logprobs.clone(), self.argmax.clone()
        return new

    def result(self, forwards: int) -> ReplayResult:
        return ReplayResult(self.logprobs, self.argmax, self.prev.float().cpu(), forwards)


def _prefill(model, input_ids, cache, prompt_len, score_from: int = 0):
    _check_fresh(cache, "randattn.replay")
    _check_ids(model, input_ids, "randattn.replay")
    install_guards(model)
    t = input_ids.shape[1]
    try:
        if isinstance(prompt_len, bool):
            raise TypeError
        prompt_len = operator.index(prompt_len)
    except TypeError:
        raise ValueError(f"prompt_len must be an integer between 1 and the sequence length {t}, got {prompt_len!r}") from None
    if not 1 <= prompt_len <= t:
        raise ValueError(f"prompt_len must be between 1 and the sequence length {t}, got {prompt_len}")
    if cache.prompt_len is None:
        cache._check_prompt_fits(int(prompt_len))  # before the cache is changed: a refusal leaves it fresh
        cache.prompt_len = int(prompt_len)
    elif cache.prompt_len != prompt_len:
        raise ValueError(f"cache was built with prompt_len={cache.prompt_len} but replay got prompt_len={prompt_len}")
    col = _Collector(input_ids)
    try:
        _forward(model, input_ids, cache, col, 0, prompt_len, score_from)
    except BaseException:
        if cache.get_seq_length() == 0:  # refused before anything was stored: leave the cache as it came
            cache.prompt_len = cache._init_prompt_len
        raise
    return col


def _forward(model, input_ids, cache, col: _Collector, start: int, n: int, score_from: int) -> None:
    """Feed ``input_ids[:, start:start+n]``; score its tokens unless all of them lie before ``score_from``."""
    chunk = input_ids[:, start : start + n]
    if start + n <= score_from:  # no target in this chunk is scored; keep only the logits predicting the next one
        col.skip(decode_step(model, chunk, cache, logits_to_keep=1))
    else:
        col.add(start, decode_step(model, chunk, cache))


class Replay:
    """Teacher forcing that can stop part-way, be forked, and go on: the engine behind :func:`replay`.

    Forking copies the cache (and the scores so far), so several conditions that differ only after
    position ``p`` (keep-masks registered on each fork) share the forwards before ``p``::

        base = Replay(model, ids, cache, prompt_len=48).run(until=fact_start)
        for cond in conditions:
            branch = base.fork()
            cond.apply(branch.cache)
            results[cond] = branch.run().result()

    ``score_from`` skips the language-model head for tokens before it (their log-probs stay NaN),
    which saves a fifth of the compute of a small model when only an answer at the end matters.
    """

    def __init__(self, model, input_ids: torch.Tensor, cache: EvictingCache, *, prompt_len: int,
                 max_chunk: Optional[int] = None, score_from: int = 0):
        if max_chunk is not None and max_chunk <= 0:
            raise ValueError(f"max_chunk must be positive or None, got {max_chunk}")
        self.model, self.input_ids, self.cache = model, input_ids, cache
        self.max_chunk, self.score_from = max_chunk, int(score_from)
        self._col = _prefill(model, input_ids, cache, prompt_len, self.score_from)
        self.pos, self.forwards = prompt_len, 1

    @torch.no_grad()
    def run(self, until: Optional[int] = None, *, progress: bool = False) -> "Replay":
        """Feed tokens up to ``until`` (default: the end). Chunks never cross an eviction round, so every
        token sees the cache that token-by-token decoding would show it."""
        t = self.input_ids.shape[1]
        until = t if until is None else int(until)
        if not self.pos <= until <= t:
            raise ValueError(f"until must lie between the replayed position {self.pos} and the length {t}, got {until}")
        limit = self.cache.budget + self.cache.buffer
        bar = tqdm(total=until, initial=self.pos, desc="replay", unit="tok", disable=not progress, leave=False)
        shared = getattr(self.cache.policy, "scope", "layer") == "model"
        while self.pos < until:
            n = limit - self.cache.physical_length(0)  # tokens until the next round fires
            if shared and n > self.cache.recent:
                # A keep-set shared by all layers is scored when the first layer reaches the round, from every
                # layer's candidates: the chunk that fires it must be no longer than the recent window.
                n -= self.cache.recent
            n = min(n, until - self.pos, self.max_chunk or n)
            _forward(self.model, self.input_ids, self.cache, self._col, self.pos, n, self.score_from)
            self.pos += n
            self.forwards += 1
            bar.update(n)
        bar.close()
        release_free_memory()
        return self

    def fork(self) -> "Replay":
        """An independent copy (cache included) that continues from the same position."""
        new = copy.copy(self)
        # The cache remembers the model it is bound to (and a policy may hold model data): share it, never copy it.
        new.cache = copy.deepcopy(self.cache, {id(self.model): self.model})
        new._col = self._col.copy()
        return new

    def result(self) -> ReplayResult:
        res = self._col.result(self.forwards)
        if self.score_from > 0:  # chunks straddling score_from were scored whole; report the same set always
            res.logprobs[:, : self.score_from] = float("nan")
            res.argmax[:, : self.score_from] = -1
        return res


@torch.no_grad()
def replay(
    model,
    input_ids: torch.Tensor,
    cache: EvictingCache,
    *,
    prompt_len: int,
    max_chunk: Optional[int] = None,
    progress: bool = False,
    score_from: int = 0,
) -> ReplayResult:
    """Teacher-force ``input_ids[B, T]`` through ``cache`` with eviction rounds exactly where
    token-by-token decoding has them.

    The prompt ``[:prompt_len]`` is prefilled; then each chunk runs up to the next round (the
    cache rounds when it holds ``K + r`` pairs, so chunks are ``r`` tokens once rounds start). Within
    a chunk no round can happen, so every token sees the same cache it would see when decoded one
    at a time; ``max_chunk`` caps chunk length for memory. Tokens before ``score_from`` are not
    scored (NaN log-probs), which skips the LM head for them.
    """
    return Replay(model, input_ids, cache, prompt_len=prompt_len, max_chunk=max_chunk, score_from=score_from).run(
        progress=progress
    ).result()


@torch.no_grad()
def replay_tokenwise(model, input_ids: torch.Tensor, cache: EvictingCache, *, prompt_len: int) -> ReplayResult:
    """Reference for :func:`replay`: prefill the prompt, then feed one token per forward."""
    col = _prefill(model, input_ids, cache, prompt_len)
    for pos in range(prompt_len, input_ids.shape[1]):
        col.add(pos, decode_step(model, input_ids[:, pos : pos + 1], cache))
    return col.result(1 + input_ids.shape[1] - prompt_len)
