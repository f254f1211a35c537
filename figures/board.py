"""The board (``python -m probes.board merge``): per task and endpoint, each selector's difference from protected
Random with its paired 95% bootstrap CI, the band of differences smaller than its MDE (what the board could not have
detected) shaded around 0, and the verdict marked (filled: better or worse after the whole board's adjustment).
Plotted from ``board.csv`` alone.

    python -m figures.board data/results/board/NAME/board.csv [--out DIR] [--name board]

Not registered in ``figures.__main__.FIGURES`` (whose entries draw a shipped result by default): no board is
shipped yet; ``probes.board merge`` draws it into the board's folder.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import matplotlib.pyplot as plt

from analysis.files import DiskFull, NotOurs
from analysis.rows import read_table

from . import style

TASK_ORDER = ("copy", "repeat", "question", "passcode", "planted")
COMMAND = "python -m probes.board merge SPEC"


def _num(x):
    if x in (None, ""):
        return None
    v = float(x)
    return None if math.isnan(v) else v


def plot(table: list[dict], out_dir=None, name: str = "board") -> list[Path]:
    """Draw the board from its rows (``board.csv``: one row per task, endpoint and selector; ``missing`` rows are
    listed in the title, not drawn)."""
    rows = [r for r in table if r.get("verdict") != "missing" and _num(r.get("delta")) is not None]
    if not rows:
        raise ValueError("the board has no paired difference to draw (run python -m probes.board run, then merge)")
    missing = sorted({r["task"] for r in table if r.get("verdict") == "missing"})
    panels = list(dict.fromkeys((r["task"], r["endpoint"]) for r in rows))
    panels.sort(key=lambda p: (TASK_ORDER.index(p[0]) if p[0] in TASK_ORDER else len(TASK_ORDER), p[1] != "score"))
    selectors = list(dict.fromkeys(r["selector"] for r in rows))
    ys = {s: i for i, s in enumerate(selectors)}
    style.apply()
    cols = min(len(panels), 4)
    lines = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(lines, cols, figsize=(3.1 * cols + 1.4, (1.3 + 0.36 * len(selectors)) * lines),
                             squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (task, endpoint) in zip(axes.flat, panels):
        these = [r for r in rows if (r["task"], r["endpoint"]) == (task, endpoint)]
        for r in these:
            y, d, lo, hi = ys[r["selector"]], float(r["delta"]), float(r["delta_lo"]), float(r["delta_hi"])
            mde = _num(r.get("mde"))
            if mde is not None and math.isfinite(mde):
                ax.fill_betweenx([y - 0.32, y + 0.32], -mde, mde, color=style.PALETTE[0], alpha=0.15, lw=0)
            verdict = r["verdict"]
            color = style.PALETTE[2] if verdict == "better" else style.PALETTE[3] if verdict == "worse" else "0.35"
            ax.errorbar(d, y, xerr=[[d - lo], [hi - d]], fmt="o", color=color, capsize=3, ms=5,
                        mfc=color if verdict in ("better", "worse") else "white")
            if mde is not None and not math.isfinite(mde):
                ax.annotate("MDE: none", (d, y), xytext=(6, 4), textcoords="offset points", fontsize=7, color="0.4")
        ax.axvline(0, color="gray", lw=1, ls="--")
        first = these[0]
        unit = "nats" if first.get("mde_units") == "nats" else ""
        ax.set_title(f"{task}: {endpoint}\n(n={first['n']}, T={first['T']}, r={first['r']})", fontsize=9)
        ax.set_xlabel(f"selector − Random{' (' + unit + ')' if unit else ''}")
        ax.set_yticks(range(len(selectors)), selectors)
        ax.set_ylim(len(selectors) - 0.5, -0.5)
    family = rows[0].get("family")
    adjustment = {"holm": "Holm", "bh": "Benjamini-Hochberg"}.get(rows[0].get("adjustment"), rows[0].get("adjustment"))
    note = f"; no rows yet: {', '.join(missing)}" if missing else ""
    fig.suptitle(f"Board: each selector against protected Random; paired 95% bootstrap CIs (filled: better or worse "
                 f"after {adjustment} across all {family} comparisons at alpha {rows[0].get('alpha')}); shaded: "
                 f"within the MDE (80% power){note}", fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m figures.board", description=__doc__.splitlines()[0])
    p.add_argument("results", help="a board.csv (python -m probes.board merge SPEC writes it)")
    p.add_argument("--out", default=None, help="output folder (default: figures/ under the current folder)")
    p.add_argument("--name", default="board", help="file name without extension (default: board)")
    args = p.parse_args(argv)
    path = Path(args.results)
    if path.is_dir():
        p.error(f"{path} is a folder; give the board.csv itself")
    if args.out is not None:
        for parent in (Path(args.out), *Path(args.out).parents):
            if parent.exists() and not parent.is_dir():
                p.error(f"--out: {parent} is a file, not a folder; give the folder the figure goes into")
    try:
        files = plot(read_table(path, COMMAND), args.out, args.name)
    except (NotOurs, DiskFull) as exc:
        p.error(f"--out: {exc}")
    except (ValueError, KeyError, TypeError) as exc:
        print(f"board: cannot draw from {path}: it is not a board.csv of `{COMMAND}` ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 1
    for f in files:
        print(f"board: {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
