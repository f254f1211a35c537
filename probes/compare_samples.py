"""Paired comparison of two lm-eval runs from their per-sample files (``lm_eval ... --log_samples``).

    python -m probes.compare_samples A.jsonl B.jsonl                    # e.g. a policy (A) and Random or full (B)
    python -m probes.compare_samples --a A_seed0.jsonl A_seed1.jsonl --b B.jsonl --metric acc

Each file is one run of one task (``samples_<task>_<date>.jsonl``); several files per side are several runs (e.g.
eviction seeds). Documents are paired by ``doc_id`` (their ``doc_hash`` must agree, so both sides saw the same
data); per document the runs are averaged and ``d = A - B``. Printed: each side's mean with a bootstrap CI, the
mean difference with its problem-clustered bootstrap CI and p, the exact sign test (ties dropped) and the verdict,
significant only when both the CI excludes 0 and the sign test has p < alpha: the accuracy harness's rule
(:func:`randattn.stats.paired_comparison`).
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from randattn.stats import mean_ci, paired_comparison, per_problem_means

from .common import seed_int

__all__ = ["SamplesError", "Run", "load_run", "scores", "compare", "main"]

_NAME = re.compile(r"^samples_(?P<task>.+)_\d{4}-\d{2}-\d{2}T[\d\-.]+\.jsonl$")


class SamplesError(ValueError):
    """A samples file cannot be compared; the message names the file and the fix."""


@dataclass
class Run:
    path: Path
    task: Optional[str]  # from lm-eval's file name, when it has that form
    rows: list


def load_run(path) -> Run:
    """One lm-eval samples file: its rows, and its task from the file name."""
    path = Path(path)
    if not path.is_file():
        raise SamplesError(f"{path}: no such file; pass the samples_<task>_<date>.jsonl lm-eval writes with "
                           f"--log_samples under --output_path")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SamplesError(f"{path}:{n}: not JSON ({exc.msg}); is this an lm-eval samples file?") from None
        if not isinstance(row, dict) or not {"doc_id", "metrics"} <= row.keys():
            raise SamplesError(f"{path}:{n}: no doc_id/metrics fields; pass a samples_<task>_<date>.jsonl file that "
                               "lm-eval wrote with --log_samples (not its results_<date>.json)")
        rows.append(row)
    if not rows:
        raise SamplesError(f"{path}: empty; the run logged no samples")
    m = _NAME.match(path.name)
    return Run(path, m["task"] if m else None, rows)


def _pick(kind: str, flag: str, wanted: Optional[str], available: list, where: str) -> str:
    if wanted is not None:
        if wanted not in available:
            raise SamplesError(f"{flag} {wanted}: {where} has no {kind} {wanted!r}; available: {', '.join(available)}")
        return wanted
    if len(available) > 1:
        raise SamplesError(f"{where} has several {kind}s ({', '.join(available)}); choose one with {flag}")
    return available[0]


def scores(run: Run, metric: Optional[str] = None, filter_name: Optional[str] = None) -> tuple[str, str, dict]:
    """``(metric, filter, {doc_id: (score, doc_hash)})`` of one run."""
    filters = list(dict.fromkeys(str(r.get("filter", "none")) for r in run.rows))
    filt = _pick("filter", "--filter", filter_name, filters, str(run.path))
    rows = [r for r in run.rows if str(r.get("filter", "none")) == filt]
    metrics = list(dict.fromkeys(m for r in rows for m in r["metrics"]))
    name = _pick("metric", "--metric", metric, metrics, str(run.path))
    out = {}
    for r in rows:
        value = r.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SamplesError(f"{run.path}: metric {name!r} is not one number per sample (doc_id {r['doc_id']} has "
                               f"{value!r}; corpus metrics such as perplexities are aggregated over all documents); "
                               f"choose a per-sample metric with --metric")
        if r["doc_id"] in out:
            raise SamplesError(f"{run.path}: doc_id {r['doc_id']} appears twice under filter {filt!r}; one file is one "
                               "run of one task")
        out[r["doc_id"]] = (float(value), r.get("doc_hash"))
    return name, filt, out


def _side(runs: list, metric, filt, label: str) -> tuple[str, str, dict, dict]:
    """Scores of one side's runs: ``(metric, filter, {doc: [score per run]}, {doc: doc_hash})``."""
    grades, hashes = defaultdict(list), {}
    for run in runs:
        metric_, filt_, per_doc = scores(run, metric, filt)
        metric, filt = metric_, filt_  # the first file's choice must hold for the rest
        for doc, (value, h) in per_doc.items():
            if hashes.setdefault(doc, h) != h:
                raise SamplesError(f"{run.path}: doc_id {doc} is a different document than in the other {label} runs "
                                   "(doc_hash differs); compare runs of the same task data")
            grades[doc].append(value)
    return metric, filt, dict(grades), hashes


def compare(a_paths: list, b_paths: list, *, metric: Optional[str] = None, filter_name: Optional[str] = None,
            n_resamples: int = 10_000, seed: int = 0, alpha: float = 0.05) -> dict:
    """The comparison of side A with side B (each a list of samples files, one per run) as a dict."""
    a_runs, b_runs = [load_run(p) for p in a_paths], [load_run(p) for p in b_paths]
    tasks = {r.task for r in a_runs + b_runs if r.task is not None}
    if len(tasks) > 1:
        raise SamplesError(f"the files are runs of different tasks ({', '.join(sorted(tasks))}); compare one task at "
                           "a time")
    metric, filt, a, a_hash = _side(a_runs, metric, filter_name, "A")
    metric, filt, b, b_hash = _side(b_runs, metric, filt, "B")
    clash = sorted(d for d in a.keys() & b.keys() if a_hash[d] != b_hash[d])
    if clash:
        raise SamplesError(f"doc_id {clash[0]} (and {len(clash) - 1} more) hold different documents in A and B "
                           "(doc_hash differs): the runs used different task data or prompts")
    common = sorted(a.keys() & b.keys())
    if not common:
        raise SamplesError("A and B share no doc_id; run both on the same task and --limit")
    a, b = {d: a[d] for d in common}, {d: b[d] for d in common}
    c = paired_comparison(a, b, n_resamples=n_resamples, seed=seed, alpha=alpha)
    side = {k: mean_ci(list(per_problem_means(g).values()), n_resamples=n_resamples, seed=seed) for k, g in
            (("a", a), ("b", b))}
    return {"task": tasks.pop() if tasks else None, "metric": metric, "filter": filt, "problems": len(common),
            "only_a": len(a_hash.keys() - b_hash.keys()), "only_b": len(b_hash.keys() - a_hash.keys()),
            "runs_a": len(a_runs), "runs_b": len(b_runs), "a": side["a"], "b": side["b"], "comparison": c}


def report(res: dict, a_paths: list, b_paths: list) -> str:
    c = res["comparison"]
    dropped = f"; left out, in one side only: A {res['only_a']}, B {res['only_b']}" if res["only_a"] or res["only_b"] \
        else ""
    lines = [f"task {res['task'] or '?'} | metric {res['metric']} (filter {res['filter']}) | {res['problems']} problems "
             f"in both{dropped}",
             f"A ({res['runs_a']} run{'s' * (res['runs_a'] > 1)}: {', '.join(map(str, a_paths))}): mean {res['a']}",
             f"B ({res['runs_b']} run{'s' * (res['runs_b'] > 1)}: {', '.join(map(str, b_paths))}): mean {res['b']}",
             f"A - B: {c.delta.value:+.3f} [95% CI {c.delta.lo:+.3f}, {c.delta.hi:+.3f}] (problem-clustered bootstrap), "
             f"p_boot {c.p_bootstrap:.3f}",
             f"exact sign test: A better on {c.sign.wins}, worse on {c.sign.losses}, tied on {c.sign.ties}; "
             f"p {c.sign.p:.3f}",
             f"verdict: {c.verdict} (significant only when the CI excludes 0 and the sign test has p < {c.alpha:g})"]
    return "\n".join(lines)


def _parser():
    import argparse

    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("files", nargs="*", metavar="FILE", help="A.jsonl B.jsonl: one run per side (or use --a/--b)")
    p.add_argument("--a", nargs="+", default=None, metavar="FILE", help="side A's samples files, one per run")
    p.add_argument("--b", nargs="+", default=None, metavar="FILE", help="side B's samples files, one per run")
    p.add_argument("--metric", default=None, help="the per-sample metric (default: the file's only one)")
    p.add_argument("--filter", default=None, help="lm-eval's filter (default: the file's only one)")
    p.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples (>= 1000)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the bootstrap")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level of both tests")
    return p


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.files and (args.a or args.b):
        p.error("give either two files (A.jsonl B.jsonl) or --a FILE... --b FILE..., not both")
    if args.files and len(args.files) != 2:
        p.error(f"expected two files, A.jsonl B.jsonl, got {len(args.files)}; for several runs per side use "
                "--a FILE... --b FILE...")
    a, b = (args.files[:1], args.files[1:]) if args.files else (args.a, args.b)
    if not a or not b:
        p.error("give two samples files, A.jsonl B.jsonl, or --a FILE... --b FILE...")
    if args.resamples < 1000:
        p.error(f"--resamples {args.resamples}: use >= 1000 for a 95% percentile interval")
    if not 0 < args.alpha < 1:
        p.error(f"--alpha {args.alpha}: must lie strictly between 0 and 1")
    try:
        res = compare(a, b, metric=args.metric, filter_name=args.filter, n_resamples=args.resamples, seed=args.seed,
                      alpha=args.alpha)
    except SamplesError as exc:
        p.error(str(exc))
    print(report(res, a, b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
