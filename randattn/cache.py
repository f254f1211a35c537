"""The evicting KV cache: periodic ``(K, r)`` eviction per layer and per KV head.

HF attention modules call ``cache.update(k, v, layer_idx)`` with post-RoPE keys. Each
:class:`EvictingLayer` appends them, returns everything it holds (so this step attends to all of
it, exactly as the mask was sized), and, when it holds ``K + r`` pairs or more, runs an eviction
round on what it *stores*: every head keeps its own top-``K`` by the policy's score, in
chronological order, and the rest are freed for good.

Slots no longer equal positions after a round, so the layer keeps the absolute position of every
slot (``positions[B, H_kv, P]``), reports the absolute length from :meth:`get_seq_length` (HF
derives ``position_ids`` from it, so new tokens keep their true positions) and the physical one
through :meth:`get_mask_sizes` (``kv_offset = L - P`` keeps the causal rule exact: every cached
slot precedes every new query).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .keeplog import KeepLog
from .policies import CacheView, Policy, make_policy

__all__ = ["EvictingCache", "EvictingLayer", "round_seed"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def round_seed(seed: int, layer_idx: int, round_idx: int) -> int:
    """Seed of the generator for one (seed, layer, round): well mixed, so neighbours don't correlate."""
    x = _splitmix64(seed & _MASK64)
    x = _splitmix64(x ^ (layer_idx & _MASK64))
    x = _splitmix64(x ^ (round_idx & _MASK64))
    return x & ((1 << 63) - 1)


@dataclass(frozen=True)
class _KeepRule:
    positions: torch.Tensor  # 1-D int64, CPU
    layers: Optional[frozenset]
    heads: Optional[frozenset]
    pin: bool  # True: keep no matter what; False: force-evict at the next round


class EvictingLayer(CacheLayerMixin):
    """One layer's evicting cache. Created by :class:`EvictingCache`; not used on its own."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, parent: "EvictingCache", layer_idx: int):
        super().__init__()
        self.parent = parent
        self.layer_idx = layer_idx
        self.positions: Optional[torch.Tensor] = None
        self._k = self._v = self._p = None  # buffers behind the keys/values/positions views
        self.seq_len = 0  # absolute length L seen by this layer
        self.events = 0  # applied eviction rounds

    # -- storage ------------------------------------------------------------------------------
    # keys/values/positions are views of the first P slots of buffers with room for K + r, so a
    # decode step writes only its new pair instead of copying the whole cache (as torch.cat would).
    # A round gathers into fresh buffers: the views already handed to attention stay intact.
    def _store(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        b, h, n, _ = keys.shape
        room = max(n, self.parent.budget + self.parent.buffer)
        self._k = keys.new_empty((b, h, room, keys.shape[-1]))
        self._v = values.new_empty((b, h, room, values.shape[-1]))
        self._p = positions.new_empty((b, h, room))
        self._k[:, :, :n] = keys
        self._v[:, :, :n] = values
        self._p[:, :, :n] = positions
        self._views(n)

    def _views(self, n: int) -> None:
        self.keys, self.values, self.positions = self._k[:, :, :n], self._v[:, :, :n], self._p[:, :, :n]

    def _append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        start, q = self.keys.shape[-2], keys.shape[-2]
        if start + q > self._k.shape[-2]:  # a long prefill or chunk: grow once
            self._store(
                torch.cat([self.keys, keys], dim=-2),
                torch.cat([self.values, values], dim=-2),
                torch.cat([self.positions, positions], dim=-1),
            )
            return
        self._k[:, :, start : start + q] = keys
        self._v[:, :, start : start + q] = values
        self._p[:, :, start : start + q] = positions
        self._views(start + q)

    # -- HF layer API -------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self._store(
            key_states.new_empty((b, h, 0, d)),
            value_states.new_empty((b, h, 0, value_states.shape[-1])),
            torch.empty((b, h, 0), dtype=torch.long, device=key_states.device),
        )
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.dim() != 4:
            raise ValueError(
                f"EvictingCache expects keys shaped [batch, kv_heads, tokens, head_dim], got {tuple(key_states.shape)} "
                f"at layer {self.layer_idx}; this architecture does not store per-head KV pairs the cache can evict"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape
        if self.keys.shape[0] != b or self.keys.shape[1] != h:
            raise ValueError(
                f"layer {self.layer_idx}: cache holds batch={self.keys.shape[0]}, kv_heads={self.keys.shape[1]} "
                f"but got batch={b}, kv_heads={h}; use a fresh EvictingCache per batch"
            )
        new_pos = torch.arange(self.seq_len, self.seq_len + q, device=self.positions.device)
        self._append(key_states, value_states, new_pos.expand(b, h, q))
        self.seq_len += q
        keys, values = self.keys, self.values
        p = self.parent
        if keys.shape[-2] >= p.budget + p.buffer:
            self._store(*p._evict(self, keys, values, self.positions))
        # This step attends to everything, as get_mask_sizes promised; the round only shrinks what is stored.
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        physical = self.keys.shape[-2] if self.is_initialized else 0
        return physical + query_length, self.seq_len - physical

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    @property
    def physical_length(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def reset(self) -> None:
        self.keys = self.values = self.positions = None
        self._k = self._v = self._p = None
        self.is_initialized = False
        self.seq_len = 0
        self.events = 0

    # Beam search and num_return_sequences move whole batch rows; positions move with them.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            idx = beam_idx.to(self.keys.device)
            self._store(self.keys.index_select(0, idx), self.values.index_select(0, idx), self.positions.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._store(
                self.keys.repeat_interleave(repeats, dim=0),
                self.values.repeat_interleave(repeats, dim=0),
                self.positions.repeat_interleave(repeats, dim=0),
            )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._store(self.keys[indices, ...], self.values[indices, ...], self.positions[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise NotImplementedError(
            "EvictingCache cannot be cropped: evicted pairs are gone, so rolling back tokens (assisted or "
            "speculative decoding, prompt lookup) is not supported. Generate without an assistant model."
        )


class EvictingCache(Cache):
    """A per-KV-head evicting KV cache for HF causal LMs.

    Args:
        policy: a policy name (see :func:`randattn.known_policies`), a :class:`Policy`, or a
            function ``score(view) -> Tensor[B, H_kv, S]`` (higher = keep).
        budget: ``K``, the pairs every KV head keeps after a round.
        buffer: ``r``, new pairs allowed on top of ``K`` before the next round (the paper's engine
            uses 64). A pair survives one Random round with probability ``K / (K + r)``.
        protect_prompt: pin positions ``0..prompt_len-1`` at ``+inf`` (the paper's "+ prompt
            protection" mode).
        prompt_len: ``l_p``; by default the length of the first forward (the prefill).
        seed: randomness is drawn per (seed, layer, round) in float32 on the cache's device.
        keep_log: record the kept absolute positions of every head at every round
            (:attr:`keep_log`, a :class:`KeepLog`).
        policy_kwargs: options for a named policy (e.g. ``n_sink=4`` for ``"streamingllm"``).

    Budget semantics: ``K`` is what each head keeps after a round and ``r`` the buffer on top, so
    the physical cache never exceeds ``K + r`` pairs per head (``K + r - 1`` between forwards).
    """

    def __init__(
        self,
        policy: "str | Policy | Callable" = "random",
        *,
        budget: int,
        buffer: int = 64,
        protect_prompt: bool = True,
        prompt_len: Optional[int] = None,
        seed: int = 0,
        keep_log: bool = False,
        **policy_kwargs,
    ):
        for name, val in (("budget", budget), ("buffer", buffer)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val <= 0:
                raise ValueError(f"{name} must be a positive integer (K pairs kept per head, r buffer), got {val!r}")
        if prompt_len is not None and (not isinstance(prompt_len, (int, np.integer)) or prompt_len < 0):
            raise ValueError(f"prompt_len must be a non-negative integer or None, got {prompt_len!r}")
        super().__init__(layers=[])
        self.policy = make_policy(policy, **policy_kwargs)
        self.budget = int(budget)
        self.buffer = int(buffer)
        self.protect_prompt = bool(protect_prompt)
        self.prompt_len: Optional[int] = None if prompt_len is None else int(prompt_len)
        self.seed = int(seed)
        self.keep_log: Optional[KeepLog] = KeepLog() if keep_log else None
        self.round_seconds = 0.0
        self.sync_timing = False  # set True to synchronise CUDA around rounds for exact timers
        self._rules: list[_KeepRule] = []
        if self.prompt_len is not None:
            self._check_prompt_fits(self.prompt_len)

    def __repr__(self) -> str:
        return (
            f"EvictingCache(policy={self.policy!r}, budget={self.budget}, buffer={self.buffer}, "
            f"protect_prompt={self.protect_prompt}, prompt_len={self.prompt_len}, seed={self.seed}, "
            f"layers={len(self.layers)}, events={self.events})"
        )

    # -- HF cache API --------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(EvictingLayer(self, len(self.layers)))
        layer = self.layers[layer_idx]
        if layer.seq_len == 0 and self.prompt_len is None:
            self.prompt_len = key_states.shape[-2]
            self._check_prompt_fits(self.prompt_len)
        return layer.update(key_states, value_states)

    # -- what happened -------------------------------------------------------------------------
    @property
    def events(self) -> list[int]:
        """Applied eviction rounds per layer (proof that compression really ran)."""
        return [layer.events for layer in self.layers]

    @property
    def total_events(self) -> int:
        return sum(self.events)

    def physical_length(self, layer_idx: int = 0) -> int:
        """Pairs per head stored now in ``layer_idx`` (``<= K + r - 1`` between forwards)."""
        return self.layers[layer_idx].physical_length if layer_idx < len(self.layers) else 0

    def positions(self, layer_idx: int) -> torch.Tensor:
        """Absolute positions stored in a layer, ``[B, H_kv, P]`` (chronological per head)."""
        return self.layers[layer_idx].positions

    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values of all layers (room for K + r pairs per head; positions excluded)."""
        return sum(l._k.nbytes + l._v.nbytes for l in self.layers if l.is_initialized)

    def stats(self) -> dict:
        return {
            "policy": self.policy.name,
            "budget": self.budget,
            "buffer": self.buffer,
            "protect_prompt": self.protect_prompt,
            "prompt_len": self.prompt_len,
            "seq_len": self.get_seq_length(),
            "events_per_layer": self.events,
            "round_seconds": self.round_seconds,
            "kv_bytes": self.kv_bytes(),
        }

    # -- keep-mask API ---------------------------------------------------------------------------
    def pin(self, positions: Iterable[int], *, layers: Optional[Iterable[int]] = None, heads: Optional[Iterable[int]] = None) -> None:
        """Keep these absolute positions in the given layers and KV heads (default: all) at every round."""
        self._add_rule(positions, layers, heads, pin=True)

    def force_evict(
        self, positions: Iterable[int], *, layers: Optional[Iterable[int]] = None, heads: Optional[Iterable[int]] = None
    ) -> None:
        """Evict these absolute positions from the given layers and KV heads (default: all) at the next
        round that sees them. Force-eviction overrides pins and prompt protection."""
        self._add_rule(positions, layers, heads, pin=False)

    def clear_keep_masks(self) -> None:
        self._rules.clear()

    def _add_rule(self, positions, layers, heads, *, pin: bool) -> None:
        pos = torch.as_tensor(list(positions) if not torch.is_tensor(positions) else positions, dtype=torch.long).flatten().cpu()
        if pos.numel() and int(pos.min()) < 0:
            raise ValueError(f"positions must be absolute token positions >= 0, got min {int(pos.min())}")
        for name, sel in (("layers", layers), ("heads", heads)):
            if sel is not None and any((not isinstance(i, (int, np.integer))) or i < 0 for i in sel):
                raise ValueError(f"{name} must be non-negative integer indices, got {list(sel)!r}")
        self._rules.append(
            _KeepRule(
                positions=pos,
                layers=None if layers is None else frozenset(int(i) for i in layers),
                heads=None if heads is None else frozenset(int(i) for i in heads),
                pin=pin,
            )
        )

    # -- the round -------------------------------------------------------------------------------
    def _check_prompt_fits(self, prompt_len: int) -> None:
        if self.protect_prompt and prompt_len + 1 > self.budget:
            raise ValueError(
                f"budget K={self.budget} cannot hold the protected prompt of {prompt_len} tokens plus one free slot; "
                f"use budget >= {prompt_len + 1} or protect_prompt=False"
            )

    def _rule_masks(self, layer_idx: int, positions: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        pinned = evicted = None
        n_heads = positions.shape[1]
        for rule in self._rules:
            if rule.layers is not None and layer_idx not in rule.layers:
                continue
            hit = torch.isin(positions, rule.positions.to(positions.device))
            if rule.heads is not None:
                bad = [h for h in rule.heads if h >= n_heads]
                if bad:
                    raise ValueError(f"keep-mask heads {sorted(bad)} out of range: the model has {n_heads} KV heads")
                sel = torch.zeros(n_heads, dtype=torch.bool, device=positions.device)
                sel[sorted(rule.heads)] = True
                hit = hit & sel[None, :, None]
            if rule.pin:
                pinned = hit if pinned is None else pinned | hit
            else:
                evicted = hit if evicted is None else evicted | hit
        return pinned, evicted

    def _evict(self, layer: EvictingLayer, keys, values, positions):
        timed_cuda = self.sync_timing and keys.is_cuda
        if timed_cuda:
            torch.cuda.synchronize(keys.device)
        t0 = time.perf_counter()
        gen = torch.Generator(device=keys.device)
        gen.manual_seed(round_seed(self.seed, layer.layer_idx, layer.events))
        prompt_len = self.prompt_len or 0
        view = CacheView(
            keys=keys,
            values=values,
            positions=positions,
            layer_idx=layer.layer_idx,
            round_idx=layer.events,
            prompt_len=prompt_len,
            seq_len=layer.seq_len,
            budget=self.budget,
            buffer=self.buffer,
            generator=gen,
        )
        scores = self._checked_scores(view)
        inf = torch.tensor(float("inf"), device=scores.device)
        if self.protect_prompt and prompt_len > 0:
            scores = torch.where(positions < prompt_len, inf, scores)
        pinned, evicted = self._rule_masks(layer.layer_idx, positions)
        if pinned is not None:
            scores = torch.where(pinned, inf, scores)
        if evicted is not None:
            scores = torch.where(evicted, -inf, scores)
        n_pinned = int(torch.isposinf(scores).sum(-1).max())
        if n_pinned > self.budget:
            raise ValueError(
                f"layer {layer.layer_idx}: {n_pinned} pairs are pinned (protected prompt + keep-mask pins) in one head "
                f"but the budget keeps only K={self.budget}; raise budget or pin fewer positions"
            )
        kept = torch.topk(scores, self.budget, dim=-1, sorted=False).indices
        if evicted is not None and bool(torch.isneginf(torch.gather(scores, -1, kept)).any()):
            raise ValueError(
                f"layer {layer.layer_idx}: force-evicted positions exceed what one round can drop "
                f"({positions.shape[-1] - self.budget} of {positions.shape[-1]} pairs); force-evict fewer positions "
                f"per round or use a larger buffer"
            )
        # topk returns score order; sorting the slot indices keeps every head chronological.
        kept = kept.sort(dim=-1).values
        gather_idx = kept[..., None]
        keys = torch.gather(keys, 2, gather_idx.expand(-1, -1, -1, keys.shape[-1]))
        values = torch.gather(values, 2, gather_idx.expand(-1, -1, -1, values.shape[-1]))
        positions = torch.gather(positions, 2, kept)
        if self.keep_log is not None:
            self.keep_log.record(layer.layer_idx, layer.events, layer.seq_len, positions)
        layer.events += 1
        if timed_cuda:
            torch.cuda.synchronize(keys.device)
        self.round_seconds += time.perf_counter() - t0
        return keys, values, positions

    def _checked_scores(self, view: CacheView) -> torch.Tensor:
        try:
            scores = self.policy.score(view)
        except Exception as exc:
            raise RuntimeError(f"policy {self.policy.name!r} failed at layer {view.layer_idx}, round {view.round_idx}: {exc}") from exc
        if not torch.is_tensor(scores):
            raise TypeError(f"policy {self.policy.name!r} returned {type(scores).__name__}; expected a Tensor shaped {view.shape}")
        try:
            scores = torch.broadcast_to(scores, view.shape)
        except RuntimeError:
            raise ValueError(
                f"policy {self.policy.name!r} returned scores shaped {tuple(scores.shape)}; expected [B, H_kv, S] = "
                f"{list(view.shape)} (or broadcastable to it)"
            ) from None
        scores = scores.to(torch.float32)
        if bool(torch.isnan(scores).any()):
            raise ValueError(f"policy {self.policy.name!r} returned NaN scores at layer {view.layer_idx}, round {view.round_idx}")
        return scores
