"""The measurements of ``python -m probes.challenge``: each part runs a selector, Random and any baselines at the same
K, r and prompt protection, and returns tidy verdict rows (one per policy and metric) for the report.

Parts with a significance verdict compare paired units (problems, instances) with
:func:`randattn.stats.paired_comparison`: a percentile-bootstrap CI over units and an exact sign test, "better" or
"worse" only when both pass. The keep-log and cost parts are descriptive (means, differences with CIs, ratios).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tqdm.auto import tqdm

import randattn
from randattn import keepstats
from analysis.accuracy import grades_by_arm
from analysis.planted import lp_table, passcode_compare, summarize
from randattn.stats import mean_ci, paired_comparison, per_problem_means

from . import accuracy, cli, passcode, prompt_protection, survival
from .common import policy_slug
from .config import ConfigError
from .policy_specs import calibration_options
from .planted import Condition

from .planted_run import PlantedConfig, run_conditions, setup, write_csv
from .results import DEFAULT_TRACES, ResultsFile, run_record, trace_label

REFERENCE = "random"


@dataclass
class Context:
    """What every part needs: the challenge's configuration, the loaded model, the policies (the selector first,
    Random last), sizes."""

    config: object  # probes.challenge.Config
    model: object
    tok: object
    policies: list[str]
    out: Path
    sizes: dict

    @property
    def args(self):
        return self.config

    @property
    def loaded(self):
        return self.model, self.tok

    def options(self, policy: str) -> dict:
        """Constructor options a policy needs here: ``--stats`` for a policy that takes calibration data (without it,
        the policy binds to the embedded model's shipped statistics or refuses the model)."""
        return calibration_options(policy, self.args.stats)

    def cache(self, policy: str, seed: int, **kw) -> randattn.EvictingCache:
        """A cache of ``policy`` under the challenge's spec (its T, r, protection and ``--stats``), seeded ``seed``."""
        return self.args.spec(policy, seed=seed).make_cache(**kw)


def _mean(grades: dict) -> float:
    return float(np.mean(list(per_problem_means(grades).values())))


def compared(test: str, metric: str, unit: str, policy: str, a: dict, b: dict, seed: int, **extra) -> dict:
    """One verdict row: ``a`` (the policy) against ``b`` (Random), both ``{unit id: [score per run]}``."""
    c = paired_comparison(a, b, seed=seed)
    common = set(a) & set(b)
    return {"test": test, "metric": metric, "unit": unit, "policy": policy, "n": c.delta.n,
            "value": _mean({k: a[k] for k in common}), "random": _mean({k: b[k] for k in common}),
            **c.delta.as_dict("delta"), "p_bootstrap": c.p_bootstrap, "wins": c.sign.wins, "losses": c.sign.losses,
            "ties": c.sign.ties, "p_sign": c.sign.p, "verdict": c.verdict, **extra}


def described(test: str, metric: str, unit: str, policy: str, value: float, random_value: float, **extra) -> dict:
    """A descriptive row (no significance test)."""
    return {"test": test, "metric": metric, "unit": unit, "policy": policy, "value": value, "random": random_value,
            "verdict": "", **extra}


def _contenders(ctx: Context) -> list[str]:
    return [p for p in ctx.policies if p != REFERENCE]


# -- accuracy on a task ------------------------------------------------------------------------------
def accuracy_part(ctx: Context) -> list[dict]:
    """Generate and grade with probes.accuracy (full attention too, as the ceiling); paired by problem."""
    a, n = ctx.args, ctx.sizes
    acc = accuracy.Config(model=a.model, device=a.device, seed=a.seed, out=str(ctx.out), figure_dir=str(ctx.out),
                          task=a.task, policy=("full", *ctx.policies), budget=(a.budget,), buffer=a.buffer,
                          runs=n["runs"], problems=n["problems"], data=a.data, stats=a.stats,
                          protect_prompt=a.protect_prompt, no_figure=a.no_figure)
    resolved, rf, _ = accuracy.run(acc, *ctx.loaded)
    accuracy.report(resolved, rf, _, figure_name="accuracy")
    rows = rf.rows
    problems = {p.id for p in accuracy.load_problems(accuracy.get_task(a.task), a.data, n["problems"])}
    rows = [r for r in rows if r["problem"] in problems and r["run"] < n["runs"]]
    grades = grades_by_arm(rows)
    arm = lambda pol: accuracy.Arm(pol, a.budget, a.protect_prompt)  # noqa: E731
    full = grades.get(accuracy.Arm(accuracy.FULL, None, None), {})
    table = []
    for pol in _contenders(ctx):
        uncompressed = sum(not r["compressed"] for r in rows if r["policy"] in (pol, REFERENCE)
                           and r["budget"] == a.budget)
        table.append(compared("accuracy", f"{a.task} accuracy", "problems", pol, grades[arm(pol)],
                              grades[arm(REFERENCE)], a.seed, full_attention=_mean(full) if full else None,
                              uncompressed_rows=uncompressed))
    return table


# -- recall of the question (a task that needs the prompt) --------------------------------------------
def question_part(ctx: Context) -> list[dict]:
    """probes.prompt_protection's task: restate the question after body/r rounds; paired by instance."""
    a, n = ctx.args, ctx.sizes
    traces = Path(a.traces) if a.traces else DEFAULT_TRACES
    tasks = prompt_protection.Tasks(ctx.tok, prompt_protection.load_rows(traces), body=n["body"], seed=a.seed)
    idx_all = list(range(min(n["instances"], len(tasks))))  # the traces sharing one prompt layout bound it
    if len(idx_all) < n["instances"]:
        tqdm.write(f"question recall: {len(idx_all)} instances (only {len(tasks)} traces share one prompt layout)")
    # Rows go to disk batch by batch, so a selector failing later loses nothing measured here and a rerun resumes.
    record = {"probe": "challenge_question", "model": a.model or randattn.DEFAULT_MODEL, "budget": a.budget,
              "buffer": a.buffer, "body": n["body"], "seed": a.seed, "protect_prompt": a.protect_prompt,
              "stats": a.stats, "traces": trace_label(traces), **run_record(ctx.model)}
    try:
        rf = ResultsFile(ctx.out / "question_recall.jsonl", record, ("instance", "policy"))
    except ValueError as exc:  # rows of another configuration there
        raise ConfigError("out", str(exc)) from None
    batches = [(pol, idx_all[b:b + 8]) for pol in ["full", *ctx.policies] for b in range(0, len(idx_all), 8)]
    todo = [(pol, idx) for pol, idx in batches if not all((i, pol) in rf.done for i in idx)]
    if len(todo) < len(batches):
        tqdm.write(f"{rf.path}: {len(batches) - len(todo)} of {len(batches)} policy x batch results already there; "
                   + ("computing the rest" if todo else "nothing to compute"))
    for pol, idx in tqdm(todo, desc="question recall", unit="batch"):
        rf.append(prompt_protection.run_batch(ctx.model, tasks, idx, pol, a.protect_prompt, budget=a.budget,
                                              buffer=a.buffer, seed=a.seed * 1_000_003 + idx[0],
                                              options={} if pol == "full" else ctx.options(pol)))
    wanted = set(idx_all)
    rows = [{k: v for k, v in r.items() if k != "config"} for r in rf.rows if r["instance"] in wanted]
    write_csv(ctx.out / "question_recall.csv", rows)
    by = {(r["policy"], r["instance"]): r for r in rows}
    table = []
    full = float(np.nanmean([r["digit_acc"] for r in rows if r["policy"] == "full"]))
    for pol in _contenders(ctx):
        for metric, key, unit in (("question digit accuracy", "digit_acc", "instances"),
                                  ("question log-prob (nats/token)", "mean_lp", "instances")):
            g = lambda p: {i: [by[(p, i)][key]] for i in idx_all}  # noqa: E731
            table.append(compared("question recall", metric, unit, pol, g(pol), g(REFERENCE), a.seed,
                                  full_attention=full if key == "digit_acc" else None,
                                  rounds=by[(pol, 0)]["rounds"]))
    return table


# -- the planted fact ----------------------------------------------------------------------------------
def _planted_config(ctx: Context, policy: str, **over) -> PlantedConfig:
    a = ctx.args
    return PlantedConfig(model=a.model, device=a.device, seed=a.seed, traces=a.traces, budget=a.budget,
                         buffer=a.buffer, policy=policy, protect_prompt=a.protect_prompt,
                         stats=a.stats if ctx.options(policy) else None, **over)  # --stats reaches the policy reading it


def planted_part(ctx: Context) -> list[dict]:
    """A fact planted in a real trace, left to the policy like every other token; R from the two endpoints
    (kept in every head, deleted) under the same background policy. Paired by instance."""
    n = ctx.sizes
    by_policy = {}
    for pol in ctx.policies:
        cfg = _planted_config(ctx, pol, distance=n["distance"], instances=n["instances"], batch=8)
        s = setup("challenge_planted", cfg, loaded=ctx.loaded, out=ctx.out / "planted" / f"{policy_slug(pol)}.jsonl")
        w = s.builder.box_width
        conds = [Condition.heads("deleted", (), w), Condition.heads("all", range(s.n_heads), w), Condition.policy()]
        by_policy[pol] = run_conditions(s, conds, desc=f"planted fact: {pol}")
    cells = {pol: lp_table(rows)["policy"] for pol, rows in by_policy.items()}
    recall = {pol: summarize(rows, ["policy"], seed=ctx.args.seed)["policy"].recall for pol, rows in by_policy.items()}
    table = []
    for pol in _contenders(ctx):
        for metric, k in (("fact retrieval", 1), ("fact log-prob (nats)", 0)):
            g = lambda p: {i: [float(v[k])] for i, v in cells[p].items()}  # noqa: E731
            table.append(compared("planted fact", metric, "instances", pol, g(pol), g(REFERENCE), ctx.args.seed,
                                  distance=n["distance"]))
        r, r0 = recall[pol], recall[REFERENCE]
        table.append(described("planted fact", "recall R (own endpoints)", "instances", pol, r.value, r0.value,
                               value_lo=r.lo, value_hi=r.hi, random_lo=r0.lo, random_hi=r0.hi))
    return table


# -- the passcode needle -------------------------------------------------------------------------------
def passcode_part(ctx: Context) -> list[dict]:
    """probes.passcode's needle asked after many rounds; paired by instance; references as in the probe."""
    n = ctx.sizes
    a = ctx.args
    cfg = passcode.Config(model=a.model, device=a.device, seed=a.seed, traces=a.traces, budget=a.budget,
                          buffer=a.buffer, protect_prompt=a.protect_prompt, instances=n["passcode_instances"], batch=8,
                          rounds=n["rounds"], policies=tuple(ctx.policies), out=str(ctx.out / "passcode"),
                          stats=a.stats if any(ctx.options(p) for p in ctx.policies) else None, no_figure=True)
    rows_by_policy, sessions = passcode.run(cfg, *ctx.loaded)
    summary = passcode_compare(rows_by_policy, seed=a.seed)
    config = {k: rows_by_policy[REFERENCE][0]["config"][k] for k in ("model", "budget", "buffer", "protect_prompt",
                                                                     "seed", "rounds")}
    path = write_csv(ctx.out / "passcode" / "summary.csv", [{**r, **config} for r in summary])
    if not a.no_figure:
        cli.draw("passcode", path, ctx.out)
    cells = {pol: lp_table(rows)["policy"] for pol, rows in rows_by_policy.items()}
    full = next((r["retrieval"] for r in summary if r["policy"] == "full attention"), None)
    table = []
    for pol in _contenders(ctx):
        for metric, k in (("passcode retrieval", 1), ("passcode log-prob (nats)", 0)):
            g = lambda p: {i: [float(v[k])] for i, v in cells[p].items()}  # noqa: E731
            table.append(compared("passcode", metric, "instances", pol, g(pol), g(REFERENCE), ctx.args.seed,
                                  rounds=n["rounds"], full_attention=full if k == 1 else None))
    return table


# -- keep-sets -----------------------------------------------------------------------------------------
def _jaccard(a: torch.Tensor, b: torch.Tensor, prompt_len: int) -> float:
    """Mean over heads of |A∩B|/|A∪B| for two ``[H, K]`` keep-sets, generated positions only."""
    vals = []
    for x, y in zip(a.tolist(), b.tolist()):
        x, y = {p for p in x if p >= prompt_len}, {p for p in y if p >= prompt_len}
        if x | y:
            vals.append(len(x & y) / len(x | y))
    return float(np.mean(vals)) if vals else float("nan")


def keeplog_part(ctx: Context) -> list[dict]:
    """Replay real chats with a keep-log: keep-set metrics per policy, and how far each policy's final keep-sets
    overlap Random's (against Random with another seed, the overlap chance alone gives)."""
    a, n = ctx.args, ctx.sizes
    traces = Path(a.traces) if a.traces else DEFAULT_TRACES
    length = a.budget + n["keeplog_rounds"] * a.buffer
    chats = survival.build_chats(ctx.tok, survival.read_rows(traces), n["sequences"], length, a.seed,
                                 a.budget if a.protect_prompt else a.budget + a.buffer)
    metrics: dict = {}
    overlap: dict = {}
    other_seed = "random (another seed)"
    for group in tqdm(survival.batches(chats, 4), desc="keep-logs", unit="batch"):
        prompt_len = group[0].prompt_len
        ids = torch.tensor([c.ids for c in group], device=ctx.model.device)
        final = {}
        for pol in [*ctx.policies, other_seed]:
            seed = a.seed * 1_000_003 + group[0].index + (7919 if pol == other_seed else 0)
            cache = ctx.cache(REFERENCE if pol == other_seed else pol, seed, keep_log=True)
            randattn.replay(ctx.model, ids, cache, prompt_len=prompt_len, score_from=ids.shape[1])
            final[pol] = [cache.positions(layer) for layer in range(len(cache.layers))]
            for b, chat in enumerate(group):
                m = keepstats.keep_metrics(keepstats.select_rows(cache.keep_log, b), prompt_len)
                metrics.setdefault(pol, {})[chat.index] = m
        for pol in final:
            for b, chat in enumerate(group):
                overlap.setdefault(pol, {})[chat.index] = float(np.mean(
                    [_jaccard(x[b], y[b], prompt_len) for x, y in zip(final[pol], final[REFERENCE])]))
    for pol in metrics:
        for seq in metrics[pol]:
            metrics[pol][seq]["overlap_with_random"] = overlap[pol][seq]
    (ctx.out / "keeplog.json").write_text(json.dumps(metrics, indent=1))
    names = {"slot_coverage": "slot coverage", "prompt_union": "prompt survival (union of heads)",
             "prompt_head": "prompt survival (per head)", "jaccard": "keep-set overlap between heads",
             "entropy": "coverage entropy", "overlap_with_random": "keep-set overlap with Random"}
    table = []
    for pol in _contenders(ctx) + [other_seed]:
        for key, label in names.items():
            if key == "overlap_with_random":
                d = [metrics[pol][s][key] for s in metrics[pol]]
                table.append(described("keep-sets", label, "sequences", pol, float(np.mean(d)), 1.0))
                continue
            if pol == other_seed:
                continue
            d = [metrics[pol][s][key] - metrics[REFERENCE][s][key] for s in metrics[pol]]
            if any(np.isnan(d)):
                continue
            table.append(described("keep-sets", label, "sequences", pol,
                                   float(np.mean([metrics[pol][s][key] for s in metrics[pol]])),
                                   float(np.mean([metrics[REFERENCE][s][key] for s in metrics[pol]])),
                                   **mean_ci(d, seed=a.seed).as_dict("delta")))
    return table


# -- cost -----------------------------------------------------------------------------------------------
def cost_part(ctx: Context) -> list[dict]:
    """Decode throughput and milliseconds per eviction round (the cache's own timers), policies interleaved
    within each repeat so drift hits them alike; medians."""
    a, n = ctx.args, ctx.sizes
    traces = Path(a.traces) if a.traces else DEFAULT_TRACES
    chat = survival.build_chats(ctx.tok, survival.read_rows(traces), 1, a.budget + a.buffer, a.seed, a.budget)[0]
    ids = torch.tensor([list(chat.ids[:chat.prompt_len])] * n["cost_batch"], device=ctx.model.device)
    new = a.budget + n["cost_rounds"] * a.buffer - chat.prompt_len
    pad = ctx.tok.pad_token_id if ctx.tok.pad_token_id is not None else 0
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
    randattn.generate(ctx.model, ids, ctx.cache(REFERENCE, 0), **{**gen, "max_new_tokens": 8, "min_new_tokens": 8})
    speed: dict = {p: [] for p in ctx.policies}
    round_ms: dict = {p: [] for p in ctx.policies}
    for rep in tqdm(range(n["cost_repeats"]), desc="cost", unit="repeat"):
        for pol in ctx.policies:
            cache = ctx.cache(pol, a.seed + rep)
            t0 = time.perf_counter()
            randattn.generate(ctx.model, ids, cache, **gen)
            seconds = time.perf_counter() - t0
            speed[pol].append(ids.shape[0] * new / seconds)
            round_ms[pol].append(1000 * cache.round_seconds / max(1, cache.total_events))
    med = {p: (statistics.median(speed[p]), statistics.median(round_ms[p])) for p in ctx.policies}
    table = []
    setting = {"batch": n["cost_batch"], "new_tokens": new, "rounds": n["cost_rounds"], "repeats": n["cost_repeats"]}
    for pol in _contenders(ctx):
        table.append(described("cost", "ms per eviction round (one layer)", "ms", pol, med[pol][1], med[REFERENCE][1],
                               ratio=med[pol][1] / med[REFERENCE][1], **setting))
        table.append(described("cost", "decode tokens/s", "tokens/s", pol, med[pol][0], med[REFERENCE][0],
                               ratio=med[pol][0] / med[REFERENCE][0], **setting))
    return table


PARTS = {"accuracy": accuracy_part, "question": question_part, "planted": planted_part, "passcode": passcode_part,
         "keeplog": keeplog_part, "cost": cost_part}


def preflight(model, tok, policy: str, *, protect: bool, options: dict) -> Optional[str]:
    """Run the selector for a few rounds on the real model; the error text when it fails, else None."""
    ids = torch.tensor([tok("Let us check the selector on a short text before the long runs begin.",
                            add_special_tokens=False)["input_ids"][:8]], device=model.device)
    cache = randattn.EvictionSpec(policy, 16, 4, protect_prompt=protect, options=options).make_cache()
    try:
        randattn.generate(model, ids, cache, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                          pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
    except (ValueError, TypeError, RuntimeError) as exc:
        return str(exc)
    if cache.total_events == 0:
        return "no eviction round ran in the trial generation"
    return None


__all__ = ["Context", "PARTS", "REFERENCE", "compared", "described", "preflight"]
