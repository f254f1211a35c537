"""Ctrl-C (SIGINT) during a probe or ``python -m figures`` (issue 38, item a): one line saying what is safe and how to
resume, exit status 130, no traceback; the files are whole and the resume ends with the rows of an uninterrupted run.

The interrupted command is a subprocess of this checkout's code started with SIGINT at its default action (a shell
starts background jobs with SIGINT ignored, and a Python started so never raises KeyboardInterrupt); the reference run
and the resume run in this process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from probes.results import INFORMATIONAL

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "PYTHONPATH": str(REPO)}
PLANTED = ["--budget", "64", "--buffer", "12", "--distance", "90", "--batch", "2", "--parity", "0", "--instances",
           "8", "--no-figure"]


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _measured(rows: list[dict]) -> list[dict]:
    return [{**r, "config": {k: v for k, v in r["config"].items() if k not in INFORMATIONAL}} for r in rows]


def _lines(folder: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in folder.glob("*.jsonl")) if folder.exists() else 0


def test_ctrl_c_during_a_probe_is_one_line_exit_130_and_the_resume_gives_the_same_rows(tiny_dir, tmp_path):
    from probes.head_pooling import main

    assert main(["--model", tiny_dir, "--out", str(tmp_path / "whole"), *PLANTED]) == 0
    (whole,) = (tmp_path / "whole").glob("*.jsonl")
    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "probes.head_pooling", "--model", tiny_dir, "--out", str(cut),
                             *PLANTED], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=_interruptible)
    deadline = time.monotonic() + 120
    try:
        while _lines(cut) == 0:  # interrupt once rows exist, mid-run
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no row within the timeout"
            time.sleep(0.02)
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=60)[1].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (rows,) = cut.glob("*.jsonl")
    partial, total = _lines(cut), _lines(tmp_path / "whole")
    assert 0 < partial < total, f"{partial} of {total} rows: the interrupt must land mid-run (make the run longer)"
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = err.strip().splitlines()[-1]
    assert last == (f"head_pooling.py: interrupted: {partial} rows are safe in {rows}; rerun the same command to "
                    "resume"), last
    assert rows.read_bytes().endswith(b"\n")  # whole rows only: nothing torn to cut on resume
    assert not [p.name for p in cut.iterdir() if ".randattn-tmp-" in p.name]
    assert main(["--model", tiny_dir, "--out", str(cut), *PLANTED]) == 0  # resume
    assert _measured(_rows(rows)) == _measured(_rows(whole))


def test_a_ctrl_c_while_a_batch_is_written_lands_after_it_is_on_disk_and_counted(tmp_path, monkeypatch):
    """The append holds SIGINT back from its write to its bookkeeping: the rows it wrote are the rows it counts, so the
    interrupted run's line and its resume agree with the file."""
    from probes import results

    path = tmp_path / "rows.jsonl"
    rf = results.ResultsFile(path, {"probe": "x"}, ("instance",))
    rf.append([{"instance": 0, "lp": -1.0}])
    real_fsync = os.fsync

    def fsync_then_ctrl_c(fd):  # the Ctrl-C arrives between the batch's write and its fsync
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        real_fsync(fd)

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(os, "fsync", fsync_then_ctrl_c)
    mark = results.openings()
    try:
        with pytest.raises(KeyboardInterrupt):
            rf.append([{"instance": 1, "lp": -2.0}, {"instance": 2, "lp": -3.0}])
    finally:
        signal.signal(signal.SIGINT, before)
        monkeypatch.setattr(os, "fsync", real_fsync)
    assert [r["instance"] for r in rf.rows] == [0, 1, 2] and rf.done == {(0,), (1,), (2,)}
    assert results.rows_on_disk(path) == 3
    reopened = results.ResultsFile(path, {"probe": "x"}, ("instance",))
    assert len(reopened.rows) == 3
    assert results.interrupted(mark) == f"interrupted: 3 rows are safe in {path}; rerun the same command to resume"
    results.release_folders()


def test_the_interrupt_line_counts_every_file_of_the_run(tmp_path):
    from probes import results

    mark = results.openings()
    assert results.interrupted(mark) == ("interrupted before any row was written; rerun the same command to start "
                                         "the run")
    a = results.ResultsFile(tmp_path / "a.jsonl", {"probe": "x"}, ("instance",))
    b = results.ResultsFile(tmp_path / "b.jsonl", {"probe": "x"}, ("instance",))
    results.ResultsFile(tmp_path / "c.jsonl", {"probe": "x"}, ("instance",))  # opened, nothing written yet
    a.append([{"instance": 0}])
    assert results.interrupted(mark) == f"interrupted: 1 row is safe in {a.path}; rerun the same command to resume"
    b.append([{"instance": i} for i in range(4)])
    assert results.interrupted(mark) == (f"interrupted: 5 rows are safe in 2 files (1 in {a.path}, 4 in {b.path}); "
                                         "rerun the same command to resume")
    results.release_folders()


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """The passcode figure, drawn once in this process."""
    from figures.__main__ import draw

    out = tmp_path_factory.mktemp("drawn")
    draw("passcode", None, out)
    return out


def test_ctrl_c_during_python_m_figures_is_one_line_exit_130_and_the_figure_is_whole(tmp_path, drawn):
    import shutil

    from analysis.files import SLOW_ENV

    figs = tmp_path / "figs"
    shutil.copytree(drawn, figs)
    before = {p.name: p.read_bytes() for p in figs.iterdir()}
    png = figs / "passcode.png"
    proc = subprocess.Popen([sys.executable, "-m", "figures", "--probe", "passcode", "--out", str(figs)], cwd=tmp_path,
                            env={**ENV, SLOW_ENV: "30"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_interruptible)
    deadline = time.monotonic() + 120
    try:
        while not list(figs.glob(f".{png.name}.randattn-tmp-*")):  # mid-write of the figure
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the figure's temporary file never appeared"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=60)[1].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert re.fullmatch(r"figures: interrupted before any figure was drawn; no file is left half-written \(each holds "
                        r"its previous or its new figure\); rerun the same command to draw them", err.strip()), err
    assert {p.name: p.read_bytes() for p in figs.iterdir()} == before  # the temporary went, the old figure stays
