"""The learned/heuristic selectors Random Attention is measured against, on the same core.

Each is a :class:`~randattn.policies.Policy` whose score the cache ranks per KV head after its
own prompt protection and keep-masks, so every selector runs with protection on or off. Pins a
selector makes itself (observation windows, sinks, VaSE's top set) are ``+inf`` scores.

GQA: a KV head serves a group of query heads; ``aggregate`` says how the group's attention
probabilities are combined into the KV head's (``"mean"`` or ``"max"``), with a default per policy.

Recent queries are the last ``window`` post-RoPE queries captured by :mod:`randattn.capture`
(attention is never patched). Attention from those queries is computed over the slots the cache
holds now, masked causally by absolute position.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .policies import CacheView, Policy, register_policy

__all__ = [
    "window_attention",
    "pool_scores",
    "H2OPolicy",
    "SnapKVPolicy",
    "RKVPolicy",
    "VaSEPolicy",
]

_AGGREGATES = ("mean", "max")


def _check_aggregate(name: str, aggregate: str) -> str:
    if aggregate not in _AGGREGATES:
        raise ValueError(f"{name}: aggregate must be one of {_AGGREGATES}, got {aggregate!r}")
    return aggregate


def _check_positive(name: str, **values) -> None:
    for key, val in values.items():
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name}: {key} must be a positive integer, got {val!r}")


def _group(t: torch.Tensor, kv_heads: int, aggregate: str) -> torch.Tensor:
    """Combine query heads ``[B, H_q, ...]`` into their KV heads ``[B, H_kv, ...]``."""
    b, hq = t.shape[:2]
    t = t.reshape(b, kv_heads, hq // kv_heads, *t.shape[2:])
    return t.mean(dim=2) if aggregate == "mean" else t.amax(dim=2)


def _need_queries(view: CacheView, policy: str) -> None:
    if view.queries is None:
        raise RuntimeError(
            f"policy {policy!r} needs the recent queries, but none were captured: drive the model through "
            f"randattn.generate / replay / decode_step, or call randattn.install_guards(model) before model.generate"
        )


def window_attention(view: CacheView, aggregate: str = "mean") -> torch.Tensor:
    """Attention probabilities of the recent queries over the cached slots, per KV head:
    ``[B, H_kv, w, S]``. Query ``t`` sees slot ``j`` only if ``position_j <= t``; the group's
    probabilities are combined with ``aggregate``."""
    q = view.queries.to(torch.float32)
    k = view.keys.to(torch.float32)
    b, hq, w, d = q.shape
    h = k.shape[1]
    k = k.repeat_interleave(hq // h, dim=1)
    logits = (q @ k.transpose(-1, -2)) * (view.scaling if view.scaling is not None else d**-0.5)
    slot_pos = view.positions.repeat_interleave(hq // h, dim=1)
    visible = slot_pos[:, :, None, :] <= view.query_positions.to(slot_pos.device)[None, None, :, None]
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    # A recent query whose own key and every older one were evicted sees nothing: it votes for nothing.
    probs = torch.nan_to_num(probs, nan=0.0)
    return _group(probs, h, aggregate)


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Pool ``[B, H, S]`` over neighbouring slots (stride 1, same length). Slot ``i`` pools slots
    ``i - kernel//2 .. i - kernel//2 + kernel - 1`` (symmetric for odd kernels; an even kernel
    leans one slot towards the older side)."""
    if kernel <= 1:
        return scores
    b, h, s = scores.shape
    x = scores.reshape(b * h, 1, s)
    if pooling == "max":
        x = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        x = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return x[..., :s].reshape(b, h, s)


def _pin_recent(scores: torch.Tensor, view: CacheView, count: int) -> torch.Tensor:
    if count <= 0:
        return scores
    recent = view.positions >= view.seq_len - count
    return scores.masked_fill(recent, float("inf"))


@register_policy("h2o")
class H2OPolicy(Policy):
    """H2O (heavy-hitter oracle): keep the pairs that received the most attention, plus a recent window.

    score_i = agg_{h in group} A_{h,i}, where A_{h,i} = sum over every query t processed since
    pair i entered the cache of softmax_t(q_t . k / sqrt(d))_i (accumulated by the cache at each
    forward). The most recent ``round(recent_fraction * K)`` positions are pinned, as in H2O's
    heavy-hitter + recent split (default half and half). ``aggregate`` default ``"mean"``.
    """

    needs = frozenset({"attention"})
    window = 1

    def __init__(self, recent_fraction: float = 0.5, aggregate: str = "mean"):
        if not 0.0 <= float(recent_fraction) < 1.0:
            raise ValueError(f"h2o: recent_fraction must be in [0, 1), got {recent_fraction!r}")
        self.recent_fraction = float(recent_fraction)
        self.aggregate = _check_aggregate("h2o", aggregate)

    def score(self, view: CacheView) -> torch.Tensor:
        if view.attention is None:
            raise RuntimeError("policy 'h2o' got no accumulated attention; see randattn.install_guards")
        scores = _group(view.attention, view.keys.shape[1], self.aggregate)
        return _pin_recent(scores, view, round(self.recent_fraction * view.budget))


@register_policy("snapkv")
class SnapKVPolicy(Policy):
    """SnapKV: keep what the most recent queries attend to, smoothed over neighbouring positions.

    score_i = pool_k( sum_{t in last w queries} agg_{h in group} softmax_t(q_{t,h} . k / sqrt(d))_i ),
    pooled over ``kernel`` neighbouring slots (``pooling`` "max" or "avg"; slots are chronological,
    so neighbours are neighbouring positions). The observation window (the last ``window``
    positions) is always kept, as in SnapKV. Defaults: window 32, kernel 7, max pooling, mean over
    the query group.
    """

    needs = frozenset({"queries"})

    def __init__(self, window: int = 32, kernel: int = 7, pooling: str = "max", aggregate: str = "mean"):
        _check_positive("snapkv", window=window, kernel=kernel)
        if pooling not in ("max", "avg"):
            raise ValueError(f"snapkv: pooling must be 'max' or 'avg', got {pooling!r}")
        self.window, self.kernel, self.pooling = window, kernel, pooling
        self.aggregate = _check_aggregate("snapkv", aggregate)

    def importance(self, view: CacheView) -> torch.Tensor:
        _need_queries(view, self.name)
        attn = window_attention(view, self.aggregate).sum(dim=2)
        return pool_scores(attn, self.kernel, self.pooling)

    def score(self, view: CacheView) -> torch.Tensor:
        return _pin_recent(self.importance(view), view, self.window)


def redundancy(keys: torch.Tensor, threshold: float) -> torch.Tensor:
    """R-KV's redundancy ``c_i`` per slot ``[B, H, S]``: mean over the other slots ``j`` of
    ``cos(k_i, k_j)`` counted only where it is ``>= threshold`` and ``j`` is newer than ``i``.
    Of a cluster of near-identical keys the newest copy therefore carries no penalty (it is the
    one spared), and every older copy is penalised."""
    k = F.normalize(keys.to(torch.float32), dim=-1)
    sim = k @ k.transpose(-1, -2)  # [B, H, S, S]
    s = sim.shape[-1]
    newer = torch.ones(s, s, dtype=torch.bool, device=sim.device).triu(diagonal=1)  # j > i
    sim = torch.where((sim >= threshold) & newer, sim, torch.zeros((), device=sim.device))
    return sim.sum(-1) / max(s - 1, 1)


def _unit_scale(x: torch.Tensor) -> torch.Tensor:
    """Divide each head's scores by their maximum (so they lie in [0, 1]); all-zero heads stay zero."""
    top = x.amax(dim=-1, keepdim=True)
    return torch.where(top > 0, x / top.clamp_min(1e-30), torch.zeros_like(x))


@register_policy("rkv")
class RKVPolicy(Policy):
    """R-KV: SnapKV-style importance mixed with a redundancy penalty from key similarity.

    score_i = lam * I_i / max_j I_j + (1 - lam) * (1 - c_i / max_j c_j), where I is SnapKV's
    pooled window attention (``window`` 8, ``kernel`` 7, max pooling, GQA ``aggregate`` "max")
    and ``c`` is :func:`redundancy` with cosine ``threshold`` 0.5 (the newest copy of a redundant
    cluster is spared). ``lam`` defaults to 0.1 (redundancy dominates, importance breaks ties).
    The observation window (last ``window`` positions) is always kept.
    """

    needs = frozenset({"queries"})

    def __init__(self, window: int = 8, kernel: int = 7, pooling: str = "max", aggregate: str = "max",
                 lam: float = 0.1, threshold: float = 0.5):
        if not 0.0 <= float(lam) <= 1.0:
            raise ValueError(f"rkv: lam must be in [0, 1], got {lam!r}")
        if not -1.0 <= float(threshold) <= 1.0:
            raise ValueError(f"rkv: threshold is a cosine similarity in [-1, 1], got {threshold!r}")
        self._snap = SnapKVPolicy(window=window, kernel=kernel, pooling=pooling, aggregate=aggregate)
        self.window, self.kernel, self.pooling, self.aggregate = window, kernel, pooling, aggregate
        self.lam, self.threshold = float(lam), float(threshold)

    def score(self, view: CacheView) -> torch.Tensor:
        importance = _unit_scale(self._snap.importance(view))
        red = _unit_scale(redundancy(view.keys, self.threshold))
        scores = self.lam * importance + (1.0 - self.lam) * (1.0 - red)
        return _pin_recent(scores, view, self.window)


@register_policy("vase")
class VaSEPolicy(Policy):
    """VaSE: a fixed top set by value range, attention sinks, the rest sampled by SnapKV score.

    The ``n_top`` pairs with the largest value range ``max_d v_i - min_d v_i`` (default K // 8) and
    the first ``n_sink`` positions (default 4) are kept. The remaining places are filled by sampling
    without replacement with probability proportional to the SnapKV score (window 32, kernel 7,
    max pooling, mean over the group), using the Gumbel-top-k trick with the cache's seeded
    generator: score_i = log(snap_i) + G_i, G_i ~ Gumbel(0, 1).
    """

    needs = frozenset({"queries"})

    def __init__(self, n_top: "int | None" = None, n_sink: int = 4, window: int = 32, kernel: int = 7,
                 pooling: str = "max", aggregate: str = "mean"):
        if n_top is not None:
            _check_positive("vase", n_top=n_top)
        if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 0:
            raise ValueError(f"vase: n_sink must be a non-negative integer, got {n_sink!r}")
        self._snap = SnapKVPolicy(window=window, kernel=kernel, pooling=pooling, aggregate=aggregate)
        self.n_top, self.n_sink = n_top, n_sink
        self.window, self.kernel, self.pooling, self.aggregate = window, kernel, pooling, aggregate

    def score(self, view: CacheView) -> torch.Tensor:
        snap = self._snap.importance(view)
        u = torch.rand(snap.shape, generator=view.generator, device=snap.device, dtype=torch.float32)
        gumbel = -torch.log(-torch.log(u.clamp(1e-20, 1.0 - 1e-7)))
        scores = torch.log(snap.clamp_min(1e-30)) + gumbel
        n_top = self.n_top if self.n_top is not None else max(1, view.budget // 8)
        vrange = view.values.amax(dim=-1) - view.values.amin(dim=-1)  # [B, H, S]
        n_top = min(n_top, vrange.shape[-1])
        top = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, vrange.topk(n_top, dim=-1).indices, True)
        sinks = view.positions < self.n_sink
        return scores.masked_fill(top | sinks, math.inf)
