"""Generate with Random Attention on a real model and show what each KV head evicted.

    python -m probes.demo                      # embedded SmolLM2-135M, K=128, r=32, 320 new tokens
    python -m probes.demo --policy recency --budget 96
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import randattn

from . import cli
from .common import ranges
from .config import DEFAULT, POSITIVE, ConfigError, EvictionConfig, eviction, option
from .planted_run import load

DEFAULT_PROMPT = (
    "A baker sells muffins for $3 and cookies for $2. On Monday she sells 14 muffins and twice as many "
    "cookies. On Tuesday she sells 5 fewer muffins and 8 more cookies than on Monday. How much money does "
    "she make over the two days? Solve it step by step."
)


@dataclass
@eviction(policy=DEFAULT, budget=128, buffer=32, protect_prompt=True)
class Config(EvictionConfig):
    """Generate with an evicting cache and show what each KV head evicted (``python -m probes.demo``)."""

    out: Optional[str] = option(None, "write the text, the cache's statistics (.json) and the keep-log (.npz) here "
                                      "(a path without suffix)")
    max_new_tokens: int = option(320, "tokens to generate", check=POSITIVE)
    prompt: str = option(DEFAULT_PROMPT, "the user message")
    layers: tuple[int, ...] = option((0, 15, -1), "layers whose per-head evictions are printed (negative: from the "
                                                  "last)")

    def check(self) -> None:
        self.check_eviction()
        if self.out is not None:
            check_demo_out(Path(self.out))


def check_demo_out(out: Path) -> None:
    """``--out``'s two files (``.json``, ``.npz``) may replace only what an earlier demo wrote there."""
    for p in out.parents:
        if p.exists() and not p.is_dir():
            raise ConfigError("out", f"{p} is a file, so {out} cannot be written; give a path in a folder")
    stats, log = out.with_suffix(".json"), out.with_suffix(".npz")
    for p in (stats, log):
        if p.is_dir():
            raise ConfigError("out", f"{p} is a folder; give --out a path without suffix whose .json and .npz are free")
    ours = False
    if stats.exists():
        try:
            obj = json.loads(stats.read_text())
            ours = isinstance(obj, dict) and {"text", "events_per_layer", "budget"} <= set(obj)
        except (ValueError, UnicodeDecodeError):
            pass
        if not ours:
            raise ConfigError("out", f"{stats} exists and is not a demo result randattn wrote; nothing was changed. "
                                     "Give --out another path")
    if log.exists() and not ours:
        raise ConfigError("out", f"{log} exists beside no demo result of randattn; nothing was changed. Give --out "
                                 "another path")


def main(argv=None) -> int:
    return cli.main(Config, run, argv, __doc__)


def run(config: Config, model=None, tokenizer=None) -> int:
    args = config
    if args.out:
        try:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("out", f"cannot create {Path(args.out).parent} ({exc.strerror or exc}); give a path you "
                                     "can write to") from None
    model, tok = load(config, None if model is None else (model, tokenizer))
    n_layers = model.config.num_hidden_layers
    bad = [layer for layer in config.layers if not -n_layers <= layer < n_layers]
    if bad:
        raise ConfigError("layers", f"{bad} out of range: the model has {n_layers} layers (0..{n_layers - 1}, or "
                                    f"-1..-{n_layers} from the last)")
    msgs = [{"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ids = ids.to(model.device)
    spec = config.bind(config.spec(), model)
    config.fits(spec, ids.shape[1])
    cache = spec.make_cache(keep_log=True).bind(model)
    t0 = time.perf_counter()
    out = randattn.generate(
        model, ids, cache, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False
    )
    seconds = time.perf_counter() - t0
    n_new = out.shape[1] - ids.shape[1]
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    print(f"model: {model.config.model_type}, {model.config.num_hidden_layers} layers, "
          f"{model.config.num_key_value_heads} KV heads | policy={args.policy} K={args.budget} r={args.buffer} "
          f"protect_prompt={args.protect_prompt} prompt={ids.shape[1]} tokens")
    print("-" * 100)
    print(text.strip())
    print("-" * 100)
    seq = cache.get_seq_length()
    print(f"{n_new} new tokens in {seconds:.1f}s ({n_new / seconds:.1f} tok/s); sequence in cache: {seq} positions; "
          f"eviction rounds per layer: {cache.events[0]} (all layers: {sorted(set(cache.events))}); "
          f"time in rounds: {100 * cache.round_seconds / seconds:.1f}% of decode")
    if cache.total_events == 0:
        print("no eviction round ran: the sequence never reached T + r; lower --budget or raise --max-new-tokens")
    for spec in args.layers:
        layer = spec % n_layers
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
        cache.keep_log.save(Path(args.out).with_suffix(".npz"))
        Path(args.out).with_suffix(".json").write_text(json.dumps({"text": text, **cache.stats()}, indent=1))
        print(f"\nwrote {Path(args.out).with_suffix('.json')} and the keep-log {Path(args.out).with_suffix('.npz')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
