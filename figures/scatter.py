"""Scattered vs intact copies of the planted fact (mass-matched: two heads' worth of slots)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from analysis.planted import rotating_pairs, scatter_compare, summarize

from . import style


def plot(rows: list[dict], out_dir=None, name: str = "scatter") -> list[Path]:
    """Draw scattered vs intact from the scatter probe's result rows."""
    config = rows[0]["config"]
    n_heads = config["kv_heads"]
    pairs = [f"intact h{a}+{b}" for a, b in rotating_pairs(n_heads)]
    phases = [f"scattered p{p}" for p in range(n_heads)]
    summ = summarize(rows, pairs + phases, seed=config["seed"])
    c = scatter_compare(rows, n_heads, config["seed"])
    style.apply()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    labels = ([p.replace("intact ", "") for p in pairs] + ["intact\n(mean)"] + [p.replace("scattered ", "")
              for p in phases] + ["scattered\n(mean)"])
    for ax, metric, ylabel in ((axes[0], "retrieval", "Retrieval"), (axes[1], "recall", "Recall R")):
        ests = ([getattr(summ[p], metric) for p in pairs] + [c[f"{metric}_intact"]]
                + [getattr(summ[p], metric) for p in phases] + [c[f"{metric}_scattered"]])
        colors = [style.PALETTE[0]] * (len(pairs) + 1) + [style.PALETTE[1]] * (len(phases) + 1)
        means = {len(pairs), len(ests) - 1}
        for x, (est, color) in enumerate(zip(ests, colors)):
            ax.bar(x, est.value, color=color, alpha=0.8 if x in means else 0.35)
            style.errorbar(ax, x, est, color="black", ms=0)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("intact: whole box in a pair of heads | scattered: token t in heads t+p, t+p+1 (mod H)",
                      fontsize=8)
    fig.suptitle(f"Scattered vs intact copies: {style.geometry(config)}; n={c['n']}, 95% bootstrap CIs\n"
                 f"R difference scattered - intact = {c['recall_diff']:.3f}", fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)
