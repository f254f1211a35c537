"""Run one conformance case in the vLLM environment: the same prompts through vLLM with the randattn plugin and
through the HF ``EvictingCache``, and write what both did as JSON (tests/test_vllm_engine.py reads it).

    .venv-vllm/bin/python tests/vllm_engine_driver.py CASE.json OUT.json

CASE: ``{"model": folder, "engine": additional_config['randattn'], "requests": [{"prompt_ids": [...], "key":
str|null, "seed": int|null, "max_tokens": n}], "block_size": 32, "hf": true, "alone": false, "in_process": true,
"bad_keys": false}``; ``"mode": "refusals"`` (with ``"long_prompt_ids"``) runs the refusal checks instead. A
request's key goes to ``SamplingParams(extra_args={"randattn_key": key})``; without one vLLM uses
``randattn.vllm.default_key(prompt_ids, seed)``, and so does the HF cache's ``row_keys`` here (the documented way
to reproduce such a request on the HF side). ``seed`` is ``SamplingParams.seed`` (greedy: it only changes the key).
The keep-log of the n-th request of a key (submission order) is ``randattn.vllm.log_file_name(key, n)``.

OUT: per request its key and keep-log file, the vLLM tokens and per-token logprobs and a digest of its keep-log,
the HF tokens and logprobs of its own greedy run, and the keep-log comparison (records on each side, equal records,
the first difference); with ``"bad_keys"`` what a bad key and a batch holding one got (``out["bad_keys"]``);
``"times"``: seconds per phase (imports, engine start, generate, alone/bad-key runs, HF side).

``{"cases": [CASE, ...]}`` runs the cases one engine after the other in this process (the HF model loaded once) and
writes ``{"cases": [OUT, ...]}``, rewritten after each case; a case with ``"in_process": false`` runs alone.
"""

from __future__ import annotations

import gc
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


def _digest(log) -> str:
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for arr in (log.layers, log.rounds, log.seq_lens):
        h.update(np.asarray(arr, np.int64).tobytes())
    for kept in log.kept:
        h.update(np.asarray(kept, np.int64).tobytes())
    return h.hexdigest()


def _bad_keys(llm, reqs) -> dict:
    """A key that is not one is refused for its request, naming randattn_key; ``LLM.generate`` over a list holding
    such a request raises (vLLM's semantics: the whole call fails); the engine serves the next call."""
    from vllm import SamplingParams

    out = {}
    sp = lambda key: SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,  # noqa: E731
                                    extra_args={"randattn_key": key})
    prompt = {"prompt_token_ids": reqs[0]["prompt_ids"]}
    try:
        llm.generate([prompt], [sp(1.5)], use_tqdm=False)
        out["float_key"] = None
    except Exception as exc:  # noqa: BLE001  (the message is what is checked)
        out["float_key"] = f"{type(exc).__name__}: {exc}"
    try:
        got = llm.generate([prompt, prompt], [sp("fine"), sp(-1)], use_tqdm=False)
        out["batch_with_bad_key"] = [len(o.outputs[0].token_ids) for o in got]
    except Exception as exc:  # noqa: BLE001
        out["batch_with_bad_key"] = f"{type(exc).__name__}: {exc}"
    out["after"] = len(llm.generate([prompt], [sp("fine")], use_tqdm=False)[0].outputs[0].token_ids)
    return out


def _refusals(case) -> dict:
    """A policy vLLM cannot serve is refused when the engine is made; a prompt that does not fit is refused for its
    request alone, and a request added before it finishes."""
    from vllm import LLM, SamplingParams

    out = {}
    common = dict(model=case["model"], dtype="float32", enforce_eager=True, seed=0, enable_prefix_caching=False,
                  block_size=32, max_model_len=1024)
    for policy in ("triattention",):
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


T0 = time.perf_counter()
_HF_MODEL = []  # the HF model, loaded once per process (a "cases" list shares it)


def _hf_model(folder):
    if not _HF_MODEL:
        import randattn

        _HF_MODEL.append(randattn.load_model(folder, dtype="float32", device="cpu")[0])
    return _HF_MODEL[0]


def run_case(case: dict) -> dict:
    """One engine: the case's requests through vLLM (in a batch, then alone when asked), then through the HF cache."""
    from vllm import LLM, SamplingParams

    from randattn.keeplog import KeepLog
    from randattn.vllm import default_key, log_file_name

    if case.get("mode") == "refusals":
        return _refusals(case)
    log_dir = tempfile.mkdtemp(prefix="randattn_vllm_keep_")
    engine = dict(case["engine"])
    engine["keep_log_dir"] = log_dir
    kw = {}
    if case.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = case["max_num_batched_tokens"]
    if case.get("blocks"):  # a pool too small for the batch at once: vLLM preempts and recomputes
        kw["num_gpu_blocks_override"] = case["blocks"] + 1  # + vLLM's null block
    times = {"start_s": time.perf_counter() - T0}  # phases, for the tier's time budget (docs/testing.md)
    t0 = time.perf_counter()
    llm = LLM(model=case["model"], dtype="float32", enforce_eager=True, seed=0, enable_prefix_caching=False,
              block_size=case.get("block_size", 32), max_model_len=case.get("max_model_len", 4096),
              additional_config={"randattn": engine}, **kw)
    times["engine_s"] = time.perf_counter() - t0
    reqs = case["requests"]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, logprobs=0,
                             seed=r.get("seed"),
                             extra_args=None if r.get("key") is None else {"randattn_key": r["key"]}) for r in reqs]
    keys = [r["key"] if r.get("key") is not None else default_key(r["prompt_ids"], r.get("seed")) for r in reqs]
    runs: dict = {}  # requests run so far per key: the n-th writes log_file_name(key, n)

    def log_of(key):
        name = log_file_name(key, runs.get(key, 0))
        runs[key] = runs.get(key, 0) + 1
        path = os.path.join(log_dir, name)
        return name, KeepLog.load(path) if os.path.exists(path) else KeepLog()

    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in reqs], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    sched = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    counters = dict(getattr(getattr(sched, "scheduler", None), "counters", {}) or {})  # in-process engine core only
    result = {"wall_s": wall, "new_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "requests": [],
              "preemptions": counters.get("preemptions"),
              "log_files": sorted(os.listdir(log_dir))}
    vl_logs = []
    for key, o in zip(keys, outs):
        comp = o.outputs[0]
        lps = [float(step[tok].logprob) for step, tok in zip(comp.logprobs, comp.token_ids)]
        name, log = log_of(key)
        vl_logs.append(log)
        result["requests"].append({"key": key, "log_file": name, "vllm_keep_records": len(log),
                                   "vllm_keep_digest": _digest(log), "vllm_tokens": list(comp.token_ids),
                                   "vllm_logprobs": lps})
    t0 = time.perf_counter()
    if case.get("alone"):  # each request again, alone in the engine: the same tokens and keep-sets as in the batch
        for r, row, p, batch_log in zip(reqs, result["requests"], params, vl_logs):
            comp = llm.generate([{"prompt_token_ids": r["prompt_ids"]}], [p], use_tqdm=False)[0].outputs[0]
            _, alone_log = log_of(row["key"])
            row.update(alone_tokens=list(comp.token_ids), alone_keep=_compare_logs(batch_log, alone_log))
    if case.get("bad_keys"):
        result["bad_keys"] = _bad_keys(llm, reqs)
    times["alone_s"] = time.perf_counter() - t0
    del llm
    gc.collect()
    t0 = time.perf_counter()
    if case.get("hf", True):
        model = _hf_model(case["model"])
        done = {}  # an identical request (same key, prompt, length) is run once on the HF side
        for r, row, vl_log in zip(reqs, result["requests"], vl_logs):
            same = (row["key"], tuple(r["prompt_ids"]), r["max_tokens"])
            if same not in done:
                done[same] = _hf_run(model, r["prompt_ids"], row["key"], case["engine"], r["max_tokens"])
            toks, lps, log = done[same]
            row.update(hf_tokens=toks, hf_logprobs=lps, keep=_compare_logs(log, vl_log))
    times["hf_s"] = time.perf_counter() - t0
    result["times"] = {**times, "generate_s": wall}
    return result


def main(case_path: str, out_path: str) -> int:
    with open(case_path) as f:
        case = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cases = case.get("cases", [case])  # a list of cases: one engine after the other in this process
    if all(c.get("in_process", True) for c in cases):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    elif len(cases) > 1:
        raise SystemExit("vllm_engine_driver: a case with in_process=false runs alone, not in a 'cases' list")

    from randattn.vllm import register

    register()  # what the vllm.general_plugins entry point does in each process
    results = []
    for c in cases:
        results.append(run_case(c))
        with open(out_path, "w") as f:  # what ran so far survives a later failure
            json.dump({"cases": results} if "cases" in case else results[0], f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
