"""Regenerate figures from saved results (no model is run).

    python -m figures                       # every figure whose results exist
    python -m figures --probe head_pooling  # one
    python -m figures --probe head_pooling --results data/results/head_pooling/other-run.jsonl --out /tmp/figs
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from probes.results import REPO_ROOT

R = REPO_ROOT / "data" / "results"
# figure name -> (module:function, the shipped result it draws by default, the command that makes it)
FIGURES = {
    "head_pooling": ("figures.head_pooling:plot", R / "head_pooling/smollm2-135m-random-K256-r16-d384-s0.jsonl",
                     "python -m probes.head_pooling"),
    "scatter": ("figures.scatter:plot", R / "scatter/smollm2-135m-random-K256-r16-d384-s0.jsonl",
                "python -m probes.scatter"),
    "two_facts": ("figures.two_facts:plot", R / "two_facts/smollm2-135m-random-K256-r16-d384-s0.jsonl",
                  "python -m probes.two_facts"),
    "blocks": ("figures.blocks:plot", R / "blocks/summary-smollm2-135m-K256-r16-d384-s0.csv", "python -m probes.blocks"),
    "passcode": ("figures.passcode:plot", R / "passcode/summary-smollm2-135m-K256-r16-n57-s0.csv",
                 "python -m probes.passcode"),
    "survival": ("figures.survival:plot", R / "survival/smollm2-135m-K256-r16-n24-seq4-b4-s0.jsonl",
                 "python -m probes.survival"),
    "prompt_protection": ("figures.prompt_protection:plot",
                          R / "prompt_protection/smollm2-135m-K256-r16-b512-s0.summary.csv",
                          "python -m probes.prompt_protection"),
    "shared_draw": ("figures.shared_draw:plot", R / "shared_draw/summary-smollm2-135m-K256-r16-s0.csv",
                    "python -m probes.shared_draw"),
    "accuracy": ("figures.accuracy:plot", R / "accuracy/smollm2-135m-copy-r16-n192-s0.jsonl", "python -m probes.accuracy"),
    "bench_decode": ("figures.bench:plot_decode", R / "bench/decode.json", "python -m bench.decode"),
    "bench_round_cost": ("figures.bench:plot_round_cost", R / "bench/round_cost.json", "python -m bench.round_cost"),
    "bench_batch_scaling": ("figures.bench:plot_batch_scaling", R / "bench/batch_scaling.json",
                            "python -m bench.batch_scaling"),
}


def draw(name: str, results=None, out_dir=None) -> list[Path]:
    target, default, _ = FIGURES[name]
    module, func = target.split(":")
    plot = getattr(importlib.import_module(module), func)
    return plot(Path(results) if results else default, out_dir, name=name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--probe", choices=sorted(FIGURES), action="append", help="only this figure (repeatable)")
    p.add_argument("--results", default=None, help="result file to draw (with one --probe); default: the shipped one")
    p.add_argument("--out", default=None, help="output directory (default: figures/)")
    args = p.parse_args(argv)
    names = args.probe or list(FIGURES)
    if args.results and len(names) != 1:
        p.error("--results needs exactly one --probe")
    missing = 0
    for name in names:
        _, default, command = FIGURES[name]
        path = Path(args.results) if args.results else default
        if not path.exists():
            print(f"{name}: no results at {path}; `{command}` produces them", file=sys.stderr)
            missing += 1
            continue
        for f in draw(name, path, args.out):
            print(f"{name}: {f}")
    return 1 if missing and (args.probe or missing == len(names)) else 0


if __name__ == "__main__":
    sys.exit(main())
