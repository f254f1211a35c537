"""Random eviction in contiguous blocks: cost vs blocks per head (next-token loss and planted-fact R)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from . import style
from randattn.stats import Estimate


def _est(row: dict, key: str):
    if row.get(key) in (None, ""):
        return None
    return Estimate(float(row[key]), float(row[f"{key}_lo"]), float(row[f"{key}_hi"]), 0)


def plot(table: list[dict], out_dir=None, name: str = "blocks") -> list[Path]:
    """Draw from the probe's summary table (the rows of its summary CSV)."""
    rows = table
    config = {"model": rows[0]["model"], "budget": rows[0]["budget"], "buffer": rows[0]["buffer"],
              "distance": rows[0]["distance"], "policy": "random-block",
              "protect_prompt": rows[0]["protect_prompt"] == "True"}
    style.apply()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "delta_nll", "next-token loss increase over full attention (nats/token)"),
                           (axes[1], "recall", "Recall R of a fact left to the block policy")):
        pts = [(float(r["blocks_per_head"]), int(r["block"]), _est(r, key)) for r in rows]
        pts = [p for p in pts if p[2] is not None]
        for x, b, est in pts:
            style.errorbar(ax, x, est, color=style.PALETTE[0], ms=6)
            ax.annotate(f"b={b}", (x, est.value), textcoords="offset points", xytext=(5, 4), fontsize=8)
        if pts:
            ax.plot([p[0] for p in pts], [p[2].value for p in pts], color=style.PALETTE[0], alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("blocks per head (K / block size)")
        ax.set_ylabel(label, fontsize=9)
        if key == "delta_nll":
            ax.axhline(0, color="gray", lw=1)
    fig.suptitle(f"Random eviction in contiguous blocks: {style.geometry(config)}; 95% bootstrap CIs", fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)
