"""Kill and resume, per kind of long run: a run SIGKILLed at a random point once rows exist, then resumed, ends with
the rows an uninterrupted run writes (timing and where-measured fields aside), none twice, none lost.

Each kind runs small on the tiny model (``tiny_dir``): the planted-fact probe (head_pooling), the accuracy harness,
the survival probe and a local grid (plus a damaged grid item). The interrupted run is a subprocess of this
checkout's code; the reference and the resume run in this process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from probes.results import INFORMATIONAL
from test_grid import ACCURACY as ACCURACY_GRID

REPO = Path(__file__).resolve().parents[1]
TIMING = {"seconds"}  # per-row wall time (survival); everything else in a row is deterministic


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _measured(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        r = {k: v for k, v in r.items() if k not in TIMING}
        if isinstance(r.get("config"), dict):
            r["config"] = {k: v for k, v in r["config"].items() if k not in INFORMATIONAL}
        out.append(r)
    return out


def _count_lines(paths) -> int:
    n = 0
    for p in paths:  # rows of a JSONL file; a grid item (one JSON file, written whole) counts as one
        try:
            n += 1 if p.suffix == ".json" else p.read_bytes().count(b"\n")
        except OSError:
            pass
    return n


def _kill_once_rows_exist(argv: list, watch, *, seed: int, timeout: float = 120) -> bool:
    """Start ``python -m`` ``argv`` from the repository root, wait until ``watch()`` (a list of files) holds a complete
    row, wait a random 0..0.5 s more, SIGKILL it. True when it was killed (False: it finished first)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while _count_lines(watch()) == 0:
            if proc.poll() is not None:
                raise AssertionError(f"ended before any row: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("no row within the timeout")
            time.sleep(0.05)
        time.sleep(random.Random(seed).uniform(0, 0.5))
        if proc.poll() is not None:
            return False
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        return True
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


PLANTED = ["--budget", "64", "--buffer", "12", "--distance", "90", "--batch", "2", "--parity", "0", "--instances",
           "8", "--no-figure"]
ACCURACY = ["--task", "copy", "--problems", "6", "--runs", "1", "--max-new-tokens", "24", "--policy", "full",
            "random", "recency", "--budget", "224", "--buffer", "8", "--batch", "2", "--no-figure"]
SURVIVAL = ["--budget", "128", "--buffer", "8", "--rounds", "4", "--sequences", "6", "--batch", "2", "--policies",
            "random", "recency", "--no-figure"]


@pytest.mark.parametrize("probe, flags", [("head_pooling", PLANTED), ("accuracy", ACCURACY), ("survival", SURVIVAL)])
def test_a_killed_probe_resumes_to_the_uninterrupted_rows(probe, flags, tiny_dir, tmp_path):
    import importlib

    main = importlib.import_module(f"probes.{probe}").main
    assert main(["--model", tiny_dir, "--out", str(tmp_path / "whole"), *flags]) == 0
    (whole,) = [p for p in (tmp_path / "whole").glob("*.jsonl")]
    cut = tmp_path / "cut"
    killed = _kill_once_rows_exist([f"probes.{probe}", "--model", tiny_dir, "--out", str(cut), *flags],
                                   lambda: list(cut.glob("*.jsonl")), seed=len(probe))
    partial = _count_lines(cut.glob("*.jsonl"))
    total = _count_lines([whole])
    # The kill must land mid-run, or the resume below is never exercised.
    assert killed and 0 < partial < total, f"killed={killed} with {partial} of {total} rows: make the run longer"
    assert main(["--model", tiny_dir, "--out", str(cut), *flags]) == 0  # resume
    (resumed,) = list(cut.glob("*.jsonl"))
    assert resumed.name == whole.name
    a, b = _measured(_rows(whole)), _measured(_rows(resumed))
    assert b == a, f"killed after {partial} rows"
    assert not resumed.read_bytes() or resumed.read_bytes().endswith(b"\n")


GRID = ACCURACY_GRID.replace("{problems}", "3").replace("{max_new_tokens}", "24")  # test_grid's small accuracy grid


def _grid_rows(out: Path) -> dict:
    return {p.relative_to(out).as_posix(): _measured(_rows(p)) for p in sorted((out / "accuracy").rglob("*.jsonl"))}


@pytest.fixture
def grid_spec(tiny_dir, tmp_path):
    spec = tmp_path / "acc.toml"
    spec.write_text(GRID.format(model=tiny_dir))
    return spec


def test_a_killed_local_grid_and_a_damaged_item_resume_to_the_uninterrupted_rows(grid_spec, tmp_path, capsys):
    from probes import grid

    flags = ["--no-figure", "--cpus-per-worker", "1"]
    assert grid.main([str(grid_spec), "--out", str(tmp_path / "whole"), *flags]) == 0
    whole = _grid_rows(tmp_path / "whole")
    cut = tmp_path / "cut"
    killed = _kill_once_rows_exist(["probes.grid", str(grid_spec), "--out", str(cut), *flags],
                                   lambda: list((cut / "items").glob("*/*.json")), seed=3)
    items = sorted((cut / "items").glob("*/*.json"))
    total = len(list((tmp_path / "whole" / "items").glob("*/*.json")))
    assert killed and 0 < len(items) < total, f"killed={killed} with {len(items)} of {total} items: make the grid longer"
    items[0].write_text(items[0].read_text()[:25])  # a damaged item (cut short)
    capsys.readouterr()
    assert grid.main([str(grid_spec), "--out", str(cut), *flags]) == 0
    err = capsys.readouterr().err
    assert f"item file {items[0]} is damaged" in err and "recomputed" in err
    assert items[0].with_name(items[0].name + ".damaged").exists()  # moved aside, not deleted
    assert _grid_rows(cut) == whole
