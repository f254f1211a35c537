"""Equal KV memory: the largest batch each cache fits in one KV budget, and the total tokens/s it reaches.

    python -m bench.equal_memory                   # budget = full attention's KV at batch 8, 4,096 new tokens
    python -m bench.equal_memory --new-tokens 1024 --budget 256 --buffer 16 --base-batch 4

The KV budget (bytes, --kv-memory) defaults to what full attention needs for --base-batch sequences
at the end of the generation. Per sequence, full attention holds key/value pairs for every position
(prompt + new tokens - 1: the last token is never fed back); an evicting cache allocates room for
K + r pairs per head once and never more. The batch each method gets is the budget divided by that,
rounded down; every method then generates at its batch, one after another, and the peak KV bytes it
really held (read after every step) are checked against the budget. Printed and saved: batch, peak
KV, total tokens/s and the multiple over full attention.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

from bench.common import BenchConfig, kv_bytes_per_position, meta, prepare, run_arms, write_results
from probes.config import DEFAULT, POSITIVE, eviction, option, setting


@dataclass
@eviction(policies=setting(help="evicting policies compared with full attention"), stats=DEFAULT)
class Config(BenchConfig):
    """Equal KV memory: the largest batch each cache fits in one KV budget, and the total tokens/s it reaches."""

    base_batch: int = option(8, "the default KV budget is full attention's KV bytes at this batch", check=POSITIVE)
    kv_memory: Optional[int] = option(None, "KV budget in bytes (default: full attention's need at --base-batch)",
                                      check=POSITIVE)


def per_sequence_bytes(model, *, policy, prompt_len: int, new_tokens: int, budget: int, buffer: int) -> int:
    """Peak K/V bytes one sequence needs: every position for full attention, K + r pairs per head otherwise."""
    positions = prompt_len + new_tokens - 1 if policy is None else budget + buffer
    return positions * kv_bytes_per_position(model)


def main(argv=None) -> int:
    p, args, options, model, prompt = prepare(Config, argv, __doc__.splitlines()[0])

    geometry = dict(prompt_len=prompt.shape[1], new_tokens=args.new_tokens, budget=args.budget, buffer=args.buffer)
    need = {pol: per_sequence_bytes(model, policy=pol, **geometry) for pol in [None, *args.policies]}
    memory = args.kv_memory or args.base_batch * need[None]
    if memory < need[None]:
        p.error(f"--kv-memory {memory} bytes cannot hold one full-attention sequence ({need[None]} bytes); raise it")

    rows = []
    for policy, per_seq in need.items():
        batch = memory // per_seq
        [row] = run_arms(model, prompt.expand(batch, -1).contiguous(), [policy], args, options, track_peak=True)
        row.update(kv_memory=memory, kv_bytes_per_sequence=per_seq, kv_bytes_predicted=batch * per_seq,
                   fits=row["kv_bytes_peak"] <= memory)
        rows.append(row)
    full = rows[0]
    for row in rows:
        row["x_full_tokens_per_s"] = row["tokens_per_s"] / full["tokens_per_s"]

    info = meta(args, model, budget=args.budget, buffer=args.buffer, new_tokens=args.new_tokens,
                kv_memory=memory, base_batch=None if args.kv_memory else args.base_batch)
    out_path = write_results(args.out or "data/results/bench/equal_memory.json", info, rows)

    print(f"\n{info['model']} on {info['device']} ({info['dtype']}), K={args.budget}, r={args.buffer}, "
          f"{args.new_tokens} new tokens, prompt {prompt.shape[1]} tokens, KV budget {memory / 2**20:.1f} MiB")
    print(f"{'policy':>14} {'batch':>5} {'KV/seq MiB':>10} {'peak KV MiB':>11} {'fits':>5} {'tok/s':>8} {'x full':>7}")
    for r in rows:
        print(f"{r['policy']:>14} {r['batch']:>5} {r['kv_bytes_per_sequence'] / 2**20:10.2f} "
              f"{r['kv_bytes_peak'] / 2**20:11.1f} {str(r['fits']):>5} {r['tokens_per_s']:8.2f} "
              f"{r['x_full_tokens_per_s']:7.2f}")
    if not all(r["fits"] for r in rows):
        print("WARNING: a cache held more KV bytes than the budget; the per-sequence accounting is wrong for it")
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
