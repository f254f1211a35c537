"""Where, and why, vLLM + randattn and the HF engine part ways on bench/vllm.py's requests.

bench/vllm.py reports how many of its requests get identical greedy tokens in the two engines (the same policy,
T, r, seed and row keys); over 1,024 tokens that is none. This script takes the benchmark's own prompts
(``bench.vllm.make_prompts``) and keys (``bench.vllm.request_key``), runs the first ``--requests`` of them (default
2) for ``--new-tokens`` (default 1,024) through

- vLLM + the plugin at block size 32 (the benchmark's), at vLLM's CPU default (128), and at block size 32 in a pool
  too small for the requests at once (``--tiny-blocks``, default 12: each needs 9, so one is preempted and
  recomputed), each engine in its own process, asking vLLM for the top-2 log-probs of every step and writing
  keep-logs (``keep_log_dir``);
- vLLM + the plugin as bench/vllm.py runs it (``bench``): all 16 of its requests in one engine, block size 32,
  its 140-block pool, its sampling (``bench.vllm.vllm_sampling``: EOS masked); only the first ``--requests`` are
  compared;
- the HF ``EvictingCache`` with the same row keys, request by request, two ways: the conformance driver's
  ``decode_step`` loop (tests/vllm_engine_driver.py; greedy may pick EOS, as vLLM's ``ignore_eos`` lets it) and
  the benchmark's ``randattn.generate`` (batch 1, ``min_new_tokens``: EOS masked, as the ``bench`` arm's
  ``min_tokens``);

and writes, per request and pair of runs (``a`` vs ``b``; ``hf_*`` keys are ``a``'s, ``vllm_*`` keys ``b``'s), the first token index where HF and vLLM differ, the top-2 log-prob margins
of both engines at that step, and whether every keep-log record of the rounds before it (layer, round, length,
kept positions of every KV head) is equal. Run from the repository root with the vLLM environment:

    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m bench.vllm_agreement     # writes data/results/bench/vllm_agreement.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.common import BenchBase, hidden, parse, result_path
from bench.vllm import hf_generation, make_prompts, model_folder, request_key, vllm_sampling
from probes.config import POSITIVE, eviction, option

ARMS = ("bs32", "bs128", "bs32-preempt", "bench")


@dataclass
@eviction(budget=256, buffer=32)
class Config(BenchBase):
    """The agreement run's settings: the benchmark's T and r, its requests, the pools of the preempting and the
    benchmark arm (read by the probes' layered parser: defaults, ``--config FILE.toml``, flags)."""

    model: str = model_folder()
    device: str = hidden("auto")  # vLLM's platform: the CPU build here
    seed: int = hidden(0)  # the benchmark's seed 0, a key per request
    out: str = result_path("data/results/bench/vllm_agreement.json")
    requests: int = option(2, "the benchmark's first requests compared", check=POSITIVE)
    new_tokens: int = option(1024, "new tokens per request", check=POSITIVE)
    tiny_blocks: int = option(12, "pool of the preempting arm, block size 32", check=POSITIVE)
    bench_blocks: int = option(140, "pool of the 'bench' arm (bench/vllm.py's)", check=POSITIVE)
    arms: tuple[str, ...] = option(ARMS, "vLLM arms; 'bench': all 16 of the benchmark's requests in one engine, "
                                         "block size 32, its pool (only the first --requests are compared)",
                                   choices=ARMS)
    no_generate: bool = option(False, "skip the HF generate() run")


def _top2(lp_row):
    """(top-1 token, its logprob, top-2 logprob) of one step's HF log-probs (a 1-D tensor)."""
    v, i = lp_row.topk(2)
    return int(i[0]), float(v[0]), float(v[1])


def run_vllm(case: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import randattn.vllm
    from randattn.keeplog import KeepLog
    from randattn.vllm import checks
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    randattn.vllm.register()
    log_dir = tempfile.mkdtemp(prefix="randattn_agree_")
    kw = dict(model=case["model"], dtype="float32", enforce_eager=True, enable_prefix_caching=False, seed=0,
              max_model_len=case["max_model_len"], gpu_memory_utilization=0.3, scheduler_cls=checks.SCHEDULER,
              additional_config={"randattn": {"policy": "random", "budget": case["budget"], "buffer": case["buffer"],
                                              "seed": 0, "keep_log_dir": log_dir}})
    if case["block_size"]:
        kw["block_size"] = case["block_size"]
    if case["blocks"]:
        kw["num_gpu_blocks_override"] = case["blocks"] + 1
    llm = LLM(**kw)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    submitted = case.get("engine_prompts") or case["prompts"]  # the benchmark arm submits all its requests
    keys = [request_key(i) for i in range(len(submitted))]
    # the conformance driver's sampling (EOS may be picked, ignore_eos goes on), or bench/vllm.py's (EOS masked)
    sampling = (vllm_sampling(case["new_tokens"]) if case.get("mask_eos") else
                {"temperature": 0.0, "max_tokens": case["new_tokens"], "ignore_eos": True})
    params = [SamplingParams(**sampling, logprobs=2, extra_args={"randattn_key": k}) for k in keys]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in submitted], params, use_tqdm=False)
    reqs = []
    for k, o in zip(keys[: len(case["prompts"])], outs):
        comp = o.outputs[0]
        top = []
        for step in comp.logprobs:
            ranked = sorted(step.items(), key=lambda kv: kv[1].rank)
            top.append([[int(t), float(l.logprob)] for t, l in ranked[:2]])
        log = KeepLog.load(os.path.join(log_dir, randattn.vllm.log_file_name(k)))
        reqs.append({"key": k, "tokens": list(comp.token_ids), "top2": top, "keep": _log_dict(log)})
    return {"block_size": llm.llm_engine.vllm_config.cache_config.block_size,
            "preemptions": sched.counters["preemptions"], "tokens_computed": sched.counters["tokens_computed"],
            "requests": reqs}


def _log_dict(log) -> dict:
    return {f"{l}/{r}": [int(s), k.tolist()] for l, r, s, k in zip(log.layers, log.rounds, log.seq_lens, log.kept)}


def run_hf(case: dict) -> dict:
    import torch

    import randattn
    from randattn.spec import EvictionSpec

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, _ = randattn.load_model(case["model"], dtype=torch.float32)
    spec = EvictionSpec(policy="random", budget=case["budget"], buffer=case["buffer"], seed=0)
    reqs = []
    for i, prompt in enumerate(case["prompts"]):
        key = request_key(i)
        cache = spec.make_cache(keep_log=True, row_keys=[key])
        tokens, top = [], []
        with torch.inference_mode():  # the conformance driver's loop
            logits = randattn.decode_step(model, torch.tensor([prompt]), cache)[:, -1]
            for j in range(case["new_tokens"]):
                lp = torch.log_softmax(logits.float(), dim=-1)[0]
                t1, l1, l2 = _top2(lp)
                v, ix = lp.topk(2)
                tokens.append(t1)
                top.append([[int(ix[0]), float(v[0])], [int(ix[1]), float(v[1])]])
                if j + 1 < case["new_tokens"]:
                    logits = randattn.decode_step(model, torch.tensor([[t1]]), cache)[:, -1]
        gen = None
        if case["hf_generate"]:  # the benchmark's HF arm at batch 1 (its generate keywords: EOS masked)
            ids = torch.tensor([prompt])
            gcache = spec.make_cache(keep_log=True, row_keys=[key])
            out = randattn.generate(model, ids, gcache, attention_mask=torch.ones_like(ids),
                                    **hf_generation(case["new_tokens"]), output_scores=True,
                                    return_dict_in_generate=True)
            gtop = []
            for sc in out.scores:  # the processed scores greedy picked from (EOS at -inf)
                v, ix = torch.log_softmax(sc.float(), dim=-1)[0].topk(2)
                gtop.append([[int(ix[0]), float(v[0])], [int(ix[1]), float(v[1])]])
            gen = {"tokens": out.sequences[0, len(prompt):].tolist(), "top2": gtop, "keep": _log_dict(gcache.keep_log)}
        reqs.append({"key": key, "tokens": tokens, "top2": top, "keep": _log_dict(cache.keep_log),
                     "generate": gen, "eos": model.generation_config.eos_token_id})
    return {"requests": reqs}


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def compare(prompt_len: int, hf: dict, vl: dict) -> dict:
    d = _first_diff(hf["tokens"], vl["tokens"])
    out = {"first_divergence": d, "tokens_compared": min(len(hf["tokens"]), len(vl["tokens"]))}
    # rounds whose inputs precede the divergence: the forward that reaches length L has fed the tokens before
    # generated index L - prompt_len, so rounds at L <= prompt_len + d saw identical tokens on both sides
    limit = prompt_len + (d if d is not None else len(hf["tokens"]))
    before = [k for k, (s, _) in hf["keep"].items() if s <= limit]
    equal = sum(1 for k in before if k in vl["keep"] and vl["keep"][k] == hf["keep"][k])
    vl_before = sum(1 for s, _ in vl["keep"].values() if s <= limit)
    out.update(keep_records_before=len(before), keep_records_before_vllm=vl_before, keep_equal_before=equal)
    if d is not None:
        (h1, hl1), (h2, hl2) = hf["top2"][d]
        (v1, vl1), (v2, vl2) = vl["top2"][d]
        out.update(hf_top2=[[h1, hl1], [h2, hl2]], vllm_top2=[[v1, vl1], [v2, vl2]],
                   hf_margin=hl1 - hl2, vllm_margin=vl1 - vl2,
                   swapped=(h1, h2) == (v2, v1))
        # how close the two engines were before: the largest |dlogprob| of the greedy token over the equal prefix
        out["max_dlogprob_before"] = max((abs(a[0][1] - b[0][1]) for a, b in zip(hf["top2"][:d], vl["top2"][:d])),
                                         default=0.0)
    return out


def _sub(kind: str, case: dict, tmp: Path) -> dict:
    case_path, out_path = tmp / f"{kind}_case.json", tmp / f"{kind}_out.json"
    case_path.write_text(json.dumps(case))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    print(f"[{kind}] running", flush=True)
    subprocess.run([sys.executable, "-m", "bench.vllm_agreement", "--worker", kind, str(case_path), str(out_path)],
                   env=env, check=True)
    return json.loads(out_path.read_text())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        kind, case_path, out_path = argv[1:]
        case = json.loads(Path(case_path).read_text())
        res = run_hf(case) if kind == "hf" else run_vllm(case)
        Path(out_path).write_text(json.dumps(res))
        return 0
    args = parse(Config, argv, __doc__.splitlines()[0])[1]
    from transformers import AutoTokenizer

    from bench.common import provenance, write_results

    tok = AutoTokenizer.from_pretrained(args.model)
    every = make_prompts(tok, 16)  # the benchmark's requests (same rng stream)
    prompts = every[: args.requests]
    longest = max(map(len, every)) + args.new_tokens
    base = {"model": args.model, "prompts": prompts, "new_tokens": args.new_tokens, "budget": args.budget,
            "buffer": args.buffer, "max_model_len": -(-longest // 128) * 128, "hf_generate": not args.no_generate}
    arms = {"bs32": (32, None), "bs128": (None, None), "bs32-preempt": (32, args.tiny_blocks),
            "bench": (32, args.bench_blocks)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = _sub("hf", base, Path(tmp))
        vls = {a: _sub("vllm", {**base, "block_size": arms[a][0], "blocks": arms[a][1], "mask_eos": a == "bench",
                                "engine_prompts": every if a == "bench" else None}, Path(tmp)) for a in args.arms}
    for i, h in enumerate(hf["requests"]):
        g = h["generate"]
        if g is not None:
            row = {"request": h["key"], "prompt_len": len(prompts[i]), "a": "hf decode_step", "b": "hf generate",
                   **compare(len(prompts[i]), h, g)}
            d = row["first_divergence"]
            if d is not None:  # what decode_step picked there, and whether generate's EOS mask forbade it
                row["a_token_is_eos"] = h["tokens"][d] in ([h["eos"]] if isinstance(h["eos"], int) else h["eos"])
            rows.append(row)
            if "bench" in vls:  # the benchmark's two arms as bench/vllm.py now runs them (EOS masked in both)
                rows.append({"request": h["key"], "prompt_len": len(prompts[i]), "a": "hf generate",
                             "b": "vllm bench", "preemptions": vls["bench"]["preemptions"],
                             **compare(len(prompts[i]), g, vls["bench"]["requests"][i])})
        for a, vl in vls.items():
            row = {"request": h["key"], "prompt_len": len(prompts[i]), "a": "hf decode_step", "b": f"vllm {a}",
                   "block_size": vl["block_size"], "preemptions": vl["preemptions"],
                   **compare(len(prompts[i]), h, vl["requests"][i])}
            rows.append(row)
        names = [a for a in vls if a != "bench"]
        for x, y in zip(names, names[1:]):
            rows.append({"request": h["key"], "prompt_len": len(prompts[i]), "a": f"vllm {x}", "b": f"vllm {y}",
                         **compare(len(prompts[i]), vls[x]["requests"][i], vls[y]["requests"][i])})
    for r in rows:
        extra = (f" margins hf {r['hf_margin']:.2e} vllm {r['vllm_margin']:.2e} swapped {r['swapped']}"
                 if r.get("hf_margin") is not None else "")
        keep = (f" keep before {r['keep_equal_before']}/{r['keep_records_before']}"
                if "keep_equal_before" in r else "")
        print(f"{r['request']} {r['a']} vs {r['b']}: first divergence {r['first_divergence']}{keep}{extra}",
              flush=True)
    import torch
    import vllm

    meta = {"model": args.model, "dtype": "torch.float32", "vllm": vllm.__version__, "torch": torch.__version__,
            "threads": int(os.environ.get("OMP_NUM_THREADS", "1")), **provenance(), "requests": args.requests,
            "new_tokens": args.new_tokens, "budget": args.budget, "buffer": args.buffer,
            "tiny_blocks": args.tiny_blocks, "bench_blocks": args.bench_blocks, "arms": list(args.arms),
            "preemptions": {a: v["preemptions"] for a, v in vls.items()},
            "prompt_lengths": [len(p) for p in prompts]}
    write_results(args.out, meta, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
