"""Regenerate figures from saved results (no model is run).

    python -m figures                       # every figure whose results exist, into figures/
    python -m figures --probe head_pooling  # one
    python -m figures --probe head_pooling --results data/results/head_pooling/other-run.jsonl --out /tmp/figs

Results are read from ``data/results/`` under the current folder (what your own runs wrote), and for a figure
with no results there from the copy shipped with the package (the runs the docs report). Figures go to
``figures/`` under the current folder, or ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from analysis.files import DiskFull, NotOurs, check_ours
from analysis.names import shipped_name
from analysis.registry import PROBES
from analysis.rows import read_json, read_rows, read_table
from analysis.shipped import shipped_result

_READERS = {"rows": read_rows}  # what a figure reads, by the part of the shipped run it draws (else a table)
# figure name -> (module:function, how its input is read, the result it draws by default, the command that makes it):
# each registered probe's (analysis.registry: figures/<name>.py:plot, drawing its shipped run's part), then the rest.
FIGURES = {
    **{p.name: (f"figures.{p.name}:plot", _READERS.get(p.figure, read_table), shipped_name(p.name, p.figure),
                p.run_command) for p in PROBES if p.figure},
    "accuracy_repeat": ("figures.accuracy:plot", read_rows, shipped_name("accuracy_repeat"),
                        "python -m probes.accuracy --task repeat --compression 2 4 8 16 --policy full random "
                        "triattention vase --runs 1"),
    "challenge": ("figures.challenge:plot", read_table, shipped_name("challenge", "folder") + "/verdict.csv",
                  "python -m probes.challenge --policy examples/attention_selector.py:recent_attention --quick"),
    "bench_decode": ("figures.bench:plot_decode", read_json, "bench/decode.json", "python -m bench.decode"),
    "bench_round_cost": ("figures.bench:plot_round_cost", read_json, "bench/round_cost.json",
                         "python -m bench.round_cost"),
    "bench_batch_scaling": ("figures.bench:plot_batch_scaling", read_json, "bench/batch_scaling.json",
                            "python -m bench.batch_scaling"),
}
# Figures drawn only on request (--probe NAME): they need an input nothing ships by default.
ON_REQUEST = {"challenge"}


def default_input(name: str) -> Path:
    """``data/results/<result>`` under the current folder when there, else the shipped copy."""
    rel = FIGURES[name][2]
    mine = Path("data") / "results" / rel
    return mine if mine.exists() else shipped_result(rel)


def draw(name: str, results=None, out_dir=None, *, stem: "str | None" = None, **options) -> list[Path]:
    """Read ``results`` (default: :func:`default_input`) and plot it into ``out_dir/<stem>.png`` and ``.pdf`` (stem:
    the figure's name unless given); ``options`` go to the plot (accuracy: which ``problems`` and how many ``runs`` of
    the file to show)."""
    target, reader, _, command = FIGURES[name]
    module, func = target.split(":")
    plot = getattr(importlib.import_module(module), func)
    path = Path(results) if results else default_input(name)
    return plot(reader(path, command), Path(out_dir) if out_dir else Path("figures"), name=stem or name, **options)


def main(argv=None) -> int:
    """The figures command; Ctrl-C (SIGINT) is one line naming the figures already drawn (exit status 130, no
    traceback): each figure goes to a temporary file renamed into place, so the one being drawn keeps its old bytes."""
    drawn: list[str] = []
    try:
        return _main(argv, drawn)
    except KeyboardInterrupt:
        done = (f"after {len(drawn)} figure file{'' if len(drawn) == 1 else 's'} drawn ({', '.join(drawn)})" if drawn
                else "before any figure was drawn")
        print(f"figures: interrupted {done}; no file is left half-written (each holds its previous or its new "
              "figure); rerun the same command to draw them", file=sys.stderr)
        return 130


def _main(argv, drawn: list) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--probe", choices=sorted(FIGURES), action="append", help="only this figure (repeatable)")
    p.add_argument("--results", default=None, help="result file to draw (with one --probe); default: yours under "
                                                   "data/results/, else the shipped one")
    p.add_argument("--out", default=None, help="output folder (default: figures/ under the current folder)")
    p.add_argument("--name", default=None, help="file name of the figure, without extension (default: the figure's "
                                                "name, e.g. head_pooling)")
    p.add_argument("--problems", default=None, help="accuracy: comma-separated problem ids to show (default: all)")
    p.add_argument("--runs", type=int, default=None, help="accuracy: the first N runs of each problem (default: all)")
    args = p.parse_args(argv)
    if args.runs is not None and args.runs <= 0:
        p.error(f"--runs: must be a positive integer, got {args.runs}")
    if args.out is not None:
        for parent in (Path(args.out), *Path(args.out).parents):
            if parent.is_symlink() and not parent.exists():
                p.error(f"--out: {parent} is a symbolic link to {os.readlink(parent)}, which does not exist; create "
                        "that folder or give --out another folder")
            if parent.exists() and not parent.is_dir():
                p.error(f"--out: {parent} is a file, not a folder; give the folder the figures go into")
    options = {}
    if args.problems or args.runs:
        if args.probe != ["accuracy"]:
            p.error("--problems and --runs apply to --probe accuracy only")
        options = {"problems": args.problems.split(",") if args.problems else None, "runs": args.runs}
    names = args.probe or [n for n in FIGURES if n not in ON_REQUEST]
    if args.results and len(names) != 1:
        p.error("--results needs exactly one --probe")
    if args.name and len(names) != 1:
        p.error("--name needs exactly one --probe")
    from .style import targets

    for name in names:  # every figure this run would replace must be ours, before any is drawn
        for target in targets(args.name or name, args.out):
            try:
                check_ours(target)
            except NotOurs as exc:
                p.error(f"--out: {exc} (the default folder is figures/ under the current folder)")
    missing = failed = 0
    for name in names:
        command = FIGURES[name][3]
        path = Path(args.results) if args.results else default_input(name)
        if not path.exists():
            print(f"{name}: no results at {path}; `{command}` produces them", file=sys.stderr)
            missing += 1
            continue
        try:
            files = draw(name, path, args.out, stem=args.name, **options)
        except DiskFull as exc:
            print(f"{name}: {exc}; free space and rerun the same command", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"{name}: cannot write into {args.out or 'figures'} ({exc.strerror or exc}); give --out a folder "
                  "you can write to", file=sys.stderr)
            return 1
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            print(f"{name}: cannot draw from {path}: it is not a result file of `{command}` "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr)
            failed += 1
            continue
        for f in files:
            drawn.append(str(f))
            print(f"{name}: {f}")
    if args.probe and (missing or failed):
        return 1
    return 1 if missing + failed == len(names) else 0


if __name__ == "__main__":
    sys.exit(main())
