"""Batch amplification: decode throughput vs batch size per cache, and the share of time in eviction rounds.

    python -m bench.batch_scaling                  # batches 1..64, 4,096 new tokens, K=1,024, r=64
    python -m bench.batch_scaling --batches 1 2 4 8 16 32 --new-tokens 256 --budget 128 --buffer 16

Every batch row of a generation waits for the same eviction rounds, so a selector's per-round cost
is paid once per round for the whole batch and grows with it. For each batch size, full attention
(HF DynamicCache) and every policy generate the same tokens one after another; printed and saved:
total tokens/s, the ratio to full attention and to Random, milliseconds per round (one layer, the
whole batch) and the share of decode time spent in rounds, from the cache's own timers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from bench.common import BenchConfig, meta, prepare, run_arms, write_results
from probes.config import DEFAULT, POSITIVE, eviction, option, setting

POLICIES = ("random", "snapkv", "rkv", "triattention")


@dataclass
@eviction(policies=setting(POLICIES, help="evicting policies run beside full attention"), stats=DEFAULT)
class Config(BenchConfig):
    """Batch amplification: decode throughput vs batch size per cache, and the share of time in eviction rounds."""

    batches: tuple[int, ...] = option((1, 2, 4, 8, 16, 32, 64), "batch sizes, each timed with every arm",
                                      check=POSITIVE)
    no_full: bool = option(False, "skip full attention (the slowest arm at large batches)")


def main(argv=None) -> int:
    _, args, options, model, prompt = prepare(Config, argv, __doc__.splitlines()[0])
    arms = ([] if args.no_full else [None]) + list(args.policies)

    rows = []
    for batch in args.batches:
        same = run_arms(model, prompt.expand(batch, -1).contiguous(), arms, args, options)
        rows += same
        ref = {r["policy"]: r["tokens_per_s"] for r in same}
        for r in same:
            r["x_full"] = r["tokens_per_s"] / ref["full"] if "full" in ref else None
            r["x_random"] = r["tokens_per_s"] / ref["random"] if "random" in ref else None

    info = meta(args, model, budget=args.budget, buffer=args.buffer, new_tokens=args.new_tokens, batches=args.batches)
    out_path = write_results(args.out or "data/results/bench/batch_scaling.json", info, rows)

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    print(f"\n{info['model']} on {info['device']} ({info['dtype']}), K={args.budget}, r={args.buffer}, "
          f"{args.new_tokens} new tokens, prompt {prompt.shape[1]} tokens")
    print(f"{'batch':>5} {'policy':>14} {'tok/s':>9} {'x full':>7} {'x random':>8} {'ms/round':>9} {'round %':>7}")
    for r in rows:
        print(f"{r['batch']:>5} {r['policy']:>14} {r['tokens_per_s']:9.2f} {fmt(r['x_full'], '7.2f'):>7} "
              f"{fmt(r['x_random'], '8.2f'):>8} {fmt(r.get('ms_per_round'), '9.2f'):>9} "
              f"{fmt(r.get('round_share') and 100 * r['round_share'], '7.2f'):>7}")
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
