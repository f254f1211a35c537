"""An independent reference of the paper's eviction engine, for the conformance tests.

Written from the behaviour of ``EvictLayer._run_eviction`` in the paper's released engine
(``kvcompress/engine/cache_utils.py`` and ``triattn_official.py`` of
``SalesforceAIResearch/Random-Attention``), as plain loops over batch rows, KV heads, query heads
and queries in float64 (or, with ``dtype``, rounded where the engine's tensors in its model's dtype round:
bf16 in the paper's runs). Ties are broken by ``torch.topk``, as the engine's ``scores.topk(K)``. Nothing
here imports randattn's selection code: it is the yardstick the package is measured against.

One round of one layer: the layer stores ``N = T + r`` slots; the candidates are the first ``N - r``
(everything but the newest ``r``); ``K = T - r`` of them are kept per head, then the ``r`` newest are
moved over untouched. Every function returns, per ``(b, h)``, the sorted candidate slots kept.
"""

from __future__ import annotations

import math

import torch


def _softmax(x: torch.Tensor) -> torch.Tensor:
    x = x - x.max()
    e = torch.exp(x)
    return e / e.sum()


def _avg_pool_counting_pads(x: torch.Tensor, kernel: int) -> torch.Tensor:
    half = kernel // 2
    n = x.shape[0]
    return torch.stack([sum(x[i] for i in range(j - half, j + half + 1) if 0 <= i < n) / kernel for j in range(n)])


def _max_pool(x: torch.Tensor, kernel: int) -> torch.Tensor:
    half = kernel // 2
    n = x.shape[0]
    return torch.stack([max(x[i] for i in range(max(0, j - half), min(n, j + half + 1))) for j in range(n)])


def _topk(scores: list, k: int) -> list:
    # The engine's ``scores.topk(K)``: among equal scores at the boundary it keeps the ones torch.topk returns
    # (not the oldest; CPU and CUDA differ). topk only compares, so a float64 copy of the same scores takes the
    # same choice as the engine's tensor in its own dtype.
    return sorted(torch.topk(torch.tensor(scores, dtype=torch.float64), k).indices.tolist())


def _rounder(dtype):
    """Round a float64 value to ``dtype`` and back: the points where the engine's tensors, held in the model's
    dtype, round (identity for float64, the exact yardstick)."""
    if dtype is None or dtype == torch.float64:
        return lambda x: x
    return lambda x: x.to(dtype).double()


def attention_importance(k: torch.Tensor, q: torch.Tensor, smooth: bool, dtype=None) -> torch.Tensor:
    """The engine's ``compute_attention_scores`` for one KV head: ``k [n, D]`` candidates, ``q [G, w, D]``
    its query heads' buffered queries (unscaled). Logits ``q . k / sqrt(D)``, softmax over candidates per
    query, mean over queries, average pool k=5 (zero padding counted) when ``smooth``, mean over the group.
    ``dtype`` rounds where the engine does with tensors in that dtype: the logits after the matmul and after
    the scale, the float32 softmax when cast back, the mean, the pool and the group mean."""
    rnd = _rounder(dtype)
    f32 = _rounder(torch.float32)
    scale = math.sqrt(q.shape[-1])
    per_group = []
    for g in range(q.shape[0]):
        probs = []
        for t in range(q.shape[1]):
            logits = torch.stack([rnd(rnd(q[g, t] @ k[j]) / scale) for j in range(k.shape[0])])
            probs.append(rnd(f32(_softmax(logits))) if dtype is not None else _softmax(logits))
        a = rnd(torch.stack(probs).mean(0))
        per_group.append(rnd(_avg_pool_counting_pads(a, 5)) if smooth else a)
    return rnd(torch.stack(per_group).mean(0))


def _cos(k: torch.Tensor, dtype=None) -> torch.Tensor:
    rnd = _rounder(dtype)
    n = k.shape[0]
    norm = [rnd(k[i] / rnd(rnd(k[i].norm()) + 1e-8)) for i in range(n)]
    return torch.stack([torch.stack([torch.tensor(0.0, dtype=k.dtype) if i == j else rnd(norm[i] @ norm[j])
                                     for j in range(n)]) for i in range(n)])


def _column_mean(m: torch.Tensor) -> torch.Tensor:
    # Summed row by row in order: equal columns (a zero in different rows) get exactly equal means, as they do in
    # the engine's float32 and bf16 reductions of exactly representable cosines; a vectorised float64 mean can
    # split the sums differently per column and turn such ties into ulp differences.
    n = m.shape[0]
    return torch.stack([sum((m[i, j] for i in range(n)), torch.tensor(0.0, dtype=m.dtype)) / n
                        for j in range(m.shape[1])])


def rkv_redundancy(k: torch.Tensor, dtype=None) -> torch.Tensor:
    """``cal_redundancy``: softmax over candidates of the column mean of the cosine matrix, diagonal zeroed
    (``dtype``: rounded as the engine's tensors in it, the softmax computed in float32 and rounded once)."""
    rnd = _rounder(dtype)
    return rnd(_softmax(rnd(_column_mean(_cos(k, dtype)))))


def rkv_official_redundancy(k: torch.Tensor, threshold: float = 0.5, dtype=None) -> torch.Tensor:
    rnd = _rounder(dtype)
    cs = _cos(k, dtype)
    n = k.shape[0]
    for i in range(n):
        similar = [j for j in range(n) if cs[i, j] > threshold]
        cs[i, max(similar) if similar else 0] = 0.0
    return rnd(_softmax(rnd(_column_mean(cs))))


def rkv_official_importance(k: torch.Tensor, q: torch.Tensor, dtype=None) -> torch.Tensor:
    """Last 8 queries; the max over the query group of the logits; softmax; mean; max pool k=7 (``dtype``: the
    logits rounded after the matmul and the scale, the float32 softmax and mean rounded once)."""
    rnd, f32 = _rounder(dtype), _rounder(torch.float32)
    scale = math.sqrt(q.shape[-1])
    q8 = q[:, -8:]
    probs = []
    for t in range(q8.shape[1]):
        logits = torch.stack([max(rnd(rnd(q8[g, t] @ k[j]) / scale) for g in range(q8.shape[0]))
                              for j in range(k.shape[0])])
        probs.append(f32(_softmax(logits)) if dtype is not None else _softmax(logits))
    return _max_pool(rnd(f32(torch.stack(probs).mean(0)) if dtype is not None else torch.stack(probs).mean(0)), 7)


def _combine(importance, redundancy, lam, dtype=None):
    """``lam * importance - (1 - lam) * redundancy``, each product and the difference rounded in ``dtype``."""
    rnd = _rounder(dtype)
    return rnd(rnd(importance * lam) - rnd(redundancy * (1 - lam)))


def keep(mode: str, keys, values, queries, prompt_len: int, budget: int, recent: int, *, lam: float = 0.5,
         smooth: bool = True, n_large: int | None = None, dtype=None, uniform=None, plan_prefix: int = 768) -> list:
    """``[B][H]`` sorted kept candidate slots for a deterministic mode, or (for ``range_sink_sample_attn``)
    ``(top set, sampling weights)`` per head. keys/values ``[B, H, N, D]``, queries ``[B, H_q, w, D]``.
    ``dtype``: the attention modes' scores rounded as the engine's tensors in that dtype (its model's, bf16 in
    the paper's runs); default exact. ``random_ppp`` ranks the engine's uniform draw ``uniform [B, H, N - r]``."""
    keys, values, queries = keys.double(), values.double(), queries.double()
    b_n, h_n, n, _ = keys.shape
    group = queries.shape[1] // h_n
    n_cand = n - recent
    k_sel = budget - recent
    pl = min(prompt_len, k_sel - 1)
    out = []
    for b in range(b_n):
        row = []
        for h in range(h_n):
            k = keys[b, h, :n_cand]
            v = values[b, h, :n_cand]
            q = queries[b, h * group:(h + 1) * group]
            if mode in ("attn", "attn_pp", "attn_rkv", "attn_rkv_pp"):
                s = attention_importance(k, q, smooth, dtype)
                if "rkv" in mode:
                    s = _combine(s, rkv_redundancy(k, dtype), lam, dtype)
                s = s.tolist()
                if mode.endswith("_pp"):
                    s[:pl] = [math.inf] * pl
                row.append(_topk(s, k_sel))
            elif mode == "rkv_official":
                s = _combine(rkv_official_importance(k, q, dtype), rkv_official_redundancy(k, dtype=dtype), lam,
                             dtype).tolist()
                row.append(_topk(s, k_sel))
            elif mode in ("range_sink_sample_attn", "range_sink_sample_attn_pp"):
                vmag = [float(v[j].max() - v[j].min()) for j in range(n_cand)]
                vmag[:4] = [math.inf] * min(4, n_cand)
                weights = attention_importance(k, q, smooth).tolist()
                large = n_large if n_large is not None else budget // 4
                if mode.endswith("_pp"):
                    vmag[:pl] = [-math.inf] * pl
                    weights[:pl] = [0.0] * pl
                    large = min(large, k_sel - pl)
                top = _topk(vmag, large)
                for j in top:
                    weights[j] = 0.0
                prompt = list(range(pl)) if mode.endswith("_pp") else []
                row.append((sorted(set(top) | set(prompt)), weights))
            elif mode == "recency_pp":
                s = [float(j) for j in range(n_cand)]
                s[:pl] = [math.inf] * pl
                row.append(_topk(s, k_sel))
            elif mode == "random_ppp":
                # The engine's slice ``rs[..., :min(pl + P, K - 64)]``: a negative end (K < 64) pins all but the
                # last |K - 64| slots, possibly more than K of them (then topk breaks the tie).
                s = [float(x) for x in uniform[b, h, :n_cand]]
                end = min(pl + plan_prefix, k_sel - 64)
                s[:end] = [math.inf] * len(s[:end])
                row.append(_topk(s, k_sel))
            else:
                raise ValueError(mode)
        out.append(row)
    return out


# -- TriAttention (triattn_official.py: score_keys_for_round and its statistics) -------------------------------
def triattention_head_scores(k_post, positions, round_start, qbar, mbar, inv_freq, offsets) -> torch.Tensor:
    """One query head's score of every candidate: un-rotate the post-RoPE key by its position, then
    ``mean_offsets sum_f |q_f||k_f| cos((round_start - p + delta) w_f + phi_f) + sum_f (mbar_f - |q_f|) |k_f|``."""
    half = inv_freq.shape[0]
    qc = torch.complex(qbar[:half].double(), qbar[half:2 * half].double())
    scores = []
    for j in range(k_post.shape[0]):
        p = float(positions[j])
        kc = torch.complex(k_post[j, :half].double(), k_post[j, half:2 * half].double())
        kpre = kc * torch.polar(torch.ones(half, dtype=torch.float64), -p * inv_freq.double())
        amp = qc.abs() * kpre.abs()
        rel = qc * kpre.conj()
        phi = torch.atan2(rel.imag, rel.real)
        extra = (mbar.double() - qc.abs()) * kpre.abs()
        trig = torch.stack([(amp * torch.cos((round_start - p + d) * inv_freq.double() + phi)).sum()
                            for d in offsets]).mean()
        scores.append(trig + extra.sum())
    return torch.stack(scores)


def triattention_layer(keys, positions, round_start, prompt_len, qbar, mbar, inv_freq, offsets, budget, recent):
    """``[B][H]`` candidate scores of one layer: per query head, z-normalised over the non-prompt candidates
    (population std, clamped at 1e-6), then the max over the KV head's query group."""
    b_n, h_n, n, _ = keys.shape
    group = qbar.shape[0] // h_n
    n_cand = n - recent
    pl = min(prompt_len, budget - recent - 1)
    out = []
    for b in range(b_n):
        row = []
        for h in range(h_n):
            per_q = []
            for g in range(h * group, (h + 1) * group):
                s = triattention_head_scores(keys[b, h, :n_cand], positions[b, h, :n_cand], round_start, qbar[g],
                                             mbar[g], inv_freq, offsets)
                d = s[pl:] if pl > 0 else s
                if d.numel() > 1:
                    s = (s - d.mean()) / d.std(unbiased=False).clamp_min(1e-6)
                per_q.append(s)
            row.append(torch.stack(per_q).amax(0))
        out.append(row)
    return out


def triattention_keep(layer_scores: list, prompt_len: int, budget: int, recent: int) -> list:
    """Pin the prompt and keep the top ``T - r`` of a ``[B][H]`` score list."""
    k_sel = budget - recent
    pl = min(prompt_len, k_sel - 1)
    out = []
    for row in layer_scores:
        kept = []
        for s in row:
            s = s.tolist()
            s[:pl] = [math.inf] * pl
            kept.append(_topk(s, k_sel))
        out.append(kept)
    return out
