"""Survival of generated positions vs age, per policy, with Random's analytic curve (log y-axis)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import matplotlib.pyplot as plt
import numpy as np

from analysis.survival import pool

from . import style

FLOOR = 1e-3  # a log axis cannot show 0; curves that reach 0 leave the plot there


def plot(rows: list[dict], out_dir=None, *, policies: Optional[Sequence[str]] = None,
         modes: Optional[Sequence[str]] = None, name: str = "survival") -> list[Path]:
    """Per-head (left) and union-over-heads (right) survival vs age, one row per prompt mode, from the survival
    probe's result rows."""
    config = rows[0]["config"]
    pooled = pool([r for r in rows if (policies is None or r["policy"] in policies)
                   and (modes is None or r["mode"] in modes)])
    if not pooled:
        raise ValueError(f"no survival rows for policies {policies} and modes {modes}")
    mode_list = list(dict.fromkeys(m for _, m in pooled))
    policy_list = list(dict.fromkeys(p for p, _ in pooled))
    colours = {p: style.PALETTE[i % len(style.PALETTE)] for i, p in enumerate(policy_list)}
    style.apply()
    fig, axes = plt.subplots(len(mode_list), 2, figsize=(12, 4.3 * len(mode_list)), squeeze=False, sharex=True)
    lowest = 1.0
    for row, mode in enumerate(mode_list):
        analytic = None
        for policy in policy_list:
            p = pooled.get((policy, mode))
            if p is None:
                continue
            c = p.by_age
            ok = c.total > 0
            analytic = analytic or (c.x[ok], p.analytic_age[0][ok], p.analytic_age[1][ok])
            width = 2.4 if policy == "random" else 1.3
            for ax, y in ((axes[row, 0], c.head), (axes[row, 1], c.union)):
                positive = y[ok][y[ok] > 0]
                if positive.size:
                    lowest = min(lowest, float(positive.min()))
                ax.plot(c.x[ok], np.where(y[ok] > 0, y[ok], np.nan), color=colours[policy], lw=width, label=policy)
        if analytic is not None:
            x, head, union = analytic
            axes[row, 0].plot(x, head, "k--", lw=1.4, label="Random, analytic $q^n$")
            axes[row, 1].plot(x, union, "k--", lw=1.4, label=f"Random, analytic $1-(1-q^n)^{{{config['kv_heads']}}}$")
        for col, what in enumerate(("per KV head", f"union over the {config['kv_heads']} KV heads of a layer")):
            ax = axes[row, col]
            ax.set_yscale("log")
            ax.set_title(f"{mode}: survival {what}", fontsize=10)
            ax.set_ylabel("share of generated positions kept")
    for ax in axes.flat:
        ax.set_ylim(max(FLOOR, lowest / 3), 1.3)
    for ax in axes[-1]:
        ax.set_xlabel(f"age in tokens (bins of {config['age_bin']}; age / r = rounds survived)")
    # One legend for all panels: the policies (same colours everywhere) and the two analytic curves.
    handles, labels = axes[0, 0].get_legend_handles_labels()
    h2, l2 = axes[0, 1].get_legend_handles_labels()
    fig.legend(handles + h2[-1:], labels + l2[-1:], loc="lower center", ncol=min(6, len(labels) + 1), fontsize=8,
               bbox_to_anchor=(0.5, -0.01), frameon=False)
    n = max(p.n for p in pooled.values())
    fig.suptitle(f"Keep-log survival: {style.model_label(config['model'])}, K={config['budget']}, "
                 f"r={config['buffer']}, {config['rounds']} rounds, {n} sequences of real traces (positions written "
                 f"after the first round)", fontsize=11)
    fig.tight_layout(rect=(0, 0.07 / len(mode_list), 1, 1))
    return style.save(fig, name, out_dir)
