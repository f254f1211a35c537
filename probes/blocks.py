"""Contiguous blocks: does it matter whether Random evicts single tokens or whole blocks?

    python -m probes.blocks                       # embedded SmolLM2-135M, K=256, r=16, blocks 1 4 16 64 256
    python -m probes.blocks --blocks 1 16 256 --skip-planted

Random eviction in contiguous blocks of ``b`` tokens per head (the ``random-block`` policy: every
head ranks blocks by its own draw each round; ``b=1`` is Random Attention). Its cost, against
blocks per head ``K / b``:

* on real traces: the increase in next-token loss (mean NLL over the tokens after the first round)
  over full attention, paired by sequence;
* on the planted fact: Recall R and Retrieval of a fact left to the block policy, with the
  endpoints (fact deleted / kept everywhere) under the same background eviction.

The paper (Qwen3-4B, K=1024): blocks of 1..64 cost almost nothing; 256 (4 blocks per head) hurts.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import randattn
from randattn.stats import mean_ci

from .common import positive_int
from .planted import Condition
from .planted_run import describe, planted_parser, run_conditions, setup, summarize, write_csv
from .results import ResultsFile


def nll_sequences(builder, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` stub + trace sequences of ``length`` tokens, each starting at a trace boundary."""
    rng = random.Random(seed * 7_919 + 1)
    need = length - len(builder.stub)
    starts = builder.trace_starts[builder.trace_starts < len(builder.stream) - need]
    if len(starts) == 0:
        raise ValueError(f"the traces hold {len(builder.stream)} tokens; a {length}-token sequence needs more")
    return [builder.stub + builder.stream[s : s + need].tolist() for s in (int(rng.choice(starts)) for _ in range(n))]


def run_nll(s, arms: dict, n: int, length: int, out: Path, desc: str = "next-token loss") -> list[dict]:
    """Mean next-token NLL per sequence under each arm (``{label: make_cache(batch_index)}``); resumable.

    Scored from position K + r on, the first token whose context a round has touched."""
    a = s.args
    config = {**{k: v for k, v in s.results.config.items() if k not in ("policy", "policy_options", "distance",
                                                                          "box_width", "n_facts")},
              "part": "nll", "length": length}
    rf = ResultsFile(out, config, ("sequence", "arm"), restart=a.restart)
    seqs = nll_sequences(s.builder, n, length, a.seed)
    score_from = a.budget + a.buffer
    todo = [(arm, bi) for arm in arms for bi in range(0, n, a.batch)
            if any((i, arm) not in rf.done for i in range(bi, min(n, bi + a.batch)))]
    for arm, bi in tqdm(todo, desc=desc, unit="batch"):
        idx = list(range(bi, min(n, bi + a.batch)))
        ids = torch.tensor([seqs[i] for i in idx], device=s.model.device)
        cache = arms[arm](bi)
        res = randattn.replay(s.model, ids, cache, prompt_len=len(s.builder.stub), score_from=score_from, max_chunk=64)
        nll = -res.logprobs[:, score_from:].double().mean(-1).numpy()
        rf.append([{"sequence": i, "arm": arm, "nll": float(nll[j]), "tokens": length - score_from,
                    "rounds": cache.events[0]} for j, i in enumerate(idx)])
    return rf.rows


def full_attention(length: int):
    """A cache no round ever reaches: full attention through the same code path."""
    return lambda bi: randattn.EvictingCache("random", budget=length + 1, buffer=1, protect_prompt=False)


def nll_deltas(rows: list[dict], arms: list[str], reference: str = "full", seed: int = 0) -> dict:
    """``{arm: Estimate of mean (NLL_arm - NLL_reference)}`` paired by sequence."""
    by = {}
    for r in rows:
        by.setdefault(r["arm"], {})[r["sequence"]] = r["nll"]
    out = {}
    for arm in arms:
        common = sorted(set(by.get(arm, {})) & set(by.get(reference, {})))
        if common:
            out[arm] = mean_ci([by[arm][i] - by[reference][i] for i in common], seed=seed)
    return out


def main(argv=None) -> int:
    p = planted_parser(__doc__.splitlines()[0], instances=24)
    p.add_argument("--blocks", type=positive_int, nargs="+", default=[1, 4, 16, 64, 256], help="block sizes (tokens)")
    p.add_argument("--sequences", type=positive_int, default=16, help="trace sequences for the next-token loss")
    p.add_argument("--length", type=positive_int, default=1024, help="tokens per trace sequence")
    p.add_argument("--skip-nll", action="store_true", help="skip the next-token-loss part")
    p.add_argument("--skip-planted", action="store_true", help="skip the planted-fact part")
    args = p.parse_args(argv)
    if args.policy != "random":
        p.error("--policy is fixed to random-block by this probe; drop the flag")
    if args.length <= args.budget + args.buffer:
        p.error(f"--length {args.length} must exceed K + r = {args.budget + args.buffer} so that rounds run")
    loaded = None
    table, planted = [], {}
    base_dir = Path(args.out) if args.out else Path("data/results/blocks")
    for b in args.blocks:
        sub = argparse.Namespace(**{**vars(args), "policy": "random-block", "out": None})
        s = setup("blocks", sub, p, policy_options={"block": b}, loaded=loaded,
                  out=None if not args.out else base_dir / f"planted-block{b}.jsonl")
        loaded = (s.model, s.tok)
        if b == args.blocks[0]:
            print(describe(s))
        if not args.skip_planted:
            w = args.box_width
            conds = [Condition.heads("deleted", [], w), Condition.heads("all", range(s.n_heads), w),
                     Condition.policy("policy")]
            rows = run_conditions(s, conds, desc=f"blocks: planted fact, block {b}")
            planted[b] = summarize(rows, ["policy", "all", "deleted"], seed=args.seed)
    deltas = {}
    if not args.skip_nll:
        model = Path(str(s.results.config["model"])).name
        out = base_dir / f"nll-{model}-K{args.budget}-r{args.buffer}-L{args.length}-s{args.seed}.jsonl"
        a = args
        arms = {"full": full_attention(args.length)}
        for b in args.blocks:
            arms[f"block{b}"] = (lambda b: lambda bi: randattn.EvictingCache(
                "random-block", block=b, budget=a.budget, buffer=a.buffer, protect_prompt=a.protect_prompt,
                seed=a.seed * 1_000_003 + bi))(b)
        rows = run_nll(s, arms, args.sequences, args.length, out, desc="blocks: next-token loss")
        deltas = {int(k[5:]): v for k, v in nll_deltas(rows, list(arms)[1:], seed=args.seed).items()}
        full = np.mean([r["nll"] for r in rows if r["arm"] == "full"])
        print(f"\nnext-token loss over {args.sequences} trace sequences of {args.length} tokens (scored from position "
              f"{args.budget + args.buffer}); full attention {full:.3f} nats/token")
    print(f"\n{'block':>6} {'blocks/head':>11}  {'dNLL vs full [95% CI]':<28} {'R of a fact left to it':<24} "
          f"{'retrieval':<22}")
    for b in args.blocks:
        d = deltas.get(b)
        pl = planted.get(b, {}).get("policy")
        row = {"block": b, "blocks_per_head": args.budget / b, "model": s.results.config["model"], "budget": args.budget,
               "buffer": args.buffer, "distance": args.distance, "policy": "random-block", "seed": args.seed,
               "protect_prompt": args.protect_prompt, "length": args.length, "sequences": args.sequences}
        if d is not None:
            row.update(d.as_dict("delta_nll"))
        if pl is not None:
            row.update(pl.recall.as_dict("recall"))
            row.update(pl.retrieval.as_dict("retrieval"))
            row["retrieval_all"] = planted[b]["all"].retrieval.value
            row["n_instances"] = pl.n
        table.append(row)
        print(f"{b:>6} {args.budget / b:>11.1f}  {format(d, '.4f') if d else '-':<28} "
              f"{format(pl.recall, '.3f') if pl else '-':<24} {format(pl.retrieval, '.3f') if pl else '-':<22}")
    base_dir.mkdir(parents=True, exist_ok=True)
    model = Path(str(s.results.config["model"])).name
    summary = write_csv(base_dir / f"summary-{model}-K{args.budget}-r{args.buffer}-d{args.distance}-s{args.seed}.csv",
                        table)
    print(f"\nsummary: {summary}")
    if not args.no_figure:
        from figures.blocks import plot

        for f in plot(summary, args.figure_dir):
            print(f"figure: {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
