"""Prompt protection analysis: per policy, the restated question's digit accuracy and log-prob score-only vs
protected, and the paired gains."""

from __future__ import annotations

import numpy as np

from randattn.stats import mean_ci


def summarize(rows: list[dict], policies: list[str], n: int, seed: int = 0) -> list[dict]:
    """Per policy: digit accuracy and mean LP, score-only vs protected, and the paired gains with CIs."""
    cell = {(r["instance"], r["policy"], r["protect"]): r for r in rows if r["instance"] < n}
    full = [cell[(i, "full", False)] for i in range(n) if (i, "full", False) in cell]
    table = [{"policy": "full", "n": len(full), "digit_acc_score_only": float(np.nanmean([r["digit_acc"] for r in full])),
              "digit_acc_protected": float("nan"), "mean_lp_score_only": float(np.mean([r["mean_lp"] for r in full])),
              "mean_lp_protected": float("nan"), "gain": 0.0, "gain_lo": 0.0, "gain_hi": 0.0}] if full else []
    for pol in policies:
        inst = [i for i in range(n) if (i, pol, False) in cell and (i, pol, True) in cell]
        if not inst:
            continue
        a = [cell[(i, pol, False)] for i in inst]
        b = [cell[(i, pol, True)] for i in inst]
        gain = mean_ci([y["digit_acc"] - x["digit_acc"] for x, y in zip(a, b)], seed=seed)
        lp_gain = mean_ci([y["mean_lp"] - x["mean_lp"] for x, y in zip(a, b)], seed=seed)
        table.append({"policy": pol, "n": len(inst),
                      "digit_acc_score_only": float(np.mean([x["digit_acc"] for x in a])),
                      "digit_acc_protected": float(np.mean([y["digit_acc"] for y in b])),
                      "mean_lp_score_only": float(np.mean([x["mean_lp"] for x in a])),
                      "mean_lp_protected": float(np.mean([y["mean_lp"] for y in b])),
                      **gain.as_dict("gain"), **lp_gain.as_dict("lp_gain")})
    return table
