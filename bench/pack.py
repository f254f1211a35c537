"""What packing distinct problems into padded batches buys the accuracy harness: problems per hour, side by side.

    python -m bench.pack                                   # 16 word problems of varied length, full + Random
    python -m bench.pack --problems 32 --batch 16 --policies full random snapkv

One model load, then ``probes.accuracy`` three times on the same problems (word problems from the traces
generator, written as a ``--data`` file: their prompts differ in length, as real benchmarks' do):

- ``one at a time``: ``--pack --batch 1`` (each problem alone, drawing by its own row key);
- ``equal-length batches``: ``--batch N``, the harness's default (only problems of one prompt length share a batch);
- ``packed``: ``--pack --batch N`` (any lengths, left-padded, sorted by length).

Reported per arm: wall time of the harness run, problems per hour and the ratio to the first arm; and whether the
packed rows equal the one-at-a-time rows (greedy decoding, same row keys: they must, up to ties that batched
matmuls can flip). The embedded copy and repeat tasks are no test of this: all their prompts have one length.
Timings need a quiet machine: nothing else running.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from bench.common import BenchBase, hidden, meta, parse, result_path, write_results
from probes.config import POSITIVE, eviction, option, setting

ARMS = {"one at a time": ["--pack", "--batch", "1"], "equal-length batches": ["--batch", "{N}"],
        "packed": ["--pack", "--batch", "{N}"]}
COMPARED = ("output", "grade", "gen_len", "terminated", "events", "prompt_len")


@dataclass
@eviction(policies=setting(("full", "random"), help="arms of the harness (full: no eviction; the others evict with "
                                                    "T and r)"), budget=128, buffer=16)
class Config(BenchBase):
    """What packing distinct problems into padded batches buys the accuracy harness."""

    full_allowed = True  # the harness's full-attention arm

    device: str = hidden("auto")  # the model loads where randattn.load_model puts it
    seed: int = hidden(0)  # the harness's own default seed
    out: str = result_path("data/results/bench/pack.json")
    problems: int = option(16, "word problems", check=POSITIVE)
    batch: int = option(8, "N, the batch of the batched arms", check=POSITIVE)
    max_new_tokens: int = option(128, "new tokens per problem", check=POSITIVE)
    threads: Optional[int] = option(None, "torch threads (default: torch's)", check=POSITIVE)


def parse_args(argv):
    return parse(Config, argv, __doc__.splitlines()[0])[1]


def word_problems(n: int, path: Path) -> None:
    """``n`` word problems from the traces generator as a math ``--data`` file (fixed seed: the same every run)."""
    from probes.traces import make_problem

    rng = random.Random("bench.pack")
    with open(path, "w") as f:
        for i in range(n):
            prob = make_problem(rng)
            f.write(json.dumps({"id": f"wp{i}", "problem": prob["question"], "answer": str(prob["answer"])}) + "\n")


def run_arm(name: str, flags: list[str], data: Path, out: Path, args, model, tok) -> tuple[dict, dict]:
    from probes import accuracy, cli

    argv = ["--task", "math500", "--data", str(data), "--problems", str(args.problems), "--runs", "1",
            "--policy", *args.policies, "--budget", str(args.budget), "--buffer", str(args.buffer),
            "--max-new-tokens", str(args.max_new_tokens), "--out", str(out), "--no-figure",
            *[f.replace("{N}", str(args.batch)) for f in flags]]
    parser = cli.parser_for(accuracy.Config, "probes.accuracy")
    config = cli.build(accuracy.Config, parser, vars(parser.parse_args(argv)))
    print(f"[{name}] python -m probes.accuracy {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    _, _, rows = accuracy.run(config, model, tok)
    wall = time.perf_counter() - t0
    lengths = sorted({r["prompt_len"] for r in rows})
    return ({"arm": name, "flags": " ".join(argv[-3:] if "--pack" in flags else argv[-2:]), "wall_s": wall,
             "generations": len(rows), "problems_per_hour": args.problems * 3600 / wall,
             "prompt_lengths": [lengths[0], lengths[-1], len(lengths)]},
            {(r["problem"], r["policy"]): {k: r[k] for k in COMPARED} for r in rows})


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import randattn

    model, tok = randattn.load_model(args.model)
    results, rows_of = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "word_problems.jsonl"
        word_problems(args.problems, data)
        for i, (name, flags) in enumerate(ARMS.items()):
            summary, rows_of[name] = run_arm(name, flags, data, Path(tmp) / f"arm{i}", args, model, tok)
            results.append(summary)
    base = results[0]["problems_per_hour"]
    same = {k: rows_of["packed"][k] == v for k, v in rows_of["one at a time"].items()}
    for r in results:
        r["x_one_at_a_time"] = r["problems_per_hour"] / base
    for r in results:
        print(f"{r['arm']:>22}: {r['wall_s']:7.1f} s  {r['problems_per_hour']:7.0f} problems/h  "
              f"{r['x_one_at_a_time']:.2f}x one at a time")
    print(f"packed rows equal to one-at-a-time rows: {sum(same.values())} of {len(same)}")
    info = meta(args, model, problems=args.problems, batch=args.batch, policies=args.policies, budget=args.budget,
                buffer=args.buffer, max_new_tokens=args.max_new_tokens, rows_compared=len(same),
                rows_equal=sum(same.values()),
                unequal=sorted(f"{p}/{pol}" for (p, pol), ok in same.items() if not ok))
    write_results(args.out, info, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
