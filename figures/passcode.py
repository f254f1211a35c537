"""The passcode needle: retrieval per policy after many rounds, with CIs."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from randattn.stats import Estimate

from . import style


def plot(table: list[dict], out_dir=None, name: str = "passcode") -> list[Path]:
    """Draw from the probe's summary table (the rows of its summary CSV)."""
    rows = table
    style.apply()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["policy"] for r in rows]
    for ax, key, label in ((axes[0], "retrieval", "Retrieval of the passcode (greedy exact)"),
                           (axes[1], "mean_lp", "mean log-prob of the passcode (nats)")):
        for x, r in enumerate(rows):
            est = Estimate(float(r[key]), float(r[f"{key}_lo"]), float(r[f"{key}_hi"]), int(r["n"]))
            color = (style.PALETTE[1] if r["policy"] == "random" else "gray" if r["rounds"] == "-"
                     else style.PALETTE[0])
            ax.bar(x, est.value, color=color, alpha=0.8)
            style.errorbar(ax, x, est, color="black", ms=0)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right")
        ax.set_ylabel(label)
    axes[0].set_ylim(0, 1.02)
    r0 = next(r for r in rows if r["rounds"] != "-")
    config = {"model": r0["model"], "budget": r0["budget"], "buffer": r0["buffer"], "policy": "each policy",
              "protect_prompt": r0["protect_prompt"] == "True"}
    fig.suptitle(f"Passcode stated once, asked after {r0['rounds']} rounds: {style.geometry(config)}; n={r0['n']}, "
                 f"95% bootstrap CIs", fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)
