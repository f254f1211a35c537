"""The cost of one eviction round per policy: scoring + per-head top-K + compaction.

    python -m bench.round_cost                       # paper shapes (Qwen3-4B layer) + the embedded model's
    python -m bench.round_cost --repeats 50 --policies random snapkv

One layer's cache is filled with random post-RoPE keys/values (and recent queries / accumulated
attention for the policies that read them), then every policy runs the same round on it, the
policies interleaved within each repeat so that drift hits them alike. Printed: median
milliseconds, the ratio to Random, and Random against the floor of copying the kept keys and
values once (the memory traffic any compaction must pay).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import randattn
from randattn.rules import longest_prompt

from bench.common import BenchBase, hidden, parse, provenance, result_path
from probes.config import POSITIVE, eviction, option, setting

# (label, H_kv, H_q, head_dim, K, r)
SHAPES = [
    ("Qwen3-4B K=1024", 8, 32, 128, 1024, 64),
    ("Qwen3-4B K=2048", 8, 32, 128, 2048, 64),
    ("SmolLM2-135M K=1024", 3, 9, 64, 1024, 64),
]


def _policy_options(name: str, shape) -> dict:
    """Options a policy needs to run on synthetic data (TriAttention: statistics of the right shape)."""
    if not randattn.make_policy(name).calibration:  # only TriAttention takes calibration data; synthesise its kind
        return {}
    from randattn.triattention import TriAttentionStats

    _, h_kv, h_q, d, _, _ = shape
    g = torch.Generator().manual_seed(1)
    qbar = torch.randn(1, h_q, d, generator=g)
    stats = TriAttentionStats(
        qbar=qbar,
        mbar=qbar.view(1, h_q, 2, d // 2).norm(dim=2) + torch.rand(1, h_q, d // 2, generator=g),
        inv_freq=1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)),
        meta={"num_kv_heads": h_kv, "max_position_embeddings": 32768},
    )
    return {"stats": stats}


def _filled_state(cache: randattn.EvictingCache, h_kv: int, h_q: int, d: int, prompt: int, seed: int) -> dict:
    """What a layer holds when a round fires after many rounds: the prompt and a random chronological subset of a
    longer trace, T + r slots in all."""
    g = torch.Generator().manual_seed(seed)
    s = cache.budget + cache.buffer
    later = torch.randperm(8 * s, generator=g)[: s - prompt].sort().values + prompt
    pos = torch.cat([torch.arange(prompt), later]).expand(1, h_kv, s).contiguous()
    state = dict(keys=torch.randn(1, h_kv, s, d, generator=g), values=torch.randn(1, h_kv, s, d, generator=g),
                 positions=pos, seq_len=int(pos.max()) + 1)
    if cache.needs_attention:
        state["attention"] = torch.rand(1, h_q, s, generator=g) * 50
    if cache.needs_queries:
        w = cache.query_window
        state.update(queries=torch.randn(1, h_q, w, d, generator=g),
                     query_positions=torch.arange(state["seq_len"] - w, state["seq_len"]), scaling=d**-0.5)
    return state


def _time_round(cache: randattn.EvictingCache, state: dict) -> float:
    """Seconds of one round on a fresh layer holding ``state`` (building the layer is not timed)."""
    layer = cache.restore_layer(0, **state)
    t0 = time.perf_counter()
    cache.run_round(layer)
    return time.perf_counter() - t0


@dataclass
@eviction(policies=setting(None, help="the policies timed (default: every registered policy)"))
class Config(BenchBase):
    """The cost of one eviction round per policy; T and r are the shapes' own (SHAPES)."""

    model: Optional[str] = hidden(None)  # synthetic keys and values: no model
    device: str = hidden("cpu")
    out: str = result_path("data/results/bench/round_cost.json")
    repeats: int = option(30, "timed rounds per policy and shape (the median is reported)", check=POSITIVE)
    warmup: int = option(3, "untimed rounds first", check=POSITIVE)
    prompt: int = option(64, "protected prompt length", check=POSITIVE)
    threads: Optional[int] = option(None, "torch CPU threads (default: torch's choice)", check=POSITIVE)


def main(argv=None) -> int:
    p, args = parse(Config, argv, __doc__.splitlines()[0])
    if args.threads:
        torch.set_num_threads(args.threads)
    policies = args.policies or randattn.known_policies()
    unknown = [x for x in policies if x not in randattn.known_policies()]
    if unknown:
        p.error(f"--policies: unknown {unknown}; choose from {', '.join(randattn.known_policies())}")
    if "random" not in policies:
        policies = ["random", *policies]
    fits = min(longest_prompt(k, r) for *_, k, r in SHAPES)  # the one prompt-fits rule (randattn.rules)
    if args.prompt > fits:
        p.error(f"--prompt: {args.prompt} protected tokens do not fit the smallest budget measured "
                f"({', '.join(f'{s[0]}: T={s[4]}, r={s[5]}' for s in SHAPES)}); use --prompt <= {fits}")

    rows = []
    torch.manual_seed(args.seed)
    for shape in SHAPES:
        label, h_kv, h_q, d, k, r = shape
        setups = {}
        for name in policies:
            cache = randattn.EvictionSpec(name, k, r, seed=args.seed,
                                          options=_policy_options(name, shape)).make_cache(prompt_len=args.prompt)
            setups[name] = (cache, _filled_state(cache, h_kv, h_q, d, args.prompt, args.seed))
        floor_src = setups["random"][1]
        kept = torch.arange(k).expand(1, h_kv, k)
        times = {name: [] for name in policies}
        floor = []
        for rep in range(args.warmup + args.repeats):
            for name, (cache, state) in setups.items():
                elapsed = _time_round(cache, state)
                if rep >= args.warmup:
                    times[name].append(elapsed)
            t0 = time.perf_counter()
            idx = kept[..., None].expand(-1, -1, -1, d)
            torch.gather(floor_src["keys"], 2, idx)
            torch.gather(floor_src["values"], 2, idx)
            if rep >= args.warmup:
                floor.append(time.perf_counter() - t0)
        base = statistics.median(times["random"])
        floor_ms = 1e3 * statistics.median(floor)
        for name in policies:
            ms = 1e3 * statistics.median(times[name])
            rows.append({"shape": label, "kv_heads": h_kv, "q_heads": h_q, "head_dim": d, "budget": k, "buffer": r,
                         "policy": name, "ms": ms, "x_random": ms / (1e3 * base), "copy_floor_ms": floor_ms})

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": torch.get_num_threads(), "repeats": args.repeats, "prompt": args.prompt, "device": "cpu",
            **provenance()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    for label, *_ in SHAPES:
        sub = [x for x in rows if x["shape"] == label]
        print(f"\n{label}: one layer, {sub[0]['kv_heads']} KV heads x {sub[0]['budget'] + sub[0]['buffer']} slots, "
              f"head dim {sub[0]['head_dim']}, prompt {args.prompt} protected; median of {args.repeats}")
        print(f"  {'policy':>14} {'ms/round':>9} {'x random':>9}")
        for x in sub:
            print(f"  {x['policy']:>14} {x['ms']:9.3f} {x['x_random']:9.2f}")
        rnd = next(x for x in sub if x["policy"] == "random")
        print(f"  copy floor (gather kept K and V once): {rnd['copy_floor_ms']:.3f} ms; random = "
              f"{rnd['ms'] / rnd['copy_floor_ms']:.2f}x the floor")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
