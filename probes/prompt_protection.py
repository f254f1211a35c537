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
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tqdm.auto import tqdm

import randattn
from randattn.stats import mean_ci

from .common import base_parser, check_policies, positive_int
from .passcode import POLICIES
from .planted_run import DEFAULT_TRACES, write_csv
from .results import REPO_ROOT, ResultsFile, git_revision

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
        # One batchable layout: the most common (prompt, restatement) length pair.
        shape = Counter((len(p), len(q)) for p, q in zip(self.prompts, self.restate)).most_common(1)[0][0]
        self.pool = [i for i in range(len(rows)) if (len(self.prompts[i]), len(self.restate[i])) == shape]
        random.Random(seed).shuffle(self.pool)
        self.prompt_len, self.body = shape[0], body
        self.prefix_len = len(enc(RESTATE))
        self.stream = [t for text in self.texts for t in text]
        self.digit = {i for i in range(len(tok)) if tok.decode([i]).strip().isdigit()}

    def __len__(self) -> int:
        return len(self.pool)

    def build(self, k: int) -> tuple[list[int], int]:
        """(ids, first scored position) of instance ``k``."""
        i = self.pool[k]
        body = self.texts[i][: self.body]
        rng = random.Random(k)
        start = rng.randrange(0, len(self.stream) - self.body)
        body = body + self.stream[start : start + self.body - len(body)]
        ids = self.prompts[i] + body + self.restate[i]
        return ids, self.prompt_len + self.body + self.prefix_len


def run_batch(model, tasks: Tasks, idx: list[int], policy: str, protect: bool, *, budget: int, buffer: int,
              seed: int, options: Optional[dict] = None) -> list[dict]:
    """Replay instances ``idx`` under one policy (``"full"``: no eviction); one row per instance with the digit
    accuracy and mean log-prob of the restated question."""
    built = [tasks.build(k) for k in idx]
    ids = torch.tensor([b[0] for b in built], device=model.device)
    score_from = built[0][1]
    if policy == "full":
        cache = randattn.EvictingCache("random", budget=ids.shape[1] + 1, buffer=1, protect_prompt=False)
    else:
        cache = randattn.EvictingCache(policy, budget=budget, buffer=buffer, protect_prompt=protect, seed=seed,
                                       **(options or {}))
    res = randattn.replay(model, ids, cache, prompt_len=tasks.prompt_len, score_from=score_from)
    target = ids[:, score_from:].cpu()
    lp = res.logprobs[:, score_from:].double()
    hit = res.argmax[:, score_from:] == target
    is_digit = torch.tensor([[t in tasks.digit for t in row] for row in target.tolist()])
    rows = []
    for j, k in enumerate(idx):
        d = is_digit[j]
        rows.append({"instance": k, "policy": policy, "protect": protect, "mean_lp": float(lp[j].mean()),
                     "digit_acc": float(hit[j][d].float().mean()) if d.any() else float("nan"),
                     "tokens": int(target.shape[1]), "rounds": cache.events[0] if cache.layers else 0})
    return rows


def main(argv=None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--traces", default=None, help="JSONL with 'question' and 'text' fields (default: the shipped corpus)")
    p.add_argument("--policies", nargs="+", default=POLICIES, help="policies compared")
    p.add_argument("--budget", type=positive_int, default=256, help="T: pairs each KV head holds right after a round, the newest r among them")
    p.add_argument("--buffer", type=positive_int, default=16, help="r: new pairs between rounds")
    p.add_argument("--body", type=positive_int, default=512,
                   help="reasoning tokens between question and restatement (body / r rounds run)")
    p.add_argument("--paper", action="store_true", help="the paper's K=1024, r=64 with a 2,048-token body (32 rounds)")
    p.add_argument("--instances", type=positive_int, default=16, help="problems (paired across policies and modes)")
    p.add_argument("--batch", type=positive_int, default=8, help="problems replayed together")
    p.add_argument("--restart", action="store_true", help="discard earlier results of this configuration")
    p.add_argument("--no-figure", action="store_true", help="do not draw the figure")
    p.add_argument("--figure-dir", default=None, help="where the figure goes (default: figures/)")
    args = p.parse_args(argv)
    if args.paper:
        args.budget, args.buffer, args.body = 1024, 64, 2048
    check_policies(p, "--policies", args.policies)
    traces = Path(args.traces) if args.traces else DEFAULT_TRACES
    try:
        rows = load_rows(traces)
    except (FileNotFoundError, ValueError) as exc:
        p.error(str(exc))
    model, tok = randattn.load_model(args.model, device=args.device)
    tasks = Tasks(tok, rows, body=args.body, seed=args.seed)
    if len(tasks) < args.instances:
        p.error(f"only {len(tasks)} traces share one prompt layout; use --instances <= {len(tasks)} or more traces")
    if args.budget <= tasks.prompt_len + 1:
        p.error(f"--budget {args.budget} cannot hold the {tasks.prompt_len}-token protected prompt plus one slot")
    model_name = args.model or randattn.DEFAULT_MODEL
    config = {"probe": "prompt_protection", "engine": randattn.ENGINE, "model": model_name, "budget": args.budget,
              "buffer": args.buffer,
              "body": args.body, "seed": args.seed, "batch": args.batch, "prompt_len": tasks.prompt_len,
              "traces": str(traces.resolve().relative_to(REPO_ROOT)) if traces.resolve().is_relative_to(REPO_ROOT)
              else str(traces), "revision": git_revision()}
    out = Path(args.out) if args.out else (Path("data/results/prompt_protection") /
                                            f"{Path(model_name).name}-K{args.budget}-r{args.buffer}-b{args.body}-s{args.seed}.jsonl")
    try:
        rf = ResultsFile(out, config, ("instance", "policy", "protect"), restart=args.restart)
    except ValueError as exc:
        p.error(str(exc))
    print(f"model {model_name} | K={args.budget} kept per head after a round, r={args.buffer} | prompt {tasks.prompt_len} "
          f"tokens, body {args.body} (~{args.body // args.buffer} rounds), restated question "
          f"{len(tasks.restate[tasks.pool[0]]) - tasks.prefix_len} tokens")
    arms = [("full", False)] + [(pol, prot) for pol in args.policies for prot in (False, True)]
    batches = [list(range(b, min(args.instances, b + args.batch))) for b in range(0, args.instances, args.batch)]
    todo = [(arm, idx) for arm in arms for idx in batches if any((i, *arm) not in rf.done for i in idx)]
    for (policy, protect), idx in tqdm(todo, desc="prompt protection", unit="batch"):
        options = {"stats": randattn.DEFAULT_MODEL} if policy == "triattention" and args.model is None else {}
        try:
            rf.append(run_batch(model, tasks, idx, policy, protect, budget=args.budget, buffer=args.buffer,
                                seed=args.seed * 1_000_003 + idx[0], options=options))
        except ValueError as exc:  # e.g. a policy's own pinned window plus the protected prompt exceed K
            p.error(f"policy {policy} (protect_prompt={protect}): {exc}")
    table = summarize(rf.rows, args.policies, args.instances, args.seed)
    print(f"\n{'policy':<14} {'score only':<22} {'+ prompt protection':<22} {'gain [95% CI]':<26} (digit accuracy of the "
          "restated question; mean log-prob in the CSV)")
    for r in table:
        if r["policy"] == "full":
            print(f"{'full':<14} {r['digit_acc_score_only']:.3f} (no eviction: the ceiling)")
            continue
        print(f"{r['policy']:<14} {r['digit_acc_score_only']:.3f}{'':<16} {r['digit_acc_protected']:.3f}{'':<16} "
              f"{r['gain']:+.3f} [{r['gain_lo']:+.3f}, {r['gain_hi']:+.3f}]")
    print("paper Table 2 (MATH500 accuracy, Qwen3-4B): snapkv .703->.829, rkv .810->.812, vase .809->.812, "
          "random .459->.874")
    summary = write_csv(out.with_suffix(".summary.csv"), [{**r, "model": model_name, "budget": args.budget,
                                                           "buffer": args.buffer} for r in table])
    print(f"\nrows: {out}\nsummary: {summary}")
    if not args.no_figure:
        from figures.prompt_protection import plot

        for f in plot(summary, args.figure_dir):
            print(f"figure: {f}")
    return 0


def summarize(rows: list[dict], policies: list[str], n: int, seed: int = 0) -> list[dict]:
    """Per policy: digit accuracy and mean LP, score-only vs protected, and the paired gains with CIs."""
    cell = {(r["instance"], r["policy"], r["protect"]): r for r in rows if r["instance"] < n}
    full = [cell[(i, "full", False)] for i in range(n) if (i, "full", False) in cell]
    table = [{"policy": "full", "n": len(full), "digit_acc_score_only": float(np.nanmean([r["digit_acc"] for r in full])),
              "digit_acc_protected": float("nan"), "mean_lp_score_only": float(np.mean([r["mean_lp"] for r in full])),
              "mean_lp_protected": float("nan"), "gain": 0.0, "gain_lo": 0.0, "gain_hi": 0.0}] if full else []
    for pol in policies:
        inst = [i for i in range(n) if (i, pol, False) in cell and (i, pol, True) in cell]
        if not inst:
            continue
        a = [cell[(i, pol, False)] for i in inst]
        b = [cell[(i, pol, True)] for i in inst]
        gain = mean_ci([y["digit_acc"] - x["digit_acc"] for x, y in zip(a, b)], seed=seed)
        lp_gain = mean_ci([y["mean_lp"] - x["mean_lp"] for x, y in zip(a, b)], seed=seed)
        table.append({"policy": pol, "n": len(inst),
                      "digit_acc_score_only": float(np.mean([x["digit_acc"] for x in a])),
                      "digit_acc_protected": float(np.mean([y["digit_acc"] for y in b])),
                      "mean_lp_score_only": float(np.mean([x["mean_lp"] for x in a])),
                      "mean_lp_protected": float(np.mean([y["mean_lp"] for y in b])),
                      **gain.as_dict("gain"), **lp_gain.as_dict("lp_gain")})
    return table


if __name__ == "__main__":
    sys.exit(main())
