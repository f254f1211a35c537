"""Generate with Random Attention on a real model and show what each KV head evicted.

    python -m probes.demo                      # embedded SmolLM2-135M, K=128, r=32, 320 new tokens
    python -m probes.demo --policy recency --budget 96
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import randattn

from .common import base_parser, check_policies, positive_int, ranges

DEFAULT_PROMPT = (
    "A baker sells muffins for $3 and cookies for $2. On Monday she sells 14 muffins and twice as many "
    "cookies. On Tuesday she sells 5 fewer muffins and 8 more cookies than on Monday. How much money does "
    "she make over the two days? Solve it step by step."
)


def main(argv=None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--policy", default="random", help=f"one of {', '.join(randattn.known_policies())}")
    p.add_argument("--budget", type=positive_int, default=128, help="T: pairs each KV head holds right after a round, the newest r among them")
    p.add_argument("--buffer", type=positive_int, default=32, help="r: new pairs between rounds")
    p.add_argument("--max-new-tokens", type=positive_int, default=320)
    p.add_argument("--no-protect-prompt", action="store_true", help="let the prompt be evicted too")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--layers", default="0,15,-1", help="layers whose per-head evictions are printed")
    args = p.parse_args(argv)
    check_policies(p, "--policy", [args.policy])

    model, tok = randattn.load_model(args.model, device=args.device)
    msgs = [{"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ids = ids.to(model.device)
    options = {}
    if args.policy == "triattention" and args.model is None:
        options["stats"] = randattn.DEFAULT_MODEL  # the embedded model's statistics ship with the package
    try:
        cache = randattn.EvictingCache(
            args.policy, budget=args.budget, buffer=args.buffer, protect_prompt=not args.no_protect_prompt,
            seed=args.seed, keep_log=True, **options,
        )
        if cache.protect_prompt:
            cache._check_prompt_fits(ids.shape[1])
    except ValueError as exc:
        p.error(str(exc))
    t0 = time.perf_counter()
    out = randattn.generate(
        model, ids, cache, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False
    )
    seconds = time.perf_counter() - t0
    n_new = out.shape[1] - ids.shape[1]
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    print(f"model: {model.config.model_type}, {model.config.num_hidden_layers} layers, "
          f"{model.config.num_key_value_heads} KV heads | policy={args.policy} K={args.budget} r={args.buffer} "
          f"protect_prompt={not args.no_protect_prompt} prompt={ids.shape[1]} tokens")
    print("-" * 100)
    print(text.strip())
    print("-" * 100)
    seq = cache.get_seq_length()
    print(f"{n_new} new tokens in {seconds:.1f}s ({n_new / seconds:.1f} tok/s); sequence in cache: {seq} positions; "
          f"eviction rounds per layer: {cache.events[0]} (all layers: {sorted(set(cache.events))}); "
          f"time in rounds: {100 * cache.round_seconds / seconds:.1f}% of decode")
    if cache.total_events == 0:
        print("no eviction round ran: the sequence never reached K + r; lower --budget or raise --max-new-tokens")
    n_layers = len(cache.layers)
    for spec in args.layers.split(","):
        layer = int(spec) % n_layers
        pos = cache.positions(layer)[0].cpu()
        print(f"\nlayer {layer}: evicted positions per KV head (kept {pos.shape[-1]} of {seq})")
        for h in range(pos.shape[0]):
            kept = set(pos[h].tolist())
            gone = [i for i in range(seq) if i not in kept]
            print(f"  head {h}: {len(gone)} evicted: {ranges(gone)}")
    # Survival by age over all layers and heads: Random's soft recency window with a thin tail.
    all_pos = torch.stack([cache.positions(l)[0].cpu() for l in range(n_layers)])
    print("\nsurvival by position (fraction of all layer x head slots still holding it):")
    step = max(1, seq // 10)
    for lo in range(0, seq, step):
        hi = min(seq, lo + step)
        frac = torch.isin(all_pos, torch.arange(lo, hi)).sum().item() / (all_pos.shape[0] * all_pos.shape[1] * (hi - lo))
        print(f"  {lo:5d}-{hi - 1:<5d} {frac:6.3f} {'#' * round(40 * frac)}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        cache.keep_log.save(Path(args.out).with_suffix(".npz"))
        Path(args.out).with_suffix(".json").write_text(json.dumps({"text": text, **cache.stats()}, indent=1))
        print(f"\nwrote {Path(args.out).with_suffix('.json')} and the keep-log {Path(args.out).with_suffix('.npz')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
