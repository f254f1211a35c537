"""Peak memory of a long generation: process RSS high-water mark and peak KV bytes, full attention vs eviction.

    python -m bench.memory                         # 8,000 new tokens, K=1,024, r=64, batch 1
    python -m bench.memory --new-tokens 4096 --batch 4

Each arm runs in a fresh Python process (so one arm's heap never raises another's high-water
mark): it loads the model, warms up, notes its RSS high-water mark, generates, and reports the
high-water mark again (``resource.getrusage``) with the peak KV bytes read after every step.
Printed and saved per arm: RSS after loading, peak RSS, the growth during generation, peak KV
bytes, and the ratios to full attention. 8,000 new tokens keep the embedded model (8,192
positions) inside its trained context.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import randattn

from bench.common import (REPO_ROOT, BenchConfig, check_rounds_run, meta, parse, policy_options, run_arms, setup,
                          write_results)
from probes.config import DEFAULT, POSITIVE, eviction, option, setting
from probes.policy_specs import calibration_options

MARK = "ARM-RESULT "


@dataclass
@eviction(policies=setting(help="evicting policies compared with full attention"), stats=DEFAULT)
class Config(BenchConfig):
    """Peak memory of a long generation: process RSS high-water mark and peak KV bytes, full attention vs eviction."""

    new_tokens: int = option(8000, "tokens generated per sequence", check=POSITIVE)
    batch: int = option(1, "sequences generated together", check=POSITIVE)
    arm: Optional[str] = option(None, argparse.SUPPRESS)  # internal: run one arm in this process


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_arm(p, args) -> int:
    """The child: one generation under ``args.arm``; prints its row after MARK."""
    policy = None if args.arm == "full" else args.arm
    model, _, prompt = setup(args, p)
    options = policy_options(p, args, [args.arm], model)
    check_rounds_run(p, args, prompt.shape[1])
    before = peak_rss_bytes()
    [row] = run_arms(model, prompt.expand(args.batch, -1).contiguous(), [policy], args, options, track_peak=True)
    row.update(rss_peak_before=before, rss_peak=peak_rss_bytes())
    row["rss_growth"] = row["rss_peak"] - before
    info = meta(args, model, budget=args.budget, buffer=args.buffer, new_tokens=args.new_tokens, batch=args.batch)
    print(MARK + json.dumps({"row": row, "meta": info}), flush=True)
    return 0


def child_args(args, arm: str) -> list:
    """The parent's flags, passed on to one arm's process."""
    out = [sys.executable, "-m", "bench.memory", "--arm", arm, "--batch", str(args.batch),
           "--new-tokens", str(args.new_tokens), "--budget", str(args.budget), "--buffer", str(args.buffer),
           "--device", args.device, "--seed", str(args.seed)]
    if arm != "full":  # the child's one policy: the arm's (its checks then see only that policy)
        out += ["--policies", arm]
    reads_stats = arm != "full" and calibration_options(arm, args.stats)  # else the child refuses an unread --stats
    for flag, value in (("--model", args.model), ("--threads", args.threads),
                        ("--stats", args.stats if reads_stats else None)):
        if value is not None:
            out += [flag, str(value)]
    return out


def main(argv=None) -> int:
    p, args = parse(Config, argv, __doc__.splitlines()[0])  # the policies and --stats are checked here
    if args.arm is not None:
        return run_arm(p, args)
    policy_options(p, args, args.policies)  # a bad --stats file stops here; each child binds to the model
    try:
        randattn.resolve_device(args.device)  # before any child starts: each would fail the same way
    except ValueError as exc:
        p.error(f"--device: {exc}")

    rows, info = [], None
    for arm in ["full", *args.policies]:
        proc = subprocess.run(child_args(args, arm), cwd=REPO_ROOT, capture_output=True, text=True)
        found = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
        if proc.returncode != 0 or not found:
            sys.stderr.write(proc.stderr[-4000:])
            p.exit(1, f"the {arm!r} arm failed (exit {proc.returncode}); its error is above\n")
        result = json.loads(found[-1][len(MARK):])
        rows.append(result["row"])
        info = info or result["meta"]
        print(json.dumps(result["row"]), flush=True)
    full = rows[0]
    for r in rows:
        r["x_full_rss_peak"] = r["rss_peak"] / full["rss_peak"]
        r["x_full_kv_peak"] = r["kv_bytes_peak"] / full["kv_bytes_peak"]
    out_path = write_results(args.out or "data/results/bench/memory.json", info, rows)

    mib = 2**20
    print(f"\n{info['model']} on {info['device']} ({info['dtype']}), K={args.budget}, r={args.buffer}, batch {args.batch}, "
          f"{args.new_tokens} new tokens, prompt {full['prompt_tokens']} tokens; one process per arm")
    print(f"{'cache':>14} {'RSS loaded':>10} {'RSS peak':>9} {'growth':>8} {'x full':>7} {'KV peak':>8} {'x full':>7} {'tok/s':>7}")
    for r in rows:
        print(f"{r['policy']:>14} {r['rss_peak_before'] / mib:10.0f} {r['rss_peak'] / mib:9.0f} "
              f"{r['rss_growth'] / mib:8.0f} {r['x_full_rss_peak']:7.2f} {r['kv_bytes_peak'] / mib:8.1f} "
              f"{r['x_full_kv_peak']:7.3f} {r['tokens_per_s']:7.2f}")
    print("(MiB)")
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
