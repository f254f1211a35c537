"""The leaderboard: every selector against protected Random at the same T, r, protection and runtime, with statistics.

    python -m probes.leaderboard                                           # every compared selector, embedded model
    python -m probes.leaderboard --selector my_selector.py:score           # your selector ranked beside them
    python -m probes.leaderboard --policies snapkv rkv --selector examples/attention_selector.py:recent_attention
    python -m probes.leaderboard --tasks copy passcode --problems 8 --passcode-instances 8 --out /tmp/look  # smaller

Each selector (``--policies``: registered names, default every selector the paper compared Random with;
``--selector``: your own ``path/to/file.py:CALLABLE`` or ``MODULE:CALLABLE``) and Random run on the embedded model's
tasks, every one under the same eviction setting (``--budget``, ``--buffer``, the prompt protected):

- ``copy``: the accuracy harness's copy task at T (graded share of the list reproduced), paired by problem;
- ``repeat``: the repeat task at ``--compression`` (T = full attention's mean length / c, its own r of 8), by problem,
  as two endpoints, two rows per selector: the copies written as a share of 64 (generation behaviour: when the model
  stopped) and the fidelity of the copies written (content kept);
- ``question``: the prompt-protection probe's question restated after ``--body`` tokens (digits recalled), by instance;
- ``passcode``: the passcode stated once and asked after ``--rounds`` rounds (retrieval), by instance;
- ``planted``: a fact planted in a real trace at ``--distance`` and left to the policy (retrieval), by instance;
- ``cost``: milliseconds per eviction round and decode tokens/s, each selector interleaved with Random in the same
  unit, reported as a ratio to Random's so that the machine's load cancels.

``--reference-lp`` gives the copy and repeat slots the teacher-forced log-prob of full attention's output under each
policy's cache (the accuracy harness's ``--reference-lp``; ``--reference-tokens N``: its first N tokens), compared with
Random like the other tasks' answer log-probs (``lp*`` columns; the repeat task's on its fidelity row);
``--temperature``/``--top-p`` sample the copy and repeat generations (every policy then runs ``--runs`` times, so every
arm has within-problem variance, paired by problem and run). All four are registered per task.
``--accuracy-task NAME`` (``--data FILE.jsonl``) runs any task of ``probes/tasks.py`` in the copy slot;
``--full-attention`` adds full attention's score on it and on the question (the ``full_attention`` column; the
repeat task has it always); ``--recall`` adds the planted fact's Recall R (each instance also with the fact deleted
and kept in every head). ``python -m probes.challenge`` is a leaderboard run of one selector with all three on.

The tasks are the probes' own code (the copy and repeat units are the accuracy kind's; the others call the probes'
run functions), planned as units of the ``leaderboard`` kind: ``python -m probes.leaderboard`` runs them here, and a
TOML grid with ``probe = "leaderboard"`` runs the same units on Ray (``python -m probes.grid``). Random's units are
shared by every selector, so adding one later computes only its own. A selector's verdict per task is the paper's
rule (:func:`randattn.stats.paired_comparison`): better or worse only when the paired bootstrap 95% CI and the exact
sign test both exclude no difference, p Holm-adjusted across the board, else "no detectable difference" (with its
minimum detectable effect). Each task's setting is registered in the board's ``spec.json`` before its first rows
(:mod:`probes.registration`); a later run asking another setting of a registered task is refused by field before
the model loads (another ``--out``, or ``--restart``). The rows of every task (resumable: a killed
run resumes to the same rows) and ``leaderboard.csv`` go to ``--out`` (default
``data/results/leaderboard/<model>-K<T>-r<r>-s<seed>-<protection>/``); ``figures/leaderboard.png``.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

import randattn
from analysis.names import result_name
from analysis.planted import summarize as planted_summary
from randattn.power import POWER, adjust, mde_normal, mde_sign, noise_rate, units_for_mde
from randattn.stats import mean_ci, paired_comparison, per_problem_means

from . import accuracy, cli, passcode, prompt_protection, registration, survival, units
from .common import policy_slug
from .config import DEFAULT, NONNEGATIVE, POSITIVE, ConfigError, EvictionConfig, eviction, option, setting
from .planted import Condition, InstanceBuilder
from .planted_run import PlantedConfig, run_conditions, setup, write_csv
from .policy_specs import calibration_options
from .results import DEFAULT_TRACES, run_record, trace_label
from .tasks import REPEAT_LINES
from .tasks import TASKS as ACCURACY_TASKS
from .units import Kind, ModelInfo, Output, Plan, Unit, make_unit
from randattn.seeding import batch_seed

#: the reference every selector is measured against (score-free Random, the prompt protected like everyone's).
REFERENCE = "random"
FULL = accuracy.FULL  # full attention (no eviction): the ceiling column with --full-attention
TASKS = ("copy", "repeat", "question", "passcode", "planted", "cost")
RUN_ORDER = ("copy", "question", "passcode", "cost", "planted", "repeat")
#: the repeat task's two endpoints, one behaviour each (no threshold joins them): how many copies the model wrote
#: (generation behaviour, as a 0-1 share so that the MDE machinery applies) and how faithful they are (content kept).
REPEAT_COPIES = f"repeat copies written (share of {REPEAT_LINES})"
REPEAT_FIDELITY = "repeat fidelity of copies written"
#: slot -> [(test, metric, row field)]: the scored endpoints of a slot, each one comparison row per selector (the
#: copy slot's is named after its task, see :func:`endpoints_of`).
ENDPOINTS = {"copy": [("copy", "copy accuracy", "grade")],
             "repeat": [("repeat copies", REPEAT_COPIES, "copies"), ("repeat fidelity", REPEAT_FIDELITY, "fidelity")],
             "question": [("question", "question digits recalled", "digit_acc")],
             "passcode": [("passcode", "passcode retrieval", "retrieved")],
             "planted": [("planted", "planted-fact retrieval", "retrieved")]}
#: the endpoint of a slot its teacher-forced log-prob sits beside (one log-prob comparison per slot and selector; the
#: slot's first row where that endpoint has none, e.g. no run wrote a repeat copy)
LP_ENDPOINT = {"repeat": "fidelity"}
#: task -> (metric, what is paired): the leaderboard's score on each task (the repeat task's two metrics joined).
METRICS = {slot: ("; ".join(m for _, m, _ in eps), "problems" if slot in ("copy", "repeat") else "instances")
           for slot, eps in ENDPOINTS.items()}
VERDICTS = {"better": "better", "worse": "worse", "indistinguishable": "no detectable difference"}
#: The board's error rate: every comparison on one board (each task's score and each log-prob) is one family,
#: adjusted by Holm's step-down method, so the chance of any false "better" or "worse" on the board is <= ALPHA.
ALPHA = 0.05
ADJUSTMENT = "holm"
ROUND_COST = "ms per eviction round (one layer)"
THROUGHPUT = "decode tokens/s"
#: the selectors ranked by default: every one the paper compared Random with (the registry's others by name).
DEFAULT_SELECTORS = tuple(p for p in randattn.COMPARED_POLICIES if p != REFERENCE)


def _fraction(value) -> Optional[str]:
    if not (isinstance(value, (int, float)) and 0 < value < 1):
        return f"must be strictly between 0 and 1 (a difference in the score's units), got {value!r}"
    return None


@dataclass
@eviction(policies=setting(DEFAULT_SELECTORS, help="registered selectors ranked against Random (names or paper modes; "
                                                   "default: every selector the paper compared it with)"),
          budget=256, buffer=16, protect_prompt=True, stats=DEFAULT)
class Config(EvictionConfig):
    """Every selector against protected Random on the embedded tasks (``python -m probes.leaderboard``)."""

    selector: tuple[str, ...] = option((), "your own selectors, ranked beside --policies: path/to/file.py:CALLABLE or "
                                           "MODULE:CALLABLE (runs the file's code: load only selectors you trust)",
                                       metavar="FILE.py:FN")
    tasks: tuple[str, ...] = option(TASKS, "the tasks run ('copy': the accuracy task, --accuracy-task)",
                                    choices=TASKS)
    accuracy_task: str = option("copy", "the task the 'copy' slot of --tasks generates and grades, paired by problem "
                                        "(any task of probes/tasks.py; its rows go to <folder>/<task>/, its board rows "
                                        "are named after it)", choices=tuple(ACCURACY_TASKS))
    data: Optional[str] = option(None, "local JSONL of problems for --accuracy-task (fields: see probes/tasks.py)")
    full_attention: bool = option(False, "also full attention (no eviction) on the accuracy and question tasks: the "
                                         "board's full_attention column, their ceiling (the repeat task has it "
                                         "always)")
    recall: bool = option(False, "planted: also the fact deleted and kept in every head under each policy (three "
                                 "replays per instance instead of one), for Recall R in the board")
    traces: Optional[str] = option(None, "JSONL with 'question' and 'text' per row: the real traces the question, "
                                         "passcode and planted tasks are built from (default: the embedded model's)")
    problems: int = option(32, "copy: problems, the first N of --accuracy-task's (paired by problem)",
                           check=POSITIVE)
    runs: int = option(1, "copy and repeat: runs per problem: eviction seeds for the policies that draw on one (and, "
                          "with --temperature > 0, sampling seeds for every policy)", check=POSITIVE)
    repeat_problems: int = option(8, "repeat: problems", check=POSITIVE)
    compression: float = option(4.0, "repeat: T = full attention's mean generation length / compression",
                                check=POSITIVE)
    repeat_buffer: Optional[int] = option(None, "repeat: its r (default: the repeat task's own, 8; the paper's is "
                                                "64; a board's repeat task runs at its spec's buffer)",
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
    temperature: float = option(0.0, "copy and repeat: sampling temperature (0 = greedy); > 0 samples every policy "
                                     "--runs times with a sampling seed per run", check=NONNEGATIVE)
    top_p: float = option(1.0, "copy and repeat: nucleus sampling with --temperature > 0")
    reference_lp: bool = option(False, "copy and repeat: also the teacher-forced log-prob of full attention's output "
                                       "under each policy's cache (the accuracy harness's --reference-lp), compared "
                                       "with Random (lp columns)")
    reference_tokens: Optional[int] = option(None, "with --reference-lp: score only the reference's first N tokens",
                                             check=POSITIVE)
    target_mde: Optional[float] = option(None, "also print, per task, how many units (problems or instances) would "
                                               "make a difference of this size detectable with 80%% power at the "
                                               "board's level (from the board's own noise; run it on finished rows "
                                               "to plan the next run)", check=_fraction, metavar="X")
    root: Optional[str] = option(None, "the exact folder of the board's files (default: --out / the setting's "
                                       "name); probes.challenge puts its board in its own folder", cli=False)

    policy_fields = ("policies", "selector")

    def check(self) -> None:
        if REFERENCE in self.selectors:
            raise ConfigError(self.policy_field(REFERENCE), "random is the reference every selector is measured "
                                                            "against; leave it out")
        if not self.selectors:
            raise ConfigError("policies", "no selector to rank: give --policies and/or --selector FILE.py:FN")
        if not self.tasks:
            raise ConfigError("tasks", "no task to run")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_p != 1.0 and self.temperature == 0:
            raise ConfigError("top_p", "applies only when sampling; greedy decoding (--temperature 0, the default) "
                                       "ignores it: pass --temperature T > 0 too, or drop --top-p")
        if self.reference_tokens is not None and not self.reference_lp:
            raise ConfigError("reference_tokens", "applies only with --reference-lp: add --reference-lp, or drop "
                                                  "--reference-tokens")
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
    """The accuracy harness's run of the ``copy`` slot (``--accuracy-task``, full attention with
    ``--full-attention``) or of the repeat task (full attention first: T comes from its lengths)."""
    name = config.accuracy_task if task == "copy" else task
    common = dict(model=config.model, device=config.device, seed=config.seed, out=str(root / name), no_figure=True,
                  task=name, runs=config.runs, stats=config.stats, protect_prompt=config.protect_prompt,
                  max_new_tokens=config.max_new_tokens,  # the accuracy harness's own batches (of equal prompts)
                  temperature=config.temperature, top_p=config.top_p, reference_lp=config.reference_lp,
                  reference_tokens=config.reference_tokens)
    if task == "copy":
        full = (FULL,) if config.full_attention else ()
        return accuracy.Config(policy=(*full, *config.policies_run), budget=(config.budget,), buffer=config.buffer,
                               problems=config.problems, data=config.data, **common)
    return accuracy.Config(policy=(FULL, *config.policies_run), compression=(config.compression,),
                           buffer=config.repeat_buffer, problems=config.repeat_problems, **common)


def board_root(config: Config, model_name: str) -> Path:
    """The folder of the board's files: ``root`` when set (the challenge's own folder), else ``--out`` (default
    ``data/results/leaderboard``) / the setting's name."""
    if config.root:
        return Path(config.root)
    return Path(config.out or Path("data") / "results" / "leaderboard") / run_name(config, model_name)


def planted_conditions(config: Config) -> tuple[str, ...]:
    """The planted task's conditions per instance: the policy's, after the endpoints of Recall R with ``--recall``."""
    return ("deleted", "all", "policy") if config.recall else ("policy",)


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
                           seed=config.seed, deletable=config.recall)  # --recall deletes the box in one round


def plan(config: Config, model: ModelInfo) -> Plan:
    """Every task's units for every selector and Random (Random's once, shared), in the order a fresh run computes
    them; the repeat task's policies are a second stage (T comes from full attention's lengths)."""
    root = board_root(config, model.name)
    pols = config.policies_run
    options = {p: calibration_options(p, config.stats) for p in pols}
    for p in pols:  # every selector binds to the model before anything runs (TriAttention without statistics...)
        config.bind(config.spec(p), model.bind_target)
    outputs, work, later = [], [], []
    meta = {"root": str(root), "model": model.name, "tasks": {}}

    def output(task, key, **extra):
        record = _record(config, model.name, task, **extra)
        o = Output(str(root / result_name(record["probe"], record)), record, key, meta={"task": task})
        outputs.append(o)
        return o

    for task in config.tasks:
        if task in ("copy", "repeat"):
            inner = accuracy.plan(accuracy_config(config, task, root), model)
            for o in inner.outputs:
                o.meta["slot"] = task  # the slot of --tasks it fills (its "task" is the accuracy task's name)
            outputs.extend(inner.outputs)
            meta["tasks"][task] = inner.outputs[0].path
            work += [_wrap(task, u) for u in inner.units]
            if inner.then is not None:
                later.append((task, inner.then))
        elif task == "question":
            tasks = _question_tasks(model.tokenizer, str(_traces(config)), config.body, config.seed)
            if config.instances > len(tasks):
                raise ConfigError("instances", f"the question task's traces make {len(tasks)} instances; use "
                                               f"--instances <= {len(tasks)} or more traces")
            n = config.instances
            config.fits(config.spec(), max(tasks.prompt_len_of(k) for k in range(n)), what="question task")
            o = output("question", ("instance", "policy"), body=config.body)
            meta["tasks"][task] = o.path
            for p in ([FULL] if config.full_attention else []) + pols:
                for idx in tasks.batches(n, config.batch):
                    w = {"task": task, "traces": str(_traces(config)), "body": config.body, "seed": config.seed,
                         "idx": idx, "policy": p, "protect": config.protect_prompt, "budget": config.budget,
                         "buffer": config.buffer, "batch_seed": batch_seed(config.seed, idx[0]),
                         "options": options.get(p, {})}
                    work.append(make_unit("leaderboard", model.name, o, {"policy": p}, [{"instance": i} for i in idx],
                                          w, label=f"question: {p} {idx[0]}-{idx[-1]}"))
        elif task in ("passcode", "planted"):
            builder = _builder(config, model.tokenizer, task)
            config.fits(config.spec(), len(builder.stub), what=f"{task} task stub")
            n = config.passcode_instances if task == "passcode" else config.planted_instances
            extra = {"rounds": config.rounds} if task == "passcode" else {"distance": config.distance}
            # The planted rows are keyed by condition too (the policy's, and with --recall R's two endpoints), so
            # rows measured without --recall are resumed by a run with it, which adds only the endpoints.
            conds = planted_conditions(config) if task == "planted" else ()
            o = output(task, ("instance", "policy", "condition") if conds else ("instance", "policy"), **extra)
            meta["tasks"][task] = o.path
            for p in pols:
                for b in range(0, n, config.batch):
                    idx = list(range(b, min(n, b + config.batch)))
                    w = {"task": task, "config": config, "policy": p, "first": b, "instances": idx[-1] + 1,
                         "scratch": str(root / "work" / task / policy_slug(p))}
                    parts = [{"condition": c} for c in conds] if conds else None
                    work.append(make_unit("leaderboard", model.name, o, {"policy": p}, [{"instance": i} for i in idx],
                                          w, parts=parts, label=f"{task}: {p} {idx[0]}-{idx[-1]}", serial=True))
        elif task == "cost":
            o = output("cost", ("policy", "metric"), repeats=config.cost_repeats, rounds=config.cost_rounds,
                       cost_batch=config.cost_batch)
            meta["tasks"][task] = o.path
            for p in config.selectors:
                work.append(make_unit("leaderboard", model.name, o, {"policy": p},
                                      [{"metric": ROUND_COST}, {"metric": THROUGHPUT}],
                                      {"task": task, "config": config, "policy": p}, label=f"cost: {p} vs random",
                                      serial=True))  # timed: never side by side with another unit
    # The cheap tasks first and the long ones last (planted replays, then the repeat task's full attention), so that
    # a run cut short has its quickest tables on disk.
    work.sort(key=lambda u: RUN_ORDER.index(u.work["task"]))
    result = Plan("leaderboard", config, outputs, work, meta=meta)
    result.then = _stages(config, outputs, meta, sorted(later, key=lambda t: RUN_ORDER.index(t[0])))
    return result


def _stages(config: Config, outputs: list, meta: dict, later: list) -> Optional[Callable[[dict], Plan]]:
    """The board's further stages from the accuracy slots' own (``later``: ``[(slot, then)]``): each stage holds
    every slot's next one (the repeat task's policies, planned from full attention's lengths; then each slot's
    reference log-probs with ``--reference-lp``), until none has another."""
    if not later:
        return None

    def stage(rows: dict) -> Plan:
        units, more = [], []
        for task, then in later:
            step = then(rows)
            units += [_wrap(task, u) for u in step.units]
            if step.then is not None:
                more.append((task, step.then))
        return Plan("leaderboard", config, outputs, units, then=_stages(config, outputs, meta, more), meta=meta)
    return stage


# -- running one unit ---------------------------------------------------------------------------------------
def _planted_rows(model, tok, w: dict, parts: Optional[list[dict]] = None) -> list[dict]:
    """One batch of the passcode or the planted task under one policy, through the probes' own run functions (their
    rows resume from a scratch file beside the board if a run is killed in the middle of a batch); the planted
    task's under the conditions of ``parts`` (the policy's, and Recall R's endpoints with ``--recall``)."""
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
        names = [p["condition"] for p in parts or [{"condition": "policy"}]]
        pins = names != ["policy"]  # R's endpoints pin (or delete) the box; the policy's condition leaves it alone
        s = setup("leaderboard_planted", cfg, loaded=(model, tok), out=scratch / "planted.jsonl", pins_boxes=pins,
                  builder_texts={"deletable": pins})
        width, heads = s.builder.box_width, range(s.n_heads)
        made = {"deleted": lambda: Condition.heads("deleted", (), width),
                "all": lambda: Condition.heads("all", heads, width), "policy": Condition.policy}
        rows = run_conditions(s, [made[n]() for n in names], desc=f"planted: {pol}")
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
    elif task == "passcode":
        yield _planted_rows(model, tok, w)
    elif task == "planted":
        rows = _planted_rows(model, tok, w, unit.parts)
        for part in unit.parts:  # one list per condition, in the unit's order
            yield [r for r in rows if r["condition"] == part["condition"]]
    elif task == "cost":
        yield measure_cost(w["config"], model, tok, w["policy"])
    else:
        raise ValueError(f"not a leaderboard task: {task!r}")


def measure_cost(config: Config, model, tok, policy: str) -> list[dict]:
    """Decode throughput and milliseconds per eviction round (the cache's own timers) of ``policy`` and Random,
    interleaved within each repeat so drift hits them alike; medians, and their ratio to Random's."""
    policies = [policy, REFERENCE]
    chat = survival.build_chats(tok, survival.read_rows(_traces(config)), 1, config.budget + config.buffer,
                                config.seed, config.budget)[0]
    ids = torch.tensor([list(chat.ids[:chat.prompt_len])] * config.cost_batch, device=model.device)
    new = config.budget + config.cost_rounds * config.buffer - chat.prompt_len
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
    randattn.generate(model, ids, config.spec(REFERENCE, seed=0).make_cache(),
                      **{**gen, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
    speed: dict = {p: [] for p in policies}
    round_ms: dict = {p: [] for p in policies}
    for rep in tqdm(range(config.cost_repeats), desc="cost", unit="repeat"):
        for pol in policies:
            cache = config.spec(pol, seed=config.seed + rep).make_cache()
            t0 = time.perf_counter()
            randattn.generate(model, ids, cache, **gen)
            seconds = time.perf_counter() - t0
            speed[pol].append(ids.shape[0] * new / seconds)
            round_ms[pol].append(1000 * cache.round_seconds / max(1, cache.total_events))
    med = {p: (statistics.median(speed[p]), statistics.median(round_ms[p])) for p in policies}
    setting = {"batch": config.cost_batch, "new_tokens": new, "rounds": config.cost_rounds,
               "repeats": config.cost_repeats}
    return [{"test": "cost", "metric": ROUND_COST, "unit": "ms", "policy": policy, "value": med[policy][1],
             "random": med[REFERENCE][1], "ratio": med[policy][1] / med[REFERENCE][1], **setting},
            {"test": "cost", "metric": THROUGHPUT, "unit": "tokens/s", "policy": policy, "value": med[policy][0],
             "random": med[REFERENCE][0], "ratio": med[policy][0] / med[REFERENCE][0], **setting}]


# -- the table -----------------------------------------------------------------------------------------------
def _mean(scores: dict) -> float:
    return float(np.mean(list(per_problem_means(scores).values())))


def compared(test: str, metric: str, unit: str, policy: str, a: dict, b: dict, seed: int, **extra) -> dict:
    """One verdict row: ``a`` (the policy) against ``b`` (Random), both ``{unit id: [score per run]}``: the paired
    bootstrap 95% CI of the difference and the exact sign test (:func:`randattn.stats.paired_comparison`), ``p`` the
    paper's two-part rule's own p (both parts must pass, so the larger of the two), and what the MDE needs: the rate
    at which the two arms disagree both ways (``noise``) and the differences' standard deviation (``sd_delta``).
    The verdict is the unadjusted rule's; :func:`adjust_board` replaces it with the board's adjusted one."""
    c = paired_comparison(a, b, seed=seed)
    common = sorted(set(a) & set(b), key=str)
    ma, mb = per_problem_means(a), per_problem_means(b)
    d = [ma[k] - mb[k] for k in common]
    return {"test": test, "metric": metric, "unit": unit, "policy": policy, "n": c.delta.n,
            "value": _mean({k: a[k] for k in common}), "random": _mean({k: b[k] for k in common}),
            **c.delta.as_dict("delta"), "p_bootstrap": c.p_bootstrap, "wins": c.sign.wins, "losses": c.sign.losses,
            "ties": c.sign.ties, "p_sign": c.sign.p, "p": max(c.sign.p, c.p_bootstrap), "noise": noise_rate(d),
            "sd_delta": float(np.std(d, ddof=1)) if len(d) > 1 else float("nan"),
            "signed_unit": all(x in (-1.0, 0.0, 1.0) for x in d), "verdict": c.verdict, **extra}


def adjust_board(table: list[dict], alpha: float = ALPHA, method: str = ADJUSTMENT) -> None:
    """The board's verdicts, in place: every comparison of the board (each row's score and, where it has one, its
    log-prob) is one family. Each gets ``p_adjusted`` (``method`` across the family), ``family`` (its size) and an
    MDE at 80% power and level ``alpha / family`` (Bonferroni, Holm's first step: what one true effect among null
    ones must clear), in the score's own units (:func:`mde`), ``lp_mde`` in nats (normal approximation at the
    observed standard deviation of the log-prob differences; ``inf`` where the sign test cannot reach the level).
    A difference is "better" or "worse" only when its 95% CI
    excludes 0 and its adjusted p is below ``alpha``; otherwise "no detectable difference", with its MDE."""
    tests = [(r, "") for r in table] + [(r, "lp_") for r in table if r.get("lp_p") is not None]
    adjusted = adjust([r[f"{pre}p"] for r, pre in tests], method)
    level = alpha / max(1, len(tests))
    for (r, pre), p_adj in zip(tests, adjusted):
        excludes = r[f"{pre}delta_lo"] > 0 or r[f"{pre}delta_hi"] < 0
        significant = excludes and p_adj < alpha
        r.update({f"{pre}p_adjusted": p_adj, f"{pre}family": len(tests), f"{pre}adjustment": method,
                  f"{pre}verdict": VERDICTS[("better" if r[f"{pre}delta"] > 0 else "worse") if significant
                                            else "indistinguishable"]})
        if pre:
            r["lp_mde"] = mde_normal(r["lp_sd_delta"], r["n"], alpha=level, power=POWER) \
                if mde_sign(r["n"], alpha=level, power=POWER) < float("inf") else float("inf")
        else:
            r["mde"], r["mde_method"] = mde(r, level)


def mde(row: dict, level: float) -> tuple[float, str]:
    """``(MDE, how)`` of one score comparison at ``level``, in the score's units. Where every paired difference is
    -1, 0 or +1 (a 0/1 score, one run per unit) the exact sign test's (``exact sign``): P(win) - P(loss) is then the
    score difference itself, at the observed two-way disagreement. Otherwise (fractional grades, several runs per
    unit) the normal approximation at the observed standard deviation (``normal``); and ``inf`` either way when
    the sign test could not reach ``level`` at this n even with every unit a win (the rule needs both tests)."""
    if mde_sign(row["n"], alpha=level, power=POWER) == float("inf"):
        return float("inf"), "exact sign"
    if row["signed_unit"] or not row["sd_delta"] > 0:
        return mde_sign(row["n"], noise=row["noise"], alpha=level, power=POWER), "exact sign"
    return mde_normal(row["sd_delta"], row["n"], alpha=level, power=POWER), "normal"


def _scores(task: str, rows: list[dict], reference_rows: list[dict] = ()) -> tuple[dict, dict, dict]:
    """``({row field: {policy: {unit: [score per run]}}}, {policy: {unit: [log-prob per run]}}, {policy: mean generated
    length})`` of one task's rows: each scored endpoint of the task (:data:`ENDPOINTS`; the repeat task's copies as a
    share of 64, and its fidelity without the runs that wrote no copy), log-probs where the task has them (the
    teacher-forced answer's mean log-prob, finer than an exact answer; the copy and repeat tasks' from their
    ``--reference-lp`` rows, ``reference_rows``); full attention's under ``full`` where it ran; the planted task's
    from the policy's condition alone."""
    scores: dict = {}
    lps: dict = {}
    lengths: dict = {}

    def add(field, r, value):
        key = r["problem"] if task in ("copy", "repeat") else r["instance"]
        scores.setdefault(field, {}).setdefault(r["policy"], {}).setdefault(key, []).append(value)
    for r in rows:
        if task == "repeat":
            if "copies" not in r:
                raise ValueError(f"a repeat row of {r['policy']} on {r['problem']} has no 'copies' field: it was graded "
                                 "before the repeat task's two endpoints; re-grade its file with python -m "
                                 "probes.regrade FILE")
            add("copies", r, r["copies"] / REPEAT_LINES)
            if r["fidelity"] is not None:
                add("fidelity", r, float(r["fidelity"]))
        elif task == "copy":
            add("grade", r, float(r["grade"]))
        elif task == "question":
            add("digit_acc", r, float(r["digit_acc"]))
            lps.setdefault(r["policy"], {})[r["instance"]] = [float(r["mean_lp"])]
        elif r.get("condition", "policy") == "policy":  # Recall R's endpoints are not the policy's score
            add("retrieved", r, float(r["retrieved"]))
            lps.setdefault(r["policy"], {})[r["instance"]] = [float(r["lp"])]
        if task in ("copy", "repeat") and r["policy"] != FULL:
            lengths.setdefault(r["policy"], []).append(r["gen_len"])
    for r in reference_rows:
        if r.get("ref_lp") is not None:
            lps.setdefault(r["policy"], {}).setdefault(r["problem"], []).append(float(r["ref_lp"]))
    return scores, lps, {p: float(np.mean(v)) for p, v in lengths.items()}


def _planned_rows(plan_units: list[Unit], path: str, rows: list[dict], key: tuple) -> list[dict]:
    """The rows of ``rows`` that this plan's units name (a file may hold more selectors or items than asked)."""
    wanted = {tuple(k[f] for f in key) for u in plan_units if u.output == path for item in u.items
              for k in u.keys(item)}
    return [r for r in rows if tuple(r[f] for f in key) in wanted]


def _recall(rows: list[dict], seed: int) -> dict:
    """``{policy: Recall R estimate}`` from the planted rows of policies that ran both endpoints (``--recall``)."""
    by_policy: dict = {}
    for r in rows:
        by_policy.setdefault(r["policy"], []).append(r)
    out = {}
    for pol, rs in by_policy.items():
        s = planted_summary(rs, ["policy"], seed=seed).get("policy")
        if s is not None and s.recall is not None:
            out[pol] = s.recall
    return out


def output_slot(output: Output) -> str:
    """The slot of ``--tasks`` an output of the plan fills (an accuracy file's own ``task`` is its task's name)."""
    return output.meta.get("slot") or output.meta.get("task")


def task_of(config: Config, slot: str) -> str:
    """A slot of ``--tasks`` as the board names it: the accuracy slot by its task (``copy`` unless
    ``--accuracy-task``), the others by their own name."""
    return config.accuracy_task if slot == "copy" else slot


def endpoints_of(config: Config, slot: str) -> list[tuple[str, str, str]]:
    """``[(test, metric, row field)]``: the scored endpoints of a slot of ``--tasks``, one board row per selector each
    (the repeat task's two; the copy slot's named after ``--accuracy-task``)."""
    if slot == "copy":
        return [(config.accuracy_task, f"{config.accuracy_task} accuracy", "grade")]
    return ENDPOINTS[slot]


def metric_of(config: Config, slot: str) -> tuple[str, str]:
    """``(metric, what is paired)`` of a slot of ``--tasks`` (the repeat task's two metrics joined by '; ')."""
    if slot == "copy":
        return f"{config.accuracy_task} accuracy", "problems"
    return METRICS[slot]


def grade_of(config: Config, slot: str) -> str:
    """The grade a slot registers (:func:`registered`)."""
    if slot == "cost":
        return f"{ROUND_COST}; {THROUGHPUT} (ratios to Random's, interleaved)"
    metric, unit = metric_of(config, slot)
    return f"{metric}, paired by {unit}"


def board(config: Config, plan_units: list[Unit], outputs: list[Output], rows: dict) -> list[dict]:
    """One row per selector and scored endpoint of each task (the repeat task's two): score with its 95% CI,
    Random's, the paired difference with its CI, bootstrap p, sign test and verdict, generated length (copy, repeat)
    and round cost as a ratio to Random's; ranked. Where the rows have them: full attention's score on the same units
    (``full_attention``), the answer's log-prob compared the same way (``lp*``: question, passcode, planted, and with
    ``--reference-lp`` the reference continuation's of copy and repeat, on the repeat task's fidelity row), the
    planted fact's Recall R with its CI (``recall*``, ``--recall``)."""
    by_task = {output_slot(o): o for o in outputs if not o.meta.get("reference")}
    references = {output_slot(o): o for o in outputs if o.meta.get("reference")}
    cost = {}
    if "cost" in by_task:
        o = by_task["cost"]
        for r in _planned_rows(plan_units, o.path, rows.get(o.path, []), o.key):
            cost[(r["policy"], r["metric"])] = r
    table = []
    for slot in config.tasks:
        if slot == "cost" or slot not in by_task:
            continue
        o = by_task[slot]
        planned = _planned_rows(plan_units, o.path, rows.get(o.path, []), o.key)
        ref_o = references.get(slot)
        ref_rows = _planned_rows(plan_units, ref_o.path, rows.get(ref_o.path, []), ref_o.key) if ref_o else []
        scores_of, lps, lengths = _scores(slot, planned, ref_rows)
        recall = _recall(planned, config.seed) if slot == "planted" else {}
        budgets = sorted({u.fixed.get("budget") for u in plan_units if u.output == o.path
                          and u.fixed.get("policy") == REFERENCE} - {None})
        unit = metric_of(config, slot)[1]
        rows_of: dict = {}  # policy -> this slot's rows of it, one per endpoint
        for test, metric, field in endpoints_of(config, slot):
            scores = scores_of.get(field, {})
            if REFERENCE not in scores:
                continue
            ref = mean_ci(list(per_problem_means(scores[REFERENCE]).values()), seed=config.seed)
            for pol in config.selectors:
                common = sorted(set(scores.get(pol, {})) & set(scores[REFERENCE]), key=str)  # a fixed order
                if not common:  # e.g. no run of one of them wrote a repeat copy: nothing to pair
                    continue
                row = compared(test, metric, unit, pol, scores[pol], scores[REFERENCE], config.seed)
                for col, p in (("value", pol), ("random", REFERENCE)):
                    means = per_problem_means({k: scores[p][k] for k in common})
                    row[col] = float(np.mean([means[k] for k in common]))
                est = mean_ci(list(per_problem_means(scores[pol]).values()), seed=config.seed)
                row.update({"value_lo": est.lo, "value_hi": est.hi, "random_lo": ref.lo, "random_hi": ref.hi,
                            "budget": budgets[0] if budgets else config.budget,
                            "gen_len": lengths.get(pol), "random_gen_len": lengths.get(REFERENCE)})
                full = {k: scores[FULL][k] for k in common if k in scores.get(FULL, {})}
                if full:  # the ceiling, on the same units
                    row["full_attention"] = float(np.mean(list(per_problem_means(full).values())))
                rows_of.setdefault(pol, []).append((field, row))
                if pol in recall and REFERENCE in recall:  # descriptive: each policy's own endpoints, no paired test
                    r, r0 = recall[pol], recall[REFERENCE]
                    row.update({"recall": r.value, "recall_lo": r.lo, "recall_hi": r.hi, "random_recall": r0.value,
                                "random_recall_lo": r0.lo, "random_recall_hi": r0.hi})
                for name, metric_name in (("round_cost", ROUND_COST), ("throughput", THROUGHPUT)):
                    c = cost.get((pol, metric_name))
                    row[f"{name}_ratio"] = c["ratio"] if c else None
                row["slot"] = slot
                table.append(row)
        for pol, these in rows_of.items():  # one log-prob comparison per slot and selector, on its content endpoint
            if pol in lps and REFERENCE in lps and set(lps[pol]) & set(lps[REFERENCE]):
                row = next((r for f, r in these if f == LP_ENDPOINT.get(slot)), these[0][1])
                lp = compared(slot, "log-prob", unit, pol, lps[pol], lps[REFERENCE], config.seed)
                row.update({"lp": lp["value"], "random_lp": lp["random"], "lp_delta": lp["delta"],
                            "lp_delta_lo": lp["delta_lo"], "lp_delta_hi": lp["delta_hi"], "lp_p": lp["p"],
                            "lp_sd_delta": lp["sd_delta"]})
                full_lp = {k: lps[FULL][k] for k in lps[pol] if k in lps.get(FULL, {})}
                if full_lp:  # the log-prob's ceiling: full attention's own output teacher-forced without eviction
                    row["full_attention_lp"] = float(np.mean(list(per_problem_means(full_lp).values())))
    adjust_board(table)
    tally = {p: sum((r["verdict"] == "better") - (r["verdict"] == "worse") for r in table if r["policy"] == p)
             for p in config.selectors}
    mean_delta = {p: float(np.mean([r["delta"] for r in table if r["policy"] == p] or [0.0])) for p in tally}
    order = sorted(tally, key=lambda p: (-tally[p], -mean_delta[p]))
    rank = {p: i + 1 for i, p in enumerate(order)}
    for r in table:
        r["rank"] = rank[r["policy"]]
    table.sort(key=lambda r: (r["rank"], config.tasks.index(r["slot"])))
    for r in table:
        del r["slot"]
    return table


def _fmt(x, spec=".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and np.isnan(x)) else format(x, spec)


def print_board(table: list[dict]) -> None:
    width = max([9, *(len(r["test"]) for r in table)])
    lp = any(r.get("lp_delta") is not None for r in table)
    print(f"\n{'#':>2} {'selector':<24} {'task':<{width}} {'n':>3} {'score [95% CI]':<22} {'random [95% CI]':<22} "
          f"{'difference [95% CI]':<25} {'p':>6} {'p_holm':>6} {'MDE':>5}  {'verdict':<24} {'round cost':>10} "
          f"{'length':>7}" + (f"  {'log-prob difference [95% CI]':<30}" if lp else ""))
    for r in table:
        lp_cell = (f"  {r['lp_delta']:+.2f} [{r['lp_delta_lo']:+.2f}, {r['lp_delta_hi']:+.2f}]"
                   + ("*" if r.get("lp_verdict") in ("better", "worse") else "")
                   if r.get("lp_delta") is not None else "  –") if lp else ""
        print(f"{r['rank']:>2} {r['policy'][:24]:<24} {r['test']:<{width}} {r['n']:>3} "
              f"{_fmt(r['value'])} [{_fmt(r['value_lo'])}, {_fmt(r['value_hi'])}]  "
              f"{_fmt(r['random'])} [{_fmt(r['random_lo'])}, {_fmt(r['random_hi'])}]  "
              f"{r['delta']:+.3f} [{r['delta_lo']:+.3f}, {r['delta_hi']:+.3f}]  {r['p']:>6.3f} "
              f"{r['p_adjusted']:>6.3f} {_fmt_mde(r['mde']):>5}  "
              f"{r['verdict']:<24} {'x' + _fmt(r['round_cost_ratio'], '.2f'):>10} {_fmt(r['gen_len'], '.1f'):>7}"
              + lp_cell)
    family = table[0]["family"] if table else 0
    print(f"verdict: better or worse only when the paired bootstrap 95% CI excludes no difference and p (the larger of "
          f"the bootstrap's and the exact sign test's) stays below {ALPHA} after {ADJUSTMENT.title()}'s adjustment "
          f"across the board's {family} comparisons (scores and log-probs); MDE: the difference in P(win) - P(loss) "
          f"the sign test detects with {POWER:.0%} power at {ALPHA}/{family} ('none': no difference is detectable "
          f"at this n); round cost: ms per eviction round as a ratio to Random's, measured side by side"
          + ("; log-prob: the answer's (question, passcode, planted) or the reference continuation's (copy, repeat: "
             "full attention's output teacher-forced), * = better or worse after the adjustment" if lp else ""))


def planned_units(table: list[dict], target: float, alpha: float = ALPHA) -> list[dict]:
    """Per task: the units it has and the units that make ``target`` detectable with 80% power at the board's level
    (``alpha / family``), from the noisiest comparison of the task (the largest two-way disagreement, or for
    fractional or multi-run scores the largest standard deviation of the paired differences, normal approximation),
    so every selector's comparison gets that power. A task where the arms never disagreed (every unit tied, e.g. all
    at the floor) gives the noise-free count: a lower bound."""
    out = []
    for task in dict.fromkeys(r["test"] for r in table):
        rows = [r for r in table if r["test"] == task]
        level = alpha / rows[0]["family"]
        normal = [r for r in rows if not r["signed_unit"] and r["sd_delta"] > 0]
        if normal:
            sd = max(r["sd_delta"] for r in normal)
            # the rule needs the sign test too: no fewer units than it needs to reach the level with every unit a win
            floor = math.floor(math.log2(2 / level)) + 1
            need = max(floor, units_for_mde(target, sd=sd, alpha=level, power=POWER))
            how = f"normal, sd {sd:.3f}" + (f"; the sign test's floor of {floor} units" if need == floor else "")
        else:
            noise = max(r["noise"] for r in rows)
            if target + 2 * noise > 1:
                out.append({"task": task, "n": rows[0]["n"], "target": target, "units": None,
                            "how": f"exact sign, noise {noise:.3f}: a difference of {target} cannot occur"})
                continue
            need = units_for_mde(target, noise=noise, alpha=level, power=POWER)
            how = f"exact sign, noise {noise:.3f}" + (": no disagreement seen, a lower bound" if noise == 0 else "")
        out.append({"task": task, "n": rows[0]["n"], "target": target, "units": need, "how": how})
    return out


def print_plan(plan_rows: list[dict]) -> None:
    print(f"\nunits for an MDE of {plan_rows[0]['target'] if plan_rows else '?'} (80% power, the board's level; "
          f"from the board's own noise):")
    width = max([10, *(len(r["task"]) for r in plan_rows)])
    for r in plan_rows:
        print(f"  {r['task']:<{width}} has {r['n']:>4}, needs {'–' if r['units'] is None else r['units']:>6}  "
              f"({r['how']})")


def _fmt_mde(x: float) -> str:
    return "none" if not np.isfinite(x) else f"{x:.2f}"


def merge(plan: Plan, rows: dict, figures: bool) -> list[Path]:
    """``leaderboard.csv`` from the rows of every task (only those this plan names), printed; the figure."""
    config: Config = plan.config
    table = board(config, plan.meta.get("units", plan.units), plan.outputs, rows)
    name = Path(result_name("leaderboard", config, "table", model=plan.meta["model"])).name
    path = write_csv(Path(plan.meta["root"]) / name, table)
    print_board(table)
    if config.target_mde is not None:
        print_plan(planned_units(table, config.target_mde))
    print(f"\nleaderboard: {path}")
    paths = [path]
    if figures and not config.no_figure:
        paths += cli.draw("leaderboard", path, config.figure_dir)
    return paths


def registered(config: Config) -> dict:
    """``{task: spec}`` of every task this run plans (:mod:`probes.registration`): what fixes it, its grade and the
    board's verdict rule."""
    verdict = {"alpha": ALPHA, "adjustment": ADJUSTMENT, "power": POWER}
    resolved = {"model": config.model or randattn.DEFAULT_MODEL, "traces": trace_label(_traces(config))}
    return {t: {**registration.task_spec(config, t, grade=grade_of(config, t), verdict=verdict), **resolved}
            for t in config.tasks}


def check(config: Config) -> None:
    """The board's tasks against its registered spec (:mod:`probes.registration`), before the model loads
    (``Kind.check``)."""
    registration.check(board_root(config, config.model or randattn.DEFAULT_MODEL), registered(config),
                       restart=config.restart)


def register_tasks(p: Plan) -> None:
    """Register the plan's tasks in the board's ``spec.json`` before their first rows (a task whose rows are on disk
    already is marked so), then describe the run (``Kind.planned``: before any result file is opened, so a
    ``--restart`` has not discarded them yet)."""
    config: Config = p.config
    have_rows: dict = {}
    for o in p.outputs:
        have_rows[output_slot(o)] = have_rows.get(output_slot(o), False) or Path(o.path).exists()
    registration.record(Path(p.meta["root"]), registered(config), restart=config.restart, rows_exist=have_rows)
    print(f"leaderboard: {', '.join(config.selectors)} vs random | model {config.model or randattn.DEFAULT_MODEL} | "
          f"T={config.budget}, r={config.buffer}, prompt {'protected' if config.protect_prompt else 'unprotected'} | "
          f"tasks {', '.join(config.tasks)} | results in {p.meta['root']}")


def main(argv=None) -> int:
    """The command line: the one every kind has (``units.command``), of this kind."""
    return units.command(KIND, __doc__)(argv)


KIND = Kind("leaderboard", Config, plan, run_unit, merge, check=check, planned=register_tasks)

if __name__ == "__main__":
    sys.exit(main())
