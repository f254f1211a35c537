"""The leaderboard (``python -m probes.leaderboard``): per task, each selector's difference from protected Random with
its paired 95% bootstrap CI (filled: significant by the CI and the exact sign test, p Holm-adjusted across the board), selectors in rank order;
a last panel: the round cost as a ratio to Random's, measured side by side. Plotted from ``leaderboard.csv`` only."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib import ticker

from . import style

TASK_ORDER = ("copy", "repeat copies", "repeat fidelity", "repeat", "question", "passcode", "planted")


def _num(x):
    if x in (None, ""):
        return None
    v = float(x)
    return None if math.isnan(v) else v


def plot(table: list[dict], out_dir=None, name: str = "leaderboard") -> list[Path]:
    """Draw the leaderboard from its rows (``leaderboard.csv``: one row per selector and task)."""
    rows = [r for r in table if _num(r.get("delta")) is not None]
    if not rows:
        raise ValueError("the leaderboard table has no paired difference to draw (run python -m probes.leaderboard)")
    ranked = sorted(dict.fromkeys(r["policy"] for r in rows), key=lambda p: min(int(r["rank"]) for r in rows
                                                                               if r["policy"] == p))
    tasks = [t for t in TASK_ORDER if any(r["test"] == t for r in rows)]
    tasks += [t for t in dict.fromkeys(r["test"] for r in rows) if t not in tasks]
    cost = {r["policy"]: _num(r.get("round_cost_ratio")) for r in rows if _num(r.get("round_cost_ratio"))}
    panels = len(tasks) + (1 if cost else 0)
    style.apply()
    fig, axes = plt.subplots(1, panels, figsize=(2.6 * panels + 1.2, 1.4 + 0.38 * len(ranked)), sharey=True,
                             squeeze=False)
    ys = {p: i for i, p in enumerate(ranked)}
    for ax, task in zip(axes[0], tasks):
        these = [r for r in rows if r["test"] == task]
        for r in these:
            d, lo, hi = float(r["delta"]), float(r["delta_lo"]), float(r["delta_hi"])
            verdict = r["verdict"]
            color = style.PALETTE[2] if verdict == "better" else style.PALETTE[3] if verdict == "worse" else "0.35"
            ax.errorbar(d, ys[r["policy"]], xerr=[[d - lo], [hi - d]], fmt="o", color=color, capsize=3, ms=5,
                        mfc=color if verdict in ("better", "worse") else "white")
        ax.axvline(0, color="gray", lw=1, ls="--")
        n = these[0]["n"] if these else "?"
        ax.set_title(f"{these[0]['metric'] if these else task}\n(n={n}; Random {float(these[0]['random']):.2f})",
                     fontsize=9)
        ax.set_xlabel("selector − Random")
    if cost:
        ax = axes[0][-1]
        for p, ratio in cost.items():
            ax.plot(ratio, ys[p], "s", color=style.PALETTE[0], ms=5)
        ax.axvline(1, color="gray", lw=1, ls="--")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_title("round cost\n(ratio to Random, same run)", fontsize=9)
        ax.set_xlabel("× Random")
    axes[0][0].set_yticks(range(len(ranked)), [f"{i + 1}. {p}" for i, p in enumerate(ranked)])
    axes[0][0].set_ylim(len(ranked) - 0.5, -0.5)  # rank 1 on top
    fig.suptitle("Leaderboard: each selector against protected Random at the same T, r and protection; paired 95% "
                 "bootstrap CIs (filled: significant by the CI and the exact sign test, p Holm-adjusted across the "
                 "board)", fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)
