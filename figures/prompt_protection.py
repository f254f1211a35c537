"""Prompt protection per policy: score-only vs score + protected prompt (the paper's Table 2 as a figure)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from . import style


def plot(table: list[dict], out_dir=None, name: str = "prompt_protection") -> list[Path]:
    """Draw from the probe's summary table (the rows of its summary CSV)."""
    rows = table
    full = next((r for r in rows if r["policy"] == "full"), None)
    rows = [r for r in rows if r["policy"] != "full"]
    style.apply()
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(rows) + 2), 4))
    width = 0.38
    for i, r in enumerate(rows):
        a, b = float(r["digit_acc_score_only"]), float(r["digit_acc_protected"])
        ax.bar(i - width / 2, a, width, color=style.PALETTE[0], label="score only" if i == 0 else None)
        ax.bar(i + width / 2, b, width, color=style.PALETTE[1], label="+ prompt protection" if i == 0 else None)
        lo, hi = float(r["gain_lo"]), float(r["gain_hi"])
        ax.text(i, max(a, b) + 0.02, f"{b - a:+.2f}\n[{lo:+.2f}, {hi:+.2f}]", ha="center", fontsize=7)
    if full is not None:
        ax.axhline(float(full["digit_acc_score_only"]), ls="--", color="gray", lw=1, label="full attention")
    ax.set_xticks(range(len(rows)), [r["policy"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("digits of the restated question predicted exactly")
    ax.set_ylim(0, 1.12)
    ax.legend(fontsize=8, loc="lower right")
    r0 = rows[0]
    fig.suptitle(f"Prompt protection: {style.model_label(r0['model'])}, K={r0['budget']}, r={r0['buffer']}; "
                 f"n={r0['n']}; numbers: paired gain with 95% CI", fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)
