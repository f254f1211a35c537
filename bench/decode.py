"""Decode throughput and KV memory: full cache vs an evicting policy, side by side in one run.

    python -m bench.decode                         # 4,096 new tokens, K=1,024, r=64, batch 1 and 8
    python -m bench.decode --new-tokens 1024 --budget 256 --batches 1 4

For each batch size the full cache (HF DynamicCache) and every policy generate the same number of
tokens from the same prompt, greedily and without stopping at EOS, one after another. Printed and
saved: tokens/s, the ratio to the full cache, KV bytes at the end, the eviction rounds that ran
(from the cache's event counter, not the configuration) and the share of decode time in rounds.
"""

from __future__ import annotations

import sys

from bench.common import add_stats_flag, bench_parser, meta, positive_int, prepare, run_arms, write_results


def main(argv=None) -> int:
    p = bench_parser(__doc__.splitlines()[0])
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8])
    p.add_argument("--policies", nargs="+", default=["random"], help="evicting policies compared with the full cache")
    add_stats_flag(p)
    args, options, model, prompt = prepare(p, argv)

    rows = []
    for batch in args.batches:
        rows += run_arms(model, prompt.expand(batch, -1).contiguous(), [None, *args.policies], args, options)

    info = meta(args, model, budget=args.budget, buffer=args.buffer, new_tokens=args.new_tokens)
    out_path = write_results(args.out or "data/results/bench/decode.json", info, rows)

    print(f"\n{info['model']} on {info['device']} ({info['dtype']}), K={args.budget}, r={args.buffer}, "
          f"{args.new_tokens} new tokens, prompt {prompt.shape[1]} tokens")
    print(f"{'batch':>5} {'policy':>14} {'tok/s':>8} {'x full':>7} {'KV MB':>8} {'x full':>7} {'rounds':>6} {'round %':>7}")
    for batch in args.batches:
        full = next(r for r in rows if r["batch"] == batch and r["policy"] == "full")
        for r in (x for x in rows if x["batch"] == batch):
            rounds = r.get("rounds_per_layer", "-")
            share = f"{100 * r['round_share']:.2f}" if "round_share" in r else "-"
            print(f"{batch:>5} {r['policy']:>14} {r['tokens_per_s']:8.2f} {r['tokens_per_s'] / full['tokens_per_s']:7.2f} "
                  f"{r['kv_bytes_end'] / 2**20:8.1f} {r['kv_bytes_end'] / full['kv_bytes_end']:7.3f} {rounds:>6} {share:>7}")
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
