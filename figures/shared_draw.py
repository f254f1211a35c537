"""One shared draw for all heads vs a draw per head: next-token loss, planted fact, passcode."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from randattn.stats import Estimate

from . import style

PANELS = [("delta_nll_vs_full", "next-token loss over full attention\n(nats/token)"),
          ("planted_recall", "Recall R of a planted fact\nleft to the policy"),
          ("passcode_retrieval", "passcode retrieval\n(stated once)")]


def plot(table: list[dict], out_dir=None, name: str = "shared_draw") -> list[Path]:
    """Draw from the probe's summary table (the rows of its summary CSV)."""
    rows = [r for r in table if r["policy"] in ("random", "random-shared")]
    style.apply()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(11, 3.6))
    for ax, (measure, label) in zip(axes, PANELS):
        sel = [r for r in rows if r["measure"] == measure]
        for x, r in enumerate(sel):
            est = Estimate(float(r["value"]), float(r["value_lo"]), float(r["value_hi"]), int(r["n"]))
            ax.bar(x, est.value, color=style.PALETTE[1] if r["policy"] == "random" else style.PALETTE[0], alpha=0.8)
            style.errorbar(ax, x, est, color="black", ms=0)
        ax.set_xticks(range(len(sel)), ["per head" if r["policy"] == "random" else "shared" for r in sel])
        ax.set_ylabel(label, fontsize=9)
        if measure.endswith("retrieval"):
            ax.set_ylim(0, 1.02)
        if not sel:
            ax.text(0.5, 0.5, "not run", ha="center", transform=ax.transAxes)
    r0 = rows[0]
    fig.suptitle(f"Random: one draw shared by all KV heads vs a draw per head; {style.model_label(r0['model'])}, "
                 f"K={r0['budget']}, r={r0['buffer']}; 95% bootstrap CIs", fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)
