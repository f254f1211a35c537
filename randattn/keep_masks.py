"""Keep-mask rules (``EvictingCache.pin`` / ``force_evict``): absolute positions kept at every round, or evicted at
the next round that sees them, in chosen layers and KV heads. Checked here when registered and against the model's
shape; :func:`rule_masks` turns them into a round's per-slot masks (read by :mod:`randattn.rounds`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["KeepRule", "make_rule", "check_rule_shape", "rule_masks"]


@dataclass(frozen=True)
class KeepRule:
    positions: torch.Tensor  # 1-D int64, CPU
    layers: Optional[frozenset]
    heads: Optional[frozenset]
    pin: bool  # True: keep no matter what; False: force-evict at the next round


def positions_tensor(positions) -> torch.Tensor:
    """Keep-mask positions as 1-D int64 on the CPU. Only integers: a fraction would be truncated and a bool read
    as position 0 or 1, silently pinning another token, so either is refused naming the value."""
    fix = "pass integer token positions, e.g. range(start, end) or a torch.long tensor"
    if torch.is_tensor(positions) or isinstance(positions, np.ndarray):
        t = torch.as_tensor(positions)
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise ValueError(f"positions must be integer token positions, got a {t.dtype} tensor "
                             f"{t.flatten()[:4].tolist()}; {fix}")
        return t.flatten().to(torch.long).cpu()
    items = list(positions)
    for p in items:
        boolean = isinstance(p, (bool, np.bool_)) or (torch.is_tensor(p) and p.dtype == torch.bool)
        integer = isinstance(p, (int, np.integer)) or (torch.is_tensor(p) and p.numel() == 1 and not (
            p.is_floating_point() or p.is_complex()))
        if boolean or not integer:
            raise ValueError(f"positions must be integer token positions, got {p!r}; {fix}")
    return torch.as_tensor([int(p) for p in items], dtype=torch.long)


def make_rule(positions, layers, heads, *, pin: bool) -> KeepRule:
    """A checked rule: integer positions ``>= 0``, non-negative integer layer and head indices (``None``: all)."""
    pos = positions_tensor(positions)
    if pos.numel() and int(pos.min()) < 0:
        raise ValueError(f"positions must be absolute token positions >= 0, got min {int(pos.min())}")
    layers = None if layers is None else list(layers)  # a generator is read once, not once per check
    heads = None if heads is None else list(heads)
    for name, sel in (("layers", layers), ("heads", heads)):
        if sel is not None and any(isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or i < 0
                                   for i in sel):
            raise ValueError(f"{name} must be non-negative integer indices, got {sel!r}")
    return KeepRule(
        positions=pos,
        layers=None if layers is None else frozenset(int(i) for i in layers),
        heads=None if heads is None else frozenset(int(i) for i in heads),
        pin=pin,
    )


def check_rule_shape(rule: KeepRule, n_layers: Optional[int], n_heads: Optional[int],
                     layer_idx: Optional[int] = None) -> None:
    """Refuse a rule naming a layer or KV head the model lacks (``None``: not known yet)."""
    kind = "pin" if rule.pin else "force_evict"
    if n_layers is not None and rule.layers is not None:
        bad = sorted(i for i in rule.layers if i >= n_layers)
        if bad:
            raise ValueError(f"keep-mask {kind}(layers={sorted(rule.layers)}): layers {bad} out of range: the model "
                             f"has {n_layers} layers, valid indices 0..{n_layers - 1}; remove the rule with "
                             f"clear_keep_masks() and register it with layers in that range")
    if n_heads is not None and rule.heads is not None and (layer_idx is None or rule.layers is None
                                                          or layer_idx in rule.layers):
        bad = sorted(h for h in rule.heads if h >= n_heads)
        if bad:
            where = "" if layer_idx is None else f" at layer {layer_idx}"
            raise ValueError(f"keep-mask {kind}(heads={sorted(rule.heads)}): heads {bad} out of range: the model has "
                             f"{n_heads} KV heads{where}, valid indices 0..{n_heads - 1}; remove the rule with "
                             f"clear_keep_masks() and register it with heads in that range")


def rule_masks(rules: Sequence[KeepRule], layer_idx: int,
               positions: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(pinned, evicted)`` bool masks shaped like ``positions[B, H_kv, S]`` for one layer's round (``None``: no
    rule hits)."""
    pinned = evicted = None
    n_heads = positions.shape[1]
    for rule in rules:
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
