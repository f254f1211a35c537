"""Accuracy per policy under eviction, with 95% bootstrap CIs over problems (``python -m probes.accuracy``).

One budget: a point per policy, protected prompt (filled) and score only (open) side by side, full
attention as a dashed line with its CI band. Several budgets (a compression sweep): accuracy
against K, one line per policy. Points marked ``*`` differ from Random at the same K and protection
by both the paired bootstrap CI and the exact sign test.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Optional

import matplotlib.pyplot as plt

from randattn.stats import mean_ci, paired_comparison, per_problem_means

from . import style


def _grades(rows: list[dict]) -> dict:
    """``{(policy, budget, protect): {problem: [grades]}}``."""
    out: dict = defaultdict(lambda: defaultdict(list))
    for r in rows:
        out[(r["policy"], r["budget"], r["protect_prompt"])][r["problem"]].append(r["grade"])
    return out


def _accuracy(g: dict):
    return mean_ci(list(per_problem_means(g).values()))


def _significant(grades: dict, key) -> bool:
    ref = ("random", key[1], key[2])
    if key[0] in ("random", "full") or ref not in grades:
        return False
    return paired_comparison(grades[key], grades[ref], n_resamples=2000).significant


def _full_line(ax, grades: dict) -> None:
    full = grades.get(("full", None, None))
    if full:
        est = _accuracy(full)
        ax.axhline(est.value, ls="--", color="gray", lw=1, label=f"full attention ({est.value:.3f})")
        ax.axhspan(est.lo, est.hi, color="gray", alpha=0.12, lw=0)


def _one_budget(ax, grades: dict, policies: list[str], budget: int, colors: dict) -> None:
    for protect, dx, face, label in ((True, -0.15, None, "+ prompt protection"), (False, 0.15, "white", "score only")):
        if any(k[2] is protect for k in grades):
            ax.plot([], [], "o", color="black", mfc=face, label=label)  # legend entry in neutral colour
        for x, pol in enumerate(policies):
            key = (pol, budget, protect)
            if key not in grades:
                continue
            est = _accuracy(grades[key])
            style.errorbar(ax, x + dx, est, color=colors[pol], mfc=face)
            if _significant(grades, key):
                ax.text(x + dx, est.hi + 0.01, "*", ha="center", fontsize=12)
    ax.set_xticks(range(len(policies)), policies, rotation=30, ha="right")
    ax.set_xlabel(f"policy (K={budget})")


def _sweep(ax, grades: dict, policies: list[str], colors: dict) -> None:
    for i, pol in enumerate(policies):
        pts = sorted((k[1], k) for k in grades if k[0] == pol and k[2] is not False)
        if not pts:
            continue
        ests = [_accuracy(grades[k]) for _, k in pts]
        xs = [b for b, _ in pts]
        color = colors[pol]
        marker = "os^vD<>pX*"[i % 10]  # the palette has 10 colours; markers keep lines apart in grey print
        ax.plot(xs, [e.value for e in ests], "-", marker=marker, ms=4, color=color, label=pol,
                lw=2.2 if pol == "random" else 1)
        for x, e in zip(xs, ests):
            style.errorbar(ax, x, e, color=color, ms=3)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({k[1] for k in grades if k[0] != "full"}))
    ax.get_xaxis().set_major_formatter("{x:.0f}")
    ax.set_xlabel("budget K (pairs per KV head), prompt protected")


def plot(rows: list[dict], out_dir=None, name: str = "accuracy", *, problems: Optional[list] = None,
         runs: Optional[int] = None) -> list[Path]:
    """Draw the accuracy figure from ``probes.accuracy`` result rows (optionally restricted to some problems and
    the first ``runs`` runs); returns the PNG and PDF paths."""
    if problems is not None:
        keep = set(problems)
        rows = [r for r in rows if r["problem"] in keep]
    if runs is not None:
        rows = [r for r in rows if r["run"] < runs]
    grades = _grades(rows)
    policies = list(dict.fromkeys(k[0] for k in sorted(grades, key=lambda k: (k[0] != "random", k[0]))
                                  if k[0] != "full"))
    budgets = sorted({k[1] for k in grades if k[0] != "full"})
    # The policy panel shows the budget where both protection modes ran (else where the policies differ most); a
    # sweep adds a panel.
    both = [b for b in budgets if {True, False} <= {k[2] for k in grades if k[1] == b}]

    def spread(b):  # a sweep in one protection mode shows the budget where the policies differ most
        acc = [_accuracy(grades[k]).value for k in grades if k[1] == b]
        return max(acc) - min(acc), b

    first = (both or ([max(budgets, key=spread)] if budgets else [None]))[0]
    style.apply()
    width = max(6.5, 0.75 * len(policies) + 3)
    fig, axes = plt.subplots(1, 2 if len(budgets) > 1 else 1, figsize=(width + (5 if len(budgets) > 1 else 0), 4.2),
                             squeeze=False, gridspec_kw={"width_ratios": [width, 5][:1 + (len(budgets) > 1)]})
    colors = {pol: style.PALETTE[i % len(style.PALETTE)] for i, pol in enumerate(policies)}  # one per policy, both panels
    _one_budget(axes[0, 0], grades, policies, first, colors)
    if len(budgets) > 1:
        _sweep(axes[0, 1], grades, policies, colors)
    for ax in axes[0]:
        _full_line(ax, grades)
        ax.set_ylabel(f"accuracy ({rows[0]['task']})")
        ax.set_ylim(0, 1.08)
        ax.legend(fontsize=7 if ax is not axes[0, 0] else 8, loc="best")  # wherever it covers the fewest points
    c = rows[0]["config"]
    n_prob = len({r["problem"] for r in rows})
    n_runs = len({r["run"] for r in rows})
    fig.suptitle(f"Accuracy under eviction: {style.model_label(c['model'])}, {c['task']}, r={c['buffer']}; {n_prob} "
                 f"problems x up to {n_runs} runs\n95% bootstrap CIs over problems; * = significant vs random "
                 "(paired CI and sign test)", fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)
