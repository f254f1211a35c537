"""Eviction autopsy analysis: what each KV head held at the divergence, span survival (analytic and from the
keep-log), where a span lies, and the batch table. Pure numpy on keep-logs and rows; the replays live in
:mod:`probes.autopsy`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from randattn.keeplog import KeepLog
from randattn.keepstats import random_survival, union_survival

__all__ = ["HeldMap", "held_map", "span_survival", "location", "summarize", "LOCATIONS", "pack_mask", "unpack_mask",
           "windows", "spans_text"]

#: Where a causal span lies, relative to the divergence: the prompt, the recent part of the trace (within
#: ``window`` tokens of the divergence), or the middle of the trace (older than that, stated once and not
#: restated where the model could read it again).
LOCATIONS = ("prompt", "recent", "middle")


@dataclass
class HeldMap:
    """What every (layer, KV head) held of positions ``0 .. until-1`` when the token at ``until`` was predicted.

    ``held[l, h, t]``: position ``t`` was still stored in head ``h`` of layer ``l`` (every position newer than
    the layer's last round before ``until - 1`` is held). ``first_round[t]``: the ``seq_len`` of the earliest
    round (any layer, any head) that evicted ``t`` before ``until`` (``-1``: never evicted). ``round_lens``: the
    ``seq_len`` of the rounds that ran before the prediction (layer 0; every layer rounds at the same lengths).
    """

    held: np.ndarray
    first_round: np.ndarray
    round_lens: np.ndarray
    until: int
    recent: int

    @property
    def evicted_anywhere(self) -> np.ndarray:
        """Positions evicted from at least one (layer, head) before the prediction."""
        return np.flatnonzero(~self.held.all(axis=(0, 1)))

    @property
    def evicted_mass(self) -> np.ndarray:
        """Per position, the number of (layer, head) pairs that no longer held it."""
        return (~self.held).sum(axis=(0, 1))

    def rounds_competed(self, positions) -> np.ndarray:
        """Rounds (before the prediction) each position was a candidate in: ``seq_len - recent > t``."""
        pos = np.asarray(positions)
        return (self.round_lens[None, :] - self.recent > pos[:, None]).sum(axis=1)

    def rounds_survived(self, positions) -> int:
        """Rounds the span lived through in every head before its first eviction from any head (all rounds it
        competed in when it never was)."""
        pos = np.asarray(positions)
        first = self.first_round[pos]
        first = first[first >= 0]
        if first.size == 0:
            return int(self.rounds_competed(pos).max()) if pos.size else 0
        s = int(first.min())
        comp = (self.round_lens[None, :] - self.recent > pos[:, None]) & (self.round_lens[None, :] < s)
        return int(comp.sum(axis=1).max())


def held_map(log: KeepLog, until: int, n_layers: int, n_heads: int, row: int = 0) -> HeldMap:
    """The :class:`HeldMap` of keep-log row ``row`` for the prediction of the token at position ``until``: the
    rounds that shaped it are those with ``seq_len <= until - 1`` (a round runs after the forward that writes
    position ``seq_len - 1``, so the forward of ``until - 1`` sees rounds up to ``seq_len = until - 1``)."""
    held = np.ones((n_layers, n_heads, until), dtype=bool)
    first = np.full(until, -1, dtype=np.int64)
    lens = []
    for layer in range(n_layers):
        recs = [(s, k) for _, s, k in log.for_layer(layer) if s <= until - 1]
        if layer == 0:
            lens = [s for s, _ in recs]
        for s, kept in recs:
            mask = np.zeros((n_heads, s), dtype=bool)
            np.put_along_axis(mask, kept[row].astype(np.int64), True, axis=1)
            gone = ~mask.all(axis=0)
            head = first[:s]
            head[gone & ((head < 0) | (head > s))] = s
        if recs:
            s, kept = recs[-1]
            mask = np.zeros((n_heads, s), dtype=bool)
            np.put_along_axis(mask, kept[row].astype(np.int64), True, axis=1)
            held[layer, :, :s] = mask
    return HeldMap(held, first, np.asarray(lens, dtype=np.int64), int(until), int(log.recent))


def span_survival(hm: HeldMap, start: int, end: int, *, budget: int, buffer: int, prompt_len: int,
                  protected: bool) -> dict:
    """Survival of span ``[start, end)`` at the prediction, in at least one KV head per layer.

    ``analytic``: Random's expectation, each token kept per head with ``q**n`` (``n`` rounds competed, the
    protected prompt always), tokens treated as independent within a head, heads independent
    (``1 - (1 - P_head)**H``); ``empirical``: the share of layers where some head still held a token of the span
    (from the keep-log); ``heads``: mean heads per layer holding a token of it; ``tokens``: the share of its
    tokens held by some head of a layer, averaged over layers."""
    pos = np.arange(start, end)
    n = hm.rounds_competed(pos)
    p = random_survival(n, budget, buffer, prompt_len, protected)
    if protected:
        p = np.where(pos < prompt_len, 1.0, p)
    p_head = 1.0 - float(np.prod(1.0 - p))
    n_heads = hm.held.shape[1]
    sub = hm.held[:, :, start:end]  # [L, H, span]
    any_tok = sub.any(axis=2)  # [L, H]
    return {
        "analytic_head": round(p_head, 6),
        "analytic": round(float(union_survival(p_head, n_heads)), 6),
        "empirical": round(float(any_tok.any(axis=1).mean()), 6),
        "heads": round(float(any_tok.sum(axis=1).mean()), 4),
        "tokens": round(float(sub.any(axis=1).mean()), 6),
        "rounds_competed": int(n.max()) if n.size else 0,
        "rounds_survived": hm.rounds_survived(pos),
    }


def location(start: int, end: int, *, prompt_len: int, until: int, window: int) -> str:
    """``prompt`` when most of ``[start, end)`` is prompt, ``recent`` when the span starts within ``window``
    tokens of position ``until`` (the divergence), else ``middle``."""
    n_prompt = max(0, min(end, prompt_len) - start)
    if n_prompt * 2 >= end - start:
        return "prompt"
    return "recent" if start >= until - window else "middle"


def windows(candidates: np.ndarray, cap: int) -> list[tuple[int, int]]:
    """Index ranges ``[i, j)`` into the sorted ``candidates`` covering them all, each spanning at most ``cap``
    consecutive positions (``candidates[j-1] - candidates[i] < cap``)."""
    out, i = [], 0
    while i < len(candidates):
        j = int(np.searchsorted(candidates, candidates[i] + cap, side="left"))
        out.append((i, j))
        i = j
    return out


def pack_mask(mask: np.ndarray) -> str:
    """A bool vector as hex (bit order of ``np.packbits``)."""
    return np.packbits(np.asarray(mask, dtype=bool)).tobytes().hex()


def unpack_mask(text: str, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(bytes.fromhex(text), dtype=np.uint8))[:n].astype(bool)


def spans_text(spans: Sequence[dict]) -> str:
    return "; ".join(f"[{s['start']},{s['end']}) {s['location']}" for s in spans) or "-"


def _row_location(spans: Optional[Sequence[dict]]) -> str:
    if not spans:
        return "none"
    return "+".join(sorted({s["location"] for s in spans}, key=LOCATIONS.index))


def summarize(rows: Sequence[dict]) -> list[dict]:
    """One line per (task, policy, protection): problems, how many diverged from full attention, how many the
    search restored by pinning spans, and where the restoring (sufficient) and the necessary spans lie."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["task"], r["policy"], r["protect_prompt"]), []).append(r)
    table = []
    for (task, policy, protect), rs in groups.items():
        diverged = [r for r in rs if r["status"] != "no divergence"]
        restored = [r for r in diverged if r["status"] == "restored"]
        suff = Counter(_row_location(r.get("spans")) for r in restored)
        nec = Counter(_row_location(r.get("necessary")) for r in diverged)
        line = {"task": task, "policy": policy, "protect_prompt": protect, "problems": len(rs),
                "diverged": len(diverged), "restored": len(restored),
                "not_restored": len(diverged) - len(restored),
                "mean_grade_full": round(float(np.mean([r["full_grade"] for r in rs if r["full_grade"] is not None]
                                                       or [np.nan])), 4),
                "mean_grade_evicted": round(float(np.mean([r["evict_grade"] for r in rs if r["evict_grade"] is not None]
                                                          or [np.nan])), 4),
                "restored_regen_matches_full": sum(bool(r.get("regen_matches_full")) for r in restored),
                "mean_replays": round(float(np.mean([r["replays"] for r in diverged] or [0])), 2)}
        for loc in LOCATIONS:
            line[f"sufficient_{loc}"] = sum(n for k, n in suff.items() if loc in k.split("+"))
        for loc in LOCATIONS:
            line[f"necessary_{loc}"] = sum(n for k, n in nec.items() if loc in k.split("+"))
        line["necessary_none"] = nec.get("none", 0)
        table.append(line)
    return table
