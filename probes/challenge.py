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

- ``accuracy``: generate and grade a task (``--task``, default the embedded copy task), paired by problem;
- ``question``: restate the question after many rounds (a task that needs the prompt), paired by instance;
- ``planted``: a fact planted in a real trace and left to the policy: retrieval, log-prob, Recall R;
- ``passcode``: a passcode stated once and asked after many rounds (where content-aware selectors should win);
- ``keeplog``: keep-set metrics from keep-logs, and how far the selector's keep-sets overlap Random's;
- ``cost``: milliseconds per eviction round and decode tokens/s relative to Random.

The first four give a verdict per metric: better or worse only when the paired bootstrap 95% CI and the exact sign
test both exclude no difference (the paper's rule), else indistinguishable. Everything goes to ``--out`` (default
``data/results/challenge/<selector>-<model>-K<K>-r<r>/``): rows of every part (resumable), ``verdict.csv``,
``report.md`` and the figures.
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

from . import cli
from .challenge_parts import PARTS, REFERENCE, Context, preflight
from .config import POSITIVE, ConfigError, EvictionConfig, eviction, option, setting
from .planted_run import load, write_csv
from .results import NotOurFile, OutputFolder, git_revision
from .tasks import TASKS

SIZES = {  # default: well under an hour on the embedded model on 2 CPUs; --quick: minutes
    "full": dict(problems=32, runs=3, body=512, instances=24, distance=384,
                 passcode_instances=16, rounds=57, sequences=4, keeplog_rounds=24, cost_batch=4, cost_rounds=16,
                 cost_repeats=3),
    "quick": dict(problems=8, runs=1, body=256, instances=8, distance=384,
                  passcode_instances=8, rounds=24, sequences=2, keeplog_rounds=12, cost_batch=2, cost_rounds=8,
                  cost_repeats=1),
}
SIGNIFICANCE_TESTS = ("accuracy", "question recall", "planted fact", "passcode")


@dataclass
@eviction(policy=setting("", help="your selector: MODULE:CALLABLE, path/to/file.py:CALLABLE or a registered name "
                                  "(runs the file's code: load only selectors you trust)"),
          budget=256, buffer=16, protect_prompt=True, stats=None)
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


# -- printing ----------------------------------------------------------------------------------------------
def _fmt(x, spec=".3f") -> str:
    return "" if x is None or x == "" else format(x, spec)


def print_table(rows: list[dict]) -> None:
    print(f"\n{'test':<16} {'metric':<34} {'policy':<26} {'policy':>8} {'random':>8}  {'difference [95% CI]':<27} "
          f"{'p_boot':>6} {'sign W/L/T':>10} {'p_sign':>6}  verdict")
    for r in rows:
        spec = ".2f" if r["unit"] in ("nats", "ms", "tokens/s") or "nats" in r["metric"] else ".3f"
        diff = (f"{r['delta']:+{spec}} [{r['delta_lo']:+{spec}}, {r['delta_hi']:+{spec}}]" if "delta_lo" in r
                else f"x{r['ratio']:.2f}" if "ratio" in r else "")
        sign = f"{r['wins']}/{r['losses']}/{r['ties']}" if "wins" in r else ""
        print(f"{r['test']:<16} {r['metric'][:34]:<34} {r['policy'][:26]:<26} {_fmt(r['value'], spec):>8} "
              f"{_fmt(r['random'], spec):>8}  {diff:<27} {_fmt(r.get('p_bootstrap')):>6} {sign:>10} "
              f"{_fmt(r.get('p_sign')):>6}  {r['verdict']}")


def verdicts(rows: list[dict], policy: str) -> dict:
    """``{"better": [...], "worse": [...], "indistinguishable": [...], "cost": {...}, "summary": str}``."""
    mine = [r for r in rows if r["policy"] == policy]
    out = {v: [f"{r['metric']}" for r in mine if r["verdict"] == v] for v in ("better", "worse", "indistinguishable")}
    out["cost"] = {r["metric"]: r["ratio"] for r in mine if "ratio" in r}
    b, w = len(out["better"]), len(out["worse"])
    if b and not w:
        out["summary"] = f"beats Random on {b} metric(s) and loses on none"
    elif w and not b:
        out["summary"] = f"loses to Random on {w} metric(s) and beats it on none"
    elif b and w:
        out["summary"] = f"mixed: better than Random on {b} metric(s), worse on {w}"
    else:
        out["summary"] = "indistinguishable from Random on every metric tested: no evidence it extracts signal"
    return out


def verdict_text(rows: list[dict], policies: list[str], args) -> list[str]:
    lines = []
    for pol in policies:
        v = verdicts(rows, pol)
        lines.append(f"{pol} vs random (K={args.budget}, r={args.buffer}, prompt "
                     f"{'protected' if args.protect_prompt else 'unprotected'}): {v['summary']}")
        for key in ("better", "worse", "indistinguishable"):
            lines.append(f"  {key}: {', '.join(v[key]) or '-'}")
        if v["cost"]:
            lines.append("  cost relative to Random: " + ", ".join(f"{m} x{x:.2f}" for m, x in v["cost"].items()))
    return lines


def write_report(out: Path, rows: list[dict], policies: list[str], args, figures: list[str], command: str) -> Path:
    """``report.md``: the configuration, the verdicts, the table and the figures."""
    cols = ["test", "metric", "policy", "n", "value", "random", "delta", "delta_lo", "delta_hi", "ratio",
            "p_bootstrap", "p_sign", "verdict"]
    cell = lambda r, c: ("" if r.get(c) is None or r.get(c) == "" else  # noqa: E731
                         f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r[c]))
    lines = [f"# Challenge: {args.policy} against Random", "",
             f"`{command}`", "",
             f"Model {args.model or randattn.DEFAULT_MODEL}; K={args.budget}, r={args.buffer}; prompt "
             f"{'protected' if args.protect_prompt else 'unprotected (score only)'} for every policy; "
             f"{'quick' if args.quick else 'default'} sizes; revision {git_revision()}.", "",
             "A metric is better/worse only when the paired bootstrap 95% CI and the exact sign test both exclude no "
             "difference; otherwise indistinguishable. Keep-set and cost rows are descriptive.", "", "## Verdict", "",
             "```", *verdict_text(rows, policies, args), "```", "", "## All rows", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in rows]
    lines += ["", "## Figures", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in figures if f.endswith(".png")]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# -- main -------------------------------------------------------------------------------------------------
def run(config: Config, model=None, tokenizer=None, argv=None) -> Path:
    """Every part, the verdicts, the figures and the report into the output folder; returns the folder."""
    policies = list(dict.fromkeys([config.policy, *config.baselines, REFERENCE]))
    folder = OutputFolder(Path(config.out) if config.out else default_out(config), restart=config.restart)
    try:
        folder.check()  # before the model loads: a folder of someone else's files is refused, untouched
    except (NotOurFile, PermissionError) as exc:
        raise ConfigError("out", str(exc)) from None
    out = folder.path
    model, tok = load(config, None if model is None else (model, tokenizer))
    ctx = Context(config, model, tok, policies, out, config.sizes)
    for pol in policies:
        error = preflight(model, tok, pol, protect=config.protect_prompt, options=ctx.options(pol))
        if error:
            raise ConfigError("policy", f"{pol}: the selector failed a trial run on the model before any work "
                                        f"started: {error}")
    folder.open()  # only now: --restart moves the old results aside (never deletes), after the trial run passed
    if folder.moved_to is not None:
        print(f"--restart: the earlier results are kept in {folder.moved_to}")
    print(f"challenge: {config.policy} vs random"
          f"{' (+ ' + ', '.join(config.baselines) + ')' if config.baselines else ''} | model "
          f"{config.model or randattn.DEFAULT_MODEL} | T={config.budget}, r={config.buffer}, prompt "
          f"{'protected' if config.protect_prompt else 'unprotected'} | parts {', '.join(config.parts)} | results in "
          f"{out}")
    rows: list[dict] = []
    for part in config.parts:
        print(f"\n== {part} ==")
        try:
            rows += PARTS[part](ctx)  # each part keeps its own rows on disk as it goes (resumable)
        except (RuntimeError, ValueError, TypeError) as exc:
            failure = cli.selector_failure(exc)
            if failure is None:
                raise
            raise cli.SelectorFailed(
                failure, step=f"challenge part {part!r}",
                kept=f"The rows measured so far are kept under {out}; no verdict was written (verdict.csv, "
                     "verdict.json and report.md come only once every part has finished)") from exc
    # Only now: a verdict over some of the parts would read as the whole challenge's.
    verdict_csv = write_csv(out / "verdict.csv", rows)
    print_table(rows)
    contenders = [x for x in policies if x != REFERENCE]
    print("\n" + "\n".join(verdict_text(rows, contenders, config)))
    figures = [] if config.no_figure else [str(f) for f in out.glob("*.png") if not f.name.startswith("challenge.")]
    figures = ([] if config.no_figure else cli.draw("challenge", verdict_csv, out)) + figures
    (out / "verdict.json").write_text(json.dumps({pol: verdicts(rows, pol) for pol in contenders}, indent=1))
    command = "python -m probes.challenge " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    report = write_report(out, rows, contenders, config, figures, command)
    print(f"\nverdict table: {verdict_csv}\nreport: {report}")
    return out


def main(argv=None) -> int:
    return cli.main(Config, lambda c: run(c, argv=argv), argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
