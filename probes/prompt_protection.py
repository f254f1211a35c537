"""Prompt protection: each policy score-only vs score + protected prompt, on a task that needs the question.

    python -m probes.prompt_protection                       # embedded SmolLM2-135M, K=256, r=16, every policy
    python -m probes.prompt_protection --policies random snapkv --instances 32

The prompt is a word problem (from the traces file's ``question`` field, chat template applied).
The model's own solution follows, then more of its reasoning text, ``--body`` tokens in all (about
``body / r`` eviction rounds), then ``Let me restate the question:`` and the question again,
teacher-forced. Restating the question needs the prompt: its numbers and names are only partly
repeated in the reasoning. Metrics per instance: mean log-prob of the restated question's tokens
and the fraction of its digit tokens the model predicts exactly (greedy). Every policy runs twice on
the same instances, score-only (the prompt competes like any other token) and with the prompt
pinned, paired by instance; full attention is the ceiling. This stands in for the paper's Table 2
(MATH500 accuracy, Qwen3-4B: Random .459 -> .874, SnapKV .703 -> .829, R-KV .810 -> .812, VaSE
.809 -> .812) until the accuracy harness exists.
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import randattn
from analysis.names import result_name
from analysis.prompt_protection import summarize

from . import cli
from .config import POSITIVE, ConfigError, EvictionConfig, eviction, option
from .planted_run import write_csv
from .results import DEFAULT_TRACES, ResultsFile, out_folder, run_record, trace_label
from .units import Kind, ModelInfo, Output, Plan, Unit, command, make_unit
from randattn.seeding import batch_seed

RESTATE = "\n\nLet me restate the question: "


def load_rows(path: Path) -> list[dict]:
    if not path.exists():
        raise FileNotFoundError(f"--traces {path}: no such file; make one with `python -m probes.traces --out {path}`")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    bad = [i for i, r in enumerate(rows) if not isinstance(r.get("question"), str) or not isinstance(r.get("text"), str)]
    if bad or not rows:
        raise ValueError(f"--traces {path}: this probe needs 'question' and 'text' fields in every row (row {bad[:1]})")
    return rows


class Tasks:
    """Instances of one layout: same prompt length, same body length, same restatement length."""

    def __init__(self, tok, rows: list[dict], *, body: int, seed: int):
        self.tok = tok
        enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
        self.prompts = [list(tok.apply_chat_template([{"role": "user", "content": r["question"]}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=True)
                             ["input_ids"]) for r in rows]
        self.restate = [enc(RESTATE) + enc(r["question"]) for r in rows]
        self.texts = [enc(r["text"].strip() + "\n\n") for r in rows]
        # Instances batch only with their own layout (prompt and restatement lengths). The most common layout comes
        # first, shuffled as it always was, so instance k of it is the same problem for any count asked; the other
        # layouts follow, most common first, each shuffled with its own seed (they widen the task past one layout).
        shapes = [(len(p), len(q)) for p, q in zip(self.prompts, self.restate)]
        counts = Counter(shapes)
        self.pool = []
        for n, shape in enumerate(sorted(counts, key=lambda s: (-counts[s], s))):
            members = [i for i in range(len(rows)) if shapes[i] == shape]
            random.Random(seed if n == 0 else f"{seed}:{shape}").shuffle(members)
            self.pool += members
        self.prompt_len, self.body = self.prompt_len_of(0), body  # the most common layout's
        self.prefix_len = len(enc(RESTATE))
        self.stream = [t for text in self.texts for t in text]
        self.digit = {i for i in range(len(tok)) if tok.decode([i]).strip().isdigit()}

    def __len__(self) -> int:
        return len(self.pool)

    def prompt_len_of(self, k: int) -> int:
        return len(self.prompts[self.pool[k]])

    def layout(self, k: int) -> tuple[int, int]:
        return self.prompt_len_of(k), len(self.restate[self.pool[k]])

    def batches(self, n: int, size: int) -> list[list[int]]:
        """Instances ``0..n-1`` in batches of at most ``size``, none mixing two layouts (a batch is one tensor)."""
        if n > len(self):
            raise ValueError(f"{n} instances asked; the traces make {len(self)}")
        out: list[list[int]] = []
        for k in range(n):
            if not out or len(out[-1]) == size or self.layout(out[-1][0]) != self.layout(k):
                out.append([])
            out[-1].append(k)
        return out

    def build(self, k: int) -> tuple[list[int], int]:
        """(ids, first scored position) of instance ``k``."""
        i = self.pool[k]
        body = self.texts[i][: self.body]
        rng = random.Random(k)
        start = rng.randrange(0, len(self.stream) - self.body)
        body = body + self.stream[start : start + self.body - len(body)]
        ids = self.prompts[i] + body + self.restate[i]
        return ids, len(self.prompts[i]) + self.body + self.prefix_len


def run_batch(model, tasks: Tasks, idx: list[int], policy: str, protect: bool, *, budget: int, buffer: int,
              seed: int, options: Optional[dict] = None) -> list[dict]:
    """Replay instances ``idx`` under one policy (``"full"``: no eviction); one row per instance with the digit
    accuracy and mean log-prob of the restated question."""
    assert len({tasks.layout(k) for k in idx}) == 1, f"instances {idx} mix layouts: use Tasks.batches"
    return replay_built(model, [tasks.build(k) for k in idx], idx, policy, protect, budget=budget, buffer=buffer,
                        seed=seed, prompt_len=tasks.prompt_len_of(idx[0]), digit=tasks.digit, options=options)


def replay_built(model, built: list, idx: list[int], policy: str, protect: bool, *, budget: int, buffer: int,
                 seed: int, prompt_len: int, digit, options: Optional[dict] = None) -> list[dict]:
    """:func:`run_batch` on instances already built (``Tasks.build``: ids and where the restatement starts)."""
    ids = torch.tensor([b[0] for b in built], device=model.device)
    score_from = built[0][1]
    spec = randattn.EvictionSpec.full() if policy == "full" else randattn.EvictionSpec(
        policy, budget, buffer, protect_prompt=protect, seed=seed, options=options or {})
    cache = spec.make_cache(max_tokens=ids.shape[1])
    res = randattn.replay(model, ids, cache, prompt_len=prompt_len, score_from=score_from)
    target = ids[:, score_from:].cpu()
    lp = res.logprobs[:, score_from:].double()
    hit = res.argmax[:, score_from:] == target
    is_digit = torch.tensor([[t in digit for t in row] for row in target.tolist()])
    rows = []
    for j, k in enumerate(idx):
        d = is_digit[j]
        rows.append({"instance": k, "policy": policy, "protect": protect, "mean_lp": float(lp[j].mean()),
                     "digit_acc": float(hit[j][d].float().mean()) if d.any() else float("nan"),
                     "tokens": int(target.shape[1]), "rounds": cache.events[0] if cache.layers else 0})
    return rows


@dataclass
@eviction(policies=randattn.COMPARED_POLICIES, budget=256, buffer=16)
class Config(EvictionConfig):
    """A question restated after a long body: how much of it each policy kept, score-only vs protected
    (``python -m probes.prompt_protection``)."""

    traces: Optional[str] = option(None, "JSONL with 'question' and 'text' fields (default: the shipped corpus)")
    body: int = option(512, "reasoning tokens between question and restatement (body / r rounds run)", check=POSITIVE)
    paper: bool = option(False, "the paper's T=1024, r=64 with a 2,048-token body (32 rounds)")
    instances: int = option(16, "problems (paired across policies and modes)", check=POSITIVE)
    batch: int = option(8, "problems replayed together", check=POSITIVE)

    def __post_init__(self) -> None:
        if self.paper:
            self.budget, self.buffer, self.body = 1024, 64, 2048
        super().__post_init__()

    def protection_of(self, policy: str) -> Optional[bool]:
        return None  # every policy runs score-only and protected


KEY = ("instance", "policy", "protect")


def _traces(config: Config) -> tuple[Path, list]:
    traces = Path(config.traces) if config.traces else DEFAULT_TRACES
    try:
        return traces, load_rows(traces)
    except (FileNotFoundError, ValueError, IsADirectoryError) as exc:
        raise ConfigError("traces", str(exc)) from None


def plan(config: Config, model: ModelInfo) -> Plan:
    """Every policy score-only and protected (plus full attention) on the same instances: one unit per arm and batch,
    the instances built here."""
    traces, rows = _traces(config)
    folder = out_folder("prompt_protection", config.out)
    for pol in config.policies:  # every policy binds before the first runs (a policy refusing the model stops here)
        config.bind(config.spec(pol), model.bind_target)
    tasks = Tasks(model.tokenizer, rows, body=config.body, seed=config.seed)
    if len(tasks) < config.instances:
        raise ConfigError("instances", f"the traces make only {len(tasks)} instances; use --instances <= "
                                       f"{len(tasks)} or more traces")
    prompt_len = max(tasks.prompt_len_of(k) for k in range(config.instances))  # the longest prompt among them
    if config.body >= len(tasks.stream):
        raise ConfigError("body", f"{config.body} tokens: the traces hold only {len(tasks.stream)}; use a smaller --body "
                                  "or longer --traces")
    longest = config.body + max(sum(tasks.layout(k)) for k in range(config.instances))
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and longest > limit:
        raise ConfigError("body", f"{config.body} makes instances of {longest} tokens, past the model's "
                                  f"max_position_embeddings={limit}; use --body <= {config.body - (longest - limit)}")
    config.fits(None, prompt_len)  # the protected arms pin the prompt
    model_name = model.name
    record = {"probe": "prompt_protection", "engine": randattn.ENGINE, "model": model_name, "budget": config.budget,
              "buffer": config.buffer, "body": config.body, "seed": config.seed, "batch": config.batch,
              "prompt_len": prompt_len, "traces": trace_label(traces), **run_record(model.model)}
    output = Output(str(folder / result_name("prompt_protection", record)), record, KEY)
    describe = (f"model {model_name} | T={config.budget} per head after a round, r={config.buffer} | prompt "
                f"{tasks.prompt_len} tokens, body {config.body} (~{config.body // config.buffer} rounds), restated "
                f"question {len(tasks.restate[tasks.pool[0]]) - tasks.prefix_len} tokens")
    arms = [("full", False)] + [(pol, prot) for pol in config.policies for prot in (False, True)]
    batches = tasks.batches(config.instances, config.batch)
    todo = []
    for policy, protect in arms:
        for idx in batches:
            seed = batch_seed(config.seed, idx[0])
            work = {"built": [tasks.build(k) for k in idx], "idx": idx, "policy": policy, "protect": protect,
                    "budget": config.budget, "buffer": config.buffer, "seed": seed,
                    "prompt_len": tasks.prompt_len_of(idx[0]), "digit": tasks.digit}
            todo.append(make_unit("prompt_protection", model_name, output, {"policy": policy, "protect": protect},
                                  [{"instance": i} for i in idx], work, salt=seed,
                                  label=f"{policy} protect={protect} from {idx[0]}", stage="prompt protection"))
    return Plan("prompt_protection", config, [output], todo, meta={"describe": describe})


def run_unit(model, tok, unit: Unit):
    """Replay one batch of instances under one arm; yields its rows."""
    w = unit.work
    try:
        yield replay_built(model, w["built"], w["idx"], w["policy"], w["protect"], budget=w["budget"],
                           buffer=w["buffer"], seed=w["seed"], prompt_len=w["prompt_len"], digit=w["digit"])
    except ValueError as exc:  # e.g. a policy's own pinned window plus the protected prompt exceed T - r
        raise ConfigError("policies", f"{w['policy']} (protect_prompt={w['protect']}): {exc}") from None


def merge(p: Plan, rows: dict, figures: bool) -> list:
    """:func:`report` on the merged file: its table, summary and figure."""
    (o,) = p.outputs
    rf = ResultsFile(o.path, o.config, KEY)  # the merged file, read back
    report(p.config.replace(no_figure=not figures), rf, rf.rows)
    return [rf.path, rf.path.with_suffix(".summary.csv")]


def start(p: Plan, files: dict) -> None:
    """The command line's description of the run, before its first unit."""
    print(p.meta["describe"])


def report(config: Config, rf: ResultsFile, rows: list[dict]) -> None:
    table = summarize(rows, list(config.policies), config.instances, config.seed)
    print(f"\n{'policy':<14} {'score only':<22} {'+ prompt protection':<22} {'gain [95% CI]':<26} (digit accuracy of "
          "the restated question; mean log-prob in the CSV)")
    for r in table:
        if r["policy"] == "full":
            print(f"{'full':<14} {r['digit_acc_score_only']:.3f} (no eviction: the ceiling)")
            continue
        print(f"{r['policy']:<14} {r['digit_acc_score_only']:.3f}{'':<16} {r['digit_acc_protected']:.3f}{'':<16} "
              f"{r['gain']:+.3f} [{r['gain_lo']:+.3f}, {r['gain_hi']:+.3f}]")
    print("paper Table 2 (MATH500 accuracy, Qwen3-4B): snapkv .703->.829, rkv .810->.812, vase .809->.812, "
          "random .459->.874")
    model_name = rf.config["model"]
    summary = write_csv(rf.path.with_suffix(".summary.csv"), [{**r, "model": model_name, "budget": config.budget,
                                                              "buffer": config.buffer} for r in table])
    print(f"\nrows: {rf.path}\nsummary: {summary}")
    if not config.no_figure:
        cli.draw("prompt_protection", summary, config.figure_dir)


KIND = Kind("prompt_protection", Config, plan, run_unit, merge, check=_traces, start=start)


def main(argv=None) -> int:
    """The command line: the one every kind has (``units.command``), of this kind."""
    return command(KIND, __doc__)(argv)


if __name__ == "__main__":
    sys.exit(main())
