"""The selectors Random Attention is measured against, as the paper ran them, on the same core.

Each is a :class:`~randattn.policies.Policy` whose score the cache ranks per KV head over the
round's candidates (every stored pair but the newest ``recent``), after its own prompt protection
and keep-masks, so every selector runs with protection on or off. Pins a selector makes itself
(sinks, VaSE's top set) are ``+inf`` scores.

By default every selector is the mode of the paper's engine (``kvcompress/engine/cache_utils.py``
in ``SalesforceAIResearch/Random-Attention``) with the settings of its grid
(``scripts/run_cell.sh``); where the original authors' settings differ they are a named variant:

====================  ==========================  ===============================================
name                  paper mode / source         score of a candidate
====================  ==========================  ===============================================
``snapkv``            ``attn`` (``--smooth``)     attention of the queries since the last round
                                                  (softmax over candidates, mean over queries),
                                                  average-pooled k=5, mean over the query group
``snapkv-longbench``  SnapKV (FasterDecoding)     last 32 queries, max-pooled k=7, the
                                                  observation window kept
``rkv``               ``attn_rkv``, lambda 0.5    ``lam * snapkv - (1 - lam) * softmax(mean cos)``
``rkv-official``      ``rkv_official``, lam 0.1   R-KV authors': last 8 queries, max over the group
                                                  of logits, max-pool k=7, thresholded redundancy
``vase``              ``range_sink_sample_attn``  top ``T/4`` by value range (4 sinks forced in),
                                                  the rest sampled by the snapkv score
``h2o``               (not in the paper's grid)   accumulated attention received + recent half
====================  ==========================  ===============================================

Attention is ``q . k / sqrt(head_dim)`` as in the paper's engine (its ``temperature`` is 1); a recent
query is masked from candidates newer than itself (only possible when its window reaches past the recent
window). SnapKV and R-KV score in float32 by default (``score_dtype="float32"``, the toolkit's choice: every
shipped row was scored so); the paper's engine scores in its model's dtype, bf16 in its runs, which rounds
many candidates to equal scores: ``score_dtype="bfloat16"`` (or ``"model"``: the keys' dtype) rounds where
the engine does and keeps its sets, ties broken by ``torch.topk`` as the engine's are.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .policies import CacheView, Policy, register_policy

__all__ = [
    "attention_logits",
    "window_attention",
    "pool_scores",
    "cosine_redundancy",
    "official_redundancy",
    "H2OPolicy",
    "SnapKVPolicy",
    "RKVPolicy",
    "RKVOfficialPolicy",
    "VaSEPolicy",
]

_AGGREGATES = ("mean", "max")
#: ``score_dtype`` names: the dtype SnapKV / R-KV scores are computed and rounded in ("model": the keys' own).
SCORE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "model": None}


def _check_score_dtype(name: str, score_dtype) -> str:
    if score_dtype not in SCORE_DTYPES:
        raise ValueError(f"{name}: score_dtype must be one of {tuple(SCORE_DTYPES)} (float32 is the default; the paper's "
                         f"engine scores in its model's dtype, bfloat16), got {score_dtype!r}")
    return score_dtype


def _score_dtype(view: CacheView, score_dtype: str) -> torch.dtype:
    return SCORE_DTYPES[score_dtype] or view.keys.dtype


def _check_aggregate(name: str, aggregate: str) -> str:
    if aggregate not in _AGGREGATES:
        raise ValueError(f"{name}: aggregate must be one of {_AGGREGATES}, got {aggregate!r}")
    return aggregate


def _check_positive(name: str, **values) -> None:
    for key, val in values.items():
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name}: {key} must be a positive integer, got {val!r}")


def _check_window(name: str, window) -> None:
    if window is not None:
        _check_positive(name, window=window)


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


def attention_logits(view: CacheView, window: Optional[int] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits ``q . k / sqrt(D)`` of the last ``window`` captured queries (default all) over the candidates,
    ``[B, H_q, w, S]`` in ``dtype`` (rounded after the product and after the scale, as the paper's engine in its
    model's dtype), ``-inf`` where a query is older than the candidate."""
    q = view.queries.to(dtype)
    qpos = view.query_positions
    if window is not None:
        q, qpos = q[:, :, -window:], qpos[-window:]
    k = view.keys.to(dtype)
    hq, h = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // h, dim=1)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    slot_pos = view.positions.repeat_interleave(hq // h, dim=1)
    visible = slot_pos[:, :, None, :] <= qpos.to(slot_pos.device)[None, None, :, None]
    return logits.masked_fill(~visible, float("-inf"))


def _softmax(logits: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    # In float32, rounded once to ``out_dtype`` (default the logits'), as the paper's engine. A query that sees no
    # candidate at all votes for nothing.
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1, dtype=torch.float32), nan=0.0)
    return probs.to(logits.dtype if out_dtype is None else out_dtype)


def window_attention(view: CacheView, aggregate: str = "mean", window: Optional[int] = None) -> torch.Tensor:
    """Attention probabilities of the recent queries over the candidates, per KV head: ``[B, H_kv, w, S]``
    (softmax over the candidates only, as the paper's engine; the group's probabilities combined with
    ``aggregate``)."""
    return _group(_softmax(attention_logits(view, window)), view.keys.shape[1], aggregate)


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Pool ``[B, H, S]`` over neighbouring slots (stride 1, same length, padding ``kernel // 2``).

    ``"avg"`` counts the zero padding, as ``F.avg_pool1d``'s default (the paper's engine, after
    kvpress's SnapKVPress): the first and last ``kernel // 2`` slots are divided by ``kernel`` too.
    An even kernel leans one slot towards the older side."""
    if kernel <= 1:
        return scores
    b, h, s = scores.shape
    x = scores.reshape(b * h, 1, s)
    if pooling == "max":
        x = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        x = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2)
    return x[..., :s].reshape(b, h, s)


def _pin_recent(scores: torch.Tensor, view: CacheView, count: int) -> torch.Tensor:
    if count <= 0:
        return scores
    recent = view.positions >= view.seq_len - count
    return scores.masked_fill(recent, float("inf"))


def _cosine(keys: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    k = keys.to(dtype)
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = k @ k.transpose(-1, -2)  # [B, H, S, S]
    return sim.masked_fill(torch.eye(sim.shape[-1], dtype=torch.bool, device=sim.device), 0.0)


def cosine_redundancy(keys: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The paper's ``attn_rkv`` redundancy per candidate ``[B, H, S]``: softmax over candidates of the mean
    cosine similarity to the other candidates (self-similarity zeroed), computed in ``dtype``."""
    return _cosine(keys, dtype).mean(dim=-2).softmax(dim=-1)


def official_redundancy(keys: torch.Tensor, threshold: float = 0.5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The R-KV authors' redundancy (``rkv_official``): cosine matrix with the diagonal zeroed; in every row
    the newest candidate more similar than ``threshold`` is spared (its entry zeroed; the oldest slot's
    when none is); column means; softmax over candidates."""
    sim = _cosine(keys, dtype)
    s = sim.shape[-1]
    idx = torch.arange(s, device=sim.device)
    newest_similar = torch.where(sim > threshold, idx, torch.zeros_like(idx)).amax(dim=-1)  # [B, H, S]
    sim = sim.scatter(-1, newest_similar[..., None], 0.0)
    return sim.mean(dim=-2).softmax(dim=-1)


@register_policy("h2o")
class H2OPolicy(Policy):
    """H2O (heavy-hitter oracle): keep the pairs that received the most attention, plus a recent window.

    score_i = agg_{h in group} A_{h,i}, where A_{h,i} = sum over every query t processed since
    pair i entered the cache of softmax_t(q_t . k / sqrt(d))_i (accumulated by the cache at each
    forward). The most recent ``round(recent_fraction * T)`` positions are pinned, as in H2O's
    heavy-hitter + recent split (default half and half). ``aggregate`` default ``"mean"``. Not run
    in the paper's grid; kept for comparison.
    """

    paper_protection = False  # the paper grid's mode (Policy.paper_protection)
    uses_seed = False

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
    """SnapKV as the paper ran it (its engine's ``attn`` mode with ``--smooth``).

    score_i = mean_{g in group} pool_k( mean_{t in window} softmax_t(q_{t,g} . k / sqrt(D))_i ), with the
    softmax over the candidates only and the window the queries since the last round (``window=None``:
    the ``r`` buffered queries). Defaults: average pooling k=5 with the padding counted, mean over the
    query group, no observation-window pin (the engine's recent window keeps the newest ``r``), scores in float32
    (``score_dtype="bfloat16"``: rounded as the paper's engine in bf16). ``snapkv-longbench`` is the original
    authors' setting.
    """

    paper_protection = False  # the paper grid's mode (Policy.paper_protection)
    uses_seed = False

    needs = frozenset({"queries"})

    def __init__(self, window: Optional[int] = None, kernel: int = 5, pooling: str = "avg",
                 aggregate: str = "mean", keep_window: bool = False, score_dtype: str = "float32"):
        _check_window("snapkv", window)
        self.score_dtype = _check_score_dtype("snapkv", score_dtype)
        _check_positive("snapkv", kernel=kernel)
        if pooling not in ("max", "avg"):
            raise ValueError(f"snapkv: pooling must be 'max' or 'avg', got {pooling!r}")
        self.window, self.kernel, self.pooling = window, kernel, pooling
        self.aggregate = _check_aggregate("snapkv", aggregate)
        self.keep_window = bool(keep_window)

    def importance(self, view: CacheView) -> torch.Tensor:
        """The pooled window attention per KV head ``[B, H_kv, S]`` (pooling per query head, then the group)."""
        _need_queries(view, self.name)
        logits = attention_logits(view, self.window, _score_dtype(view, self.score_dtype))
        per_query_head = _softmax(logits).mean(dim=2)  # [B, H_q, S]
        pooled = pool_scores(per_query_head, self.kernel, self.pooling)
        return _group(pooled, view.keys.shape[1], self.aggregate)

    def score(self, view: CacheView) -> torch.Tensor:
        scores = self.importance(view)
        return _pin_recent(scores, view, self.window or view.buffer) if self.keep_window else scores


@register_policy("snapkv-longbench")
class SnapKVLongBenchPolicy(SnapKVPolicy):
    """SnapKV with its authors' LongBench setting (FasterDecoding/SnapKV): the last 32 queries, max pooling
    k=7, mean over the query group, and the observation window (the last 32 positions) kept."""

    def __init__(self, window: int = 32, kernel: int = 7, pooling: str = "max", aggregate: str = "mean",
                 keep_window: bool = True, score_dtype: str = "float32"):
        super().__init__(window=window, kernel=kernel, pooling=pooling, aggregate=aggregate, keep_window=keep_window,
                         score_dtype=score_dtype)


@register_policy("rkv")
class RKVPolicy(Policy):
    """R-KV as the paper's grid ran it (its engine's ``attn_rkv`` mode, ``--rkv_lambda 0.5 --smooth``).

    score_i = lam * I_i - (1 - lam) * R_i at raw scale, where I is :class:`SnapKVPolicy`'s importance
    (queries since the last round, average-pooled k=5, mean over the group) and R is
    :func:`cosine_redundancy` (softmax over candidates of the mean cosine similarity), both in ``score_dtype``
    (float32; ``"bfloat16"`` as the paper's engine). ``rkv-official`` is the R-KV authors' version.
    """

    paper_protection = False  # the paper grid's mode (Policy.paper_protection)
    uses_seed = False

    needs = frozenset({"queries"})

    def __init__(self, lam: float = 0.5, window: Optional[int] = None, kernel: int = 5, pooling: str = "avg",
                 aggregate: str = "mean", score_dtype: str = "float32"):
        if not 0.0 <= float(lam) <= 1.0:
            raise ValueError(f"rkv: lam must be in [0, 1], got {lam!r}")
        self.score_dtype = _check_score_dtype("rkv", score_dtype)
        self._snap = SnapKVPolicy(window=window, kernel=kernel, pooling=pooling, aggregate=aggregate,
                                  score_dtype=score_dtype)
        self.lam = float(lam)
        self.window, self.kernel, self.pooling, self.aggregate = window, kernel, pooling, aggregate

    def score(self, view: CacheView) -> torch.Tensor:
        self._snap.name = self.name
        red = cosine_redundancy(view.keys, _score_dtype(view, self.score_dtype))
        return self.lam * self._snap.importance(view) - (1.0 - self.lam) * red


@register_policy("rkv-official")
class RKVOfficialPolicy(Policy):
    """R-KV as its authors wrote it (Zefan-Cai/R-KV; the paper's ``rkv_official`` mode, lambda 0.1).

    Importance: logits of the last ``window`` (8; at most the buffer ``r``, as the paper's engine reads them
    from its buffer of ``r`` queries) queries, max over the query group, softmax over the
    candidates, mean over the queries, max pooling k=7. Redundancy: :func:`official_redundancy` (cosine
    ``threshold`` 0.5, the newest similar copy spared). score = lam * I - (1 - lam) * R, in ``score_dtype``
    (float32; ``"bfloat16"`` as the paper's engine: logits and cosines rounded, softmax and its mean in float32).
    """

    paper_protection = False  # the paper grid's mode (Policy.paper_protection)
    uses_seed = False

    needs = frozenset({"queries"})

    def __init__(self, lam: float = 0.1, window: int = 8, kernel: int = 7, threshold: float = 0.5,
                 score_dtype: str = "float32"):
        if not 0.0 <= float(lam) <= 1.0:
            raise ValueError(f"rkv-official: lam must be in [0, 1], got {lam!r}")
        if not -1.0 <= float(threshold) <= 1.0:
            raise ValueError(f"rkv-official: threshold is a cosine similarity in [-1, 1], got {threshold!r}")
        _check_positive("rkv-official", window=window, kernel=kernel)
        self.lam, self.window, self.kernel, self.threshold = float(lam), window, kernel, float(threshold)
        self.score_dtype = _check_score_dtype("rkv-official", score_dtype)

    def importance(self, view: CacheView) -> torch.Tensor:
        _need_queries(view, self.name)
        # The paper's engine reads them from its buffer of the last r queries: with r < 8, those r.
        window = min(self.window, view.buffer)
        dtype = _score_dtype(view, self.score_dtype)
        logits = _group(attention_logits(view, window, dtype), view.keys.shape[1], "max")  # [B, H_kv, w, S]
        # the authors' mean over the queries is taken in float32, before the cast back
        return pool_scores(_softmax(logits, torch.float32).mean(dim=2).to(dtype), self.kernel, "max")

    def score(self, view: CacheView) -> torch.Tensor:
        red = official_redundancy(view.keys, self.threshold, _score_dtype(view, self.score_dtype))
        return self.lam * self.importance(view) - (1.0 - self.lam) * red


@register_policy("vase")
class VaSEPolicy(Policy):
    """VaSE as the paper ran it (its engine's ``range_sink_sample_attn`` mode, ``--n_large T/4 --smooth``).

    A top set of ``n_top`` candidates by value range ``max_d v - min_d v`` (default ``T // 4``), with the
    first ``n_sink`` positions (4) forced into it; the remaining places are sampled without replacement in
    proportion to :class:`SnapKVPolicy`'s score (Gumbel-top-k with the cache's seeded generator:
    ``log(snap_i) + G_i``, the same distribution as ``torch.multinomial`` without replacement). Candidates
    the core already pins (the protected prompt: the paper's ``range_sink_sample_attn_pp``) are left out of
    the top set and the sample, which then fill the places left: ``min(n_top, keep - pinned)`` and the rest.
    With row keys (``view.row_key`` set) the value range is ranked at bfloat16 precision, so that the last-bit
    rounding of a batch's matmuls cannot reorder a token's tied copies (docs/cache.md, row keys).
    """

    paper_protection = False  # the paper grid's mode (Policy.paper_protection)
    needs = frozenset({"queries"})

    def __init__(self, n_top: "int | None" = None, n_sink: int = 4, window: Optional[int] = None, kernel: int = 5,
                 pooling: str = "avg", aggregate: str = "mean"):
        if n_top is not None:
            _check_positive("vase", n_top=n_top)
        if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 0:
            raise ValueError(f"vase: n_sink must be a non-negative integer, got {n_sink!r}")
        self._snap = SnapKVPolicy(window=window, kernel=kernel, pooling=pooling, aggregate=aggregate)
        self.n_top, self.n_sink = n_top, n_sink
        self.window, self.kernel, self.pooling, self.aggregate = window, kernel, pooling, aggregate

    def score(self, view: CacheView) -> torch.Tensor:
        self._snap.name = self.name
        snap = self._snap.importance(view)
        vrange = view.values.amax(dim=-1) - view.values.amin(dim=-1)  # [B, H, S]
        if view.row_key is not None:
            # Row keys promise keep-sets that do not depend on the batch. At layer 0 a value depends on the token only,
            # so a prompt token generated again ties its copy up to one rounding (one came from the prefill's matmul,
            # one from a decode step's), and which rounds higher follows the batch's shapes. Ranked at bfloat16
            # precision (the paper's engine's dtype) the two are equal, and every batch breaks the tie alike.
            vrange = vrange.to(torch.bfloat16)
        vrange = vrange.to(torch.float32)
        vrange = vrange.masked_fill(view.positions < self.n_sink, math.inf)
        pinned = view.pinned
        n_pinned = 0
        if pinned is not None:
            vrange = vrange.masked_fill(pinned, -math.inf)
            n_pinned = int(pinned.sum(-1).max())
        n_top = self.n_top if self.n_top is not None else max(1, view.budget // 4)
        n_top = max(0, min(n_top, view.keep - n_pinned, vrange.shape[-1]))
        u = torch.rand(snap.shape, generator=view.generator, device=snap.device, dtype=torch.float32)
        gumbel = -torch.log(-torch.log(u.clamp(1e-20, 1.0 - 1e-7)))
        scores = torch.log(snap.clamp_min(1e-30)) + gumbel
        if n_top:
            top = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, vrange.topk(n_top, dim=-1).indices, True)
            scores = scores.masked_fill(top, math.inf)
        return scores
