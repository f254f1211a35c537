"""Head pooling: retrieval and Recall R vs which KV heads hold the planted fact."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from analysis.planted import heads_holding as _size
from analysis.planted import summarize

from . import style


def plot(rows: list[dict], out_dir=None, name: str = "head_pooling") -> list[Path]:
    """Draw head pooling from its result rows (``python -m probes.head_pooling``)."""
    config = rows[0]["config"]
    n_heads = config["kv_heads"]
    names = list(dict.fromkeys(r["condition"] for r in rows))
    summ = summarize(rows, names, seed=config["seed"])
    pooled = [n for n in names if _size(n, n_heads) is not None]
    style.apply()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in ((axes[0], "retrieval", "Retrieval (exact value, greedy)"),
                              (axes[1], "recall", "Recall R")):
        for k in range(n_heads + 1):
            group = [n for n in pooled if _size(n, n_heads) == k]
            xs = k + np.linspace(-0.25, 0.25, len(group)) if len(group) > 1 else np.full(len(group), float(k))
            for x, n in zip(xs, group):
                est = getattr(summ[n], metric)
                if est is None:
                    continue
                style.errorbar(ax, x, est, color=style.PALETTE[min(k, 9)], ms=6)
                if n_heads <= 4:
                    ax.annotate(n, (x, est.value), textcoords="offset points", xytext=(6, -3), fontsize=8)
        if "policy" in summ and getattr(summ["policy"], metric) is not None:
            est = getattr(summ["policy"], metric)
            ax.axhline(est.value, ls="--", color="gray", lw=1)
            ax.text(0.98, est.value, f"fact left to {config['policy']} eviction ", color="gray", fontsize=8,
                    va="bottom", ha="right", transform=ax.get_yaxis_transform())
        ax.set_xticks(range(n_heads + 1))
        ax.set_xlabel("KV heads holding the fact (same heads in every layer)")
        ax.set_ylabel(label)
    axes[0].set_ylim(-0.03, 1.03)
    n = summ[pooled[0]].n
    fig.suptitle(f"Head pooling: {style.geometry(config)}; n={n} instances, 95% bootstrap CIs", fontsize=11)
    fig.tight_layout()
    return style.save(fig, name, out_dir)
