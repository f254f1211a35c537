"""The vLLM plugin's CUDA path against the HF engine on the same GPU (issue 39, item 3; run by bench/vllm_gpu_check.sh).

NOT RUN ON A GPU YET: written with the CUDA path (randattn.vllm.flash_backend), whose layout code is tested on CPU.

For each policy (``--policies``, default random, rkv, snapkv) one vLLM engine on CUDA (FlashAttention, the plugin's
wrap of it) generates ``--new-tokens`` greedy tokens for ``--requests`` prompts (bench.vllm's prompts and keys) with
keep-logs; then the HF ``EvictingCache`` on the same GPU, same dtype, same row keys, teacher-forces exactly vLLM's
tokens (``randattn.replay``: rounds where token-by-token decoding has them) and its keep-log is compared record by
record (layer, round, length, kept positions of every KV head).

What to expect: Random's keep-sets depend only on (seed, key, layer, round) and the candidate count, never on the
values, so every record must be equal (``random_exact``); the query-window selectors rank bf16 scores that two
different kernels computed, so near-ties may break differently: their share of equal records is reported, not
required. On CPU in float32 both are exact (tests/test_vllm_engine.py).

    python -m bench.vllm_gpu_conformance --out data/results/bench/vllm_gpu_conformance.json   # in the CUDA vLLM venv
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _records(log) -> dict:
    return {(l, r): (s, k) for l, r, s, k in zip(log.layers, log.rounds, log.seq_lens, log.kept)}


def compare(hf_log, vl_log) -> dict:
    """Equal records (same length and the same kept positions in every head) of two keep-logs, keyed by (layer,
    round)."""
    import numpy as np

    hf, vl = _records(hf_log), _records(vl_log)
    equal = sum(1 for k in set(hf) & set(vl) if hf[k][0] == vl[k][0] and np.array_equal(hf[k][1], vl[k][1]))
    return {"hf_records": len(hf), "vllm_records": len(vl), "equal": equal}


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model folder (default: the embedded model's converted folder)")
    p.add_argument("--policies", nargs="+", default=["random", "rkv", "snapkv"])
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--buffer", type=int, default=64, help="r (the paper's 64)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--out", default="data/results/bench/vllm_gpu_conformance.json")
    a = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    import randattn
    import randattn.models as models
    from bench.vllm import make_prompts, request_key
    from randattn.keeplog import KeepLog
    from randattn.vllm import log_file_name, register

    if not torch.cuda.is_available():
        raise SystemExit("bench.vllm_gpu_conformance needs a CUDA GPU (this is the CUDA path's check)")
    register()
    folder = a.model or str(models.converted_embedded(models.DEFAULT_MODEL))
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = make_prompts(tok, a.requests)
    keys = [request_key(i) for i in range(a.requests)]
    hf_model = randattn.load_model(folder, dtype=a.dtype, device="cuda")[0]
    result = {"model": folder, "dtype": a.dtype, "device": torch.cuda.get_device_name(), "budget": a.budget,
              "buffer": a.buffer, "new_tokens": a.new_tokens, "policies": {}}
    for policy in a.policies:
        log_dir = tempfile.mkdtemp(prefix="randattn_gpu_keep_")
        engine = {"policy": policy, "budget": a.budget, "buffer": a.buffer, "keep_log_dir": log_dir}
        t0 = time.perf_counter()
        llm = LLM(model=folder, dtype=a.dtype, enforce_eager=True, seed=0, enable_prefix_caching=False,
                  block_size=16, max_model_len=max(map(len, prompts)) + a.new_tokens + 16,
                  gpu_memory_utilization=0.3, additional_config={"randattn": engine})
        params = [SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True,
                                 extra_args={"randattn_key": k}) for k in keys]
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        del llm
        torch.cuda.empty_cache()
        rows = []
        for ids, key, o in zip(prompts, keys, outs):
            toks = list(o.outputs[0].token_ids)
            vl_log = KeepLog.load(os.path.join(log_dir, log_file_name(key)))
            cache = randattn.EvictionSpec(policy, budget=a.budget, buffer=a.buffer).make_cache(keep_log=True,
                                                                                               row_keys=[key])
            # vLLM never feeds its last token back, so neither does the replay (it would only add a round)
            seq = torch.tensor([ids + toks[:-1]], device="cuda")
            with torch.inference_mode():
                randattn.replay(hf_model, seq, cache, prompt_len=len(ids))
            rows.append({"key": key, "tokens": len(toks), **compare(cache.keep_log, vl_log)})
        equal = sum(r["equal"] for r in rows)
        total = sum(r["hf_records"] for r in rows)
        result["policies"][policy] = {"requests": rows, "equal_records": equal, "hf_records": total,
                                      "share_equal": equal / total if total else None, "vllm_wall_s": wall}
        print(f"{policy}: {equal}/{total} keep records equal to the HF engine's", flush=True)
    if "random" in result["policies"]:
        r = result["policies"]["random"]
        result["random_exact"] = r["hf_records"] > 0 and r["equal_records"] == r["hf_records"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0 if result.get("random_exact", True) else 1


if __name__ == "__main__":
    sys.exit(main())
