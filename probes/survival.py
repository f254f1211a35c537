"""Survival of generated positions and keep-log metrics per policy, from keep-logs of real text.

    python -m probes.survival                        # every policy, T=256, r=16, 24 rounds, 4 sequences
    python -m probes.survival --policies random snapkv --modes protected
    python -m probes.survival --paper                # T=1024, r=64 (the paper's geometry)

Each sequence is a chat built from the trace corpus: the question of one trace is the prompt
(protected in the ``protected`` mode), followed by the model's own solution and further
question/solution turns of other traces, cut to ``T + rounds * r`` tokens so that exactly
``rounds`` eviction rounds run per layer. Every policy replays the same sequences with a keep-log
(teacher forcing has the rounds token-by-token decoding has). From the logs: per-head and
union-over-heads survival of generated positions by age and by rounds competed in (the newest r of a
round sit it out, as in the paper's engine), Random's curves against ``q^n`` with
``q = (T-r)/T`` (``(T-r-lp)/(T-lp)`` with the prompt pinned) and ``1-(1-q^n)^H``, and the
keep-log metrics of :mod:`randattn.keepstats`. ``--seed`` fixes both the eviction draws and which
traces form the chats.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

import randattn
from randattn import keepstats
from analysis.names import result_name
from analysis.survival import Pooled, mean_deficit, pool
from randattn.rules import longest_prompt
from randattn.traces import load_traces

from . import cli
from .config import DEFAULT, POSITIVE, ConfigError, EvictionConfig, eviction, option, setting
from .policy_specs import native_protection
from .results import DEFAULT_TRACES, ResultsFile, out_folder, run_record, trace_label
from .units import Kind, ModelInfo, Output, Plan, Unit, command, make_unit
from randattn.seeding import batch_seed

PAPER = {"budget": 1024, "buffer": 64}
MODES = {"protected": True, "score-only": False}  # mode -> protect_prompt
# The paper's keep-log numbers (SPEC §4), shown beside ours; "" where the paper gives none.
PAPER_NUMBERS = {
    "random": {"slot_coverage": ".999-1.000", "prompt_union": ".994-.999", "prompt_head": ".994-.999"},
    "snapkv": {"prompt_union": "lowest", "prompt_head": "lowest"},
}
ROUND_TABLE_N = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 48, 64)


@dataclass
@eviction(policies=setting(None, help="policies to run (default: every registered one)"), budget=256, buffer=16,
          stats=DEFAULT)
class Config(EvictionConfig):
    """Survival curves and keep-log metrics per policy (``python -m probes.survival``)."""

    modes: tuple[str, ...] = option(tuple(MODES), "'protected': prompt pinned (the paper's '+ prompt protection'); "
                                                  "'score-only': the policy alone decides about the prompt too",
                                    choices=tuple(MODES))
    paper: bool = option(False, "the paper's geometry T=1024, r=64 (overrides --budget/--buffer; T=256, r=16 keeps "
                                "its per-round survival (T-r)/T = 0.9375)")
    rounds: int = option(24, "eviction rounds per layer; each sequence is cut to T + rounds*r tokens", check=POSITIVE)
    sequences: int = option(4, "sequences (chats of real traces) per policy", check=POSITIVE)
    batch: int = option(4, "sequences replayed together (same prompt length)", check=POSITIVE)
    traces: Optional[str] = option(None, "JSONL with 'question' and 'text' fields per row (default: the embedded "
                                         "model's own solutions, shipped with the package)")
    age_bin: Optional[int] = option(None, "age bin width in tokens (default: r, one round)", check=POSITIVE)
    entropy_bins: int = option(10, "age bins of the coverage entropy", check=POSITIVE)

    def __post_init__(self) -> None:
        if self.paper:
            self.budget, self.buffer = PAPER["budget"], PAPER["buffer"]
        self.age_bin = self.buffer if self.age_bin is None else self.age_bin
        if self.policies is None:
            self.policies = tuple(randattn.known_policies())
        self.modes = tuple(dict.fromkeys(self.modes))
        super().__post_init__()

    def protection_of(self, policy: str) -> Optional[bool]:
        return None  # each mode is its own arm (--modes)

    def check(self) -> None:
        self.check_eviction()
        if self.stats is not None:
            try:
                randattn.load_stats(self.stats)
            except (FileNotFoundError, ValueError, TypeError) as exc:
                raise ConfigError("stats", str(exc)) from None


# -- sequences -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chat:
    """One sequence: token ids, its prompt length (the first question, templated) and the traces used."""

    index: int
    ids: tuple
    prompt_len: int
    traces: tuple


def read_rows(path: Path) -> list[dict]:
    """Rows with string ``question`` and ``text`` (``load_traces`` checks the text field first)."""
    load_traces(path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    bad = [n for n, r in enumerate(rows, 1) if not isinstance(r.get("question"), str)]
    if bad:
        raise ValueError(f"--traces {path}: line {bad[0]} has no string 'question' field (the probe builds chats from "
                         f"question/solution pairs)")
    return rows


def _render(tok, turns: Sequence[tuple[str, str]], question: Optional[str] = None) -> str:
    """The chat text of (question, solution) turns, optionally followed by a question awaiting its answer."""
    msgs = [m for q, t in turns for m in ({"role": "user", "content": q}, {"role": "assistant", "content": t})]
    if question is not None:
        msgs.append({"role": "user", "content": question})
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=question is not None)
    return "".join(f"{'Question' if m['role'] == 'user' else 'Answer'}: {m['content']}\n\n" for m in msgs)


def build_chats(tok, rows: list[dict], n: int, length: int, seed: int, max_prompt: int) -> list[Chat]:
    """``n`` chats of exactly ``length`` tokens. First questions come from the largest group of equal
    prompt length (so sequences batch together), shorter than ``max_prompt``; the rest of each chat is
    drawn from the other traces, none used twice, in an order fixed by ``seed``."""
    order = [int(i) for i in np.random.default_rng(seed).permutation(len(rows))]
    prompts = {i: tok(_render(tok, [], rows[i]["question"]), add_special_tokens=False)["input_ids"] for i in order}
    groups: dict[int, list[int]] = {}
    for i in order:
        if len(prompts[i]) < max_prompt:
            groups.setdefault(len(prompts[i]), []).append(i)
    if not groups:
        raise ConfigError("budget", f"no trace question fits a protected prompt in K (every prompt has >= {max_prompt} tokens); "
                         f"raise --budget")
    # Upper bound on what the traces can give (each chat re-renders its turns, so find out before building any).
    available = sum(map(len, prompts.values())) + sum(
        map(len, tok([r["text"] for r in rows], add_special_tokens=False)["input_ids"]))
    if n * length > available:
        raise ConfigError("rounds", f"the traces run out: {n} sequences of {length} tokens need {n * length} tokens, the traces "
                         f"hold about {available}; use fewer --sequences or --rounds, or longer --traces")
    firsts = [i for _, g in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])) for i in g][:n]
    taken = set(firsts)
    pool = [i for i in order if i not in taken]
    chats = []
    for s, first in enumerate(firsts):
        q = rows[first]["question"]
        prompt_text = _render(tok, [], q)
        turns, used = [(q, rows[first]["text"])], [first]
        while True:
            full = _render(tok, turns)
            rest = tok(full[len(prompt_text):], add_special_tokens=False)["input_ids"]
            ids = prompts[first] + rest
            if len(ids) >= length:
                break
            if not pool:
                raise ConfigError("rounds", f"the traces run out: {n} sequences of {length} tokens need more text; use fewer "
                                 f"--sequences or --rounds")
            nxt = pool.pop(0)
            turns.append((rows[nxt]["question"], rows[nxt]["text"]))
            used.append(nxt)
        if not full.startswith(prompt_text):
            raise RuntimeError("the chat template does not render the first question as a prefix of the chat")
        chats.append(Chat(s, tuple(ids[:length]), len(prompts[first]), tuple(used)))
    return chats


def batches(chats: Sequence[Chat], size: int) -> list[list[Chat]]:
    """Chats grouped by prompt length (a replay has one prompt length), ``size`` at a time."""
    by_len: dict[int, list[Chat]] = {}
    for c in chats:
        by_len.setdefault(c.prompt_len, []).append(c)
    out = [g[i : i + size] for g in by_len.values() for i in range(0, len(g), size)]
    return sorted(out, key=lambda b: b[0].index)


# -- one run -------------------------------------------------------------------------------------
def run_batch(model, chats: list[Chat], policy: str, mode: str, args, options: dict, seed: int) -> list[dict]:
    """Replay one batch under one policy and mode with a keep-log; one result row per sequence."""
    protected = MODES[mode]
    prompt_len = chats[0].prompt_len
    cache = args.spec(policy, protect_prompt=protected, seed=seed, options=options).make_cache(keep_log=True)
    ids = torch.tensor([c.ids for c in chats], device=model.device)
    t0 = time.perf_counter()
    randattn.replay(model, ids, cache, prompt_len=prompt_len, score_from=ids.shape[1])
    seconds = time.perf_counter() - t0
    events = cache.events
    q = keepstats.random_round_survival(args.budget, args.buffer, prompt_len, protected)
    rows = []
    for b, chat in enumerate(chats):
        log = keepstats.select_rows(cache.keep_log, b)
        rows.append({
            "policy": policy, "mode": mode, "sequence": chat.index, "prompt_len": prompt_len, "length": len(chat.ids),
            "traces": list(chat.traces), "rounds": events[0], "rounds_min": min(events), "rounds_max": max(events),
            "q": q, "seconds": seconds / len(chats),
            **keepstats.keep_metrics(log, prompt_len, n_bins=args.entropy_bins),
            "by_rounds": keepstats.survival_curve(log, prompt_len, by="rounds").to_dict(),
            # By age without the initial fill, so that age in tokens means rounds survived (see keepstats).
            "by_age": keepstats.survival_curve(log, prompt_len, by="age", width=args.age_bin,
                                               skip_initial=True).to_dict(),
        })
    return rows


# -- pooling and tables --------------------------------------------------------------------------
def _fmt(v: float, width: int = 7) -> str:
    return f"{'-':>{width}}" if v != v else f"{v:{width}.3f}"


def metrics_table(pooled: dict[tuple[str, str], Pooled], n_mid: int) -> list[str]:
    """Keep-log metrics per policy and mode, with the paper's numbers beside them."""
    head = (f"{'policy':<14} {'mode':<10} {'seqs':>4} {'rounds':>6}  {'slot cov':>8} {'prompt U':>8} {'prompt/h':>8} "
            f"{'Jaccard':>7} {'entropy':>7} {f's_h(n={n_mid})':>9} {f's_U(n={n_mid})':>9} {'deficit':>7}  paper")
    lines = [head, "-" * len(head)]
    for (policy, mode), p in pooled.items():
        m = p.metrics
        i = n_mid - 1
        sh = p.by_rounds.head[i] if i < len(p.by_rounds.total) else float("nan")
        su = p.by_rounds.union[i] if i < len(p.by_rounds.total) else float("nan")
        paper = PAPER_NUMBERS.get(policy, {})
        paper_text = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in paper.items())
        rounds = "/".join(str(r) for r in p.rounds)
        lines.append(f"{policy:<14} {mode:<10} {p.n:>4} {rounds:>6}  {_fmt(m['slot_coverage'], 8)} "
                     f"{_fmt(m['prompt_union'], 8)} {_fmt(m['prompt_head'], 8)} {_fmt(m['jaccard'])} "
                     f"{_fmt(m['entropy'])} {_fmt(sh, 9)} {_fmt(su, 9)} {mean_deficit(p.by_rounds):7.3f}  {paper_text}")
    return lines


def random_table(p: Pooled, n_heads: int) -> list[str]:
    """Random's measured per-head and union survival by rounds survived against the analytic curves."""
    c = p.by_rounds
    a_head, a_union = p.analytic_rounds
    se = c.head_se()
    lines = [f"Random ({p.mode}): survival of generated positions after n rounds, measured vs analytic "
             f"(H_kv={n_heads}; deficit = independent-heads union from the measured per-head survival minus "
             f"the measured union)",
             f"{'n':>3} {'obs':>7}  {'per head':>8} {'±SE':>6} {'analytic':>8} {'diff/SE':>7}  {'union':>6} "
             f"{'1-(1-s)^H':>9} {'indep.':>6} {'deficit':>7}"]
    for n in sorted({*ROUND_TABLE_N, len(c.total)}):
        i = n - 1
        if i >= len(c.total) or c.total[i] == 0:
            continue
        z = (c.head[i] - a_head[i]) / se[i] if se[i] > 0 else float("nan")
        lines.append(f"{n:>3} {c.total[i] * n_heads:>7}  {c.head[i]:8.4f} {se[i]:6.4f} {a_head[i]:8.4f} {z:7.2f}  "
                     f"{c.union[i]:6.4f} {a_union[i]:9.4f} {c.independent_union[i]:6.4f} {c.deficit[i]:7.4f}")
    return lines


# -- main ----------------------------------------------------------------------------------------
def modes_of(policy: str, modes: Sequence[str]) -> list[str]:
    """The asked-for modes a policy can run in: a paper mode name, or a policy defined with a protection mode
    (``random-pcap`` protects part of the prompt itself), runs in that mode only."""
    native = native_protection(policy)
    return [m for m in modes if native is None or MODES[m] == native]


def _slug(config: dict) -> str:
    """The rows file's name without ``.jsonl`` (analysis.names defines it)."""
    return result_name("survival", config)[: -len(".jsonl")]


KEY = ("policy", "mode", "sequence")


def _traces(config: Config) -> tuple[Path, list]:
    traces = Path(config.traces) if config.traces else DEFAULT_TRACES
    try:
        return traces, read_rows(traces)
    except (FileNotFoundError, ValueError, IsADirectoryError) as exc:
        raise ConfigError("traces", str(exc)) from None


def plan(config: Config, model: ModelInfo) -> Plan:
    """Every policy and mode over the chats: one unit per (policy, mode, batch of chats of one prompt length)."""
    traces, rows = _traces(config)
    folder = out_folder("survival", config.out)
    for pol in config.policies:  # every policy binds before the first runs (a policy refusing the model stops here)
        config.bind(config.spec(pol), model.bind_target)
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    length = config.budget + config.rounds * config.buffer
    # A protected prompt needs a free slot beside the recent window of r; score-only prompts just have to leave
    # room for generated text.
    max_prompt = (longest_prompt(config.budget, config.buffer) + 1 if "protected" in config.modes
                  else config.budget + config.buffer)
    chats = build_chats(model.tokenizer, rows, config.sequences, length, config.seed, max_prompt)
    record = {"probe": "survival", "engine": randattn.ENGINE, "model": model.name,
              "traces": trace_label(traces), "budget": config.budget, "buffer": config.buffer, "rounds": config.rounds,
              "length": length, "sequences": config.sequences, "batch": config.batch, "seed": config.seed,
              "age_bin": config.age_bin, "entropy_bins": config.entropy_bins, "kv_heads": n_heads, "layers": n_layers,
              **run_record(model.model)}
    output = Output(str(folder / result_name("survival", record)), record, KEY)
    groups = batches(chats, config.batch)
    lps = sorted({c.prompt_len for c in chats})
    qs = {m: [round(keepstats.random_round_survival(config.budget, config.buffer, lp, MODES[m]), 4) for lp in lps]
          for m in config.modes}
    describe = (f"model {record['model']} ({n_layers} layers, {n_heads} KV heads) | T={config.budget} "
                f"r={config.buffer} | {len(chats)} chats of {length} tokens (prompt {'/'.join(map(str, lps))} tokens), "
                f"{config.rounds} rounds per layer | Random per-round survival: "
                + "; ".join(f"{m} {'/'.join(map(str, v))}" for m, v in qs.items()))
    todo = []
    for pol in config.policies:
        for mode in modes_of(pol, config.modes):
            for bi, batch in enumerate(groups):
                work = {"chats": batch, "policy": pol, "mode": mode, "config": config,
                        "seed": batch_seed(config.seed, bi)}
                todo.append(make_unit("survival", model.name, output, {"policy": pol, "mode": mode},
                                      [{"sequence": c.index} for c in batch], work, salt=work["seed"],
                                      label=f"{pol}/{mode} batch {bi}"))
    return Plan("survival", config, [output], todo, meta={"describe": describe, "n_heads": n_heads})


def run_unit(model, tok, unit: Unit):
    """Replay one batch of chats under one policy and mode with a keep-log; yields its rows."""
    w = unit.work
    new = run_batch(model, w["chats"], w["policy"], w["mode"], w["config"], {}, seed=w["seed"])
    rounds = w["config"].rounds
    if new[0]["rounds_min"] != rounds or new[0]["rounds_max"] != rounds:
        tqdm.write(f"note: {w['policy']}/{w['mode']} ran {new[0]['rounds_min']}-{new[0]['rounds_max']} rounds per "
                   f"layer, not {rounds} (a prompt longer than T + r is cut at its prefill)")
    yield new


def _wanted(config: Config, rows: list[dict]) -> list[dict]:
    wanted = {(pol, mode) for pol in config.policies for mode in modes_of(pol, config.modes)}
    return [r for r in rows if (r["policy"], r["mode"]) in wanted]


def merge(p: Plan, rows: dict, figures: bool) -> list:
    """:func:`report` on the merged file."""
    (o,) = p.outputs
    rf = ResultsFile(o.path, o.config, KEY)  # the merged file, read back
    report(p.config.replace(no_figure=not figures), rf, _wanted(p.config, rf.rows), p.meta["n_heads"])
    return [rf.path]


def start(p: Plan, files: dict) -> None:
    """The command line's description of the run, before its first unit."""
    print(p.meta["describe"])


def report(config: Config, results: ResultsFile, rows: list[dict], n_heads: int) -> None:
    pooled = pool(rows)
    n_mid = max(1, config.rounds // 2)
    print(f"\nkeep-log metrics ({config.sequences} sequences). slot cov = share of generated positions some head "
          "selected at some round; prompt U / prompt/h = prompt kept at the last round by >= 1 head / per head; "
          "Jaccard = overlap of heads' selected keep-sets; entropy = spread of selected slots over "
          f"{config.entropy_bins} age bins (1 = even); s_h, s_U = per-head / union survival after n rounds competed in; "
          "deficit = independent-heads union minus measured union (mean over n)")
    for line in metrics_table(pooled, n_mid):
        print(line)
    for mode in config.modes:
        if ("random", mode) in pooled:
            print()
            for line in random_table(pooled[("random", mode)], n_heads):
                print(line)
    print(f"\nrows: {results.path}")
    if not config.no_figure:
        cli.draw("survival", results.path, config.figure_dir)


KIND = Kind("survival", Config, plan, run_unit, merge, check=_traces, start=start)


def main(argv=None) -> int:
    """The command line: the one every kind has (``units.command``), of this kind."""
    return command(KIND, __doc__)(argv)


if __name__ == "__main__":
    sys.exit(main())
