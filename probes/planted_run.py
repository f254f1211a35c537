"""Running planted-fact probes: the configuration, the resumable loop over instances, instrument checks, tables.

Every planted-fact probe (head pooling, scatter, blocks, two facts) is a list of
:class:`~probes.planted.Condition` handed to :func:`run_conditions`; this module does the rest the
same way for all of them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

import randattn
from analysis.names import result_name, summary_beside
from analysis.planted import ConditionSummary
from randattn.keepstats import random_round_survival
from randattn.traces import load_traces

from .config import NONNEGATIVE, POSITIVE, ConfigError, RunConfig, check_budget, option
from .policy_specs import calibration_options, check_policy, check_stats_used
from .planted import Condition, InstanceBuilder, audit_keep_log, fact_metrics, model_shape, run_batch
from .results import DEFAULT_TRACES, ResultsFile, out_folder, run_record, trace_label

PAPER = {"budget": 1024, "buffer": 64, "distance": 1536}


@dataclass
class PlantedConfig(RunConfig):
    """The planted-fact instrument's settings, shared by head pooling, scatter, two facts, blocks, passcode and the
    shared-draw probe."""

    traces: Optional[str] = option(None, "JSONL with a 'text' field per row: the filler (default: the embedded "
                                         "model's own solutions, shipped with the package; use traces of the model "
                                         "you probe)")
    budget: int = option(256, "T: pairs each KV head holds right after a round, the newest r among them",
                         check=POSITIVE)
    buffer: int = option(16, "r: new pairs between rounds (the recent window)", check=POSITIVE)
    distance: int = option(384, "tokens from the first fact-box token to the first answer token", check=POSITIVE)
    paper: bool = option(False, "the paper's geometry: T=1024, r=64, distance 1536 (overrides the three above)")
    box_width: int = option(12, "tokens per fact box (<= r)", check=POSITIVE)
    instances: int = option(48, "instances (paired across conditions)", check=POSITIVE)
    batch: int = option(8, "instances replayed together", check=POSITIVE)
    policy: str = option("random", "how the background (everything but the box) is evicted")
    stats: Optional[str] = option(None, "calibration statistics for a policy that needs them (TriAttention: `python "
                                        "-m randattn.calibrate`); the embedded model's ship with the package")
    protect_prompt: bool = option(False, "protect the stub prompt (the paper's probe leaves it unprotected)")
    parity: int = option(1, "instances checked against token-by-token decoding before the run (0: skip)",
                         check=NONNEGATIVE)

    def __post_init__(self) -> None:
        if self.paper:
            for k, v in PAPER.items():
                setattr(self, k, v)
        super().__post_init__()

    def check(self) -> None:
        check_budget(self.budget, self.buffer)
        check_policy("policy", self.policy)
        for spec in getattr(self, "policies", ()):
            check_policy("policies", spec)
        check_stats_used(self.stats, getattr(self, "policies", None) or (self.policy,))


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
    policy_options: dict = field(default_factory=dict)
    no_eviction: bool = False  # full attention through the same code path (a budget no round reaches)

    @property
    def args(self) -> PlantedConfig:  # the instrument's code reads the configuration as ``s.args``
        return self.config

    def make_cache(self, batch_index: int, keep_log: bool = False) -> randattn.EvictingCache:
        a = self.config
        if self.no_eviction:
            return randattn.EvictingCache("random", budget=self.builder.length + 1, buffer=1, protect_prompt=False,
                                          keep_log=keep_log)
        # Every batch draws its own evictions; rows of one batch differ through their row index.
        return randattn.EvictingCache(a.policy, budget=a.budget, buffer=a.buffer, protect_prompt=a.protect_prompt,
                                      seed=a.seed * 1_000_003 + batch_index, keep_log=keep_log, **self.policy_options)


def load(config: RunConfig, loaded=None):
    """``(model, tokenizer)``: ``loaded`` when given, else the config's model on its device."""
    if loaded is not None:
        return loaded
    try:
        return randattn.load_model(config.model, device=config.device)
    except (FileNotFoundError, OSError, ValueError, RuntimeError) as exc:
        raise ConfigError("model" if "device" not in str(exc).lower() else "device", str(exc)) from None


def setup(probe: str, config: PlantedConfig, *, n_facts: int = 1, extra_config: Optional[dict] = None,
          policy_options: Optional[dict] = None, loaded=None, out: Optional[Path] = None,
          builder_texts: Optional[dict] = None, pins_boxes: bool = True) -> Session:
    """Check the configuration against the traces and the model (unless ``loaded=(model, tokenizer)``), open (or
    resume) the results file (``out``, else ``<--out or data/results/<probe>>/<config slug>.jsonl``). ``pins_boxes``: the
    run's conditions pin fact boxes, which must then fit beside the protected prompt. Problems are
    :class:`ConfigError` naming the field to change."""
    policy_options = {**calibration_options(config.policy, config.stats), **(policy_options or {})}
    calibration = randattn.make_policy(config.policy).calibration  # a file path: not part of the configuration
    traces = Path(config.traces) if config.traces else DEFAULT_TRACES
    try:
        texts = load_traces(traces)
    except (FileNotFoundError, ValueError, IsADirectoryError) as exc:
        raise ConfigError("traces", str(exc)) from None
    folder = out.parent if out is not None else out_folder(probe, config.out)
    model, tok = load(config, loaded)
    try:
        builder = InstanceBuilder(tok, texts, budget=config.budget, buffer=config.buffer, distance=config.distance,
                                  box_width=config.box_width, n_facts=n_facts, seed=config.seed, **(builder_texts or {}))
        randattn.EvictingCache(config.policy, budget=config.budget, buffer=config.buffer, **policy_options).bind(model)
    except FileNotFoundError as exc:  # a --stats file that is not there
        raise ConfigError("stats", str(exc)) from None
    except ValueError as exc:
        raise ConfigError("budget" if "budget" in str(exc) else "box_width" if "box" in str(exc) else "policy",
                          str(exc)) from None
    if config.protect_prompt and len(builder.stub) + 1 > config.budget - config.buffer:
        raise ConfigError("budget", f"T={config.budget} cannot hold the {len(builder.stub)}-token protected stub "
                                    f"prompt beside the recent window of r={config.buffer}")
    # Conditions pin fact boxes (kept in some heads) beside the protected prompt: all must fit the T - r selected
    # (``pins_boxes=False``: this run's conditions pin no box).
    pinned = len(builder.stub) * config.protect_prompt + n_facts * config.box_width
    if pins_boxes and pinned + 1 > config.budget - config.buffer:
        raise ConfigError("budget", f"T={config.budget} cannot hold {n_facts} pinned fact box(es) of {config.box_width}"
                                    + (f" beside the {len(builder.stub)}-token protected stub prompt" if
                                       config.protect_prompt else "")
                                    + f" and the recent window of r={config.buffer}; use --budget >= "
                                      f"{pinned + 1 + config.buffer}")
    per_instance = builder.length - len(builder.stub)
    if builder.stream.size < per_instance:
        raise ConfigError("traces", f"{traces} holds {builder.stream.size} tokens; one instance needs {per_instance}")
    n_heads, n_layers = model_shape(model)
    record = {
        "probe": probe, "model": config.model or randattn.DEFAULT_MODEL, "traces": trace_label(traces),
        "budget": config.budget, "buffer": config.buffer, "distance": config.distance, "box_width": config.box_width,
        "policy": config.policy, "policy_options": {k: v for k, v in policy_options.items() if k != calibration},
        "protect_prompt": config.protect_prompt, "seed": config.seed, "batch": config.batch, "n_facts": n_facts,
        "kv_heads": n_heads, "layers": n_layers, **(extra_config or {}), "engine": randattn.ENGINE,
        **run_record(model),
    }
    path = out or folder / result_name("planted", record)
    try:
        results = ResultsFile(path, record, ("instance", "condition", "fact"), restart=config.restart)
    except PermissionError as exc:
        raise ConfigError("out", str(exc)) from None
    except ValueError as exc:
        raise ConfigError("out", str(exc)) from None
    return Session(probe, config, model, tok, builder, results, n_heads, n_layers, policy_options)


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
def run_conditions(s: Session, conditions: Sequence[Condition], *, desc: Optional[str] = None) -> list[dict]:
    """Run every instance under every condition (resuming what is done); returns this run's rows."""
    a = s.config
    names = [c.name for c in conditions]
    if len(set(names)) != len(names):
        raise ValueError(f"condition names must be unique, got {names}")
    n_batches = math.ceil(a.instances / a.batch)
    todo = []
    for bi in range(n_batches):
        idx = list(range(bi * a.batch, min(a.instances, (bi + 1) * a.batch)))
        missing = [c for c in conditions if any((i, c.name, f) not in s.results.done
                                                for i in idx for f in range(s.builder.n_facts))]
        if missing:
            todo.append((bi, idx, missing))
    done_before = n_batches * len(conditions) - sum(len(m) for _, _, m in todo)
    if done_before:
        tqdm.write(f"{s.results.path}: {done_before} of {n_batches * len(conditions)} batch x condition results "
                   f"already there (an earlier run, or the results shipped with the repo); "
                   + ("computing the rest" if todo else "nothing to compute, printing them")
                   + "; --restart recomputes everything")
    bar = tqdm(total=n_batches * len(conditions), initial=done_before, desc=desc or s.probe, unit="cond")
    audited = False
    for bi, idx, missing in todo:
        instances = [s.builder.build(i) for i in idx]
        audit = not audited
        ids = torch.tensor([inst.ids for inst in instances])
        make = lambda keep_log: s.make_cache(bi, keep_log)  # noqa: E731
        for cond, result, cache, rounds in run_batch(s.model, instances, missing, make, audit=audit):
            if audit:
                checked = audit_keep_log(cache, cond, instances[0].facts, s.n_heads)
                if checked:
                    tqdm.write(f"audit {cond.name}: fact boxes held exactly where specified "
                               f"({checked} round x layer x row x head records after the box)")
            rows = []
            for f in range(s.builder.n_facts):
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
            s.results.append(rows)
            bar.update(1)
        audited = True
    bar.close()
    wanted = {(i, n) for i in range(a.instances) for n in names}
    return [r for r in s.results.rows if (r["instance"], r["condition"]) in wanted]


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
