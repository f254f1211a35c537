"""What the grid runner costs: one small grid run to the end by each backend, the whole command timed.

    python -m bench.grid_overhead                          # examples/grid_copy.toml: local x2 threads, local x1, Ray
    python -m bench.grid_overhead --arms local ray --spec my_grid.toml

Each arm runs ``python -m probes.grid SPEC --out FRESH_DIR --no-figure`` in its own process (so planning, model
loads, the Ray instance and the merge are all inside the wall time), one arm after another, nothing shared between
them. From the grid's item files it then reads what each batch took (the worker's own timing) and when the first
one finished, and checks that every arm wrote the same rows. Reported per arm: wall time, items/s, start to the
first batch (the first finished batch's end less its duration; the item files store whole seconds) and the median
batch. Timings need a quiet machine: nothing else running.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench.common import REPO_ROOT, parse, provenance, result_path, write_results
from probes.config import Config as BaseConfig, option

# arm -> extra flags of probes.grid; "local" uses torch's thread default (2 here), "ray" one 1-thread worker per CPU.
ARMS = {"local": [], "local1": ["--cpus-per-worker", "1"], "ray": ["--backend", "ray"]}
ARM_NAMES = {"local": "local", "local1": "local --cpus-per-worker 1", "ray": "ray (local instance)"}


def _spec_file(path) -> "str | None":
    if not Path(path).is_file():
        return (f"{path} is not a file (examples/ ships with the repository, not the wheel: run from a checkout or "
                "name your own spec)")
    return None


@dataclass
class Config(BaseConfig):
    """What the grid runner costs: one small grid run to the end by each backend (no eviction settings of its own:
    they are the spec's)."""

    spec: str = option(str(REPO_ROOT / "examples" / "grid_copy.toml"), "grid spec (TOML) every arm runs; default: the "
                       "repository's examples/grid_copy.toml", check=_spec_file, metavar="SPEC")
    arms: tuple[str, ...] = option(tuple(ARMS), "backends, run in this order", choices=tuple(ARMS))
    out: str = result_path("data/results/bench/grid_overhead.json")


def parse_args(argv):
    return parse(Config, argv, __doc__.splitlines()[0])[1]


def read_items(grid_dir: Path) -> list[dict]:
    """The grid's item records (``items/<2>/<id>.json``), sorted by id."""
    return [json.loads(p.read_text()) for p in sorted((grid_dir / "items").glob("*/*.json"))]


def summarize(records: list[dict], started: float, wall: float) -> dict:
    """Per arm: wall, items/s, start to the first batch, the median batch, workers; ``started`` is the Unix time the
    command was launched. An item's ``seconds`` is its batch's time shared equally among the batch's items."""
    units: dict = {}
    for r in records:
        u = units.setdefault(r["unit"], {"seconds": 0.0, "finished": r["finished"], "worker": r["worker"]})
        u["seconds"] += r["seconds"]
    first = min(units.values(), key=lambda u: u["finished"])
    first_end = datetime.strptime(first["finished"], "%Y-%m-%dT%H:%M:%S").timestamp()
    return {"wall_s": wall, "items": len(records), "items_per_s": len(records) / wall, "batches": len(units),
            "start_to_first_batch_s": max(0.0, first_end - first["seconds"] - started),
            "median_batch_s": statistics.median(u["seconds"] for u in units.values()),
            "workers": len({u["worker"] for u in units.values()})}


def run_arm(spec: str, arm: str, grid_dir: Path) -> tuple[dict, dict]:
    """Run the grid once with this backend; returns the arm's summary and ``{item id: rows}``."""
    command = [sys.executable, "-m", "probes.grid", spec, "--out", str(grid_dir), "--no-figure", *ARMS[arm]]
    print(f"[{arm}] {' '.join(command[1:])}", flush=True)
    started, t0 = time.time(), time.perf_counter()
    res = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "TQDM_DISABLE": "1"})
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"bench.grid_overhead: the {arm} arm's grid exited {res.returncode}; its output is above")
    records = read_items(grid_dir)
    return {"arm": arm, "backend": ARM_NAMES[arm], **summarize(records, started, wall)}, \
        {r["id"]: r["rows"] for r in records}


def comparable(rows: dict) -> dict:
    """Rows without what only says where they ran (device, revision, versions)."""
    from probes.results import INFORMATIONAL

    return {i: [{**r, "config": {k: v for k, v in r.get("config", {}).items() if k not in INFORMATIONAL}} for r in rs]
            for i, rs in rows.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    summaries, reference = [], None
    with tempfile.TemporaryDirectory(prefix="grid-overhead-") as tmp:
        for arm in args.arms:
            summary, rows = run_arm(args.spec, arm, Path(tmp) / arm)
            rows = comparable(rows)
            reference = rows if reference is None else reference
            summary["same_rows_as_first_arm"] = rows == reference
            summaries.append(summary)
            print(json.dumps(summary), flush=True)
    spec = Path(args.spec).resolve()
    meta = {**provenance(), "spec": str(spec.relative_to(REPO_ROOT)) if spec.is_relative_to(REPO_ROOT) else str(spec),
            "cpus": os.cpu_count(), "arms": list(args.arms)}
    out = write_results(args.out, meta, summaries)
    print(f"\n{'backend':>28} {'wall s':>7} {'items/s':>8} {'to 1st batch s':>14} {'batch s':>8} {'same rows':>9}")
    for s in summaries:
        print(f"{s['backend']:>28} {s['wall_s']:7.1f} {s['items_per_s']:8.2f} {s['start_to_first_batch_s']:14.0f} "
              f"{s['median_batch_s']:8.1f} {str(s['same_rows_as_first_arm']):>9}")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
