"""Planted-fact analysis: Retrieval and Recall R per condition, and what each planted-fact probe derives from them.

Rows are the probes' result rows (``instance, condition, fact, lp, retrieved, ...``). Recall R is a ratio of
sums over instances paired by index: ``R = Σ(LP_cond − LP_del) / Σ(LP_top − LP_del)``, with the top either
the fact kept in every head (``all``: the paper's code, ``kvcompress/synth/analyze_probe.py``) or the full
cache (``full``: no eviction at all).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from randattn.stats import Estimate, bootstrap, mean_ci, recall_ci


def lp_table(rows: Sequence[dict], fact: Optional[int] = 0) -> dict:
    """``{condition: {instance: (lp, retrieved)}}``; ``fact=None`` sums LPs over facts and needs all retrieved."""
    out: dict = {}
    for r in rows:
        if fact is not None and r["fact"] != fact:
            continue
        cell = out.setdefault(r["condition"], {})
        lp, ok = cell.get(r["instance"], (0.0, True))
        cell[r["instance"]] = (lp + r["lp"], ok and r["retrieved"])
    return out


@dataclass
class ConditionSummary:
    condition: str
    n: int
    retrieval: Estimate
    recall: Optional[Estimate]  # vs the fact kept everywhere (the paper's code)
    mean_lp: float
    recall_full: Optional[Estimate] = None  # vs the full cache (no eviction at all), when the run has it

    def as_row(self) -> dict:
        row = {"condition": self.condition, "n": self.n, **self.retrieval.as_dict("retrieval"), "mean_lp": self.mean_lp}
        if self.recall is not None:
            row.update(self.recall.as_dict("recall"))
        if self.recall_full is not None:
            row.update(self.recall_full.as_dict("recall_full"))
        return row


def summarize(rows: Sequence[dict], names: Sequence[str], *, fact: Optional[int] = 0, seed: int = 0,
              deleted: str = "deleted", kept: str = "all") -> dict[str, ConditionSummary]:
    """Retrieval and Recall R (vs ``deleted`` and ``kept``) with bootstrap CIs, paired by instance."""
    table = lp_table(rows, fact)

    def recall_vs(cell, inst, top):
        if deleted not in table or top not in table:
            return None
        paired = [i for i in inst if i in table[deleted] and i in table[top]]
        if not paired:
            return None
        return recall_ci([cell[i][0] for i in paired], [table[deleted][i][0] for i in paired],
                         [table[top][i][0] for i in paired], seed=seed)

    out = {}
    for name in names:
        cell = table.get(name, {})
        inst = sorted(cell)
        if not inst:
            continue
        ok = [cell[i][1] for i in inst]
        out[name] = ConditionSummary(name, len(inst), mean_ci(ok, seed=seed), recall_vs(cell, inst, kept),
                                     float(np.mean([cell[i][0] for i in inst])), recall_vs(cell, inst, "full"))
    return out


def endpoint_check(rows: Sequence[dict], *, fact: Optional[int] = 0, seed: int = 0) -> tuple[bool, str]:
    """Is kept-everywhere clearly better than deleted? If not, no condition in between can be read."""
    table = lp_table(rows, fact)
    paired = sorted(set(table.get("all", {})) & set(table.get("deleted", {})))
    if not paired:
        return False, "endpoints missing: the run has no 'all' and 'deleted' conditions"
    gap = mean_ci([table["all"][i][0] - table["deleted"][i][0] for i in paired], seed=seed)
    r_all = np.mean([table["all"][i][1] for i in paired])
    r_del = np.mean([table["deleted"][i][1] for i in paired])
    text = (f"endpoints: LP(all) - LP(deleted) = {gap:.2f} nats per instance; retrieval all {r_all:.3f} vs "
            f"deleted {r_del:.3f} (n={len(paired)})")
    ok = gap.lo > 0 and r_all - r_del >= 0.2
    if not ok:
        text += ("\nWARNING: kept-everywhere is not clearly better than deleted, so this probe cannot measure anything "
                 "on this model/configuration (try a shorter --distance, more --instances, or a larger model)")
    return ok, text


def superadditivity(rows, a: str, b: str, ab: str, seed: int = 0):
    """R(a+b) - R(a) - R(b) with a bootstrap CI (all R share the denominator Σ(LP_all - LP_del))."""
    t = lp_table(rows)
    inst = sorted(set.intersection(*(set(t[c]) for c in (a, b, ab, "deleted", "all"))))
    cols = [[t[c][i][0] for i in inst] for c in (ab, a, b, "deleted", "all")]
    return bootstrap(lambda x_ab, x_a, x_b, d, al: (x_ab - x_a - x_b + d).sum(-1) / (al - d).sum(-1), *cols, seed=seed)


def pooling_findings(rows, summaries, n_heads: int, seed: int = 0) -> list[str]:
    """Head pooling's findings as lines: heads useful alone, the best retrieval per number of heads, and
    superadditivity of every pair."""
    lines = []
    singles = [subset_label((h,), n_heads) for h in range(n_heads) if subset_label((h,), n_heads) in summaries]
    useful = [n for n in singles if summaries[n].recall is not None and summaries[n].recall.lo > 0]
    lines.append(f"useful alone (R's CI above 0): {', '.join(useful) if useful else 'none'} of {len(singles)} heads")
    by_size: dict[int, tuple[str, float]] = {}
    for name, s in summaries.items():
        k = heads_holding(name, n_heads)
        if k is not None and (k not in by_size or s.retrieval.value > by_size[k][1]):
            by_size[k] = (name, s.retrieval.value)
    lines.append("best retrieval by number of heads holding the fact: "
                 + "; ".join(f"{k}: {v:.2f} ({n})" for k, (n, v) in sorted(by_size.items())))
    for a, b in itertools.combinations(range(n_heads), 2):
        na, nb, nab = (subset_label(x, n_heads) for x in ((a,), (b,), (a, b)))
        if all(n in summaries for n in (na, nb, nab)) and n_heads > 2:
            est = superadditivity(rows, na, nb, nab, seed)
            verdict = "superadditive" if est.lo > 0 else "subadditive" if est.hi < 0 else "additive within CI"
            lines.append(f"R({nab}) - R({na}) - R({nb}) = {est:.3f}: {verdict}")
    return lines


def heads_holding(name: str, n_heads: int):
    """How many KV heads hold the fact under a head-pooling condition (None: not a head subset)."""
    if name == "deleted":
        return 0
    if name == "all":
        return n_heads
    if name.startswith("h"):
        return len(name[1:].split("+"))
    if name.startswith("best"):
        return int(name[4:].split(":")[0])
    return None


def rotating_pairs(n_heads: int) -> list[tuple[int, int]]:
    return [(h, (h + 1) % n_heads) for h in range(n_heads)]


def scatter_compare(rows, n_heads: int, seed: int = 0) -> dict:
    """R and retrieval of scattered (mean over phases per instance) vs intact (mean over the pairs per
    instance), and the paired differences."""
    t = lp_table(rows)
    intact = [f"intact h{a}+{b}" for a, b in rotating_pairs(n_heads)]
    spread = [f"scattered p{p}" for p in range(n_heads)]
    inst = sorted(set.intersection(*(set(t[c]) for c in ["deleted", "all", *spread, *intact])))
    d = np.array([t["deleted"][i][0] for i in inst])
    a = np.array([t["all"][i][0] for i in inst])
    sc = np.array([[t[c][i][0] for c in spread] for i in inst]).mean(1)
    it = np.array([[t[c][i][0] for c in intact] for i in inst]).mean(1)
    sc_ok = np.array([[t[c][i][1] for c in spread] for i in inst], float).mean(1)
    it_ok = np.array([[t[c][i][1] for c in intact] for i in inst], float).mean(1)
    r = lambda x, d, a: (x - d).sum(-1) / (a - d).sum(-1)  # noqa: E731
    return {
        "n": len(inst),
        "recall_scattered": bootstrap(r, sc, d, a, seed=seed),
        "recall_intact": bootstrap(r, it, d, a, seed=seed),
        "recall_diff": bootstrap(lambda s, i, d, a: (s - i).sum(-1) / (a - d).sum(-1), sc, it, d, a, seed=seed),
        "retrieval_scattered": mean_ci(sc_ok, seed=seed),
        "retrieval_intact": mean_ci(it_ok, seed=seed),
        "retrieval_diff": mean_ci(sc_ok - it_ok, seed=seed),
    }


def _lp_columns(rows, fact, names):
    t = lp_table(rows, fact)
    inst = sorted(set.intersection(*(set(t[n]) for n in names)))
    return [[t[n][i][0] for i in inst] for n in names]


def pair_tests(rows, a: int, b: int, seed: int = 0) -> dict:
    """Superadditivity (together vs the sum of singles, on both answers) and interference (x with and without y)."""
    both, xa, yb = f"x@{a}+y@{b}", f"x@{a}", f"y@{b}"
    cols = _lp_columns(rows, None, [both, xa, yb, "deleted", "all"])
    sup = bootstrap(lambda t, x, y, d, al: (t - x - y + d).sum(-1) / (al - d).sum(-1), *cols, seed=seed)
    cols = _lp_columns(rows, 0, [both, xa, "deleted", "all"])
    inter = bootstrap(lambda t, x, d, al: (t - x).sum(-1) / (al - d).sum(-1), *cols, seed=seed)
    return {"superadditivity": sup, "x_interference": inter}


def nll_deltas(rows: list[dict], arms: list[str], reference: str = "full", seed: int = 0) -> dict:
    """``{arm: Estimate of mean (NLL_arm - NLL_reference)}`` paired by sequence."""
    by = {}
    for r in rows:
        by.setdefault(r["arm"], {})[r["sequence"]] = r["nll"]
    out = {}
    for arm in arms:
        common = sorted(set(by.get(arm, {})) & set(by.get(reference, {})))
        if common:
            out[arm] = mean_ci([by[arm][i] - by[reference][i] for i in common], seed=seed)
    return out


def passcode_compare(rows_by_policy: dict, reference: str = "random", seed: int = 0) -> list[dict]:
    """Per policy: retrieval and mean LP with CIs, and the paired differences against ``reference``."""
    ref = lp_table(rows_by_policy[reference])["policy"] if reference in rows_by_policy else None
    table = []
    if reference in rows_by_policy:  # the instrument's ceiling: full attention, and the passcode pinned everywhere
        t = lp_table(rows_by_policy[reference])
        for name, label in (("full", "full attention"), ("kept", "pinned everywhere")):
            if name in t:
                inst = sorted(t[name])
                table.append({"policy": label, "n": len(inst), "rounds": "-",
                              **mean_ci([t[name][i][1] for i in inst], seed=seed).as_dict("retrieval"),
                              **mean_ci([t[name][i][0] for i in inst], seed=seed).as_dict("mean_lp")})
    for policy, rows in rows_by_policy.items():
        cell = lp_table(rows)["policy"]
        inst = sorted(cell)
        rounds = sorted({r["rounds_after_fact"] for r in rows if r["condition"] == "policy"})
        row = {"policy": policy, "n": len(inst), "rounds": "/".join(map(str, rounds)),
               **mean_ci([cell[i][1] for i in inst], seed=seed).as_dict("retrieval"),
               **mean_ci([cell[i][0] for i in inst], seed=seed).as_dict("mean_lp")}
        if ref is not None and policy != reference:
            common = [i for i in inst if i in ref]
            row.update(mean_ci([cell[i][1] - ref[i][1] for i in common], seed=seed).as_dict("retrieval_vs_random"))
            row.update(mean_ci([cell[i][0] - ref[i][0] for i in common], seed=seed).as_dict("lp_vs_random"))
        table.append(row)
    return table


def subset_label(heads: Sequence[int], n_heads: int) -> str:
    if len(heads) == 0:
        return "deleted"
    if len(heads) == n_heads:
        return "all"
    return "h" + "+".join(str(h) for h in heads)
