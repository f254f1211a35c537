"""Left-padded batches in the cache: each row's padding from the prompt's 2D mask, the mask HF must be handed once
slots are no longer positions, and the compaction of a padded round (rows right-aligned, dead slots on the left).

Each row runs as its prompt would alone: positions of its own (its first real token at 0, padding at -1, a dead
slot), its own prompt protected, its rounds when *it* holds ``T + r`` real pairs."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["left_pads", "check_forward_mask", "mask_by_slot", "padded_keep_index"]


def left_pads(attention_mask: torch.Tensor) -> list[int]:
    """Each row's left padding in a prompt's ``attention_mask[B, L]`` (1 = token, 0 = pad). Refuses anything else
    (another shape, values other than 0/1, an all-padding row, right padding or holes)."""
    if not torch.is_tensor(attention_mask) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a 2D [batch, tokens] padding mask (1 = token, 0 = pad), got "
                         f"{shape}; 4D masks are not supported by EvictingCache (slots are not positions once "
                         f"heads evict)")
    if attention_mask.dtype.is_floating_point or attention_mask.is_complex():
        bad = ~((attention_mask == 0) | (attention_mask == 1))
        if bool(bad.any()):
            raise ValueError("attention_mask must hold only 0 (pad) and 1 (token)")
    mask = attention_mask.to(torch.bool).cpu()
    b, n = mask.shape
    real = mask.sum(-1)
    empty = [i for i in range(b) if int(real[i]) == 0]
    if empty:
        raise ValueError(f"attention_mask: rows {empty} are all padding (no token to start from); drop them from "
                         f"the batch")
    pads = n - real
    left = torch.arange(n)[None, :] >= pads[:, None]
    if not torch.equal(left, mask):
        rows = [i for i in range(b) if not torch.equal(left[i], mask[i])]
        raise ValueError(f"attention_mask: rows {rows} are not left-padded (zeros after a token: right padding or "
                         f"holes); EvictingCache supports left padding only: set tokenizer.padding_side = 'left' "
                         f"(what HF generation expects for decoder-only models)")
    return [int(x) for x in pads]


def check_forward_mask(attention_mask: torch.Tensor, batch: int, seq: int, new_tokens: int) -> None:
    """Refuse a forward's mask that is not the 2D ``[batch, cached + new tokens]`` padding mask."""
    if not torch.is_tensor(attention_mask) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a 2D [batch, tokens] padding mask, got {shape}; 4D masks "
                         f"are not supported by EvictingCache (slots are not positions once heads evict)")
    if tuple(attention_mask.shape) != (batch, seq + new_tokens):
        raise ValueError(f"attention_mask is shaped {tuple(attention_mask.shape)} but this forward needs "
                         f"[batch, cached + new tokens] = [{batch}, {seq + new_tokens}]")


def mask_by_slot(held: list, physical: int, batch: int, seq: int, new_tokens: int) -> torch.Tensor:
    """The 2D mask HF looks up by slot (``kv_offset + slot``) for a padded batch after its rounds: 1 where a row
    holds a real pair (its last ``held[row]`` of the ``physical`` slots) and on the new tokens, 0 on dead slots."""
    held_t = torch.tensor(held, dtype=torch.long)
    by_slot = torch.zeros((batch, seq + new_tokens), dtype=torch.long)
    by_slot[:, seq - physical : seq] = (torch.arange(physical)[None, :] >= (physical - held_t)[:, None]).long()
    by_slot[:, seq:] = 1
    return by_slot


def padded_keep_index(kept: dict, held: list, budget: int, physical: int, heads: int,
                      device) -> "tuple[torch.Tensor, list[int], int]":
    """The gather index of a padded round: rows in ``kept`` (row -> its kept slots ``[H_kv, T]``) keep ``T``, the
    others all they hold; every row right-aligned in ``width`` slots, dead slots (index 0, position set to -1 by
    the caller) on the left of the shorter ones. Returns ``(index[B, H_kv, width], held after, width)``."""
    held = [budget if row in kept else n for row, n in enumerate(held)]
    width = max(held)
    index = []
    for row in range(len(held)):
        src: Optional[torch.Tensor] = kept.get(row)
        if src is None:
            src = torch.arange(physical - held[row], physical, device=device).expand(heads, -1)
        dead = torch.zeros((heads, width - held[row]), dtype=torch.long, device=device)
        index.append(torch.cat([dead, src], dim=-1))
    return torch.stack(index), held, width
