"""TriAttention: score cached keys by the logit a *calibrated mean query* would give them in the future.

Pre-RoPE queries of a head concentrate around a fixed direction, so the query that will arrive
at a future position ``t`` is predicted well by the calibrated mean query rotated to ``t``. The
policy therefore needs no captured queries at all (``needs = frozenset()``): only per-head
statistics collected once per model by ``python -m randattn.calibrate``.

Statistics (per layer ``l`` and query head ``h``, from pre-RoPE queries ``q`` = the layer's own
projection + q-norm, no rotary, over a calibration trace; rotary pair ``f`` is dims ``f`` and
``f + R/2`` in HF's rotate_half layout, ``R = 2 * len(inv_freq)`` the rotary dim)::

    qbar[l, h, :] = mean_tokens q                                   (real D-vector)
    mbar[l, h, f] = mean_tokens sqrt(q_f^2 + q_{f+R/2}^2)           (mean pair magnitude)

plus the model's ``inv_freq`` (after any rope scaling) and rotary ``attention_scaling`` ``a``.

Score of cached slot ``j`` (post-RoPE key ``k_j``, already rotated by its own position) for query
head ``h`` at a round where the sequence holds ``L = seq_len`` positions::

    trig_j = mean_{delta in offsets} RoPE(qbar, L + delta) . k_j
           = sum_f Re( a * qbar_f^c * mean_delta exp(i (L + delta) w_f) * conj(k_{j,f}^c) )
             + qbar[R:] . k_j[R:]                                   (non-rotary dims, if R < D)
    norm_j = sum_f (mbar_f - |qbar_f|) * |k_{j,f}|
    raw_j  = trig_j + norm_j

where ``x_f^c = x_f + i x_{f+R/2}`` and ``|x_f| = |x_f^c|`` (pair magnitude), ``w_f = inv_freq[f]``,
and ``RoPE(q, t)`` is exactly HF's ``apply_rotary_pos_emb`` with ``cos = cos(t w) * a`` and
``sin = sin(t w) * a``. ``norm_j`` is position-free: the part of a future query's length that
the mean direction does not explain (``mbar_f >= |qbar_f|``), credited to keys with large pair
magnitudes. Each query head's ``raw`` is then z-normalised over the generated candidates (the prompt
left out of the mean and std, as the paper's engine and the TriAttention reference, whose score matrix
never holds the prefill), ``z_j = (raw_j - mean raw) / max(std raw, 1e-6)`` (population std), and the
KV head's score is ``aggregate`` over its query group (``"max"``, default, or ``"mean"``; query head
``h_q`` reads KV head ``h_q // (H_q / H_kv)`` as in HF's ``repeat_kv``). Higher = keep.

With ``shared_layers=True`` (default; the paper's ``triattn_ph``, "the scheme behind the reported
numbers") every KV head keeps one set shared by all layers: its score at a position is the mean over
layers of that layer's group score. ``shared_layers=False`` is the per-layer ``triattn_pl``. The
prompt is pinned in both (the cache's prompt protection, on by default).

This is the math of the paper's engine (``kvcompress/engine/triattn_official.py``, after
WeianMao/triattention): ``amp * cos((L - p + delta) w + phi) + extra`` with ``phi`` the phase of
``qbar conj(k_pre)``. It equals the formula above exactly when the rotary ``attention_scaling`` is 1
(Llama, Qwen3, SmolLM2); with another factor the two differ by a power of it.

Defaults: ``offsets = (1, 2, 4, ..., 65536)`` (17 powers of two, as the paper's engine);
``aggregate = "max"``.

Usage::

    EvictingCache("triattention", budget=1024, stats="smollm2-135m")      # shipped statistics
    EvictingCache("triattention", budget=1024, stats="path/to/stats.pt")  # your own calibration

Shipped statistics live in ``randattn/stats/<name>.pt`` (a short name resolves there).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from .policies import CacheView, Policy, register_policy

__all__ = [
    "TriAttentionStats",
    "TriAttentionPolicy",
    "load_stats",
    "check_stats",
    "shipped_stats",
    "triattention_raw",
    "DEFAULT_OFFSETS",
    "STATS_DIR",
]

FORMAT = "randattn-triattention-v1"
DEFAULT_OFFSETS: tuple[int, ...] = tuple(2**i for i in range(17))  # 1, 2, 4, ..., 65536 (the paper's engine)
STATS_DIR = Path(__file__).resolve().parent / "stats"  # package data: ships in the wheel
_EPS = 1e-6
_AGGREGATES = ("max", "mean")
CALIBRATE_HINT = "python -m randattn.calibrate --model MODEL --out stats.pt"


@dataclass
class TriAttentionStats:
    """Calibrated per-head query statistics of one model.

    qbar: ``[L, H_q, D]`` mean pre-RoPE query; mbar: ``[L, H_q, R/2]`` mean pair magnitude;
    inv_freq: ``[R/2]`` rotary inverse frequencies (after rope scaling); attention_scaling: the
    rotary ``attention_scaling`` factor; meta: model_type, num_layers, num_heads, num_kv_heads,
    head_dim, rotary_dim, max_position_embeddings, source, tokens, sequences, ...
    """

    qbar: torch.Tensor
    mbar: torch.Tensor
    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.qbar.dim() != 3 or self.mbar.dim() != 3 or self.inv_freq.dim() != 1:
            raise ValueError(
                f"TriAttention statistics must have qbar [L, H_q, D], mbar [L, H_q, R/2], inv_freq [R/2]; got "
                f"{tuple(self.qbar.shape)}, {tuple(self.mbar.shape)}, {tuple(self.inv_freq.shape)}"
            )
        half = self.inv_freq.shape[0]
        if self.mbar.shape != (*self.qbar.shape[:2], half) or 2 * half > self.qbar.shape[2]:
            raise ValueError(
                f"inconsistent TriAttention statistics: qbar {tuple(self.qbar.shape)}, mbar {tuple(self.mbar.shape)}, "
                f"inv_freq {tuple(self.inv_freq.shape)} (need mbar [L, H_q, R/2] with R = 2 * len(inv_freq) <= D)"
            )

    @property
    def num_layers(self) -> int:
        return self.qbar.shape[0]

    @property
    def num_heads(self) -> int:
        return self.qbar.shape[1]

    @property
    def head_dim(self) -> int:
        return self.qbar.shape[2]

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    @property
    def num_kv_heads(self) -> Optional[int]:
        n = self.meta.get("num_kv_heads")
        return None if n is None else int(n)

    def concentration(self) -> torch.Tensor:
        """``|qbar_f| / mbar_f`` per ``[L, H_q, R/2]``: 1 = every query of the pair points the same way."""
        half = self.inv_freq.shape[0]
        q = self.qbar.double()
        mag = torch.sqrt(q[..., :half] ** 2 + q[..., half : 2 * half] ** 2)
        return mag / self.mbar.double().clamp_min(1e-30)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "qbar": self.qbar.detach().cpu().to(torch.float32).contiguous(),
            "mbar": self.mbar.detach().cpu().to(torch.float32).contiguous(),
            "inv_freq": self.inv_freq.detach().cpu().to(torch.float64).contiguous(),
            "attention_scaling": float(self.attention_scaling),
            "meta": dict(self.meta),
        }

    def save(self, path: "str | os.PathLike") -> None:
        """Write a ``.pt`` file (plain tensors, floats and strings: loads with ``weights_only=True``)."""
        path = Path(path)
        if path.parent and not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.to_dict(), path)

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> "TriAttentionStats":
        missing = [k for k in ("qbar", "mbar", "inv_freq") if k not in d]
        if missing or d.get("format", FORMAT) != FORMAT:
            raise ValueError(
                f"{source} is not a TriAttention statistics file (format {d.get('format')!r}, missing {missing}); "
                f"create one with `{CALIBRATE_HINT}`"
            )
        return cls(
            qbar=d["qbar"].to(torch.float32),
            mbar=d["mbar"].to(torch.float32),
            inv_freq=d["inv_freq"].to(torch.float64),
            attention_scaling=float(d.get("attention_scaling", 1.0)),
            meta=dict(d.get("meta", {})),
        )

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "TriAttentionStats":
        try:
            d = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:  # pickle errors, truncated files, ...
            raise ValueError(f"could not read TriAttention statistics from {str(path)!r}: {exc}") from exc
        if not isinstance(d, dict):
            raise ValueError(f"{str(path)!r} does not hold TriAttention statistics (got a {type(d).__name__})")
        return cls.from_dict(d, source=repr(str(path)))

    def describe(self) -> str:
        m = self.meta
        conc = self.concentration()
        return (
            f"TriAttention statistics: {m.get('model_type', '?')} ({m.get('name_or_path', '?')}), "
            f"{self.num_layers} layers x {self.num_heads} query heads ({m.get('num_kv_heads', '?')} KV heads), "
            f"head_dim {self.head_dim}, rotary dim {self.rotary_dim}, attention_scaling {self.attention_scaling:g}; "
            f"{m.get('tokens', '?')} tokens in {m.get('sequences', '?')} sequences from {m.get('source', '?')}; "
            f"mean concentration |qbar_f|/mbar_f = {conc.mean().item():.3f} (median {conc.median().item():.3f})"
        )


def shipped_stats() -> dict:
    """``{short name: path}`` of the statistics files shipped in ``randattn/stats/``."""
    if not STATS_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(STATS_DIR.glob("*.pt"))}


def _resolve(spec: "str | os.PathLike") -> Path:
    path = Path(spec).expanduser()
    if path.exists():
        return path
    name = str(spec)
    if re.fullmatch(r"[\w.\-]+", name) and not name.endswith(".pt"):
        from .models import embedded_name

        key = embedded_name(name) or name.lower()
        shipped = shipped_stats()
        if key in shipped:
            return shipped[key]
    names = ", ".join(sorted(shipped_stats())) or "none"
    raise FileNotFoundError(
        f"TriAttention statistics {name!r}: no such file, and not the name of a shipped file (shipped in "
        f"{STATS_DIR}: {names}). Create them with `{CALIBRATE_HINT.replace('stats.pt', name)}`."
    )


@functools.lru_cache(maxsize=None)
def _shipped(name: str) -> TriAttentionStats:
    """A shipped statistics file, loaded once per process (every cache of a run binds to it)."""
    return TriAttentionStats.load(shipped_stats()[name])


def load_stats(spec: "str | os.PathLike | dict | TriAttentionStats") -> TriAttentionStats:
    """Statistics from a path, the short name of a shipped file (e.g. ``"smollm2-135m"``), a dict
    as saved by :meth:`TriAttentionStats.save`, or a :class:`TriAttentionStats` (returned as is)."""
    if isinstance(spec, TriAttentionStats):
        return spec
    if isinstance(spec, dict):
        return TriAttentionStats.from_dict(spec)
    if isinstance(spec, (str, os.PathLike)):
        return TriAttentionStats.load(_resolve(spec))
    raise TypeError(
        f"triattention: stats must be a path, a shipped name ({', '.join(shipped_stats()) or 'none'}), a dict or "
        f"TriAttentionStats, not {type(spec).__name__}"
    )


def _model_shape(model) -> dict:
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    return {
        "model_type": cfg.model_type,
        "num_layers": cfg.num_hidden_layers,
        "num_heads": heads,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
    }


def check_stats(stats: "TriAttentionStats | str | os.PathLike | dict", model) -> TriAttentionStats:
    """Raise ``ValueError`` naming what differs if ``stats`` were not made for ``model``'s shapes
    (layer count, query heads, KV heads, head_dim); returns the loaded statistics."""
    st = load_stats(stats)
    want = _model_shape(model)
    made_for = st.meta.get("model_type")
    if made_for and made_for != want["model_type"]:
        raise ValueError(
            f"TriAttention statistics were made for a {made_for} model ({st.meta.get('name_or_path', '?')}), not for "
            f"this {want['model_type']} model ({_model_name(model)}); calibrate this model with `{CALIBRATE_HINT}`"
        )
    found = {
        "num_layers": st.num_layers,
        "num_heads": st.num_heads,
        "num_kv_heads": st.num_kv_heads if st.num_kv_heads is not None else want["num_kv_heads"],
        "head_dim": st.head_dim,
    }
    bad = [f"{k} {found[k]} (model has {want[k]})" for k in found if found[k] != want[k]]
    if bad:
        raise ValueError(
            f"TriAttention statistics do not match this model ({want['model_type']}): they have {', '.join(bad)}. "
            f"They were made for {st.meta.get('model_type', '?')} ({st.meta.get('name_or_path', '?')}); calibrate this "
            f"model with `{CALIBRATE_HINT}`"
        )
    return st


def _model_name(model) -> str:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "name_or_path", None) or getattr(cfg, "_name_or_path", None) or "?"


def _future_rotation(seq_len: int, offsets: Sequence[int], inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``a * mean_delta cos((L + delta) w)`` and ``... sin(...)`` per frequency, in float64."""
    t = torch.tensor([seq_len + d for d in offsets], dtype=torch.float64, device=inv_freq.device)
    ang = t[:, None] * inv_freq.to(torch.float64)[None, :]
    return ang.cos().mean(0) * scaling, ang.sin().mean(0) * scaling


def triattention_raw(
    keys: torch.Tensor,
    qbar: torch.Tensor,
    mbar: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    seq_len: int,
    offsets: Sequence[int],
) -> torch.Tensor:
    """``raw = trig + norm`` of every slot for every query head: ``[B, H_kv, G, S]`` (``G = H_q / H_kv``).

    keys ``[B, H_kv, S, D]`` post-RoPE; qbar ``[H_q, D]``; mbar ``[H_q, R/2]``; inv_freq ``[R/2]``.
    Averaging over offsets commutes with the (linear) rotation, so the mean query is rotated once
    by the offset-averaged ``cos``/``sin`` and dotted with every key.
    """
    b, h, s, d = keys.shape
    hq = qbar.shape[0]
    half = inv_freq.shape[0]
    r = 2 * half
    g = hq // h
    dev = keys.device
    cos, sin = _future_rotation(seq_len, offsets, inv_freq.to(dev), attention_scaling)
    q = qbar.to(dev, torch.float64)
    q1, q2 = q[:, :half], q[:, half:r]
    u = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin, q[:, r:]], dim=-1)  # RoPE(qbar), offset-averaged
    qmag = torch.sqrt(q1**2 + q2**2)
    wnorm = mbar.to(dev, torch.float64) - qmag  # [H_q, R/2]
    k = keys.to(torch.float32)
    kmag = torch.sqrt(k[..., :half] ** 2 + k[..., half:r] ** 2)  # [B, H, S, R/2]
    trig = torch.einsum("bhsd,hgd->bhgs", k, u.to(torch.float32).reshape(h, g, d))
    norm = torch.einsum("bhsf,hgf->bhgs", kmag, wnorm.to(torch.float32).reshape(h, g, half))
    return trig + norm


def _check_offsets(offsets) -> tuple[int, ...]:
    try:
        out = tuple(offsets)
    except TypeError:
        out = None
    if not out or any(isinstance(o, bool) or not isinstance(o, int) or o < 0 for o in out):
        raise ValueError(f"triattention: offsets must be a non-empty sequence of non-negative ints, got {offsets!r}")
    return out


@register_policy("triattention")
class TriAttentionPolicy(Policy):
    """TriAttention as the paper ran it (its engine's ``triattn_ph``): the offset-averaged logit of the
    calibrated mean query, rotated to future positions, plus a norm term; z-normalised per query head over
    the generated candidates, max over the group, and (``shared_layers``) averaged over the layers, so each
    KV head keeps one set in every layer.

    ``raw_j = mean_{delta in offsets} RoPE(qbar, L + delta) . k_j + sum_f (mbar_f - |qbar_f|) |k_{j,f}|``,
    ``z = (raw - mean raw) / max(std raw, 1e-6)`` over non-prompt candidates, score = ``aggregate`` of ``z``
    over the query heads of each KV head. Full formula and conventions in :mod:`randattn.triattention`.

    Args:
        stats: the model's statistics: a ``.pt`` path from ``python -m randattn.calibrate``, the
            short name of a shipped file (``"smollm2-135m"``), a dict or :class:`TriAttentionStats`.
            ``None``: :meth:`bind` takes the shipped ones of the model (the embedded model has them) or
            refuses the model, before anything is scored.
        offsets: future offsets ``delta`` averaged over (default ``1, 2, 4, ..., 65536``).
        aggregate: ``"max"`` (default, after z-normalisation) or ``"mean"`` over the query group.
        shared_layers: one keep-set per KV head for all layers (default, ``triattn_ph``), or one per layer
            (``triattn_pl``).
    """

    paper_protection = True  # the paper grid's mode (Policy.paper_protection)
    uses_seed = False
    calibration = "stats"
    needs = frozenset()

    def __init__(self, stats=None, offsets: Optional[Sequence[int]] = None, aggregate: str = "max",
                 shared_layers: bool = True):
        if aggregate not in _AGGREGATES:
            raise ValueError(f"triattention: aggregate must be one of {_AGGREGATES}, got {aggregate!r}")
        if not isinstance(shared_layers, bool):
            raise ValueError(f"triattention: shared_layers must be True or False, got {shared_layers!r}")
        self._stats = None if stats is None else load_stats(stats)
        self.stats = stats if stats is None or isinstance(stats, (str, os.PathLike)) else "<in-memory>"
        self._bound = None  # the model the statistics were checked against
        self.offsets = _check_offsets(DEFAULT_OFFSETS if offsets is None else offsets)
        self.aggregate = aggregate
        self.shared_layers = shared_layers
        self._on: dict = {}

    @property
    def scope(self) -> str:  # type: ignore[override]
        return "model" if self.shared_layers else "layer"

    def bind(self, model) -> "TriAttentionPolicy":
        """Check the statistics against ``model``'s shapes; without statistics, take the shipped ones of a model
        randattn loaded from its embedded files (``ModelRef.of_model(model).embedded``), else refuse it with the
        calibration command."""
        if self._bound is model:
            return self
        if self._stats is None:
            from .models import ModelRef

            name = ModelRef.of_model(model).embedded
            if name not in shipped_stats():
                shipped = ", ".join(f'"{n}"' for n in shipped_stats()) or "none"
                raise ValueError(
                    "triattention needs TriAttention statistics for this model (stats=None, and none ship for it): the "
                    f"policy scores keys with per-head query statistics calibrated once per model. Create them with "
                    f'`{CALIBRATE_HINT}` and pass stats="stats.pt" (a probe\'s --stats FILE). Shipped (pass the name): '
                    f"{shipped}.")
            self._stats, self.stats = _shipped(name), name
        check_stats(self._stats, model)
        self._bound = model
        return self

    def _tensors(self, device: torch.device):
        key = str(device)
        if key not in self._on:
            st = self._stats
            self._on[key] = (st.qbar.to(device), st.mbar.to(device), st.inv_freq.to(device))
        return self._on[key]

    def _check_view(self, view: CacheView) -> None:
        if self._stats is None:
            raise ValueError('triattention has no statistics: pass stats="stats.pt" (from `' + CALIBRATE_HINT + '`), '
                             "or run it on the embedded model loaded by randattn.load_model(), whose statistics ship (the "
                             "cache binds the policy to the model at its first forward)")
        st = self._stats
        _, h, _, d = view.keys.shape
        problems = []
        if view.layer_idx >= st.num_layers:
            problems.append(f"layer {view.layer_idx} but the statistics cover {st.num_layers} layers")
        if d != st.head_dim:
            problems.append(f"head_dim {d} but the statistics have head_dim {st.head_dim}")
        kv = st.num_kv_heads
        if (kv is not None and h != kv) or st.num_heads % h:
            problems.append(
                f"{h} KV heads but the statistics have {st.num_heads} query heads / {kv if kv is not None else '?'} KV heads"
            )
        if problems:
            raise ValueError(
                f"TriAttention statistics ({self.stats}, made for {st.meta.get('model_type', '?')} "
                f"{st.meta.get('name_or_path', '')}) do not match this model: the cache has {'; '.join(problems)}. "
                f"Calibrate this model with `{CALIBRATE_HINT}`"
            )

    def group_scores(self, view: CacheView) -> torch.Tensor:
        """One layer's score ``[B, H_kv, S]``: z-normalised per query head over the generated candidates,
        then aggregated over the group."""
        self._check_view(view)
        qbar, mbar, inv_freq = self._tensors(view.keys.device)
        raw = triattention_raw(
            view.keys, qbar[view.layer_idx], mbar[view.layer_idx], inv_freq,
            self._stats.attention_scaling, view.seq_len, self.offsets,
        )  # [B, H_kv, G, S]
        generated = view.positions >= view.prompt_len  # [B, H_kv, S]
        if int(generated.sum(-1).min()) > 1:
            w = generated[:, :, None, :].to(raw.dtype)
            n = w.sum(-1, keepdim=True)
            mean = (raw * w).sum(-1, keepdim=True) / n
            std = (((raw - mean) ** 2 * w).sum(-1, keepdim=True) / n).sqrt()
        else:
            mean = raw.mean(dim=-1, keepdim=True)
            std = raw.std(dim=-1, unbiased=False, keepdim=True)
        z = (raw - mean) / std.clamp_min(_EPS)
        return z.amax(dim=2) if self.aggregate == "max" else z.mean(dim=2)

    def score(self, view: CacheView) -> torch.Tensor:
        return self.group_scores(view)

    def score_layers(self, views: "list[CacheView]") -> "list[torch.Tensor]":
        """The layer-shared score: at every absolute position, the mean over the layers holding it of their
        group scores (all layers hold the same positions when every one keeps the shared set)."""
        per_layer = [self.group_scores(v) for v in views]
        b, h, _ = views[0].shape
        length = max(v.seq_len for v in views)
        total = torch.zeros((b, h, length), dtype=torch.float64, device=per_layer[0].device)
        count = torch.zeros_like(total)
        for v, sc in zip(views, per_layer):
            total.scatter_add_(2, v.positions, sc.to(torch.float64))
            count.scatter_add_(2, v.positions, torch.ones_like(sc, dtype=torch.float64))
        mean = total / count.clamp_min(1)
        return [torch.gather(mean, 2, v.positions).to(torch.float32) for v in views]
