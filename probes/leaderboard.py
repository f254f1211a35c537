"""The leaderboard: every selector against protected Random at the same T, r, protection and runtime, with statistics.

    python -m probes.leaderboard                                           # every compared selector, embedded model
    python -m probes.leaderboard --selector my_selector.py:score           # your selector ranked beside them
    python -m probes.leaderboard --policies snapkv rkv --selector examples/attention_selector.py:recent_attention
    python -m probes.leaderboard --tasks copy passcode --problems 8 --passcode-instances 8   # a smaller look

Each selector (``--policies``: registered names, default every selector the paper compared Random with;
``--selector``: your own ``path/to/file.py:CALLABLE`` or ``MODULE:CALLABLE``) and Random run on the embedded model's
tasks, every one under the same eviction setting (``--budget``, ``--buffer``, the prompt protected):

- ``copy``: the accuracy harness's copy task at T (graded share of the list reproduced), paired by problem;
- ``repeat``: the repeat task at ``--compression`` (T = full attention's mean length / c, its own r of 8), by problem;
- ``question``: the prompt-protection probe's question restated after ``--body`` tokens (digits recalled), by instance;
- ``passcode``: the passcode stated once and asked after ``--rounds`` rounds (retrieval), by instance;
- ``planted``: a fact planted in a real trace at ``--distance`` and left to the policy (retrieval), by instance;
- ``cost``: milliseconds per eviction round and decode tokens/s, each selector interleaved with Random in the same
  unit, reported as a ratio to Random's so that the machine's load cancels.

The tasks are the probes' own code (the copy and repeat units are the accuracy kind's; the others call the probes'
run functions), planned as units of the ``leaderboard`` kind: ``python -m probes.leaderboard`` runs them here, and a
TOML grid with ``probe = "leaderboard"`` runs the same units on Ray (``python -m probes.grid``). Random's units are
shared by every selector, so adding one later computes only its own. A selector's verdict per task is the paper's
rule (:func:`randattn.stats.paired_comparison`): better or worse only when the paired bootstrap 95% CI and the exact
sign test both exclude no difference, else "no detectable difference". The rows of every task (resumable: a killed
run resumes to the same rows) and ``leaderboard.csv`` go to ``--out`` (default
``data/results/leaderboard/<model>-K<T>-r<r>-s<seed>-<protection>/``); ``figures/leaderboard.png``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import numpy as np

import randattn
from analysis.names import result_name
from randattn.stats import mean_ci, per_problem_means

from . import accuracy, cli, passcode, prompt_protection, units
from .challenge_parts import REFERENCE, Context, compared, cost_part
from .common import policy_slug
from .config import POSITIVE, ConfigError, EvictionConfig, eviction, option, setting
from .planted import Condition, InstanceBuilder
from .planted_run import PlantedConfig, load, run_conditions, setup, write_csv
from .policy_specs import calibration_options
from .results import DEFAULT_TRACES, run_record, trace_label
from .units import Kind, ModelInfo, Output, Plan, Unit, make_unit, run_local

TASKS = ("copy", "repeat", "question", "passcode", "planted", "cost")
RUN_ORDER = ("copy", "question", "passcode", "cost", "planted", "repeat")
#: task -> (metric, what is paired): the leaderboard's score on each task.
METRICS = {"copy": ("copy accuracy", "problems"), "repeat": ("repeat accuracy", "problems"),
           "question": ("question digits recalled", "instances"), "passcode": ("passcode retrieval", "instances"),
           "planted": ("planted-fact retrieval", "instances")}
VERDICTS = {"better": "better", "worse": "worse", "indistinguishable": "no detectable difference"}
ROUND_COST = "ms per eviction round (one layer)"
THROUGHPUT = "decode tokens/s"
#: the selectors ranked by default: every one the paper compared Random with (the registry's others by name).
DEFAULT_SELECTORS = tuple(p for p in randattn.COMPARED_POLICIES if p != REFERENCE)


@dataclass
@eviction(policies=setting(DEFAULT_SELECTORS, help="registered selectors ranked against Random (names or paper modes; "
                                                   "default: every selector the paper compared it with)"),
          budget=256, buffer=16, protect_prompt=True, stats=None)
class Config(EvictionConfig):
    """Every selector against protected Random on the embedded tasks (``python -m probes.leaderboard``)."""

    selector: tuple[str, ...] = option((), "your own selectors, ranked beside --policies: path/to/file.py:CALLABLE or "
                                           "MODULE:CALLABLE (runs the file's code: load only selectors you trust)",
                                       metavar="FILE.py:FN")
    tasks: tuple[str, ...] = option(TASKS, "the tasks run", choices=TASKS)
    traces: Optional[str] = option(None, "JSONL with 'question' and 'text' per row: the real traces the question, "
                                         "passcode and planted tasks are built from (default: the embedded model's)")
    problems: int = option(32, "copy: problems (paired by problem)", check=POSITIVE)
    runs: int = option(1, "copy and repeat: eviction seeds per problem for the policies that draw on one",
                       check=POSITIVE)
    repeat_problems: int = option(8, "repeat: problems", check=POSITIVE)
    compression: float = option(4.0, "repeat: T = full attention's mean generation length / compression",
                                check=POSITIVE)
    instances: int = option(16, "question: instances", check=POSITIVE)
    body: int = option(512, "question: reasoning tokens between the question and its restatement", check=POSITIVE)
    passcode_instances: int = option(16, "passcode: instances", check=POSITIVE)
    rounds: int = option(57, "passcode: eviction rounds between the statement and the question", check=POSITIVE)
    planted_instances: int = option(16, "planted: instances", check=POSITIVE)
    distance: int = option(384, "planted: tokens from the fact to its answer", check=POSITIVE)
    cost_repeats: int = option(3, "cost: interleaved repeats per selector (medians)", check=POSITIVE)
    cost_rounds: int = option(8, "cost: eviction rounds per timed generation", check=POSITIVE)
    cost_batch: int = option(2, "cost: sequences per timed generation", check=POSITIVE)
    batch: int = option(8, "question, passcode, planted: instances replayed together (copy and repeat: the accuracy "
                           "harness's batches)", check=POSITIVE)
    max_new_tokens: Optional[int] = option(None, "copy and repeat: new tokens at most (default: each task's, copy 192, "
                                                 "repeat 1664)", check=POSITIVE)

    policy_fields = ("policies", "selector")

    def check(self) -> None:
        if REFERENCE in self.selectors:
            raise ConfigError(self.policy_field(REFERENCE), "random is the reference every selector is measured "
                                                            "against; leave it out")
        if not self.selectors:
            raise ConfigError("policies", "no selector to rank: give --policies and/or --selector FILE.py:FN")
        if not self.tasks:
            raise ConfigError("tasks", "no task to run")
        self.check_eviction()

    @property
    def selectors(self) -> list[str]:
        """The selectors ranked, in order (``--policies`` then ``--selector``), Random not among them."""
        return list(dict.fromkeys([*self.policies, *self.selector]))

    @property
    def policies_run(self) -> list[str]:
        return [*self.selectors, REFERENCE]


def run_name(config: Config, model_name: str) -> str:
    """The run's folder: the setting every selector shares (not the selectors, so a new one joins the same board)."""
    return result_name("leaderboard", config, "folder", model=model_name)


def _traces(config: Config) -> Path:
    return Path(config.traces) if config.traces else DEFAULT_TRACES


def _record(config: Config, model_name: str, task: str, **extra) -> dict:
    """The configuration stored in every row of one task's file (a resumed run must match it; the selectors and the
    item counts are not in it, so more selectors or items extend the same file)."""
    return {"probe": f"leaderboard_{task}", "engine": randattn.ENGINE, "model": model_name, "budget": config.budget,
            "buffer": config.buffer, "protect_prompt": config.protect_prompt, "seed": config.seed,
            "stats": config.stats, "traces": trace_label(_traces(config)), **extra, **run_record()}


# -- planning ------------------------------------------------------------------------------------------------
def _wrap(task: str, inner: Unit) -> Unit:
    """A unit of another kind (the accuracy kind's copy and repeat batches) as a leaderboard unit: same rows, same
    ids and output; the worker runs it through that kind's ``run_unit``."""
    return Unit("leaderboard", inner.model, inner.output, inner.fixed, inner.items, {"task": task, "inner": inner},
                inner.parts, inner.fanout, inner.ids, inner.id, label=f"{task}: {inner.label}")


def accuracy_config(config: Config, task: str, root: Path) -> accuracy.Config:
    common = dict(model=config.model, device=config.device, seed=config.seed, out=str(root / task), no_figure=True,
                  task=task, runs=config.runs, stats=config.stats, protect_prompt=config.protect_prompt,
                  max_new_tokens=config.max_new_tokens)  # the accuracy harness's own batches (of equal prompts)
    if task == "copy":
        return accuracy.Config(policy=tuple(config.policies_run), budget=(config.budget,), buffer=config.buffer,
                               problems=config.problems, **common)
    return accuracy.Config(policy=(accuracy.FULL, *config.policies_run), compression=(config.compression,),
                           problems=config.repeat_problems, **common)


_QUESTION_TASKS: dict = {}


def _question_tasks(tok, traces: str, body: int, seed: int) -> prompt_protection.Tasks:
    """The question task's instances (built once per tokenizer and layout in a process)."""
    key = (id(tok), traces, body, seed)
    if key not in _QUESTION_TASKS:
        _QUESTION_TASKS.clear()
        _QUESTION_TASKS[key] = prompt_protection.Tasks(tok, prompt_protection.load_rows(Path(traces)), body=body,
                                                       seed=seed)
    return _QUESTION_TASKS[key]


def _builder(config: Config, tok, task: str) -> InstanceBuilder:
    from randattn.traces import load_traces

    texts = load_traces(_traces(config))
    if task == "passcode":
        return InstanceBuilder(tok, texts, budget=config.budget, buffer=config.buffer, box_width=20, seed=config.seed,
                               distance=passcode.passcode_distance(config.rounds, config.buffer, 20),
                               fact=passcode.FACT, query=passcode.QUERY, instruction=passcode.INSTRUCTION,
                               deletable=False)
    return InstanceBuilder(tok, texts, budget=config.budget, buffer=config.buffer, distance=config.distance,
                           seed=config.seed, deletable=False)


def plan(config: Config, model: ModelInfo) -> Plan:
    """Every task's units for every selector and Random (Random's once, shared), in the order a fresh run computes
    them; the repeat task's policies are a second stage (T comes from full attention's lengths)."""
    root = Path(config.out or Path("data") / "results" / "leaderboard") / run_name(config, model.name)
    pols = config.policies_run
    options = {p: calibration_options(p, config.stats) for p in pols}
    for p in pols:  # every selector binds to the model before anything runs (TriAttention without statistics...)
        config.bind(config.spec(p), model.bind_target)
    outputs, work, later = [], [], None
    meta = {"root": str(root), "model": model.name, "tasks": {}}

    def output(task, key, **extra):
        record = _record(config, model.name, task, **extra)
        o = Output(str(root / result_name(record["probe"], record)), record, key, meta={"task": task})
        outputs.append(o)
        return o

    for task in config.tasks:
        if task in ("copy", "repeat"):
            inner = accuracy.plan(accuracy_config(config, task, root), model)
            outputs.extend(inner.outputs)
            meta["tasks"][task] = inner.outputs[0].path
            work += [_wrap(task, u) for u in inner.units]
            if inner.then is not None:
                later = inner.then
        elif task == "question":
            tasks = _question_tasks(model.tokenizer, str(_traces(config)), config.body, config.seed)
            config.fits(config.spec(), tasks.prompt_len, what="question task")
            n = min(config.instances, len(tasks))
            o = output("question", ("instance", "policy"), body=config.body)
            meta["tasks"][task] = o.path
            for p in pols:
                for b in range(0, n, config.batch):
                    idx = list(range(b, min(n, b + config.batch)))
                    w = {"task": task, "traces": str(_traces(config)), "body": config.body, "seed": config.seed,
                         "idx": idx, "policy": p, "protect": config.protect_prompt, "budget": config.budget,
                         "buffer": config.buffer, "batch_seed": config.seed * 1_000_003 + idx[0],
                         "options": options[p]}
                    work.append(make_unit("leaderboard", model.name, o, {"policy": p}, [{"instance": i} for i in idx],
                                          w, label=f"question: {p} {idx[0]}-{idx[-1]}"))
        elif task in ("passcode", "planted"):
            builder = _builder(config, model.tokenizer, task)
            config.fits(config.spec(), len(builder.stub), what=f"{task} task stub")
            n = config.passcode_instances if task == "passcode" else config.planted_instances
            extra = {"rounds": config.rounds} if task == "passcode" else {"distance": config.distance}
            o = output(task, ("instance", "policy"), **extra)
            meta["tasks"][task] = o.path
            for p in pols:
                for b in range(0, n, config.batch):
                    idx = list(range(b, min(n, b + config.batch)))
                    w = {"task": task, "config": config, "policy": p, "first": b, "instances": idx[-1] + 1,
                         "scratch": str(root / "work" / task / policy_slug(p))}
                    work.append(make_unit("leaderboard", model.name, o, {"policy": p}, [{"instance": i} for i in idx],
                                          w, label=f"{task}: {p} {idx[0]}-{idx[-1]}"))
        elif task == "cost":
            o = output("cost", ("policy", "metric"), repeats=config.cost_repeats, rounds=config.cost_rounds,
                       cost_batch=config.cost_batch)
            meta["tasks"][task] = o.path
            for p in config.selectors:
                work.append(make_unit("leaderboard", model.name, o, {"policy": p},
                                      [{"metric": ROUND_COST}, {"metric": THROUGHPUT}],
                                      {"task": task, "config": config, "policy": p}, label=f"cost: {p} vs random"))
    # The cheap tasks first and the long ones last (planted replays, then the repeat task's full attention), so that
    # a run cut short has its quickest tables on disk.
    work.sort(key=lambda u: RUN_ORDER.index(u.work["task"]))
    result = Plan("leaderboard", config, outputs, work, meta=meta)
    if later is not None:
        def second(rows: dict) -> Plan:
            stage = later(rows)
            return Plan("leaderboard", config, outputs, [_wrap("repeat", u) for u in stage.units], meta=meta)
        result.then = second
    return result


# -- running one unit ---------------------------------------------------------------------------------------
def _planted_rows(model, tok, w: dict) -> list[dict]:
    """One batch of the passcode or the planted task under one policy, through the probes' own run functions (their
    rows resume from a scratch file beside the board if a run is killed in the middle of a batch)."""
    c: Config = w["config"]
    pol, task = w["policy"], w["task"]
    stats = c.stats if calibration_options(pol, c.stats) else None
    common = dict(model=c.model, device=c.device, seed=c.seed, traces=c.traces, budget=c.budget, buffer=c.buffer,
                  protect_prompt=c.protect_prompt, stats=stats, instances=w["instances"], batch=c.batch,
                  no_figure=True)
    scratch = Path(w["scratch"])
    if task == "passcode":
        cfg = passcode.Config(policies=(pol,), rounds=c.rounds, references=False, out=str(scratch), **common)
        rows = passcode.run(cfg, model, tok)[0][pol]
    else:
        cfg = PlantedConfig(policy=pol, distance=c.distance, **common)
        s = setup("leaderboard_planted", cfg, loaded=(model, tok), out=scratch / "planted.jsonl", pins_boxes=False,
                  builder_texts={"deletable": False})  # the fact is only ever left to the policy
        rows = run_conditions(s, [Condition.policy()], desc=f"planted: {pol}")
    return [{**{k: v for k, v in r.items() if k != "config"}, "policy": pol} for r in rows
            if r["instance"] >= w["first"] and r["fact"] == 0]


def run_unit(model, tok, unit: Unit):
    """One leaderboard unit: a copy or repeat batch (the accuracy kind's own unit), a question batch, a passcode or
    planted batch, or one selector's cost measured against Random's."""
    w = unit.work
    task = w["task"]
    if "inner" in w:
        inner = replace(w["inner"], parts=unit.parts)
        yield from units.kind(inner.kind).run_unit(model, tok, inner)
    elif task == "question":
        tasks = _question_tasks(tok, w["traces"], w["body"], w["seed"])
        yield prompt_protection.run_batch(model, tasks, w["idx"], w["policy"], w["protect"], budget=w["budget"],
                                          buffer=w["buffer"], seed=w["batch_seed"], options=w["options"])
    elif task in ("passcode", "planted"):
        yield _planted_rows(model, tok, w)
    elif task == "cost":
        c: Config = w["config"]
        sizes = {"cost_batch": c.cost_batch, "cost_rounds": c.cost_rounds, "cost_repeats": c.cost_repeats}
        rows = cost_part(Context(c, model, tok, [w["policy"], REFERENCE], Path("."), sizes))
        yield [{k: v for k, v in r.items() if k != "verdict"} for r in rows]
    else:
        raise ValueError(f"not a leaderboard task: {task!r}")


# -- the table -----------------------------------------------------------------------------------------------
def _scores(task: str, rows: list[dict]) -> tuple[dict, dict, dict]:
    """``({policy: {unit: [score per run]}}, {policy: {unit: [log-prob]}}, {policy: mean generated length})`` of one
    task's rows (log-probs for the teacher-forced tasks: the answer's mean log-prob, finer than an exact answer)."""
    scores: dict = {}
    lps: dict = {}
    lengths: dict = {}
    for r in rows:
        if task in ("copy", "repeat"):
            if r["policy"] == accuracy.FULL:
                continue
            scores.setdefault(r["policy"], {}).setdefault(r["problem"], []).append(float(r["grade"]))
            lengths.setdefault(r["policy"], []).append(r["gen_len"])
        elif task == "question":
            scores.setdefault(r["policy"], {})[r["instance"]] = [float(r["digit_acc"])]
            lps.setdefault(r["policy"], {})[r["instance"]] = [float(r["mean_lp"])]
        else:
            scores.setdefault(r["policy"], {})[r["instance"]] = [float(r["retrieved"])]
            lps.setdefault(r["policy"], {})[r["instance"]] = [float(r["lp"])]
    return scores, lps, {p: float(np.mean(v)) for p, v in lengths.items()}


def _planned_rows(plan_units: list[Unit], path: str, rows: list[dict], key: tuple) -> list[dict]:
    """The rows of ``rows`` that this plan's units name (a file may hold more selectors or items than asked)."""
    wanted = {tuple(k[f] for f in key) for u in plan_units if u.output == path for item in u.items
              for k in u.keys(item)}
    return [r for r in rows if tuple(r[f] for f in key) in wanted]


def board(config: Config, plan_units: list[Unit], outputs: list[Output], rows: dict) -> list[dict]:
    """One row per selector and task: score with its 95% CI, Random's, the paired difference with its CI, bootstrap
    p, sign test and verdict, generated length (copy, repeat) and round cost as a ratio to Random's; ranked."""
    by_task = {o.meta.get("task") or ("copy" if "/copy/" in o.path else "repeat"): o for o in outputs}
    cost = {}
    if "cost" in by_task:
        o = by_task["cost"]
        for r in _planned_rows(plan_units, o.path, rows.get(o.path, []), o.key):
            cost[(r["policy"], r["metric"])] = r
    table = []
    for task in config.tasks:
        if task == "cost" or task not in by_task:
            continue
        o = by_task[task]
        scores, lps, lengths = _scores(task, _planned_rows(plan_units, o.path, rows.get(o.path, []), o.key))
        if REFERENCE not in scores:
            continue
        budgets = sorted({u.fixed.get("budget") for u in plan_units if u.output == o.path
                          and u.fixed.get("policy") == REFERENCE} - {None})
        metric, unit = METRICS[task]
        ref = mean_ci(list(per_problem_means(scores[REFERENCE]).values()), seed=config.seed)
        for pol in config.selectors:
            if pol not in scores:
                continue
            row = compared(task, metric, unit, pol, scores[pol], scores[REFERENCE], config.seed)
            common = sorted(set(scores[pol]) & set(scores[REFERENCE]), key=str)  # a fixed order: reruns byte-equal
            for col, p in (("value", pol), ("random", REFERENCE)):
                means = per_problem_means({k: scores[p][k] for k in common})
                row[col] = float(np.mean([means[k] for k in common]))
            est = mean_ci(list(per_problem_means(scores[pol]).values()), seed=config.seed)
            row.update({"value_lo": est.lo, "value_hi": est.hi, "random_lo": ref.lo, "random_hi": ref.hi,
                        "verdict": VERDICTS[row["verdict"]], "budget": budgets[0] if budgets else config.budget,
                        "gen_len": lengths.get(pol), "random_gen_len": lengths.get(REFERENCE)})
            if pol in lps and REFERENCE in lps:  # the answer's log-prob, paired the same way (not ranked)
                lp = compared(task, "log-prob", unit, pol, lps[pol], lps[REFERENCE], config.seed)
                row.update({"lp": lp["value"], "random_lp": lp["random"], "lp_delta": lp["delta"],
                            "lp_delta_lo": lp["delta_lo"], "lp_delta_hi": lp["delta_hi"],
                            "lp_verdict": VERDICTS[lp["verdict"]]})
            for name, metric_name in (("round_cost", ROUND_COST), ("throughput", THROUGHPUT)):
                c = cost.get((pol, metric_name))
                row[f"{name}_ratio"] = c["ratio"] if c else None
            table.append(row)
    tally = {p: sum((r["verdict"] == "better") - (r["verdict"] == "worse") for r in table if r["policy"] == p)
             for p in config.selectors}
    mean_delta = {p: float(np.mean([r["delta"] for r in table if r["policy"] == p] or [0.0])) for p in tally}
    order = sorted(tally, key=lambda p: (-tally[p], -mean_delta[p]))
    rank = {p: i + 1 for i, p in enumerate(order)}
    for r in table:
        r["rank"] = rank[r["policy"]]
    table.sort(key=lambda r: (r["rank"], config.tasks.index(r["test"])))
    return table


def _fmt(x, spec=".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and np.isnan(x)) else format(x, spec)


def print_board(table: list[dict]) -> None:
    print(f"\n{'#':>2} {'selector':<24} {'task':<9} {'n':>3} {'score [95% CI]':<22} {'random [95% CI]':<22} "
          f"{'difference [95% CI]':<25} {'p_sign':>6}  {'verdict':<24} {'round cost':>10} {'length':>7}")
    for r in table:
        print(f"{r['rank']:>2} {r['policy'][:24]:<24} {r['test']:<9} {r['n']:>3} "
              f"{_fmt(r['value'])} [{_fmt(r['value_lo'])}, {_fmt(r['value_hi'])}]  "
              f"{_fmt(r['random'])} [{_fmt(r['random_lo'])}, {_fmt(r['random_hi'])}]  "
              f"{r['delta']:+.3f} [{r['delta_lo']:+.3f}, {r['delta_hi']:+.3f}]  {r['p_sign']:>6.3f}  "
              f"{r['verdict']:<24} {'x' + _fmt(r['round_cost_ratio'], '.2f'):>10} {_fmt(r['gen_len'], '.1f'):>7}")
    print("verdict: better or worse only when the paired bootstrap 95% CI and the exact sign test both exclude no "
          "difference; round cost: ms per eviction round as a ratio to Random's, measured side by side")


def merge(plan: Plan, rows: dict, figures: bool) -> list[Path]:
    """``leaderboard.csv`` from the rows of every task (only those this plan names), printed; the figure."""
    config: Config = plan.config
    table = board(config, plan.meta.get("units", plan.units), plan.outputs, rows)
    path = write_csv(Path(plan.meta["root"]).parent / result_name("leaderboard", config, "table",
                                                                  model=plan.meta["model"]), table)
    print_board(table)
    print(f"\nleaderboard: {path}")
    paths = [path]
    if figures and not config.no_figure:
        paths += cli.draw("leaderboard", path, config.figure_dir)
    return paths


def run(config: Config, model=None, tokenizer=None) -> tuple[Plan, dict]:
    """Every pending unit here (the local backend), then the table; ``(final plan, {output path: ResultsFile})``."""
    model, tok = load(config, None if model is None else (model, tokenizer))
    p = plan(config, ModelInfo.loaded(config.model or randattn.DEFAULT_MODEL, model, tok))
    print(f"leaderboard: {', '.join(config.selectors)} vs random | model {config.model or randattn.DEFAULT_MODEL} | "
          f"T={config.budget}, r={config.buffer}, prompt {'protected' if config.protect_prompt else 'unprotected'} | "
          f"tasks {', '.join(config.tasks)} | results in {p.meta['root']}")
    all_units = list(p.units)
    stages = []

    def then(rows, _later=p.then):
        nxt = _later(rows)
        all_units.extend(nxt.units)
        stages.append(nxt)
        return nxt

    if p.then is not None:
        p.then = then
    files = run_local(p, model, tok, restart=config.restart, desc="leaderboard")
    final = Plan("leaderboard", config, p.outputs, all_units, meta={**p.meta, "units": all_units})
    merge(final, {path: rf.rows for path, rf in files.items()}, figures=True)
    return final, files


def main(argv=None) -> int:
    return cli.main(Config, run, argv, __doc__)


KIND = Kind("leaderboard", Config, plan, run_unit, merge)

if __name__ == "__main__":
    sys.exit(main())
