"""Where one vLLM arm of ``bench.vllm`` spends its time: the arm's worker under cProfile, split into parts.

Run with the vLLM virtual environment, from the repository root (the profiled worker runs with 1 thread by default,
so the split is not blurred by thread waits):

    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m bench.vllm_profile --arm "vllm random" --requests 16 --new-tokens 512

The worker is ``bench.vllm``'s own (``-m bench.vllm --worker ARM CASE OUT``, the same engine, pool and requests as
the benchmark; the case file is built as ``bench.vllm`` builds it, or given with ``--case``), run as
``python -m cProfile -o PROFILE -m bench.vllm --worker ...``. Parts, in cumulative seconds inside vLLM's
``execute_model`` (all steps, the untimed warm-up included):

- ``rounds``: the plugin's eviction rounds (``randattn/vllm/state.py:_round``); inside them ``read`` / ``write``
  (``PagedKV``, the request's held slots out of / back into its blocks), ``select`` (the round engine's
  ``RoundEngine.keep`` in ``randattn/rounds.py``: score, force-evict, select) and ``view`` (its ``RoundEngine.view``:
  the candidates, the seeded generator, the pins);
- ``bookkeeping``: the plugin's per-layer work outside rounds (the backend's ``forward`` less vLLM's attention and
  the rounds: positions, query buffering, PagedKV set-up) plus ``plan_step`` (once per step);
- ``attention``: vLLM's CPU attention (``cpu_attn.py`` impl ``forward``) and its KV write (``do_kv_cache_update``);
- ``logits``: vLLM's ``LogitsProcessor.forward`` (the LM head);
- ``other``: the rest of ``execute_model`` (the model's linear layers, norms, sampling, input preparation).

Profiling costs time itself (Python calls are slowed most), so shares are indicative; compare runs of this script,
not with ``bench.vllm``'s timings. ``--from-profile FILE`` only splits an existing profile (for example one made
before a change, with the same command). Results go to ``data/results/bench/vllm_profile.json``, one entry per
(arm, size, revision), replacing an entry with the same key.
"""

from __future__ import annotations

import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from bench.common import BenchBase, hidden, parse
from bench.vllm import ARMS, block_size_option, make_prompts, model_folder
from probes.config import POSITIVE, eviction, option

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "data" / "results" / "bench" / "vllm_profile.json"


@dataclass
@eviction(budget=256, buffer=32)
class Config(BenchBase):
    """One vLLM arm of bench.vllm under cProfile (read by the probes' layered parser: defaults, ``--config
    FILE.toml``, flags)."""

    model: str = model_folder()
    device: str = hidden("auto")  # vLLM's platform: the CPU build here
    seed: int = hidden(0)  # the benchmark's seed 0, a key per request
    out: str = option(str(OUT), "the profile record (JSON; an entry of the same arm, sizes and revision is replaced)",
                      metavar="FILE")
    arm: str = option("vllm random", "the vLLM arm profiled", choices=ARMS[:2])
    requests: int = option(16, "requests", check=POSITIVE)
    new_tokens: int = option(512, "new tokens per request", check=POSITIVE)
    block_size: int = block_size_option()
    blocks: int = option(140, "KV pool in blocks (bench.vllm's run)", check=POSITIVE)
    threads: int = option(1, "CPU threads of the profiled process", check=POSITIVE)
    case: Optional[str] = option(None, "a bench.vllm case file to run instead of building one (its sizes are used)",
                                 metavar="FILE")
    from_profile: Optional[str] = option(None, "split this cProfile file instead of running (give --revision)",
                                         metavar="FILE")
    revision: Optional[str] = option(None, "the revision to name (default: git HEAD, +dirty if randattn/vllm "
                                           "changed)")
    note: str = option("", "a note kept with the entry")
    keep_profile: Optional[str] = option(None, "copy the cProfile file here", metavar="FILE")


def _find(stats: pstats.Stats, path_end: str, func: str) -> dict:
    """Cumulative seconds and calls of the function ``func`` in a file ending with ``path_end`` (0 if absent)."""
    ct, calls = 0.0, 0
    for (f, _line, fn), (_cc, nc, _tt, cum, _callers) in stats.stats.items():
        if fn == func and f.replace(os.sep, "/").endswith(path_end):
            ct, calls = ct + cum, calls + nc
    return {"s": ct, "calls": calls}


def split(profile: str) -> dict:
    """The parts of ``execute_model`` (module docstring) from a cProfile file."""
    st = pstats.Stats(profile)
    f = {
        "execute_model": _find(st, "vllm/v1/worker/gpu_model_runner.py", "execute_model"),
        "hook_forward": _find(st, "randattn/vllm/backend.py", "forward"),
        "round": _find(st, "randattn/vllm/state.py", "_round"),
        "read": _find(st, "randattn/vllm/backend.py", "read"),
        "write": _find(st, "randattn/vllm/backend.py", "write"),
        "select": _find(st, "randattn/rounds.py", "keep"),
        "view": _find(st, "randattn/rounds.py", "view"),
        "after_attention": _find(st, "randattn/vllm/state.py", "after_attention"),
        "plan_step": _find(st, "randattn/vllm/state.py", "plan_step"),
        "attn_forward": _find(st, "vllm/v1/attention/backends/cpu_attn.py", "forward"),
        "kv_update": _find(st, "vllm/v1/attention/backends/cpu_attn.py", "do_kv_cache_update"),
        "logits": _find(st, "vllm/model_executor/layers/logits_processor.py", "forward"),
    }
    total = f["execute_model"]["s"]
    rounds = f["round"]["s"]
    # the hook's forward wraps vLLM's attention forward; without the plugin's backend (no hook) it is absent
    per_layer = 0.0
    if f["hook_forward"]["calls"]:
        per_layer = max(f["hook_forward"]["s"] - f["attn_forward"]["s"] - rounds, 0.0)
    bookkeeping = per_layer + f["plan_step"]["s"]
    attention = f["attn_forward"]["s"] + f["kv_update"]["s"]
    logits = f["logits"]["s"]
    seconds = {
        "execute_model": total,
        "rounds": rounds,
        "rounds.read": f["read"]["s"],
        "rounds.write": f["write"]["s"],
        "rounds.select": f["select"]["s"],
        "rounds.view": f["view"]["s"],
        "bookkeeping": bookkeeping,
        "bookkeeping.per_layer": per_layer,
        "bookkeeping.after_attention_outside_rounds": max(f["after_attention"]["s"] - rounds, 0.0),
        "bookkeeping.plan_step": f["plan_step"]["s"],
        "attention": attention,
        "logits": logits,
        "other": total - rounds - bookkeeping - attention - logits,
    }
    return {"seconds": {k: round(v, 2) for k, v in seconds.items()},
            "share_of_execute_model": {k: round(v / total, 4) for k, v in seconds.items() if total},
            "calls": {"steps": f["execute_model"]["calls"], "rounds": f["round"]["calls"],
                      "layer_forwards": f["hook_forward"]["calls"] or f["attn_forward"]["calls"]}}


def _revision() -> str:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    return rev + ("+dirty(randattn/vllm)" if git("status", "--porcelain", "randattn/vllm") else "")


def _plugin_blobs() -> dict:
    """Git blob ids of the plugin's files as run (to tie a dirty-tree run to the commit that holds the same code)."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "randattn" / "vllm").glob("*.py"))
    out = subprocess.run(["git", "hash-object", *files], cwd=ROOT, capture_output=True, text=True).stdout.split()
    return dict(zip(files, out))


def _case(args) -> dict:
    if args.case:
        return json.loads(Path(args.case).read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = make_prompts(tok, args.requests)
    longest = max(map(len, prompts)) + args.new_tokens
    return {"model": args.model, "prompts": prompts, "new_tokens": args.new_tokens, "budget": args.budget,
            "buffer": args.buffer, "block_size": args.block_size, "blocks": args.blocks,
            "max_model_len": -(-longest // args.block_size) * args.block_size, "threads": args.threads,
            "memory_utilization": 0.3, "hf_batches": [], "dtype": "float32"}


def _record(entry: dict, out: Path) -> None:
    rows = json.loads(out.read_text())["runs"] if out.exists() else []
    key = lambda r: (r["arm"], r["requests"], r["new_tokens"], r["revision"])  # noqa: E731
    rows = [r for r in rows if key(r) != key(entry)] + [entry]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"doc": __doc__.splitlines()[0], "runs": rows}, indent=1) + "\n")


def main(argv=None) -> int:
    args = parse(Config, argv, __doc__.splitlines()[0])[1]
    case = _case(args)
    entry = {"arm": args.arm, "requests": len(case["prompts"]), "new_tokens": case["new_tokens"],
             "budget": case["budget"], "buffer": case["buffer"], "block_size": case["block_size"],
             "blocks": case["blocks"], "threads": case["threads"], "revision": args.revision or _revision(),
             "note": args.note}
    if not args.from_profile:
        entry["plugin_blobs"] = _plugin_blobs()
    with tempfile.TemporaryDirectory() as tmp:
        if args.from_profile:
            prof = args.from_profile
            entry["profile"] = "given (--from-profile)"
        else:
            prof, case_path, out_path = Path(tmp) / "prof.out", Path(tmp) / "case.json", Path(tmp) / "out.json"
            case_path.write_text(json.dumps(case))
            env = {**os.environ, "OMP_NUM_THREADS": str(case["threads"]), "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "bench.vllm", "--worker",
                            args.arm, str(case_path), str(out_path)], env=env, cwd=ROOT, check=True)
            entry["profiled_process_s"] = round(time.perf_counter() - t0, 1)
            row = json.loads(out_path.read_text())[0]
            entry["generate_wall_s"] = round(row["wall_s"], 1)  # the timed generate call, under the profiler
            entry["generated_tokens"] = row["generated_tokens"]
            entry["profile"] = "run here"
            if args.keep_profile:
                Path(args.keep_profile).write_bytes(Path(prof).read_bytes())
        entry.update(split(str(prof)))
    made = os.path.getmtime(args.from_profile) if args.from_profile else time.time()
    entry["measured"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(made))
    _record(entry, Path(args.out))
    print(json.dumps(entry, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
