"""The main job (``python -m probes.head_pooling``) old vs new, side by side in one run, rows compared field by field.

    python -m bench.main_job --baseline REV                    # --instances 4, 16 and the full default (48)
    python -m bench.main_job --baseline REV --instances 16     # one size

``--baseline`` is a git revision (checked out into a temporary worktree) or a folder holding an older checkout; its
code runs with ``PYTHONPATH`` set to it, this checkout's with ``PYTHONPATH`` set here, each as its own subprocess on
the embedded model with a fresh ``--out`` (``--restart --no-figure``), one after the other, never concurrently. Each
size's wall times (the whole command: model load, parity check, units, statistics) and their ratio are printed and
saved with the rows comparison of ``bench.rows_identity`` (every field, floats exact) in ``--out`` (default
``data/results/bench/main_job.json``). Time it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO_ROOT
from bench.rows_identity import compare_file, result_files

SIZES = (4, 16, 48)


def _tree(baseline: str, keep: Path) -> Path:
    path = Path(baseline)
    if path.is_dir():
        return path.resolve()
    where = keep / "baseline"
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "-f", str(where), baseline],
                   check=True, capture_output=True)
    return where


def _run(code: Path, out: Path, instances: int, extra: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=str(code))
    cmd = [sys.executable, "-m", "probes.head_pooling", "--instances", str(instances), "--out", str(out), "--restart",
           "--no-figure", *extra]
    log = out.with_suffix(".log")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=code, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc:
        raise SystemExit(f"{' '.join(cmd)} (in {code}) exited {rc}; see {log}")
    return wall


def _identical(old: Path, new: Path, old_code: Path) -> bool:
    """Every rows file of the two runs equal field by field, floats exact (``bench.rows_identity``'s comparison, paths
    into each run's folder and code tree rewritten first); differences are printed."""
    a = {p.relative_to(old).as_posix(): p for p in result_files(old)}
    b = {p.relative_to(new).as_posix(): p for p in result_files(new)}
    if set(a) != set(b) or not a:
        print(f"  files differ: only old {sorted(set(a) - set(b))}, only new {sorted(set(b) - set(a))}")
        return False
    ok = True
    for rel in sorted(a):
        problems = compare_file(a[rel], b[rel], 0.0, [], [(str(old), "<OUT>"), (str(old_code), "<ROOT>")],
                                [(str(new), "<OUT>"), (str(REPO_ROOT), "<ROOT>")], set())
        for line in problems:
            print(f"  {rel}: {line}")
        ok = ok and not problems
    return ok


def _revision(code: Path) -> str:
    """The checkout's short revision, ``+changes`` when its tracked files differ from it."""
    r = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(code), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (r.stdout.strip() or "?") + ("+changes" if dirty else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="git revision or folder of the old code")
    p.add_argument("--instances", type=int, nargs="+", default=list(SIZES), help="main-job sizes to time")
    p.add_argument("--new-args", nargs=argparse.REMAINDER, default=[],
                   help="extra flags for the new code's command (e.g. --processes 1), last on the line")
    p.add_argument("--out", default=str(REPO_ROOT / "data" / "results" / "bench" / "main_job.json"))
    a = p.parse_args(argv)
    if any(n <= 0 for n in a.instances):
        p.error(f"--instances must be positive, got {a.instances}")
    work = Path(tempfile.mkdtemp(prefix="main_job_"))
    old = _tree(a.baseline, work)
    baseline_rev, rows = _revision(old), []
    try:
        for n in a.instances:
            t_old = _run(old, work / f"old{n}", n, [])
            t_new = _run(REPO_ROOT, work / f"new{n}", n, a.new_args)
            identical = _identical(work / f"old{n}", work / f"new{n}", old)
            rows.append({"instances": n, "old_s": round(t_old, 1), "new_s": round(t_new, 1),
                         "x_faster": round(t_old / t_new, 3), "rows_identical": identical})
            print(f"--instances {n:3d}: old {t_old:7.1f} s   new {t_new:7.1f} s   {t_old / t_new:.2f}x faster   rows "
                  f"{'identical' if identical else 'DIFFER'}", flush=True)
    finally:
        if old.parent == work:
            subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(old)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    meta = {"baseline": baseline_rev, "new": _revision(REPO_ROOT),
            "new_args": a.new_args, "machine": platform.machine(), "cores": os.cpu_count(),
            "cpu": platform.processor() or "?", "date": time.strftime("%Y-%m-%d")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0 if all(r["rows_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
