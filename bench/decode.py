"""Decode throughput and KV memory: full cache, HF's sliding window and evicting policies, side by side in one run.

    python -m bench.decode                         # 4,096 new tokens, T=1,024, r=64, batch 1 and 8
    python -m bench.decode --repeats 2             # every arm twice, the order reversed the second time; medians
    python -m bench.decode --batches 8 --no-full   # the window floor and Random only
    python -m bench.decode --new-tokens 1024 --budget 256 --batches 1 4

For each batch size the full cache (HF DynamicCache), transformers' own sliding-window cache of the same
T + r pairs (``window``: no scoring, no gather; the cost floor of any cache that size) and every policy
generate the same number of tokens from the same prompt, greedily and without stopping at EOS. Printed and
saved: tokens/s (medians and ranges over the repeats), the ratios to the full cache and to the window, KV
bytes at the end, the eviction rounds that ran (from the cache's event counter, not the configuration) and
the share of decode time in rounds.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from bench.common import WINDOW, BenchConfig, medians, meta, prepare, run_arms, write_results
from probes.config import DEFAULT, POSITIVE, eviction, option, setting


@dataclass
@eviction(policies=setting(help="evicting policies compared with the full cache"), stats=DEFAULT)
class Config(BenchConfig):
    """Decode throughput and KV memory: full cache, HF's sliding window and evicting policies, side by side."""

    batches: tuple[int, ...] = option((1, 8), "batch sizes, each timed with every arm", check=POSITIVE)
    no_full: bool = option(False, "leave out full attention (its batch-8 run at the paper's length alone takes 30 min "
                                  "on 2 cores)")
    no_window: bool = option(False, "leave out the sliding-window floor")
    repeats: int = option(1, "runs of every arm, the order alternating", check=POSITIVE)


def main(argv=None) -> int:
    _, args, options, model, prompt = prepare(Config, argv, __doc__.splitlines()[0])

    arms = [*([] if args.no_full else [None]), *([] if args.no_window else [WINDOW]), *args.policies]
    rows = []
    for batch in args.batches:
        rows += run_arms(model, prompt.expand(batch, -1).contiguous(), arms, args, options, repeats=args.repeats)

    info = meta(args, model, budget=args.budget, buffer=args.buffer, new_tokens=args.new_tokens, repeats=args.repeats)
    out_path = write_results(args.out or "data/results/bench/decode.json", info, rows)
    med = medians(rows)

    print(f"\n{info['model']} on {info['device']} ({info['dtype']}), T={args.budget}, r={args.buffer}, "
          f"{args.new_tokens} new tokens, prompt {prompt.shape[1]} tokens, {args.repeats} repeat(s): median tok/s "
          f"[range]")
    print(f"{'batch':>5} {'policy':>14} {'tok/s':>8} {'range':>17} {'x full':>7} {'x window':>8} {'KV MB':>8} "
          f"{'x full':>7} {'rounds':>6} {'round %':>7}")
    for batch in args.batches:
        full = med.get((batch, "full"), (None,))[0]
        window = med.get((batch, WINDOW), (None,))[0]
        kv_full = next((r["kv_bytes_end"] for r in rows if r["batch"] == batch and r["policy"] == "full"), None)
        for policy in dict.fromkeys(r["policy"] for r in rows if r["batch"] == batch):
            r = next(x for x in rows if x["batch"] == batch and x["policy"] == policy)
            m, lo, hi = med[(batch, policy)]
            rounds = r.get("rounds_per_layer", "-")
            share = f"{100 * r['round_share']:.2f}" if "round_share" in r else "-"
            vs_window = f"{m / window:8.2f}" if window else f"{'-':>8}"
            vs_full = f"{m / full:7.2f}" if full else f"{'-':>7}"
            kv_vs_full = f"{r['kv_bytes_end'] / kv_full:7.3f}" if kv_full else f"{'-':>7}"
            print(f"{batch:>5} {policy:>14} {m:8.2f} {f'[{lo:.2f}, {hi:.2f}]':>17} {vs_full} {vs_window} "
                  f"{r['kv_bytes_end'] / 2**20:8.1f} {kv_vs_full} {rounds:>6} {share:>7}")
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
