"""No torn or overwritten file (issue 29, section 3 and part of 4).

- Summaries, tables and figures go to a temporary name and are renamed into place: SIGKILL, SIGTERM or SIGINT in
  the middle of a write (``RANDATTN_TEST_SLOW_WRITE`` pauses half-way) leaves the previous file byte for byte.
- Only files randattn wrote are replaced: a user's own summary or figure is refused, unchanged; the shipped ones
  are recognised (and still load with pandas).
- One run per results folder: a second process is refused naming the first one's pid; a killed run leaves no lock.
- A full disk (``RLIMIT_FSIZE``) stops a run with a message saying the rows are safe and how to resume.
- A dangling symbolic link as ``--out`` is a clear refusal; a finished run on read-only media re-prints its tables.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from probes.results import ResultsFile, RunInUse, release_folders
from analysis.files import NotOurs, SLOW_ENV, check_ours, why_not_ours, write_text

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "PYTHONPATH": str(REPO)}
SIGNALS = [signal.SIGKILL, signal.SIGTERM, signal.SIGINT]
TABLE = [{"condition": c, "n": 8, "retrieval": 0.5, "mean_lp": -1.0} for c in "abcdefghijk"]  # an 11-row summary


def _interruptible() -> None:
    """In the child: Ctrl-C's default action. A shell starts background jobs with SIGINT ignored, and a Python started
    so never installs its KeyboardInterrupt handler: the SIGINT cases would then wait out the slow write."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(code: str, cwd: Path, slow: float = 30) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env={**ENV, SLOW_ENV: str(slow)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_interruptible)


def _interrupt_mid_write(proc: subprocess.Popen, target: Path, sig: int, timeout: float = 60) -> None:
    """Wait until ``proc`` has a temporary file of ``target`` (it is mid-write), then send ``sig``."""
    deadline = time.monotonic() + timeout
    while not list(target.parent.glob(f".{target.name}.randattn-tmp-*")):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the writer never started its temporary file"
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.wait(30)


def _no_temporaries(folder: Path) -> None:
    from analysis.files import _sweep

    for p in list(folder.iterdir()):
        _sweep(p)  # what the next write does: a dead writer's temporary goes
    assert not [p.name for p in folder.iterdir() if ".randattn-tmp-" in p.name]


# The writer every summary goes through (probes.planted_run.write_csv -> analysis.files.write_text), loaded
# on its own: a subprocess that imports torch would take most of a test's time just starting.
WRITER = f"""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("files", {str(REPO / "analysis" / "files.py")!r})
    files = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(files)
"""


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_summary_write_interrupted_leaves_the_previous_summary(tmp_path, sig):
    import csv
    import io

    from probes.planted_run import write_csv

    path = tmp_path / "rows.summary.csv"
    write_csv(path, TABLE)
    before = path.read_bytes()
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, list(TABLE[0]))
    w.writeheader()
    w.writerows([{**r, "n": 9} for r in TABLE])
    proc = _start(WRITER + f"""
    files.write_text({str(path)!r}, {buf.getvalue()!r})
    """, tmp_path)
    _interrupt_mid_write(proc, path, sig)
    assert proc.returncode != 0
    assert path.read_bytes() == before  # all 12 lines, not a torn 3
    _no_temporaries(tmp_path)
    import pandas as pd

    assert len(pd.read_csv(path)) == 11


def test_an_uninterrupted_slow_write_lands_whole(tmp_path):
    path = tmp_path / "rows.summary.csv"
    proc = _start(WRITER + f"""
    files.write_text({str(path)!r}, "a,b\\n" + "1,2\\n" * 11)
    """, tmp_path, slow=0.2)
    assert proc.wait(60) == 0, proc.stderr.read().decode()
    assert path.read_text().count("\n") == 12 and not list(tmp_path.glob(".*"))


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """The passcode figure, drawn once in this process."""
    from figures.__main__ import draw

    out = tmp_path_factory.mktemp("drawn")
    draw("passcode", None, out)
    return out


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_python_m_figures_interrupted_leaves_the_previous_figure(tmp_path, sig, drawn):
    import shutil

    figs = tmp_path / "figs"
    shutil.copytree(drawn, figs)
    cmd = [sys.executable, "-m", "figures", "--probe", "passcode", "--out", str(figs)]
    png = figs / "passcode.png"
    before = {p.name: p.read_bytes() for p in figs.iterdir()}
    assert len(before) == 2 and all(before.values())
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**ENV, SLOW_ENV: "30"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_interruptible)
    _interrupt_mid_write(proc, png, sig)
    _no_temporaries(figs)
    assert {p.name: p.read_bytes() for p in figs.iterdir()} == before  # no PNG left at 0 bytes


# -- only our own files ------------------------------------------------------------------------------------------
def test_a_users_own_summary_is_never_replaced(tmp_path):
    from probes.planted_run import write_csv

    path = tmp_path / "rows.summary.csv"
    path.write_text("my,own,analysis\n1,2,3\n")
    with pytest.raises(NotOurs, match=f"{path} was not written by randattn .*nothing was changed"):
        write_csv(path, TABLE)
    assert path.read_text() == "my,own,analysis\n1,2,3\n"
    write_csv(tmp_path / "ok.csv", TABLE)  # ours: replaced by a rerun, also one with a column more
    write_csv(tmp_path / "ok.csv", [{**r, "recall": 0.1} for r in TABLE])
    assert "recall" in (tmp_path / "ok.csv").read_text()


def test_a_users_own_figure_is_refused_before_any_figure_is_drawn(tmp_path, monkeypatch, capsys):
    from figures.__main__ import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "figures").mkdir()
    mine = tmp_path / "figures" / "head_pooling.png"
    mine.write_bytes(b"\x89PNG my own plot")
    with pytest.raises(SystemExit) as info:
        main(["--probe", "passcode", "--probe", "head_pooling"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--out: figures/head_pooling.png was not written by randattn" in err and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["head_pooling.png"]  # passcode not drawn
    assert mine.read_bytes() == b"\x89PNG my own plot"


def test_the_shipped_figures_summaries_and_tables_are_recognised_as_ours():
    import pandas as pd

    shipped = [p for p in (REPO / "figures").iterdir() if p.suffix in (".png", ".pdf")]
    shipped += [p for p in (REPO / "data" / "results").rglob("*") if p.suffix in (".csv", ".md", ".tex")
                and p.name != "report.md"]
    assert len(shipped) > 50
    assert {p: why_not_ours(p, p.read_bytes()) for p in shipped} == dict.fromkeys(shipped)
    for p in shipped:
        if p.suffix == ".csv":
            assert len(pd.read_csv(p)) > 0, p


def test_a_text_file_of_another_kind_or_a_link_is_not_ours(tmp_path):
    (tmp_path / "t.md").write_text("# my notes\n")
    (tmp_path / "x.txt").write_text("x")
    (tmp_path / "link.csv").symlink_to(tmp_path / "nowhere.csv")
    for name in ("t.md", "x.txt", "link.csv"):
        with pytest.raises(NotOurs):
            check_ours(tmp_path / name, b"| a | b |\n")
    (tmp_path / "empty.png").write_bytes(b"")  # what a kill left before this fix: nothing to lose
    check_ours(tmp_path / "empty.png")
    write_text(tmp_path / "t2.md", "| a | b |\n|---|---|\n")
    assert write_text(tmp_path / "t2.md", "| a | b | c |\n|---|---|---|\n").read_text().startswith("| a | b | c |")


# -- one run per folder ----------------------------------------------------------------------------------------
KEY = ("instance", "condition", "fact")
ROW = {"instance": 0, "condition": "a", "fact": 0, "lp": -1.0, "retrieved": True}


def test_a_second_process_on_one_folder_is_refused_and_a_killed_one_leaves_no_lock(tmp_path):
    holder = _start(f"""
        import sys, time
        from probes.results import ResultsFile
        rf = ResultsFile({str(tmp_path / "a.jsonl")!r}, {{"probe": "x"}}, {KEY!r})
        print("held", flush=True)
        time.sleep(60)
    """, tmp_path)
    try:
        assert holder.stdout.readline().strip() == b"held", holder.stderr.read().decode()
        with pytest.raises(RunInUse, match=f"{tmp_path} is in use by another run \\(pid {holder.pid}\\); wait for it "
                                           "or use another --out"):
            ResultsFile(tmp_path / "b.jsonl", {"probe": "x"}, KEY)
        assert not (tmp_path / "b.jsonl").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    rf = ResultsFile(tmp_path / "b.jsonl", {"probe": "x"}, KEY)  # the kernel dropped the dead run's lock
    rf.append([ROW])
    same = ResultsFile(tmp_path / "a.jsonl", {"probe": "x"}, KEY)  # one process: one lock for both files
    assert same._lock is rf._lock
    release_folders()


def test_a_second_probe_run_on_one_out_is_a_usage_error(tiny_dir, tmp_path, capsys):
    from probes.head_pooling import main

    out = tmp_path / "out"
    holder = _start(f"""
        import time
        from probes.results import hold_folder
        lock = hold_folder({str(out)!r})
        print("held", flush=True)
        time.sleep(60)
    """, tmp_path)
    try:
        assert holder.stdout.readline().strip() == b"held"
        with pytest.raises(SystemExit) as info:
            main(["--model", tiny_dir, "--out", str(out), "--budget", "64", "--buffer", "12", "--distance", "90",
                  "--instances", "2", "--batch", "2", "--no-figure"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"--out: {out} is in use by another run (pid {holder.pid}); wait for it or use another --out" in err
        assert not list(out.glob("*.jsonl"))
    finally:
        holder.kill()
        holder.wait(30)


# -- full disk, dangling link, read-only media -----------------------------------------------------------------------
PLANTED = ["--budget", "64", "--buffer", "12", "--distance", "90", "--batch", "2", "--parity", "0", "--instances",
           "6", "--no-figure"]


def _limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit raises EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_full_disk_mid_run_says_the_rows_are_safe_and_how_to_resume(tiny_dir, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "probes.head_pooling", "--model", tiny_dir, "--out", str(out), *PLANTED]
    done = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
                          preexec_fn=_limit_file_size(6000))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "the disk is full or a file-size limit is reached" in done.stderr
    assert "rows written before are safe" in done.stderr and "rerun the same command to resume" in done.stderr
    (rows,) = out.glob("*.jsonl")
    partial = rows.read_bytes().count(b"\n")
    assert 0 < partial
    from probes.head_pooling import main

    assert main(cmd[3:]) == 0  # the same command, room again: resumes
    lines = [json.loads(x) for x in rows.read_text().splitlines()]
    keys = [(r["instance"], r["condition"], r["fact"]) for r in lines]
    assert len(keys) == len(set(keys)) > partial  # completed, none twice


def test_a_dangling_symlink_out_is_a_clear_refusal(tmp_path, capsys):
    from figures.__main__ import main as figures_main
    from probes.head_pooling import main

    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    for run in (lambda: main(["--out", str(link), "--model", "nosuch", *PLANTED]),
                lambda: figures_main(["--probe", "passcode", "--out", str(link)])):
        with pytest.raises(SystemExit) as info:
            run()
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"--out: {link} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in err
    assert link.is_symlink() and not (tmp_path / "gone").exists()


def _read_only_mount(folder: Path):
    """Bind-mount ``folder`` read-only onto itself (root alone ignores permission bits); None where not allowed."""
    done = subprocess.run(["mount", "--bind", "-o", "ro", str(folder), str(folder)], capture_output=True)
    if done.returncode != 0:
        return None
    probe = folder / ".write-probe"
    try:
        probe.write_text("x")
    except OSError:
        return lambda: subprocess.run(["umount", str(folder)], check=True)
    probe.unlink()  # a kernel that ignored ro on the bind: undo and say so
    subprocess.run(["umount", str(folder)], check=True)
    return None


def test_a_finished_run_on_read_only_media_reprints_its_tables(tiny_dir, tmp_path, capsys):
    from probes.head_pooling import main

    out = tmp_path / "out"
    args = ["--model", tiny_dir, "--out", str(out), *PLANTED]
    assert main(args) == 0
    first = capsys.readouterr().out
    files = {p: p.read_bytes() for p in out.iterdir()}
    unmount = _read_only_mount(out)
    if unmount is None:
        pytest.skip("a read-only bind mount is not allowed here")
    try:
        assert main(args) == 0
        again = capsys.readouterr()
        table = first[first.index("condition"):first.index("\nrows:")]
        assert table in again.out and "Traceback" not in again.err
        with pytest.raises(SystemExit) as info:  # more instances: rows to add, and nowhere to add them
            main([*args[:-3], "--instances", "8", "--no-figure"])
        assert info.value.code == 2
        assert "read-only media" in capsys.readouterr().err
    finally:
        unmount()
    assert {p: p.read_bytes() for p in out.iterdir()} == files


def test_a_probe_never_replaces_a_users_own_summary_beside_its_rows(tiny_dir, tmp_path, capsys):
    from probes.head_pooling import main

    out = tmp_path / "out"
    args = ["--model", tiny_dir, "--out", str(out), *PLANTED[:-3], "--instances", "2", "--no-figure"]
    assert main(args) == 0
    (summary,) = out.glob("*.summary.csv")
    summary.write_text("instance,my_score\n0,0.7\n")  # the user's own analysis, saved under that name
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--out: {summary} was not written by randattn (its columns (instance, my_score) are not" in err
    assert summary.read_text() == "instance,my_score\n0,0.7\n"


@pytest.mark.parametrize("var", ["RANDATTN_CACHE", "HOME"])
def test_an_unusable_model_cache_is_named_by_its_variable_not_model(var, tmp_path, monkeypatch, capsys):
    from probes.head_pooling import main

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    monkeypatch.delenv("RANDATTN_CACHE", raising=False)
    monkeypatch.setenv(var, str(a_file))
    with pytest.raises(SystemExit) as info:  # the embedded model (no --model): converted into the cache
        main(["--out", str(tmp_path / "out"), "--no-figure"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {var}: {a_file} is a file, not a folder" in err and "set RANDATTN_CACHE to a folder" in err
    assert "--model" not in err.splitlines()[-1] and a_file.read_text() == "mine\n"
    assert not (tmp_path / "out").exists()
