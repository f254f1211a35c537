"""Replay vs token-by-token decoding: the probes' teacher-forced workload, same tokens, same evicting cache.

    python -m bench.replay_speed                   # 4,096 trace tokens after the prompt, K=1,024, r=64
    python -m bench.replay_speed --new-tokens 1024 --budget 256 --buffer 16 --batch 8

Sequences are real reasoning text written by the model (question, then its solutions, from
--traces), as the probes feed them. Each policy runs twice on the same tokens with the same seed:
``randattn.replay`` (chunks that end where the next round fires, about r tokens per forward) and
``randattn.replay_tokenwise`` (one token per forward, what a decode loop does). Printed and saved:
seconds and forwards of each, the speed-up, the largest |log-prob difference|, whether greedy
predictions agree and whether every head kept the same positions at every round (keep-logs).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import randattn
from bench.common import REPO_ROOT, BenchConfig, load, meta, parse, policy_options, write_results
from probes.config import DEFAULT, POSITIVE, eviction, option, setting
from probes.survival import build_chats, read_rows

DEFAULT_TRACES = REPO_ROOT / "data" / "traces" / "smollm2-135m.jsonl"


@dataclass
@eviction(policies=setting(help="evicting policies to replay under"), stats=DEFAULT)
class Config(BenchConfig):
    """Replay vs token-by-token decoding: the probes' teacher-forced workload, same tokens, same evicting cache."""

    batch: int = option(1, "sequences replayed together", check=POSITIVE)
    traces: str = option(str(DEFAULT_TRACES), "JSONL with 'question' and 'text' per row")


def trace_batch(tok, traces: Path, *, batch: int, new_tokens: int, budget: int, seed: int):
    """``[batch, P + new_tokens]`` ids sharing one prompt length P (< K, so a protected prompt fits) and P."""
    chats = build_chats(tok, read_rows(traces), batch, budget + new_tokens, seed, max_prompt=budget)
    prompt_len = chats[0].prompt_len
    ids = torch.tensor([c.ids[: prompt_len + new_tokens] for c in chats])
    return ids, prompt_len


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def same_keep_sets(a: randattn.KeepLog, b: randattn.KeepLog) -> bool:
    return (len(a) > 0 and a.layers == b.layers and a.seq_lens == b.seq_lens
            and all(np.array_equal(x, y) for x, y in zip(a.kept, b.kept)))


def main(argv=None) -> int:
    p, args = parse(Config, argv, __doc__.splitlines()[0])  # the policies and --stats are checked here
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load(p, args)
    options = policy_options(p, args, args.policies, model)
    try:
        ids, prompt_len = trace_batch(tok, Path(args.traces), batch=args.batch, new_tokens=args.new_tokens,
                                      budget=args.budget, seed=args.seed)
    except (FileNotFoundError, ValueError) as exc:
        p.error(str(exc))
    if ids.shape[1] < args.budget + args.buffer:
        p.error(f"{ids.shape[1]} tokens never reach K + r = {args.budget + args.buffer}: raise --new-tokens")
    ids = ids.to(model.device)

    def cache(policy):
        return randattn.EvictionSpec(policy, args.budget, args.buffer, seed=args.seed,
                                     options=options[policy]).make_cache(keep_log=True)

    randattn.replay(model, ids[:, : prompt_len + 8], cache("random"), prompt_len=prompt_len)  # untimed warm-up
    rows = []
    for policy in args.policies:
        fast_cache, slow_cache = cache(policy), cache(policy)
        fast, fast_s = timed(randattn.replay, model, ids, fast_cache, prompt_len=prompt_len)
        slow, slow_s = timed(randattn.replay_tokenwise, model, ids, slow_cache, prompt_len=prompt_len)
        diff = (fast.logprobs - slow.logprobs).abs().nan_to_num(0.0)
        row = {
            "policy": policy, "batch": args.batch, "prompt_tokens": prompt_len, "new_tokens": args.new_tokens,
            "budget": args.budget, "buffer": args.buffer, "rounds_per_layer": fast_cache.events[0],
            "replay_seconds": fast_s, "replay_forwards": fast.forwards,
            "tokenwise_seconds": slow_s, "tokenwise_forwards": slow.forwards,
            "speedup": slow_s / fast_s,
            "max_abs_logprob_diff": float(diff.max()),
            "same_argmax": bool(torch.equal(fast.argmax, slow.argmax)),
            "same_keep_sets": same_keep_sets(fast_cache.keep_log, slow_cache.keep_log),
            "same_rounds": fast_cache.events == slow_cache.events,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    info = meta(args, model, budget=args.budget, buffer=args.buffer, new_tokens=args.new_tokens, batch=args.batch,
                traces=str(args.traces))
    out_path = write_results(args.out or "data/results/bench/replay_speed.json", info, rows)

    print(f"\n{info['model']} on {info['device']} ({info['dtype']}), K={args.budget}, r={args.buffer}, batch {args.batch}, "
          f"prompt {prompt_len} + {args.new_tokens} teacher-forced trace tokens")
    print(f"{'policy':>14} {'rounds':>6} {'replay s':>9} {'fwd':>5} {'token s':>9} {'fwd':>5} {'speed-up':>8} "
          f"{'max |dLP|':>9} {'keep-sets':>9}")
    for r in rows:
        print(f"{r['policy']:>14} {r['rounds_per_layer']:>6} {r['replay_seconds']:9.2f} {r['replay_forwards']:>5} "
              f"{r['tokenwise_seconds']:9.2f} {r['tokenwise_forwards']:>5} {r['speedup']:8.2f} "
              f"{r['max_abs_logprob_diff']:9.1e} {'same' if r['same_keep_sets'] else 'DIFFER':>9}")
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
