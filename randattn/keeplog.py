"""Keep-log: which absolute positions every KV head kept at every eviction round."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

__all__ = ["KeepLog"]


@dataclass
class KeepLog:
    """Kept positions per (layer, round), each ``int32[B, H_kv, K]`` on the CPU.

    ``seq_len`` of a record is the absolute length when the round ran: the round happened right
    after position ``seq_len - 1`` was written, so a query at position ``t >= seq_len`` (before the
    next round) sees ``kept`` plus positions ``seq_len..t``. ``recent`` is the cache's recent window:
    at a round the newest ``recent`` positions were kept outside the competition, so position ``p``
    competed at a round of length ``seq_len`` only if ``p < seq_len - recent``.

    A padded batch runs each row's rounds on its own, so its records are per row: ``rows[i]`` is the batch row of
    record ``i`` (``kept`` then ``[1, H_kv, K]``, positions and ``seq_len`` in the row's own coordinates: its first
    real token at 0), ``None`` for a record of the whole batch. :meth:`row` gives one row's log.
    """

    recent: int = 0
    layers: list = field(default_factory=list)
    rounds: list = field(default_factory=list)
    seq_lens: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    rows: list = field(default_factory=list)

    def record(self, layer_idx: int, round_idx: int, seq_len: int, positions: torch.Tensor,
               row: Optional[int] = None) -> None:
        self.rows.append(None if row is None else int(row))
        self.layers.append(int(layer_idx))
        self.rounds.append(int(round_idx))
        self.seq_lens.append(int(seq_len))
        self.kept.append(positions.detach().to("cpu", torch.int32).numpy())

    def row(self, b: int) -> "KeepLog":
        """Row ``b``'s records alone (``kept[1, H, K]``), as that row's prompt would have logged them by itself."""
        out = KeepLog(recent=self.recent)
        for r, l, rd, s, k in zip(self.rows or [None] * len(self), self.layers, self.rounds, self.seq_lens, self.kept):
            if r is None or r == b:
                out.record(l, rd, s, torch.from_numpy(k[b : b + 1] if r is None else k))
        return out

    def __len__(self) -> int:
        return len(self.layers)

    def for_layer(self, layer_idx: int) -> list[tuple[int, int, np.ndarray]]:
        """``[(round, seq_len, kept[B, H, K]), ...]`` for one layer, in round order."""
        out = [(r, s, k) for l, r, s, k in zip(self.layers, self.rounds, self.seq_lens, self.kept) if l == layer_idx]
        return sorted(out, key=lambda x: x[0])

    def save(self, path: "str | os.PathLike") -> None:
        """Write a compressed ``.npz`` (arrays ``layer``, ``round``, ``seq_len``, ``kept[N, B, H, K]``)."""
        kept = np.stack(self.kept) if self.kept else np.zeros((0, 0, 0, 0), np.int32)
        np.savez_compressed(
            path,
            recent=np.asarray(self.recent, np.int64),
            layer=np.asarray(self.layers, np.int32),
            round=np.asarray(self.rounds, np.int32),
            seq_len=np.asarray(self.seq_lens, np.int64),
            kept=kept,
            row=np.asarray([-1 if r is None else r for r in (self.rows or [None] * len(self))], np.int64),
        )

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "KeepLog":
        with np.load(path) as z:
            log = cls(recent=int(z["recent"]) if "recent" in z.files else 0)
            log.layers = z["layer"].tolist()
            log.rounds = z["round"].tolist()
            log.seq_lens = z["seq_len"].tolist()
            log.kept = list(z["kept"])
            rows = z["row"].tolist() if "row" in z.files else [-1] * len(log.layers)
            log.rows = [None if r < 0 else int(r) for r in rows]
        return log

    def visible_mask(self, layer_idx: int, seq_len: int, batch: int, heads: int, device=None) -> torch.Tensor:
        """Bool ``[B, H_kv, T, T]``: which key position each query position saw in this layer.

        Causal, minus everything evicted by rounds that ran before the query was processed. This
        is the reference that physical eviction must reproduce.
        """
        if any(r is not None for r in self.rows):
            raise ValueError("this keep-log holds a padded batch's per-row records; take one row's with "
                             "keep_log.row(b) (its own positions) and build that row's mask")
        t = torch.arange(seq_len)
        vis = (t[None, :] <= t[:, None]).expand(batch, heads, seq_len, seq_len).clone()
        for _, start, kept in self.for_layer(layer_idx):
            if start >= seq_len:
                break
            keep_row = torch.zeros(batch, heads, seq_len, dtype=torch.bool)
            keep_row.scatter_(2, torch.from_numpy(kept.astype(np.int64)), True)
            keep_row[:, :, start:] = True  # written after the round
            # Queries from this round on lose what the round dropped (later rounds only drop more).
            vis[:, :, start:, :] &= keep_row[:, :, None, :]
        return vis.to(device) if device is not None else vis

    def summary(self) -> Optional[dict]:
        if not self.layers:
            return None
        return {"records": len(self), "layers": len(set(self.layers)), "rounds_per_layer": max(self.rounds) + 1}
