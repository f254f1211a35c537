"""Regime calibration (issue 37, item 1): sweep a board task's difficulty knob under full attention, Random and the
weakest baseline (recency), and pick, by a rule fixed here before any selector is compared, the point where the task
can tell them apart.

    python -m probes.calibrate_regime passcode --values 4 8 16 32 57          # rounds between statement and question
    python -m probes.calibrate_regime planted --values 128 256 384 768        # tokens from the fact to its answer
    python -m probes.calibrate_regime copy --values 128 160 192 232           # the budget T
    python -m probes.calibrate_regime question --values 256 512 1024          # reasoning tokens before the restatement
    python -m probes.calibrate_regime passcode --values 8 16 --dry-run        # print the probe command lines only

Each point is one run of the probe that owns the task, in its own folder (``OUT/<task>/points/<knob>-<value>/``), so
an interrupted sweep resumes point by point and row by row (every probe resumes its own rows); ``--buffer``
defaults to the paper's r = 64. The arms per point: the task's **ceiling** (full attention; for ``planted``, whose
probe has no full-attention arm, the fact kept in every head while Random evicts the rest, the Recall R endpoint
``all``), **Random** (the board's reference) and **recency** (the weakest baseline).

The rule (:data:`RULE`, written into ``regime.json`` with the sweep): a point qualifies when the ceiling scores at
least 0.8, recency at most 0.5, and Random lies inside [0.1, 0.9] (neither at the floor nor at the ceiling, where
no selector could differ from it). Of the qualifying points the one whose Random score is closest to 0.5 (the most
room both ways) is chosen, ties to the earlier of ``--values``. When none qualifies the sweep says so, writes the
sweep without a choice, and exits 3: it never picks a point silently. ``--fallback`` asks for the declared second
tier (:data:`FALLBACK`) in that case: the ceiling's and Random's conditions without the baseline's, the choice marked
``"tier": "fallback"`` in ``regime.json`` and its reason saying that recency is not below Random there (on a fact
stated once, Random can fall to the floor before the distance leaves recency's window, so no point has both).

Writes ``OUT/<task>/sweep.csv`` (one row per point and arm: score, 95% bootstrap CI, n) and
``OUT/<task>/regime.json`` (the rule, the chosen point or ``null`` with the reason, the command lines).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from randattn.stats import mean_ci

CEILING, REFERENCE, BASELINE = "ceiling", "random", "recency"
ARMS = (CEILING, REFERENCE, BASELINE)
RULE = {"ceiling_at_least": 0.8, "baseline_at_most": 0.5, "reference_within": [0.1, 0.9],
        "choose": "the qualifying point whose Random score is closest to 0.5; ties: the earlier value",
        "text": "ceiling >= 0.8, recency <= 0.5, 0.1 <= Random <= 0.9"}
#: The second tier, declared (2026-12-04) before any selector ran at a calibrated point, after the first passcode
#: sweep showed why it is needed: on a fact stated once, Random falls below 0.1 before the distance leaves recency's
#: window (at T=512, r=64: Random 0.25 / 0.125 / 0.062 at 4 / 6 / 8 rounds, recency 1.0 / 0.88 / 0.94), so no point
#: has the baseline below and Random off the floor. Dropping the baseline's condition keeps the two that make a
#: verdict possible (a ceiling that succeeds, a reference off the floor and the ceiling); the chosen point is marked
#: ``"tier": "fallback"`` and the docs must say that recency is not below Random there.
FALLBACK = {"ceiling_at_least": 0.8, "reference_within": [0.1, 0.9],
            "choose": "when no point satisfies the rule: the point with ceiling >= 0.8 and 0.1 <= Random <= 0.9 "
                      "whose Random score is closest to 0.5 (ties: the earlier value), marked as the fallback tier",
            "text": "ceiling >= 0.8, 0.1 <= Random <= 0.9 (the baseline's condition dropped)"}
PAPER_BUFFER = 64


@dataclass(frozen=True)
class TaskSweep:
    """How one task's point is run and read."""

    knob: str  # the swept setting, as the probe's flag names it
    endpoint: str  # what the score measures (one line, as the docs say it)
    command: Callable[[argparse.Namespace, object, Path], list[str]]
    read: Callable[[Path, object], dict]  # {arm: [per-unit scores]}


def _rows(folder: Path, name: str = "*.jsonl") -> list[dict]:
    out = []
    for path in sorted(folder.rglob(name)):
        if "work" in path.relative_to(folder).parts:  # the leaderboard's scratch files
            continue
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def _common(a) -> list[str]:
    flags = ["--budget", str(a.budget), "--buffer", str(a.buffer), "--seed", str(a.seed)]
    return flags + (["--model", a.model] if a.model else [])


def _passcode_cmd(a, value, out: Path) -> list[str]:
    return ["-m", "probes.passcode", "--policies", REFERENCE, BASELINE, "--rounds", str(value), "--instances",
            str(a.units), *_common(a), "--out", str(out), "--no-figure"]


def _passcode_read(out: Path, value) -> dict:
    arms: dict = {arm: [] for arm in ARMS}
    for r in _rows(out):
        pol, cond = r.get("config", {}).get("policy"), r.get("condition")
        arm = CEILING if cond == "full" else pol if cond == "policy" and pol in (REFERENCE, BASELINE) else None
        if arm:
            arms[arm].append(float(r["retrieved"]))
    return arms


def _board_cmd(task: str):
    def cmd(a, value, out: Path) -> list[str]:
        flags = {"planted": ["--distance", str(value), "--planted-instances", str(a.units), "--recall"],
                 "question": ["--body", str(value), "--instances", str(a.units), "--full-attention"]}[task]
        return ["-m", "probes.leaderboard", "--tasks", task, "--policies", BASELINE, *flags, *_common(a), "--out",
                str(out), "--no-figure"]
    return cmd


def _board_read(task: str):
    def read(out: Path, value) -> dict:
        arms: dict = {arm: [] for arm in ARMS}
        for r in _rows(out, f"{task}.jsonl"):
            pol = r.get("policy")
            if task == "question":
                arm = CEILING if pol == "full" else pol if pol in (REFERENCE, BASELINE) else None
                score = r.get("digit_acc")
            else:  # planted: the ceiling is the fact kept in every head (Recall R's "all" endpoint) under Random
                cond = r.get("condition")
                arm = (CEILING if cond == "all" and pol == REFERENCE else
                       pol if cond == "policy" and pol in (REFERENCE, BASELINE) else None)
                score = r.get("retrieved")
            if arm:
                arms[arm].append(float(score))
        return arms
    return read


def _copy_cmd(a, values, out: Path) -> list[str]:
    return ["-m", "probes.accuracy", "--task", "copy", "--policy", "full", REFERENCE, BASELINE, "--budget",
            *map(str, values), "--buffer", str(a.buffer), "--seed", str(a.seed), "--problems", str(a.units),
            "--runs", "1", *(["--model", a.model] if a.model else []), "--out", str(out), "--no-figure"]


def _copy_read(out: Path, value) -> dict:
    arms: dict = {arm: [] for arm in ARMS}
    for r in _rows(out):
        pol = r.get("policy")
        if pol == "full":
            arms[CEILING].append(float(r["grade"]))
        elif pol in (REFERENCE, BASELINE) and r.get("budget") == int(value):
            arms[pol].append(float(r["grade"]))
    return arms


TASKS = {
    "passcode": TaskSweep("rounds", "retrieval of a passcode stated once (greedy exact)", _passcode_cmd,
                          _passcode_read),
    "planted": TaskSweep("distance", "retrieval of a fact planted in a real trace (greedy exact)",
                         _board_cmd("planted"), _board_read("planted")),
    "question": TaskSweep("body", "digits of the question recalled after its restatement",
                          _board_cmd("question"), _board_read("question")),
    "copy": TaskSweep("budget", "share of the list reproduced in order (content kept)", None, _copy_read),
}


def _qualifying(points: list[dict], rule: dict) -> list[dict]:
    lo, hi = rule["reference_within"]
    out = []
    for p in points:
        s = p["scores"]
        if any(s.get(arm) is None for arm in ARMS):
            continue
        if (s[CEILING] >= rule["ceiling_at_least"] and lo <= s[REFERENCE] <= hi
                and s[BASELINE] <= rule.get("baseline_at_most", float("inf"))):
            out.append(p)
    return out


def choose(points: list[dict], *, fallback: bool = False) -> tuple[Optional[dict], str]:
    """The chosen point of a sweep by :data:`RULE` (``points``: ``{"value", "scores": {arm: mean}}`` in sweep
    order), and why; ``(None, reason)`` when no point qualifies. With ``fallback`` (``--fallback``), a sweep where no
    point satisfies the rule is chosen by :data:`FALLBACK`, and the reason says so."""
    qualifying = _qualifying(points, RULE)
    tier = "rule"
    if not qualifying:
        fmt = lambda x: "no rows" if x is None else f"{x:.3f}"  # noqa: E731
        seen = "; ".join(f"{p['value']}: " + ", ".join(f"{arm} {fmt(p['scores'].get(arm))}" for arm in ARMS)
                         for p in points)
        none = f"no point satisfies {RULE['text']} ({seen})"
        qualifying = _qualifying(points, FALLBACK) if fallback else []
        if not qualifying:
            return None, none + (f"; none satisfies the fallback {FALLBACK['text']} either" if fallback else "")
        tier = "fallback"
    best = min(qualifying, key=lambda p: abs(p["scores"][REFERENCE] - 0.5))  # min keeps the earliest on ties
    if tier == "fallback":
        return ({**best, "tier": tier}, f"{none}; by the fallback ({FALLBACK['text']}) {len(qualifying)} of "
                                        f"{len(points)} points qualify; Random closest to 0.5 at {best['value']} "
                                        f"(recency is not below Random there)")
    return ({**best, "tier": tier}, f"{len(qualifying)} of {len(points)} points qualify; Random closest to 0.5 at "
                                    f"{best['value']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m probes.calibrate_regime",
                                description="Sweep a board task's difficulty knob and pick its regime by a fixed rule")
    p.add_argument("task", choices=sorted(TASKS))
    p.add_argument("--values", nargs="+", type=int, required=True,
                   help="the knob's values (passcode: rounds; planted: distance; question: body; copy: budget T)")
    p.add_argument("--units", type=int, default=16, help="instances (or problems) per point and arm")
    p.add_argument("--budget", type=int, default=256, help="T (for copy: swept by --values)")
    p.add_argument("--buffer", type=int, default=PAPER_BUFFER, help="r (default: the paper's 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="as the probes' --model (default: the embedded model)")
    p.add_argument("--out", default="data/results/calibration")
    p.add_argument("--dry-run", action="store_true", help="print the probe command lines and stop")
    p.add_argument("--fallback", action="store_true",
                   help="when no point satisfies the rule, choose by the declared fallback tier (ceiling >= 0.8, "
                        "0.1 <= Random <= 0.9; recency's condition dropped), marked so in regime.json")
    a = p.parse_args(argv)
    for name in ("units", "budget", "buffer"):
        if getattr(a, name) <= 0:
            p.error(f"--{name} must be a positive integer, got {getattr(a, name)}")
    if any(v <= 0 for v in a.values) or len(set(a.values)) != len(a.values):
        p.error(f"--values must be distinct positive integers, got {a.values}")
    sweep = TASKS[a.task]
    root = Path(a.out) / a.task
    point_dir = lambda v: root / "points" / f"{sweep.knob}-{v}"  # noqa: E731
    if a.task == "copy":  # one accuracy run sweeps every budget
        commands = [(a.values, _copy_cmd(a, a.values, root / "points" / "budgets"))]
    else:
        commands = [(v, sweep.command(a, v, point_dir(v))) for v in a.values]
    for _, cmd in commands:
        print("python " + " ".join(cmd), flush=True)
    if a.dry_run:
        return 0
    for _, cmd in commands:
        rc = subprocess.call([sys.executable, *cmd])
        if rc != 0:
            print(f"calibrate_regime: the point's run failed (exit {rc}); rerun the same command to resume",
                  file=sys.stderr)
            return rc
    points, table = [], []
    for v in a.values:
        folder = root / "points" / ("budgets" if a.task == "copy" else f"{sweep.knob}-{v}")
        arms = sweep.read(folder, v)
        scores = {}
        for arm in ARMS:
            vals = arms.get(arm) or []
            est = mean_ci(vals) if vals else None
            scores[arm] = None if est is None else est.value
            table.append({"task": a.task, "knob": sweep.knob, "value": v, "arm": arm, "n": len(vals),
                          "score": None if est is None else est.value, "ci_low": None if est is None else est.lo,
                          "ci_high": None if est is None else est.hi})
        points.append({"value": v, "scores": scores})
    chosen, reason = choose(points, fallback=a.fallback)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    record = {"task": a.task, "knob": sweep.knob, "endpoint": sweep.endpoint, "rule": RULE,
              **({"fallback": FALLBACK} if a.fallback else {}),
              "settings": {"budget": a.budget, "buffer": a.buffer, "seed": a.seed, "units": a.units,
                           "model": a.model}, "values": a.values, "points": points,
              "chosen": None if chosen is None else {sweep.knob: chosen["value"], "scores": chosen["scores"],
                                                     "tier": chosen["tier"]},
              "reason": reason, "commands": ["python " + " ".join(c) for _, c in commands]}
    (root / "regime.json").write_text(json.dumps(record, indent=1) + "\n")
    print(reason)
    print(f"wrote {root / 'sweep.csv'} and {root / 'regime.json'}")
    return 0 if chosen is not None else 3


if __name__ == "__main__":
    sys.exit(main())
