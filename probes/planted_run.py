"""Running planted-fact probes: flags, the resumable loop over instances, instrument checks, summaries.

Every planted-fact probe (head pooling, scatter, blocks, two facts) is a list of
:class:`~probes.planted.Condition` handed to :func:`run_conditions`; this module does the rest the
same way for all of them.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

import randattn
from randattn.keepstats import random_round_survival
from randattn.stats import Estimate, mean_ci, recall_ci
from randattn.traces import load_traces

from .common import base_parser, check_policies, policy_slug, positive_int
from .planted import Condition, InstanceBuilder, audit_keep_log, fact_metrics, model_shape, run_batch
from .results import REPO_ROOT, ResultsFile, git_revision

DEFAULT_TRACES = REPO_ROOT / "data" / "traces" / "smollm2-135m.jsonl"
PAPER = {"budget": 1024, "buffer": 64, "distance": 1536}


def planted_parser(description: str, *, instances: int = 48) -> argparse.ArgumentParser:
    p = base_parser(description)
    g = p.add_argument_group("planted-fact instrument")
    g.add_argument("--traces", default=None,
                   help=f"JSONL with a 'text' field per row: the filler (default: {DEFAULT_TRACES.relative_to(REPO_ROOT)}, "
                        "the embedded model's own solutions; use traces of the model you probe)")
    g.add_argument("--budget", type=positive_int, default=256,
                   help="T: pairs each KV head holds right after a round, the newest r among them (the paper's engine)")
    g.add_argument("--buffer", type=positive_int, default=16, help="r: new pairs between rounds")
    g.add_argument("--distance", type=positive_int, default=384,
                   help="tokens from the first fact-box token to the first answer token")
    g.add_argument("--paper", action="store_true",
                   help="the paper's geometry: K=1024, r=64, distance 1536 (overrides the three flags above)")
    g.add_argument("--box-width", type=positive_int, default=12, help="tokens per fact box (<= r)")
    g.add_argument("--instances", type=positive_int, default=instances, help="instances (paired across conditions)")
    g.add_argument("--batch", type=positive_int, default=8, help="instances replayed together")
    g.add_argument("--policy", default="random", help="how the background (everything but the box) is evicted")
    g.add_argument("--protect-prompt", action="store_true",
                   help="protect the stub prompt (the paper's probe leaves it unprotected)")
    g.add_argument("--parity", type=int, default=1,
                   help="instances checked against token-by-token decoding before the run (0: skip)")
    g.add_argument("--restart", action="store_true", help="discard earlier results of this configuration")
    g.add_argument("--no-figure", action="store_true", help="do not draw the figure")
    g.add_argument("--figure-dir", default=None, help="where the figure goes (default: figures/)")
    return p


@dataclass
class Session:
    """Everything a planted-fact run needs, built once from the command line."""

    probe: str
    args: argparse.Namespace
    model: object
    tok: object
    builder: InstanceBuilder
    results: ResultsFile
    n_heads: int
    n_layers: int
    policy_options: dict = field(default_factory=dict)
    no_eviction: bool = False  # full attention through the same code path (a budget no round reaches)

    def make_cache(self, batch_index: int, keep_log: bool = False) -> randattn.EvictingCache:
        a = self.args
        if self.no_eviction:
            return randattn.EvictingCache("random", budget=self.builder.length + 1, buffer=1, protect_prompt=False,
                                          keep_log=keep_log)
        # Every batch draws its own evictions; rows of one batch differ through their row index.
        return randattn.EvictingCache(a.policy, budget=a.budget, buffer=a.buffer, protect_prompt=a.protect_prompt,
                                      seed=a.seed * 1_000_003 + batch_index, keep_log=keep_log, **self.policy_options)


def setup(probe: str, args: argparse.Namespace, parser: argparse.ArgumentParser, *, n_facts: int = 1,
          extra_config: Optional[dict] = None, policy_options: Optional[dict] = None, loaded=None,
          out: Optional[Path] = None, builder_texts: Optional[dict] = None) -> Session:
    """Validate flags, load model (unless ``loaded=(model, tokenizer)``) and traces, open (or resume) the
    results file (``out``, else ``--out``, else ``data/results/<probe>/<config>.jsonl``)."""
    if args.paper:
        for k, v in PAPER.items():
            setattr(args, k, v)
    check_policies(parser, "--policy", [args.policy])
    policy_options = dict(policy_options or {})
    if args.policy == "triattention" and args.model is None:
        policy_options.setdefault("stats", randattn.DEFAULT_MODEL)
    traces = Path(args.traces) if args.traces else DEFAULT_TRACES
    try:
        texts = load_traces(traces)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    model, tok = loaded or randattn.load_model(args.model, device=args.device)
    try:
        builder = InstanceBuilder(tok, texts, budget=args.budget, buffer=args.buffer, distance=args.distance,
                                  box_width=args.box_width, n_facts=n_facts, seed=args.seed, **(builder_texts or {}))
        randattn.EvictingCache(args.policy, budget=args.budget, buffer=args.buffer, **policy_options)
    except ValueError as exc:
        parser.error(str(exc))
    if args.protect_prompt and len(builder.stub) + 1 > args.budget:
        parser.error(f"--budget {args.budget} cannot hold the {len(builder.stub)}-token protected stub prompt")
    per_instance = builder.length - len(builder.stub)
    if builder.stream.size < per_instance:
        parser.error(f"--traces {traces} holds {builder.stream.size} tokens; one instance needs {per_instance}")
    n_heads, n_layers = model_shape(model)
    try:
        trace_label = str(traces.resolve().relative_to(REPO_ROOT))
    except ValueError:
        trace_label = str(traces)
    config = {
        "probe": probe, "model": args.model or randattn.DEFAULT_MODEL, "traces": trace_label,
        "budget": args.budget, "buffer": args.buffer, "distance": args.distance, "box_width": args.box_width,
        "policy": args.policy, "policy_options": {k: v for k, v in policy_options.items() if k != "stats"},
        "protect_prompt": args.protect_prompt, "seed": args.seed, "batch": args.batch, "n_facts": n_facts,
        "kv_heads": n_heads, "layers": n_layers, **(extra_config or {}), "engine": randattn.ENGINE,
        "revision": git_revision(),
    }
    out = out or (Path(args.out) if args.out else Path("data/results") / probe / f"{_slug(config)}.jsonl")
    try:
        results = ResultsFile(out, config, ("instance", "condition", "fact"), restart=args.restart)
    except ValueError as exc:
        parser.error(str(exc))
    return Session(probe, args, model, tok, builder, results, n_heads, n_layers, policy_options)


def _slug(config: dict) -> str:
    model = Path(str(config["model"])).name.replace("/", "_")
    extra = "".join(f"-{k}{v}" for k, v in config["policy_options"].items())
    return (f"{model}-{policy_slug(config['policy'])}{extra}-K{config['budget']}-r{config['buffer']}-d{config['distance']}"
            f"-s{config['seed']}" + ("-pp" if config["protect_prompt"] else ""))


def describe(s: Session) -> str:
    a, b = s.args, s.builder
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
    a = s.args
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


def write_csv(path: "str | Path", table: Sequence[dict]) -> Path:
    """A tidy CSV of summary rows (columns: the union of the rows' keys, in first-seen order)."""
    import csv

    path = Path(path)
    keys = list(dict.fromkeys(k for r in table for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(table)
    return path
