"""Run one conformance case in the vLLM environment: the same prompts through vLLM with the randattn plugin and
through the HF ``EvictingCache``, and write what both did as JSON (tests/test_vllm_engine.py reads it).

    .venv-vllm/bin/python tests/vllm_engine_driver.py CASE.json OUT.json

CASE: ``{"model": folder, "engine": additional_config['randattn'], "requests": [{"prompt_ids": [...], "key":
str|null, "max_tokens": n}], "block_size": 32, "hf": true, "alone": false, "in_process": true}``; ``"mode":
"refusals"`` (with ``"long_prompt_ids"``) runs the refusal checks instead. A request's key
goes to ``SamplingParams(extra_args={"randattn_key": key})`` and to the HF cache's ``row_keys``; with no key the
HF side cannot know vLLM's request id, so it is not run for that request.

OUT: per request the vLLM tokens and per-token logprobs, the HF tokens and logprobs of its own greedy run, and
the keep-log comparison (records on each side, equal records, the first difference).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def _hf_run(model, prompt_ids, key, engine, max_tokens):
    import torch

    import randattn
    from randattn.spec import EvictionSpec

    spec_kw = {k: engine[k] for k in ("policy", "budget", "buffer", "recent", "protect_prompt", "seed", "options")
               if k in engine}
    cache = EvictionSpec(**spec_kw).make_cache(keep_log=True, row_keys=[key])
    ids = torch.tensor([prompt_ids])
    tokens, logprobs = [], []
    with torch.inference_mode():
        logits = randattn.decode_step(model, ids, cache)[:, -1]
        for i in range(max_tokens):
            lp = torch.log_softmax(logits.float(), dim=-1)
            nxt = int(lp.argmax(-1))
            tokens.append(nxt)
            logprobs.append(float(lp[0, nxt]))
            if i + 1 < max_tokens:  # vLLM never feeds its last token back either (it would only run a round)
                logits = randattn.decode_step(model, torch.tensor([[nxt]]), cache)[:, -1]
    return tokens, logprobs, cache.keep_log


def _compare_logs(hf_log, vl_log):
    hf = {(l, r): (s, k) for l, r, s, k in zip(hf_log.layers, hf_log.rounds, hf_log.seq_lens, hf_log.kept)}
    vl = {(l, r): (s, k) for l, r, s, k in zip(vl_log.layers, vl_log.rounds, vl_log.seq_lens, vl_log.kept)}
    import numpy as np

    equal, first = 0, None
    for key in sorted(set(hf) | set(vl)):
        a, b = hf.get(key), vl.get(key)
        if a is not None and b is not None and a[0] == b[0] and a[1].shape == b[1].shape and np.array_equal(a[1], b[1]):
            equal += 1
        elif first is None:
            first = {"layer": key[0], "round": key[1], "hf_seq_len": None if a is None else a[0],
                     "vllm_seq_len": None if b is None else b[0],
                     "differing_slots": None if a is None or b is None or a[1].shape != b[1].shape
                     else int((a[1] != b[1]).sum())}
    return {"hf_records": len(hf), "vllm_records": len(vl), "equal": equal, "first_difference": first}


def _refusals(case) -> dict:
    """A policy vLLM cannot serve is refused when the engine is made; a prompt that does not fit is refused for its
    request alone, and a request added before it finishes."""
    from vllm import LLM, SamplingParams

    out = {}
    common = dict(model=case["model"], dtype="float32", enforce_eager=True, seed=0, enable_prefix_caching=False,
                  block_size=32, max_model_len=1024)
    for policy in ("h2o", "triattention"):
        try:
            LLM(**common, additional_config={"randattn": {"policy": policy, "budget": 64, "buffer": 16}})
            out[policy] = None
        except Exception as exc:  # noqa: BLE001  (the message is what is checked)
            out[policy] = f"{type(exc).__name__}: {exc}"
    llm = LLM(**common, additional_config={"randattn": case["engine"]})
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=case["requests"][0]["max_tokens"], ignore_eos=True)
    engine.add_request("good", {"prompt_token_ids": case["requests"][0]["prompt_ids"]}, sp)
    try:
        engine.add_request("too-long", {"prompt_token_ids": case["long_prompt_ids"]}, sp)
        out["too_long"] = None
    except Exception as exc:  # noqa: BLE001
        out["too_long"] = f"{type(exc).__name__}: {exc}"
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    out["finished"] = done
    return out


def main(case_path: str, out_path: str) -> int:
    with open(case_path) as f:
        case = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if case.get("in_process", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    log_dir = tempfile.mkdtemp(prefix="randattn_vllm_keep_")
    engine = dict(case["engine"])
    engine["keep_log_dir"] = log_dir

    from randattn.vllm import register

    register()  # what the vllm.general_plugins entry point does in each process
    from vllm import LLM, SamplingParams

    kw = {}
    if case.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = case["max_num_batched_tokens"]
    if case.get("mode") == "refusals":
        with open(out_path, "w") as f:
            json.dump(_refusals(case), f)
        return 0
    llm = LLM(model=case["model"], dtype="float32", enforce_eager=True, seed=0, enable_prefix_caching=False,
              block_size=case.get("block_size", 32), max_model_len=case.get("max_model_len", 4096),
              additional_config={"randattn": engine}, **kw)
    reqs = case["requests"]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, logprobs=0,
                             extra_args=None if r.get("key") is None else {"randattn_key": r["key"]}) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in reqs], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    result = {"wall_s": wall, "new_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "requests": []}
    from randattn.keeplog import KeepLog

    vl_logs = {}
    for r, o in zip(reqs, outs):
        comp = o.outputs[0]
        lps = [float(step[tok].logprob) for step, tok in zip(comp.logprobs, comp.token_ids)]
        name = r.get("key") or o.request_id
        path = os.path.join(log_dir, f"{name}.npz")
        vl_logs[name] = KeepLog.load(path) if os.path.exists(path) else KeepLog()
        result["requests"].append({"key": r.get("key"), "vllm_tokens": list(comp.token_ids), "vllm_logprobs": lps})
    if case.get("alone"):  # each request again, alone in the engine: the same tokens and keep-sets as in the batch
        for r, row, p in zip(reqs, result["requests"], params):
            comp = llm.generate([{"prompt_token_ids": r["prompt_ids"]}], [p], use_tqdm=False)[0].outputs[0]
            name = r.get("key")
            alone_log = KeepLog.load(os.path.join(log_dir, f"{name}.npz"))
            row.update(alone_tokens=list(comp.token_ids), alone_keep=_compare_logs(vl_logs[name], alone_log))
    del llm
    if case.get("hf", True):
        import randattn

        model, _ = randattn.load_model(case["model"], dtype="float32", device="cpu")
        for r, row in zip(reqs, result["requests"]):
            if r.get("key") is None:
                continue
            toks, lps, log = _hf_run(model, r["prompt_ids"], r["key"], case["engine"], r["max_tokens"])
            row.update(hf_tokens=toks, hf_logprobs=lps, keep=_compare_logs(log, vl_logs[r["key"]]))
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
