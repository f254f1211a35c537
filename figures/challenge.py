"""The challenge's verdicts (``python -m probes.challenge``): each metric's difference from Random with its paired
95% bootstrap CI (the task's score and its answer's log-prob, from the leaderboard's board rows in ``verdict.csv``),
one colour per selector; filled markers pass the CI and the exact sign test, p Holm-adjusted across the board."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from randattn.stats import Estimate

from . import style


def _points(table: list[dict]) -> list[dict]:
    """The verdict table's comparisons as points: each board row's score, and its answer's log-prob where it has
    one (``lp_*`` columns), the log-prob ones marked ``nats``."""
    out = []
    for r in table:
        if not r.get("verdict"):
            continue
        out.append({"policy": r["policy"], "metric": r["metric"], "delta": r["delta"], "lo": r["delta_lo"],
                    "hi": r["delta_hi"], "n": r["n"], "verdict": r["verdict"], "nats": False})
        if r.get("lp_delta") not in (None, ""):
            out.append({"policy": r["policy"], "metric": f"{r['test']} log-prob", "delta": r["lp_delta"],
                        "lo": r["lp_delta_lo"], "hi": r["lp_delta_hi"], "n": r["n"], "verdict": r["lp_verdict"],
                        "nats": True})
    return out


def plot(table: list[dict], out_dir=None, name: str = "challenge") -> list[Path]:
    """Draw the verdicts from the challenge's verdict table (the rows of its ``verdict.csv``: the leaderboard's board
    rows of the selector and its baselines)."""
    rows = _points(table)
    if not rows:
        raise ValueError("the verdict table has no metric with a significance test (run the accuracy, question, "
                         "planted or passcode part)")
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    # Differences of rates and of log-probs do not share a scale: one panel each.
    panels = [(lbl, [r for r in rows if r["nats"] == nats])
              for lbl, nats in (("difference from Random (rate)", False), ("difference from Random (nats)", True))]
    panels = [(lbl, rs) for lbl, rs in panels if rs]
    style.apply()
    height = 1.2 + 0.45 * max(len(dict.fromkeys(r["metric"] for r in rs)) for _, rs in panels) * len(policies) ** 0.5
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), max(3.0, height)), squeeze=False)
    for ax, (label, rs) in zip(axes[0], panels):
        metrics = list(dict.fromkeys(r["metric"] for r in rs))
        step = 0.7 / max(1, len(policies))
        for i, pol in enumerate(policies):
            color = style.PALETTE[(i + 2) % len(style.PALETTE)]
            for r in (r for r in rs if r["policy"] == pol):
                y = metrics.index(r["metric"]) + (i - (len(policies) - 1) / 2) * step
                est = Estimate(float(r["delta"]), float(r["lo"]), float(r["hi"]), int(r["n"]))
                filled = r["verdict"] in ("better", "worse")
                ax.errorbar(est.value, y, xerr=[[est.value - est.lo], [est.hi - est.value]], fmt="o", color=color,
                            mfc=color if filled else "white", capsize=3, ms=6)
            ax.plot([], [], "o", color=color, label=pol)
        ax.axvline(0, color="gray", lw=1, ls="--")
        ax.set_yticks(range(len(metrics)), metrics)
        ax.invert_yaxis()
        ax.set_xlabel(label)
    axes[0][0].legend(fontsize=8, loc="best")
    fig.suptitle("Selector minus Random at the same K, r and prompt protection; paired 95% bootstrap CIs\n"
                 "filled: significant by the CI and the sign test, p Holm-adjusted across the board", fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)
