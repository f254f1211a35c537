"""Accuracy analysis: per-arm accuracy with CIs, paired, problem-clustered comparisons with Random (accuracy and
generation length), protection gains, the methods x budgets table, and any other per-row endpoint compared the same way
(:func:`endpoint_summary`: the repeat task's copies written and their fidelity, the reference log-prob)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import numpy as np

from randattn.stats import comparison_table, mean_ci, paired_comparison, per_problem_means  # noqa: F401 (re-exported)

FULL = "full"


@dataclass(frozen=True)
class Arm:
    """One generation setting: a policy at a budget, with or without the protected prompt."""

    policy: str
    budget: Optional[int]  # None for full attention
    protect: Optional[bool]  # None for full attention
    compression: Optional[float] = None

    @property
    def label(self) -> str:
        """Method name in tables: the policy, ``(score only)`` when the prompt competes."""
        if self.policy == FULL:
            return FULL
        return self.policy if self.protect else f"{self.policy} (score only)"


def arm_of(row: dict) -> Arm:
    return Arm(row["policy"], row["budget"], row["protect_prompt"])


def grades_by_arm(rows: list[dict], field: str = "grade") -> dict[Arm, dict[str, list[float]]]:
    """``{arm: {problem: [grade (or another field) per run]}}``."""
    out: dict = defaultdict(lambda: defaultdict(list))
    for r in rows:
        out[arm_of(r)][r["problem"]].append(r[field])
    return {a: dict(g) for a, g in out.items()}


def summarize(rows: list[dict], *, seed: int = 0, n_resamples: int = 10_000) -> list[dict]:
    """One line per arm: accuracy with CI, lengths, termination, rounds, uncompressed rows, and the paired
    comparison with Random at the same K and protection (or protected Random when that is all there is)."""
    grades = grades_by_arm(rows)
    lengths = grades_by_arm(rows, "gen_len")
    by_arm = defaultdict(list)
    for r in rows:
        by_arm[arm_of(r)].append(r)
    table = []
    order = sorted(grades, key=lambda a: (a.policy != FULL, a.budget or 0, not a.protect, a.policy))
    for arm in order:
        rs, g = by_arm[arm], grades[arm]
        acc = mean_ci(list(per_problem_means(g).values()), seed=seed)
        line = {"method": arm.label, "policy": arm.policy, "budget": arm.budget, "protect_prompt": arm.protect,
                "problems": len(g), "runs": max(len(v) for v in g.values()), **acc.as_dict("accuracy"),
                "gen_len": float(np.mean([r["gen_len"] for r in rs])),
                "terminated": float(np.mean([r["terminated"] for r in rs])),
                "events": float(np.mean([r["events"] for r in rs])),
                "uncompressed": 0 if arm.policy == FULL else sum(not r["compressed"] for r in rs)}
        if any("copies" in r for r in rs):  # the repeat task's two endpoints beside its grade (= the fidelity)
            fid = [r["fidelity"] for r in rs if r.get("fidelity") is not None]
            line.update({"copies": float(np.mean([r["copies"] for r in rs])),
                         "fidelity": float(np.mean(fid)) if fid else None})
        ref = next((b for b in (Arm("random", arm.budget, arm.protect), Arm("random", arm.budget, True))
                    if b in grades and b != arm), None)
        if arm.policy == FULL:
            ref = next((b for b in order if b.policy == "random" and b.protect), None)
        if ref is not None:
            c = paired_comparison(g, grades[ref], n_resamples=n_resamples, seed=seed)
            line.update({"vs": ref.label + ("" if arm.policy != FULL else f" K={ref.budget}"),
                         **c.delta.as_dict("delta"), "p_bootstrap": c.p_bootstrap, "wins": c.sign.wins,
                         "losses": c.sign.losses, "ties": c.sign.ties, "p_sign": c.sign.p, "verdict": c.verdict})
            # The paper checks that parity is not bought with longer reasoning: generation length, paired the same way.
            n = paired_comparison(lengths[arm], lengths[ref], n_resamples=n_resamples, seed=seed)
            line.update({**n.delta.as_dict("len_delta"), "len_p_sign": n.sign.p,
                         "len_verdict": {"better": "longer", "worse": "shorter"}.get(n.verdict, n.verdict)})
        table.append(line)
    return table


def endpoint_summary(rows: list[dict], field: str, *, seed: int = 0, n_resamples: int = 10_000) -> list[dict]:
    """One line per arm for the per-row endpoint ``field`` (rows where it is None left out: a repeat generation without
    a copy has no fidelity, an empty reference no log-prob): its mean over problems (runs averaged within a problem)
    with a 95% bootstrap CI, and the paired, problem-clustered comparison with Random at the same K and protection
    (:func:`randattn.stats.paired_comparison`, runs as repeated measures; full attention against protected Random), as
    :func:`summarize` compares grades."""
    values = {a: {p: [v for v in vs if v is not None] for p, vs in g.items()}
              for a, g in grades_by_arm([r for r in rows if field in r], field).items()}
    values = {a: {p: vs for p, vs in g.items() if vs} for a, g in values.items()}
    values = {a: g for a, g in values.items() if g}
    order = sorted(values, key=lambda a: (a.policy != FULL, a.budget or 0, not a.protect, a.policy))
    out = []
    for arm in order:
        g = values[arm]
        est = mean_ci(list(per_problem_means(g).values()), seed=seed)
        line = {"method": arm.label, "policy": arm.policy, "budget": arm.budget, "protect_prompt": arm.protect,
                "field": field, "problems": len(g), "runs": max(len(v) for v in g.values()), **est.as_dict("value")}
        ref = next((b for b in (Arm("random", arm.budget, arm.protect), Arm("random", arm.budget, True))
                    if b in values and b != arm), None)
        if arm.policy == FULL:
            ref = next((b for b in order if b.policy == "random" and b.protect), None)
        if ref is not None and set(g) & set(values[ref]):
            c = paired_comparison(g, values[ref], n_resamples=n_resamples, seed=seed)
            line.update({"vs": ref.label + ("" if arm.policy != FULL else f" K={ref.budget}"),
                         **c.delta.as_dict("delta"), "p_bootstrap": c.p_bootstrap, "wins": c.sign.wins,
                         "losses": c.sign.losses, "ties": c.sign.ties, "p_sign": c.sign.p, "verdict": c.verdict})
        out.append(line)
    return out


def protection_gains(rows: list[dict], *, seed: int = 0, n_resamples: int = 10_000) -> list[dict]:
    """For each policy and K run both ways: protected minus score-only accuracy, paired by problem."""
    grades = grades_by_arm(rows)
    out = []
    for arm in sorted(grades, key=lambda a: (a.budget or 0, a.policy)):
        if arm.protect and Arm(arm.policy, arm.budget, False) in grades:
            c = paired_comparison(grades[arm], grades[Arm(arm.policy, arm.budget, False)], n_resamples=n_resamples,
                                  seed=seed)
            out.append({"policy": arm.policy, "budget": arm.budget, **c.delta.as_dict("gain"),
                        "p_bootstrap": c.p_bootstrap, "p_sign": c.sign.p, "verdict": c.verdict})
    return out


def table_results(rows: list[dict], task: str, field: str = "grade") -> dict:
    """``{(policy, column): {problem: [grades]}}`` for :func:`randattn.stats.comparison_table`: one column per K and
    protection mode (``copy K=256``, ``copy K=256 score only``), so every cell is compared with Random under the same
    K and protection; full attention is repeated in each column. ``field``: another per-row score than the grade."""
    grades = grades_by_arm(rows, field)
    columns = sorted({(a.budget, a.protect) for a in grades if a.policy != FULL}, key=lambda c: (c[0], not c[1]))
    results = {}
    for k, protect in columns:
        col = f"{task} K={k}" + ("" if protect else " score only")
        for arm, g in grades.items():
            if arm.policy == FULL or (arm.budget, arm.protect) == (k, protect):
                results[(arm.policy, col)] = g
    return dict(sorted(results.items(), key=lambda kv: (kv[0][0] != FULL, kv[0][0] != "random", kv[0][0])))


def warn_uncompressed(table: list[dict]) -> Optional[str]:
    """The loud warning when rows under an evicting policy never ran a round (None when all did)."""
    bad = [(t["method"], t["budget"], t["uncompressed"]) for t in table if t["uncompressed"]]
    if not bad:
        return None
    listing = ", ".join(f"{m} K={k}: {n}" for m, k, n in bad)
    bar = "!" * 100
    return (f"{bar}\nWARNING: rows that never triggered an eviction round ({listing}).\n"
            "Their generation ended before the cache reached K + r, so they measured FULL ATTENTION, not compression\n"
            "(the paper's vLLM benchmark bug). Those rows carry compressed: false. Lower --budget, raise "
            f"--max-new-tokens, or drop them.\n{bar}")
