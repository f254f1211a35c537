"""Running planted-fact probes: the configuration, the resumable loop over instances, instrument checks, tables.

Every planted-fact probe (head pooling, scatter, blocks, two facts) is a list of
:class:`~probes.planted.Condition` handed to :func:`run_conditions`; this module does the rest the
same way for all of them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

import randattn
from analysis.names import result_name, summary_beside
from analysis.planted import ConditionSummary
from randattn.keepstats import random_round_survival
from randattn.spec import min_budget
from randattn.traces import load_traces

from .config import DEFAULT, NONNEGATIVE, POSITIVE, ConfigError, EvictionConfig, RunConfig, eviction, option, setting
from .planted import Condition, InstanceBuilder, audit_keep_log, fact_metrics, model_shape, run_batch
from .results import DEFAULT_TRACES, ResultsFile, out_folder, run_record, trace_label
from .units import Kind, Output, Plan, Unit, load, make_unit, run_local
from randattn.seeding import batch_seed

PAPER = {"budget": 1024, "buffer": 64, "distance": 1536}
#: The key of a planted-fact row: which instance, under which condition, which of its facts.
KEY = ("instance", "condition", "fact")


@dataclass
@eviction(policy=setting("random", help="how the background (everything but the box) is evicted"), budget=256,
          buffer=16, protect_prompt=False, stats=DEFAULT)
class PlantedConfig(EvictionConfig):
    """The planted-fact instrument's settings, shared by head pooling, scatter, two facts, blocks, passcode and the
    shared-draw probe."""

    traces: Optional[str] = option(None, "JSONL with a 'text' field per row: the filler (default: the embedded "
                                         "model's own solutions, shipped with the package; use traces of the model "
                                         "you probe)")
    distance: int = option(384, "tokens from the first fact-box token to the first answer token", check=POSITIVE)
    paper: bool = option(False, "the paper's geometry: T=1024, r=64, distance 1536 (overrides --budget, --buffer and "
                                "--distance)")
    box_width: int = option(12, "tokens per fact box (<= r)", check=POSITIVE)
    instances: int = option(48, "instances (paired across conditions)", check=POSITIVE)
    batch: int = option(8, "instances replayed together", check=POSITIVE)
    parity: int = option(1, "instances checked against token-by-token decoding before the run (0: skip)",
                         check=NONNEGATIVE)

    def __post_init__(self) -> None:
        if self.paper:
            for k, v in PAPER.items():
                setattr(self, k, v)
        super().__post_init__()


@dataclass
class Session:
    """Everything a planted-fact run needs, built once from its configuration."""

    probe: str
    config: PlantedConfig
    model: object
    tok: object
    builder: InstanceBuilder
    results: ResultsFile
    n_heads: int
    n_layers: int
    spec: "randattn.EvictionSpec | None" = None  # the run's eviction setting (policy options included)
    no_eviction: bool = False  # full attention through the same code path (a budget no round reaches)

    @property
    def policy_options(self) -> dict:
        return self.spec.cache_options if self.spec is not None else {}

    def make_cache(self, batch_index: int, keep_log: bool = False) -> randattn.EvictingCache:
        if self.no_eviction:
            return randattn.EvictionSpec.full().make_cache(max_tokens=self.builder.length, keep_log=keep_log)
        # Every batch draws its own evictions; rows of one batch differ through their row index.
        return dataclasses.replace(self.spec, seed=batch_seed(self.config.seed, batch_index)).make_cache(
            keep_log=keep_log)


def check_traces(config: PlantedConfig) -> None:
    """The traces file's refusal (a :class:`ConfigError` naming ``traces``), before a command line loads the model
    (``Kind.check``); :func:`setup` reads them again."""
    try:
        load_traces(Path(config.traces) if config.traces else DEFAULT_TRACES)
    except (FileNotFoundError, ValueError, IsADirectoryError) as exc:
        raise ConfigError("traces", str(exc)) from None


def starter(parity: Optional[Callable[[Sequence[Condition]], Condition]] = None) -> Callable[[Plan, dict], None]:
    """A planted-fact kind's ``Kind.start``: print the run's description, then (``parity``: which of the plan's
    conditions) check chunked replay against token-by-token decoding on ``--parity`` instances."""
    def start(p: Plan, files: dict) -> None:
        s = p.meta["session"]
        print(describe(s))
        if parity is not None:
            parity_check(s, parity(p.meta["conditions"]), s.config.parity)

    return start


def setup(probe: str, config: PlantedConfig, *, n_facts: int = 1, extra_config: Optional[dict] = None,
          policy_options: Optional[dict] = None, loaded=None, out: Optional[Path] = None,
          builder_texts: Optional[dict] = None, pins_boxes: bool = True,
          open_results: bool = True) -> Session:
    """Check the configuration against the traces and the model (unless ``loaded=(model, tokenizer)``), open (or
    resume) the results file (``out``, else ``<--out or data/results/<probe>>/<config slug>.jsonl``). ``pins_boxes``: the
    run's conditions pin fact boxes, which must then fit beside the protected prompt. Problems are
    :class:`ConfigError` naming the field to change."""
    traces = Path(config.traces) if config.traces else DEFAULT_TRACES
    try:
        texts = load_traces(traces)
    except (FileNotFoundError, ValueError, IsADirectoryError) as exc:
        raise ConfigError("traces", str(exc)) from None
    folder = out.parent if out is not None else out_folder(probe, config.out)
    model, tok = load(config, loaded)
    # The layout's problems name their field (box_width, distance, traces, model); the spec's too (budget, policy,
    # protect_prompt, stats), and binding it asks the policy whether it can serve this model.
    builder = InstanceBuilder(tok, texts, budget=config.budget, buffer=config.buffer, distance=config.distance,
                              box_width=config.box_width, n_facts=n_facts, seed=config.seed, **(builder_texts or {}))
    spec = config.spec(config.policy, options=policy_options or {})
    config.bind(spec, model)
    config.fits(spec, len(builder.stub))  # the protected stub prompt
    # Conditions pin fact boxes (kept in some heads) beside the protected prompt: all must fit the T - r selected
    # (``pins_boxes=False``: this run's conditions pin no box); the same arithmetic as the prompt-fits rule.
    pinned = len(builder.stub) * config.protect_prompt + n_facts * config.box_width
    if pins_boxes and min_budget(pinned, spec.recent_window) > config.budget:
        raise ConfigError("budget", f"T={config.budget} cannot hold {n_facts} pinned fact box(es) of {config.box_width}"
                                    + (f" beside the {len(builder.stub)}-token protected stub prompt" if
                                       config.protect_prompt else "")
                                    + f" and the recent window of r={config.buffer}; use --budget >= "
                                      f"{min_budget(pinned, spec.recent_window)}")
    calibration = spec.policy_object.calibration  # a file path: not part of the configuration
    per_instance = builder.length - len(builder.stub)
    if builder.stream.size < per_instance:
        raise ConfigError("traces", f"{traces} holds {builder.stream.size} tokens; one instance needs {per_instance}")
    n_heads, n_layers = model_shape(model)
    record = {
        "probe": probe, "model": config.model or randattn.DEFAULT_MODEL, "traces": trace_label(traces),
        "budget": config.budget, "buffer": config.buffer, "distance": config.distance, "box_width": config.box_width,
        "policy": config.policy, "policy_options": {k: v for k, v in spec.cache_options.items() if k != calibration},
        "protect_prompt": config.protect_prompt, "seed": config.seed, "batch": config.batch, "n_facts": n_facts,
        "kv_heads": n_heads, "layers": n_layers, **(extra_config or {}), "engine": randattn.ENGINE,
        **run_record(model),
    }
    path = out or folder / result_name("planted", record)
    if not open_results:  # a plan: the backend that runs its units opens the file (probes.units)
        return Session(probe, config, model, tok, builder, Output(str(path), record, KEY), n_heads, n_layers, spec)
    try:
        results = ResultsFile(path, record, KEY, restart=config.restart)
    except PermissionError as exc:
        raise ConfigError("out", str(exc)) from None
    except ValueError as exc:
        raise ConfigError("out", str(exc)) from None
    return Session(probe, config, model, tok, builder, results, n_heads, n_layers, spec)


def _slug(config: dict) -> str:
    """The rows file's name without ``.jsonl`` (analysis.names defines it)."""
    return result_name("planted", config)[: -len(".jsonl")]


def describe(s: Session) -> str:
    a, b = s.config, s.builder
    survival = random_round_survival(a.budget, a.buffer, len(b.stub), a.protect_prompt)
    rounds = math.ceil((a.distance - a.box_width) / a.buffer)
    return (f"model {s.results.config['model']} ({s.n_layers} layers, {s.n_heads} KV heads) | background "
            f"{a.policy}{' +prompt protection' if a.protect_prompt else ''} | T={a.budget} per head after a "
            f"round (the newest r={a.buffer} among them), r={a.buffer} buffer (per-round survival {survival:.3f}) | "
            f"distance {a.distance} "
            f"(~{rounds} rounds between fact and answer) | {b.length} tokens per instance, stub {len(b.stub)}")


# -- the loop ------------------------------------------------------------------------------------
def condition_units(s: Session, conditions: Sequence[Condition], stage: str = "") -> list[Unit]:
    """``run_conditions``' batches as units: one per batch of ``--batch`` instances (its evictions seeded by the batch
    index), one part per condition (the text before the box replayed once and forked); the instances are built
    here, so a worker needs only the model. The first batch audits its keep-logs."""
    names = [c.name for c in conditions]
    if len(set(names)) != len(names):
        raise ValueError(f"condition names must be unique, got {names}")
    a, path = s.config, str(s.results.path)
    output = Output(path, s.results.config, KEY)
    out = []
    for bi in range(math.ceil(a.instances / a.batch)):
        idx = list(range(bi * a.batch, min(a.instances, (bi + 1) * a.batch)))
        work = {"instances": [s.builder.build(i) for i in idx], "conditions": list(conditions), "audit": bi == 0,
                "spec": None if s.no_eviction else s.spec, "seed": batch_seed(a.seed, bi),
                "length": s.builder.length, "n_facts": s.builder.n_facts}
        out.append(make_unit("planted", s.results.config["model"], output, {}, [{"instance": i} for i in idx], work,
                             parts=[{"condition": n} for n in names], fanout={"fact": list(range(s.builder.n_facts))},
                             salt=[work["seed"], s.no_eviction], label=f"{s.probe} batch {bi}", stage=stage))
    return out


def batch_cache(work: dict, keep_log: bool = False) -> randattn.EvictingCache:
    """A planted-fact unit's cache (as :meth:`Session.make_cache` builds it for that batch)."""
    if work["spec"] is None:  # full attention through the same code path
        return randattn.EvictionSpec.full().make_cache(max_tokens=work["length"], keep_log=keep_log)
    return dataclasses.replace(work["spec"], seed=work["seed"]).make_cache(keep_log=keep_log)


def run_unit(model, tok, unit: Unit):
    """Replay one batch of instances under each of the unit's conditions; yields each condition's rows."""
    w = unit.work
    parts = {p["condition"] for p in unit.parts}
    conditions = [c for c in w["conditions"] if c.name in parts]
    instances, n_heads = w["instances"], model_shape(model)[0]
    ids = torch.tensor([inst.ids for inst in instances])
    make = lambda keep_log: batch_cache(w, keep_log)  # noqa: E731
    for cond, result, cache, rounds in run_batch(model, instances, conditions, make, audit=w["audit"]):
        if w["audit"]:
            checked = audit_keep_log(cache, cond, instances[0].facts, n_heads)
            if checked:
                tqdm.write(f"audit {cond.name}: fact boxes held exactly where specified "
                           f"({checked} round x layer x row x head records after the box)")
        rows = []
        for f in range(w["n_facts"]):
            lp, ok = fact_metrics(result, ids, instances[0].facts[f])
            for j, inst in enumerate(instances):
                fact = inst.facts[f]
                rows.append({
                    "instance": inst.index, "condition": cond.name, "fact": f, "name": fact.name,
                    "value": fact.value, "lp": float(lp[j]), "retrieved": bool(ok[j]),
                    "answer_tokens": fact.answer_end - fact.answer_start,
                    "rounds": cache.events[0], "rounds_after_fact": rounds,
                    **cond.meta,
                })
        yield rows


def session_rows(s: Session, conditions: Sequence[Condition], rows: Optional[list] = None) -> list[dict]:
    """The rows of this run's instances under ``conditions`` (``rows``: of the session's file), in file order."""
    wanted = {(i, c.name) for i in range(s.config.instances) for c in conditions}
    return [r for r in (s.results.rows if rows is None else rows) if (r["instance"], r["condition"]) in wanted]


def session_plan(s: Session, conditions: Sequence[Condition], *, then=None, stage: str = "") -> Plan:
    """A planted-fact probe's plan: its session's file, the batches under ``conditions`` (``then``: a further
    stage from ``{path: rows}``; ``stage``: the progress bar's label). ``s`` comes from ``setup(...,
    open_results=False)``."""
    return Plan(s.probe, s.config, [s.results], condition_units(s, conditions, stage), then=then,
                meta={"session": s, "conditions": list(conditions)})


def session_merge(report: Callable[[Session, list], None]) -> Callable[[Plan, dict, bool], list]:
    """A planted-fact probe's merge: its own ``report(session, rows)`` on the merged file (summary and figure
    exactly as its command line writes them)."""
    def merge(plan: Plan, rows: dict, figures: bool) -> list:
        s = plan.meta["session"]
        path = Path(s.results.path)
        s = dataclasses.replace(s, results=ResultsFile(path, s.results.config, KEY))  # the merged file, read back
        report(s, session_rows(s, plan.meta["conditions"]))
        return [path, summary_path(s)]

    return merge


def run_conditions(s: Session, conditions: Sequence[Condition], *, desc: Optional[str] = None) -> list[dict]:
    """Run every instance under every condition here (the local backend over :func:`condition_units`, resuming
    what is done); returns this run's rows."""
    units = condition_units(s, conditions)
    run_local(Plan(s.probe, s.config, [], units), s.model, s.tok, desc=desc or s.probe,
              files={str(s.results.path): s.results})
    return session_rows(s, conditions)


def parity_check(s: Session, condition: Condition, n: int) -> float:
    """Chunked replay vs token-by-token decoding on ``n`` instances under ``condition``: same keep-sets, same
    answer log-probs. Returns the largest |ΔLP|; raises when they disagree."""
    if n <= 0:
        return float("nan")
    worst = 0.0
    t0 = time.perf_counter()
    for i in range(n):
        inst = s.builder.build(i)
        ids = torch.tensor([inst.ids], device=s.model.device)
        fact = inst.facts[0]
        base = randattn.Replay(s.model, ids, s.make_cache(10**6 + i), prompt_len=inst.prompt_len,
                               score_from=fact.answer_start).run(until=fact.box_start)
        fast, slow = base.fork(), base.fork()
        slow.max_chunk = 1
        for branch in (fast, slow):
            condition.apply(branch.cache, inst.facts, s.n_heads, s.n_layers)
            branch.run()
        same_sets = all(torch.equal(fast.cache.positions(l), slow.cache.positions(l)) for l in range(s.n_layers))
        lp_fast, _ = fact_metrics(fast.result(), ids.cpu(), fact)
        lp_slow, _ = fact_metrics(slow.result(), ids.cpu(), fact)
        worst = max(worst, float(np.abs(lp_fast - lp_slow).max()))
        if not same_sets or worst > 1e-3:
            raise RuntimeError(f"replay parity failed on instance {i}: keep-sets equal={same_sets}, |dLP|={worst:.2e}")
    print(f"replay parity: {n} instance(s) under {condition.name!r}, chunked replay vs token-by-token decoding from "
          f"the fact on: identical keep-sets, max |dLP| = {worst:.1e} ({time.perf_counter() - t0:.0f}s)")
    return worst


# -- statistics ----------------------------------------------------------------------------------
def print_table(summaries: dict[str, ConditionSummary], labels: Optional[dict] = None) -> None:
    labels = labels or {}
    width = max([len(labels.get(n, n)) for n in summaries] + [9])
    full = any(s.recall_full is not None for s in summaries.values())
    print(f"{'condition':<{width}}  {'n':>4}  {'retrieval [95% CI]':<22}  {'recall R [95% CI]':<24}  "
          + (f"{'R vs full cache':<24}  " if full else "") + f"{'mean LP':>8}")
    for name, s in summaries.items():
        rec = f"{s.recall:.3f}" if s.recall is not None else "-"
        rec_full = (f"{s.recall_full:.3f}" if s.recall_full is not None else "-") if full else None
        print(f"{labels.get(name, name):<{width}}  {s.n:>4}  {s.retrieval:.3f}  {rec:<24}  "
              + (f"{rec_full:<24}  " if full else "") + f"{s.mean_lp:8.2f}")
    if full:
        print("recall R divides by the fact kept in every head (the paper's code, analyze_probe.py); 'R vs full "
              "cache' by no eviction at all")


def summary_path(s: Session) -> Path:
    """The summary table beside the rows: ``<rows>.summary.csv``, or ``<rows>.n<N>.summary.csv`` when this run covered
    only the first N of the file's instances (so a shorter rerun never overwrites the full summary)."""
    in_file = len({r["instance"] for r in s.results.rows})
    covered = None if s.config.instances >= in_file else s.config.instances
    return s.results.path.with_name(summary_beside(s.results.path.name, covered))


def finish(s: Session, table: Sequence[dict], figure: Optional[str] = None) -> Path:
    """Write the summary table, print where the rows and the summary are, and draw ``figure`` from the rows."""
    from .cli import draw

    path = write_csv(summary_path(s), table)
    print(f"\nrows: {s.results.path}\nsummary: {path}")
    if figure and not s.config.no_figure:
        draw(figure, s.results.path, s.config.figure_dir)
    return path


def write_csv(path: "str | Path", table: Sequence[dict]) -> Path:
    """A tidy CSV of summary rows (columns: the union of the rows' keys, in first-seen order), written through a
    temporary file renamed into place, and only over a summary randattn wrote (``analysis.files``)."""
    import csv
    import io

    from analysis.files import write_text

    keys = list(dict.fromkeys(k for r in table for k in r))
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, keys)
    w.writeheader()
    w.writerows(table)
    return write_text(path, buf.getvalue())


#: The runner of every planted-fact probe's units (head pooling, scatter, blocks, two facts, passcode, ...): their
#: plans and merges are their own, the units they plan all run here.
KIND = Kind("planted", PlantedConfig, None, run_unit, None)
