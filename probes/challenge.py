"""The null-hypothesis challenge: your selector against score-free Random at the same K, r and prompt protection.

    python -m probes.challenge --policy my_selector:score                 # embedded SmolLM2-135M, K=256, r=16
    python -m probes.challenge --policy my_selector:score --quick         # a few minutes
    python -m probes.challenge --policy examples/attention_selector.py:recent_attention --baselines snapkv rkv
    python -m probes.challenge --policy my_selector:score --model Qwen/Qwen3-4B --budget 1024 --buffer 64 \\
        --task math500 --data math500.jsonl --stats qwen3-4b-stats.pt

``--policy`` is a registered policy name or ``MODULE:CALLABLE`` / ``path/to/file.py:CALLABLE``: a score function
``score(view) -> Tensor[B, H_kv, S]`` (``randattn.score_function(needs=("queries",), window=w)`` gives it recent
queries) or a ``randattn.Policy`` subclass. The core does prompt protection, per-head top-K and compaction, so the
selector and Random differ only in their scores. Parts (``--only`` / ``--skip``):

- ``accuracy``: generate and grade a task (``--task``, default the embedded copy task), full attention as the
  ceiling, paired by problem;
- ``question``: restate the question after many rounds (a task that needs the prompt), paired by instance;
- ``planted``: a fact planted in a real trace and left to the policy: retrieval, log-prob, Recall R;
- ``passcode``: a passcode stated once and asked after many rounds (where content-aware selectors should win);
- ``keeplog``: keep-set metrics from keep-logs, and how far the selector's keep-sets overlap Random's;
- ``cost``: milliseconds per eviction round and decode tokens/s relative to Random.

The challenge is a leaderboard run (``probes.leaderboard``) of one selector and its baselines: the accuracy,
question, planted, passcode and cost parts are the leaderboard's tasks (copy slot, question, planted with Recall R,
passcode, cost), planned, run and compared by its code, with the board in the challenge's folder; the keep-log part
is the challenge's own (descriptive). Each scored part gives a verdict on its score and on the answer's log-prob:
better or worse only when the paired bootstrap 95% CI and the exact sign test both exclude no difference (the paper's
rule), else no detectable difference. Everything goes to ``--out`` (default
``data/results/challenge/<selector>-<model>-K<K>-r<r>/``): the leaderboard's rows of every part (resumable; Random's
shared by the selector and the baselines), ``verdict.csv`` (the board's rows), ``descriptive.csv`` (cost and
keep-sets), ``verdict.json``, ``report.md`` and the figures.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import randattn
from analysis.names import result_name

from . import cli, leaderboard
from .challenge_parts import keeplog_part, preflight
from .config import DEFAULT, POSITIVE, ConfigError, EvictionConfig, eviction, option, setting
from .leaderboard import REFERENCE
from .planted_run import load, write_csv
from .policy_specs import calibration_options
from .results import NotOurFile, OutputFolder, git_revision
from .tasks import TASKS
from .units import ModelInfo, Plan, run_local

#: the challenge's parts, in run order; each but ``keeplog`` is a slot of the leaderboard's ``--tasks``.
PARTS = ("accuracy", "question", "planted", "passcode", "keeplog", "cost")
TASK_OF = {"accuracy": "copy", "question": "question", "planted": "planted", "passcode": "passcode", "cost": "cost"}

SIZES = {  # default: well under an hour on the embedded model on 2 CPUs; --quick: minutes
    "full": dict(problems=32, runs=3, body=512, instances=24, distance=384,
                 passcode_instances=16, rounds=57, sequences=4, keeplog_rounds=24, cost_batch=4, cost_rounds=16,
                 cost_repeats=3),
    "quick": dict(problems=8, runs=1, body=256, instances=8, distance=384,
                  passcode_instances=8, rounds=24, sequences=2, keeplog_rounds=12, cost_batch=2, cost_rounds=8,
                  cost_repeats=1),
}
#: size -> the leaderboard's options it sets (``instances``: the question's and the planted fact's).
BOARD_OPTIONS = {"problems": ("problems",), "runs": ("runs",), "body": ("body",),
                 "instances": ("instances", "planted_instances"), "distance": ("distance",),
                 "passcode_instances": ("passcode_instances",), "rounds": ("rounds",), "cost_batch": ("cost_batch",),
                 "cost_rounds": ("cost_rounds",), "cost_repeats": ("cost_repeats",)}


@dataclass
@eviction(policy=setting("", help="your selector: MODULE:CALLABLE, path/to/file.py:CALLABLE or a registered name "
                                  "(runs the file's code: load only selectors you trust)"),
          budget=256, buffer=16, protect_prompt=True, stats=DEFAULT)
class Config(EvictionConfig):
    """The null-hypothesis challenge (``python -m probes.challenge --policy MODULE:CALLABLE``)."""

    baselines: tuple[str, ...] = option((), "named selectors run alongside, also against Random (e.g. snapkv rkv "
                                            "triattention)")
    task: str = option("copy", "accuracy task", choices=tuple(TASKS))
    data: Optional[str] = option(None, "local JSONL of problems for --task (see probes/tasks.py)")
    traces: Optional[str] = option(None, "JSONL with 'question' and 'text' per row: the real reasoning traces the "
                                         "probes plant into (default: the embedded model's)")
    quick: bool = option(False, "small sizes: minutes instead of tens of minutes")
    only: Optional[tuple[str, ...]] = option(None, "run only these parts", choices=tuple(PARTS))
    skip: tuple[str, ...] = option((), "skip these parts", choices=tuple(PARTS))
    problems: Optional[int] = option(None, f"override the size 'problems' (default {SIZES['full']['problems']}, "
                                           f"--quick {SIZES['quick']['problems']})", check=POSITIVE)
    runs: Optional[int] = option(None, f"override the size 'runs' (default {SIZES['full']['runs']}, --quick "
                                       f"{SIZES['quick']['runs']})", check=POSITIVE)
    instances: Optional[int] = option(None, f"override the size 'instances' (default {SIZES['full']['instances']}, "
                                            f"--quick {SIZES['quick']['instances']})", check=POSITIVE)
    passcode_instances: Optional[int] = option(None, "override the size 'passcode_instances' (default "
                                                     f"{SIZES['full']['passcode_instances']}, --quick "
                                                     f"{SIZES['quick']['passcode_instances']})", check=POSITIVE)
    rounds: Optional[int] = option(None, f"override the size 'rounds' (default {SIZES['full']['rounds']}, --quick "
                                         f"{SIZES['quick']['rounds']})", check=POSITIVE)
    restart: bool = option(False, "start afresh: earlier results in --out are moved aside to --out.previous-N (never "
                                  "deleted)")

    policy_fields = ("policy", "baselines")

    def check(self) -> None:
        if not self.policy:
            raise ConfigError("policy", "give your selector: MODULE:CALLABLE, path/to/file.py:CALLABLE or a registered "
                                        "name")
        if self.policy == REFERENCE:
            raise ConfigError("policy", "random is the reference every selector is measured against; give your own "
                                        "selector (MODULE:CALLABLE) or another registered name")
        self.check_eviction()
        if not self.parts:
            raise ConfigError("only", "--only/--skip leave no part to run")

    @property
    def parts(self) -> list[str]:
        return [x for x in (self.only or PARTS) if x not in self.skip]

    @property
    def sizes(self) -> dict:
        sizes = dict(SIZES["quick" if self.quick else "full"])
        for name in ("problems", "runs", "instances", "passcode_instances", "rounds"):
            if getattr(self, name) is not None:
                sizes[name] = getattr(self, name)
        return sizes


def default_out(config: Config) -> Path:
    return Path("data/results/challenge") / result_name("challenge", config, "folder",
                                                        model=config.model or randattn.DEFAULT_MODEL)


# -- the leaderboard run of the selector --------------------------------------------------------------
def board_config(config: Config, out: Path) -> Optional[leaderboard.Config]:
    """The leaderboard's configuration of this challenge: the selector and the baselines against Random at the
    challenge's setting, its parts as tasks, its sizes as the tasks' options, full attention as the accuracy and
    question ceiling, Recall R's endpoints on the planted fact; its files in ``out``. None when no part is a task."""
    tasks = tuple(TASK_OF[p] for p in config.parts if p in TASK_OF)
    if not tasks:
        return None
    sizes = {opt: config.sizes[size] for size, opts in BOARD_OPTIONS.items() for opt in opts}
    return leaderboard.Config(model=config.model, device=config.device, seed=config.seed, budget=config.budget,
                              buffer=config.buffer, protect_prompt=config.protect_prompt, stats=config.stats,
                              traces=config.traces,
                              policies=tuple(p for p in dict.fromkeys([config.policy, *config.baselines])
                                             if p != REFERENCE),  # Random is every board's reference
                              selector=(), tasks=tasks, accuracy_task=config.task, data=config.data,
                              full_attention=True, recall=True, no_figure=True, root=str(out), **sizes)


#: a leaderboard field a refusal names -> the challenge's flag for it
_FIELDS = {"accuracy_task": "task", "planted_instances": "instances", "tasks": "only", "root": "out",
           "selector": "policy"}


def _as_challenge(config: Config, exc: ConfigError) -> ConfigError:
    """A refusal of the leaderboard's plan, naming the challenge's flag (``--baselines`` for a baseline)."""
    field = _FIELDS.get(exc.field, exc.field)
    if exc.field == "policies":
        name = exc.message.split(":")[0]
        field = "baselines" if name in config.baselines and name != config.policy else "policy"
    return ConfigError(field, exc.message)


def descriptive_rows(files: dict, plan: Plan, contenders: list[str]) -> list[dict]:
    """The cost rows the board's ratios come from (medians of each selector and of Random, measured side by side)."""
    out = []
    for o in plan.outputs:
        if leaderboard.output_slot(o) == "cost" and o.path in files:
            for r in files[o.path].rows:
                if r["policy"] in contenders:
                    out.append({k: v for k, v in r.items() if k != "config"})
    return out


# -- printing ----------------------------------------------------------------------------------------------
def _fmt(x, spec=".3f") -> str:
    return "" if x is None or x == "" else format(x, spec)


def print_descriptive(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"\n{'test':<10} {'metric':<34} {'policy':<26} {'policy':>8} {'random':>8}  {'difference [95% CI]':<27}")
    for r in rows:
        diff = (f"{r['delta']:+.3f} [{r['delta_lo']:+.3f}, {r['delta_hi']:+.3f}]" if "delta_lo" in r
                else f"x{r['ratio']:.2f}" if "ratio" in r else "")
        print(f"{r['test']:<10} {r['metric'][:34]:<34} {r['policy'][:26]:<26} {_fmt(r['value']):>8} "
              f"{_fmt(r['random']):>8}  {diff}")


VERDICT_KEYS = ("better", "worse", "no detectable difference")


def verdicts(rows: list[dict], policy: str) -> dict:
    """``{"better": [...], "worse": [...], "no detectable difference": [...], "cost": {...}, "summary": str}`` from
    the board's rows of ``policy``: each task's score and, where it has one, its answer's log-prob."""
    mine = [r for r in rows if r["policy"] == policy]
    tested = [(r["metric"], r["verdict"]) for r in mine]
    tested += [(f"{r['test']} log-prob", r["lp_verdict"]) for r in mine if r.get("lp_verdict")]
    out = {v: [m for m, verdict in tested if verdict == v] for v in VERDICT_KEYS}
    costs = next((r for r in mine if r.get("round_cost_ratio") is not None), None)
    out["cost"] = ({leaderboard.ROUND_COST: costs["round_cost_ratio"], leaderboard.THROUGHPUT: costs["throughput_ratio"]}
                   if costs else {})
    b, w = len(out["better"]), len(out["worse"])
    if b and not w:
        out["summary"] = f"beats Random on {b} metric(s) and loses on none"
    elif w and not b:
        out["summary"] = f"loses to Random on {w} metric(s) and beats it on none"
    elif b and w:
        out["summary"] = f"mixed: better than Random on {b} metric(s), worse on {w}"
    elif tested:
        out["summary"] = "indistinguishable from Random on every metric tested: no evidence it extracts signal"
    else:
        out["summary"] = "no metric with a significance test ran (accuracy, question, planted or passcode)"
    return out


def verdict_text(rows: list[dict], policies: list[str], args, costs: list[dict] = ()) -> list[str]:
    lines = []
    for pol in policies:
        v = verdicts(rows, pol)
        lines.append(f"{pol} vs random (K={args.budget}, r={args.buffer}, prompt "
                     f"{'protected' if args.protect_prompt else 'unprotected'}): {v['summary']}")
        for key in VERDICT_KEYS:
            lines.append(f"  {key}: {', '.join(v[key]) or '-'}")
        # the board's ratios, else the cost rows' own (keep-set rows share the list and have no ratio)
        cost = v["cost"] or {r["metric"]: r["ratio"] for r in costs if r["policy"] == pol and r["test"] == "cost"}
        if cost:
            lines.append("  cost relative to Random: " + ", ".join(f"{m} x{x:.2f}" for m, x in cost.items()))
    return lines


REPORT_COLUMNS = ["test", "metric", "policy", "n", "value", "random", "full_attention", "delta", "delta_lo",
                  "delta_hi", "p_bootstrap", "p_sign", "verdict", "lp_delta", "lp_delta_lo", "lp_delta_hi",
                  "lp_verdict", "recall", "random_recall", "round_cost_ratio", "throughput_ratio"]
DESCRIPTIVE_COLUMNS = ["test", "metric", "policy", "value", "random", "delta", "delta_lo", "delta_hi", "ratio"]


def _markdown(rows: list[dict], cols: list[str]) -> list[str]:
    cell = lambda r, c: ("" if r.get(c) is None or r.get(c) == "" else  # noqa: E731
                         f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r[c]))
    cols = [c for c in cols if any(r.get(c) not in (None, "") for r in rows)]
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + \
        ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in rows]


def write_report(out: Path, rows: list[dict], extra: list[dict], policies: list[str], args, figures: list[str],
                 command: str) -> Path:
    """``report.md``: the configuration, the verdicts, the board's rows, the descriptive rows and the figures."""
    lines = [f"# Challenge: {args.policy} against Random", "",
             f"`{command}`", "",
             f"Model {args.model or randattn.DEFAULT_MODEL}; K={args.budget}, r={args.buffer}; prompt "
             f"{'protected' if args.protect_prompt else 'unprotected (score only)'} for every policy; "
             f"{'quick' if args.quick else 'default'} sizes; revision {git_revision()}.", "",
             "A metric is better/worse only when the paired bootstrap 95% CI and the exact sign test both exclude no "
             "difference; otherwise no detectable difference. The rows are the leaderboard's (`python -m "
             "probes.leaderboard`) for these policies; keep-set and cost rows are descriptive.", "", "## Verdict", "",
             "```", *verdict_text(rows, policies, args, extra), "```", "", "## The board's rows", ""]
    lines += _markdown(rows, REPORT_COLUMNS) if rows else ["(no scored part ran)"]
    if extra:
        lines += ["", "## Descriptive rows (cost, keep-sets)", ""] + _markdown(extra, DESCRIPTIVE_COLUMNS)
    lines += ["", "## Figures", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in figures if f.endswith(".png")]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# -- main -------------------------------------------------------------------------------------------------
def run(config: Config, model=None, tokenizer=None, argv=None) -> Path:
    """Every part (the leaderboard's units of its tasks, then the keep-logs), the verdicts, the figures and the
    report into the output folder; returns the folder."""
    policies = list(dict.fromkeys([config.policy, *config.baselines, REFERENCE]))
    folder = OutputFolder(Path(config.out) if config.out else default_out(config), restart=config.restart)
    try:
        folder.check()  # before the model loads: a folder of someone else's files is refused, untouched
    except (NotOurFile, PermissionError) as exc:
        raise ConfigError("out", str(exc)) from None
    out = folder.path
    model, tok = load(config, None if model is None else (model, tokenizer))
    for pol in policies:
        error = preflight(model, tok, pol, protect=config.protect_prompt,
                          options=calibration_options(pol, config.stats))
        if error:
            raise ConfigError("policy", f"{pol}: the selector failed a trial run on the model before any work "
                                        f"started: {error}")
    plan = None
    try:
        board = board_config(config, out)
        if board is not None:
            plan = leaderboard.plan(board, ModelInfo.loaded(config.model or randattn.DEFAULT_MODEL, model, tok))
    except ConfigError as exc:
        raise _as_challenge(config, exc) from None
    folder.open()  # only now: --restart moves the old results aside (never deletes), after the trial run passed
    if folder.moved_to is not None:
        print(f"--restart: the earlier results are kept in {folder.moved_to}")
    print(f"challenge: {config.policy} vs random"
          f"{' (+ ' + ', '.join(config.baselines) + ')' if config.baselines else ''} | model "
          f"{config.model or randattn.DEFAULT_MODEL} | T={config.budget}, r={config.buffer}, prompt "
          f"{'protected' if config.protect_prompt else 'unprotected'} | parts {', '.join(config.parts)} | results in "
          f"{out}")
    files: dict = {}
    keeplog: list[dict] = []
    for part in config.parts:
        print(f"\n== {part} ==")
        try:
            if part == "keeplog":
                keeplog, metrics = keeplog_part(config, model, tok, policies, config.sizes)
                (out / "keeplog.json").write_text(json.dumps(metrics, indent=1))
            else:  # the leaderboard's units of this task, each batch's rows on disk as it finishes (resumable)
                slot = TASK_OF[part]
                sub = Plan("leaderboard", board, [o for o in plan.outputs if leaderboard.output_slot(o) == slot],
                           [u for u in plan.units if u.work["task"] == slot], meta=plan.meta)
                files = run_local(sub, model, tok, desc=f"challenge: {part}", files=files)
        except (RuntimeError, ValueError, TypeError) as exc:
            failure = cli.selector_failure(exc)
            if failure is None:
                raise
            raise cli.SelectorFailed(
                failure, step=f"challenge part {part!r}",
                kept=f"The rows measured so far are kept under {out}; no verdict was written (verdict.csv, "
                     "verdict.json and report.md come only once every part has finished)") from exc
    # Only now: a verdict over some of the parts would read as the whole challenge's.
    contenders = [x for x in policies if x != REFERENCE]
    rows = {path: rf.rows for path, rf in files.items()}
    table = leaderboard.board(board, plan.units, plan.outputs, rows) if plan is not None else []
    extra = (descriptive_rows(files, plan, contenders) if plan is not None else []) + keeplog
    verdict_csv = write_csv(out / "verdict.csv", table) if table else out / "verdict.csv"
    if extra:
        write_csv(out / "descriptive.csv", extra)
    if table:
        leaderboard.print_board(table)
    print_descriptive(extra)
    print("\n" + "\n".join(verdict_text(table, contenders, config, extra)))
    figures: list[str] = []
    if not config.no_figure:
        if table:
            figures += [str(f) for f in cli.draw("challenge", verdict_csv, out)]
        for o in plan.outputs if plan is not None else ():
            if leaderboard.output_slot(o) == "copy" and o.path in files and files[o.path].rows:
                figures += [str(f) for f in cli.draw("accuracy", o.path, out, "--name", "accuracy", "--problems",
                                                     ",".join(map(str, o.meta["problems"])), "--runs", str(o.meta["runs"]))]
    (out / "verdict.json").write_text(json.dumps({pol: verdicts(table, pol) for pol in contenders}, indent=1))
    command = "python -m probes.challenge " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    report = write_report(out, table, extra, contenders, config, figures, command)
    print(f"\nverdict table: {verdict_csv}\nreport: {report}")
    return out


def main(argv=None) -> int:
    return cli.main(Config, lambda c: run(c, argv=argv), argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
