"""Decode throughput and KV memory: full cache vs an evicting policy, side by side in one run.

    python -m bench.decode                         # 4,096 new tokens, K=1,024, r=64, batch 1 and 8
    python -m bench.decode --new-tokens 1024 --budget 256 --batches 1 4

For each batch size the full cache (HF DynamicCache) and every policy generate the same number of
tokens from the same prompt, greedily and without stopping at EOS, one after another. Printed and
saved: tokens/s, the ratio to the full cache, KV bytes at the end, the eviction rounds that ran
(from the cache's event counter, not the configuration) and the share of decode time in rounds.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

import randattn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from probes.common import base_parser, positive_int  # noqa: E402

PROMPT = "Solve step by step: a train travels 180 km in 2.5 hours, then 120 km in 1.5 hours. What is its average speed?"


def _kv_bytes_dynamic(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def run_one(model, ids, *, policy, budget, buffer, new_tokens, seed=0) -> dict:
    """Generate ``new_tokens`` for every row of ``ids`` and measure it. ``policy=None``: full cache."""
    from transformers import DynamicCache

    cache = DynamicCache() if policy is None else randattn.EvictingCache(policy, budget=budget, buffer=buffer, seed=seed)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if policy is None:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, **kwargs)
    else:
        out = randattn.generate(model, ids, cache, **kwargs)
    if ids.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    row = {
        "policy": policy or "full",
        "batch": ids.shape[0],
        "prompt_tokens": ids.shape[1],
        "new_tokens": out.shape[1] - ids.shape[1],
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "kv_bytes_end": _kv_bytes_dynamic(cache) if policy is None else cache.kv_bytes(),
    }
    if policy is not None:
        row.update(
            budget=budget,
            buffer=buffer,
            rounds_per_layer=cache.events[0],
            rounds_all_layers_equal=len(set(cache.events)) == 1,
            round_seconds=cache.round_seconds,
            round_share=cache.round_seconds / seconds,
            pairs_per_head_end=cache.physical_length(0),
        )
    return row


def main(argv=None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=positive_int, default=4096)
    p.add_argument("--budget", type=positive_int, default=1024, help="K: pairs each KV head keeps after a round")
    p.add_argument("--buffer", type=positive_int, default=64, help="r: new pairs between rounds")
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8])
    p.add_argument("--policies", nargs="+", default=["random"], help="evicting policies compared with the full cache")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    for pol in args.policies:
        if pol not in randattn.known_policies():
            p.error(f"--policies: {pol!r} is unknown; choose from {', '.join(randattn.known_policies())}")
    if args.threads:
        torch.set_num_threads(args.threads)
    out_path = Path(args.out or "data/results/bench/decode.json")

    model, tok = randattn.load_model(args.model, device=args.device)
    msgs = [{"role": "user", "content": PROMPT}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    prompt = prompt.to(model.device)
    total = prompt.shape[1] + args.new_tokens
    if total < args.budget + args.buffer:
        p.error(f"{total} tokens never reach K + r = {args.budget + args.buffer}: no eviction would run; raise --new-tokens")

    rows = []
    for batch in args.batches:
        ids = prompt.expand(batch, -1).contiguous()
        for policy in [None, *args.policies]:
            row = run_one(model, ids, policy=policy, budget=args.budget, buffer=args.buffer, new_tokens=args.new_tokens, seed=args.seed)
            rows.append(row)
            print(json.dumps(row), flush=True)

    meta = {
        "model": args.model or randattn.DEFAULT_MODEL,
        "device": str(model.device),
        "dtype": str(model.dtype),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "budget": args.budget,
        "buffer": args.buffer,
        "new_tokens": args.new_tokens,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    print(f"\n{meta['model']} on {meta['device']} ({meta['dtype']}), K={args.budget}, r={args.buffer}, "
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
