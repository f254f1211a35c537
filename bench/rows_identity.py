"""Rows identical through a refactor: every shipped probe at a fixed small configuration, then a field-by-field diff.

    python -m bench.rows_identity run OUT_DIR [--only NAME ...]      # run the probes with the code of this folder
    python -m bench.rows_identity compare BEFORE_DIR AFTER_DIR [--atol X] [--atol-fields GLOB ...]
    python -m bench.rows_identity list                                # the probes and their command lines

``run`` runs each probe of :data:`PROBES` as ``python -m MODULE ARGS`` in a subprocess, from the current
directory with ``PYTHONPATH`` set to it (so a worktree of an older revision runs its own code, not the editable
install's), one torch thread, each into its own folder ``OUT_DIR/NAME/``. Before anything runs it checks that
``probes``, ``randattn`` and ``bench`` import from the current directory, and stops if they do not. The command
lines use only flags that existed before the experiment-layer refactor (issue 28): a refactor must keep them
working. A probe that exits non-zero (an unknown flag is exit status 2) or writes no results file is a failure of
the run, recorded in ``OUT_DIR/rows_identity.json`` (the manifest: commands, exit status, wall time, where the
code was imported from); logs go to ``OUT_DIR/_logs/``, inputs the driver writes (grid specs) to
``OUT_DIR/_inputs/``.

``compare`` pairs every ``.jsonl``, ``.csv``, ``.json`` and ``.npz`` file under the two folders by relative path
(folders starting with ``_`` and the manifest left out) and compares them row by row, field by field (nested fields by
their dotted path). Left out of the comparison, at any depth, are only the fields that say where, when or how
fast a row was measured (:data:`EXCLUDED`, :data:`EXCLUDED_SUFFIXES`); absolute paths into each side's out dir
or code folder are rewritten to ``<OUT>`` / ``<ROOT>`` before comparing. Floats are compared exactly unless
``--atol`` is given. Exit status 0 only when every probe ran on both sides and every file is identical; a file
on one side only, a probe missing or failed on either side, or any differing field is a failure.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

MANIFEST = "rows_identity.json"
RESULT_SUFFIXES = (".jsonl", ".csv", ".json", ".npz")  # .npz: keep-logs (the demo's), compared array by array

#: Field names never compared, at any depth: where/when/with what the row was measured, not what was measured.
EXCLUDED = frozenset({
    # provenance (probes.results.INFORMATIONAL, bench.common.meta/provenance, the grid's items: host:pid, when)
    "revision", "git", "versions", "device", "date", "machine", "worker", "finished", "started",
    # wall-clock time and throughput (bench.pack: problems per hour and its ratio to one-at-a-time)
    "seconds", "wall", "wall_s", "elapsed", "time", "timestamp", "tok_per_s", "tokens_per_s", "ms",
    "problems_per_hour", "x_one_at_a_time", "x_random",  # (bench.round_cost: ms as a multiple of Random's)
    "speedup",  # bench.replay_speed: token-by-token seconds / replay seconds
})
#: Field-name endings never compared: durations and rates (``*_s``, ``*_ms``, ``*_seconds``, ``*_per_s``).
EXCLUDED_SUFFIXES = ("_s", "_ms", "_seconds", "_per_s", "_per_sec", "_sec", "_per_hour")

# -- the probes -------------------------------------------------------------------------------------------
#: The planted-fact probes' small geometry (tests/test_probe_clis.py's): T=64, r=12, the fact 90 tokens back.
SMALL = ["--budget", "64", "--buffer", "12", "--distance", "90", "--batch", "2"]
#: The copy task at a K that holds its 213-token protected prompt plus a few rounds in 48 new tokens.
COPY = ["--task", "copy", "--budget", "232", "--buffer", "8", "--problems", "2", "--runs", "1",
        "--max-new-tokens", "48", "--batch", "2"]
# the repeat task: its protected prompt is 67 tokens; 64 new tokens make a few rounds at T=96, r=8
REPEAT = ["--task", "repeat", "--budget", "96", "--buffer", "8", "--problems", "2", "--runs", "1",
          "--max-new-tokens", "64", "--batch", "2"]

GRID_ACCURACY = """\
probe = "accuracy"
task = "copy"
models = ["smollm2-135m"]
policies = ["full", "random", "recency"]
budgets = [232]
buffers = [8]
protect_prompt = [true]
seeds = [0]
runs = 1
problems = 2
batch = 2
max_new_tokens = 48
"""
GRID_PASSCODE = """\
probe = "passcode"
models = ["smollm2-135m"]
policies = ["random", "recency"]
budgets = [96]
buffers = [16]
protect_prompt = [true]
seeds = [0]
rounds = [5]
instances = 2
batch = 2
"""


@dataclass(frozen=True)
class Probe:
    """One command: ``python -m module *args``; ``{out}`` is the probe's folder, ``{inputs}`` the driver's inputs."""
    name: str
    module: str
    args: tuple[str, ...]


def _p(name: str, module: str, *args: str) -> Probe:
    return Probe(name, module, tuple(args))


PROBES: tuple[Probe, ...] = (
    _p("head_pooling", "probes.head_pooling", *SMALL, "--instances", "2", "--parity", "1", "--out", "{out}",
       "--no-figure"),
    _p("two_facts", "probes.two_facts", *SMALL, "--instances", "2", "--parity", "0", "--out", "{out}", "--no-figure"),
    # snapkv with the stub prompt protected: T must hold its 45 tokens, the pinned box and r (>= 70)
    _p("scatter", "probes.scatter", *SMALL, "--instances", "2", "--parity", "0", "--policy", "snapkv",
       "--protect-prompt", "--budget", "96", "--out", "{out}", "--no-figure"),
    _p("blocks", "probes.blocks", *SMALL, "--instances", "2", "--parity", "0", "--blocks", "1", "32",
       "--sequences", "2", "--length", "160", "--out", "{out}", "--no-figure"),
    _p("shared_draw", "probes.shared_draw", *SMALL, "--instances", "2", "--parity", "0", "--sequences", "2",
       "--length", "160", "--rounds", "4", "--passcode-instances", "2", "--out", "{out}", "--no-figure"),
    # real chats: the protected question (~126 tokens) and r must fit below T
    _p("survival", "probes.survival", "--policies", "random", "random-shared", "recency", "h2o", "snapkv", "rkv",
       "vase", "triattention", "--modes", "protected", "score-only", "--budget", "256", "--buffer", "16",
       "--rounds", "4", "--sequences", "2", "--batch", "2", "--out", "{out}", "--no-figure"),
    _p("prompt_protection", "probes.prompt_protection", "--instances", "3", "--batch", "2", "--budget", "128",
       "--buffer", "8", "--body", "120", "--policies", "random", "snapkv", "rkv", "--out", "{out}", "--no-figure"),
    _p("passcode", "probes.passcode", "--instances", "2", "--batch", "2", "--parity", "1", "--budget", "96",
       "--buffer", "16", "--rounds", "5", "--policies", "random", "recency", "h2o", "snapkv", "--out", "{out}",
       "--no-figure"),
    _p("accuracy_copy", "probes.accuracy", *COPY, "--policy", "full", "random", "recency", "h2o", "snapkv",
       "--out", "{out}", "--no-figure"),
    _p("accuracy_copy_pack", "probes.accuracy", *COPY, "--policy", "full", "random", "snapkv", "--pack",
       "--out", "{out}", "--no-figure"),
    _p("accuracy_copy_matched", "probes.accuracy", *COPY, "--policy", "random", "snapkv", "--protocol", "matched",
       "--out", "{out}", "--no-figure"),
    _p("accuracy_copy_grid", "probes.accuracy", *COPY, "--policy", "random", "snapkv", "--protocol", "grid",
       "--out", "{out}", "--no-figure"),
    _p("accuracy_repeat", "probes.accuracy", *REPEAT, "--policy", "full", "random", "rkv", "--out", "{out}",
       "--no-figure"),
    _p("accuracy_repeat_pack_sampled", "probes.accuracy", *REPEAT, "--policy", "random", "--pack",
       "--temperature", "0.7", "--top-p", "0.9", "--out", "{out}", "--no-figure"),
    # the cost part is timings alone: left out; T=240, r=12 holds the copy prompt and the planted 12-token box
    _p("challenge", "probes.challenge", "--policy", "examples/attention_selector.py:recent_attention", "--quick",
       "--skip", "cost", "--budget", "240", "--buffer", "12", "--problems", "1", "--runs", "1", "--instances", "2",
       "--passcode-instances", "2", "--rounds", "4", "--out", "{out}", "--no-figure"),
    _p("autopsy", "probes.autopsy", "--task", "copy", "--problems", "1", "--policy", "random", "snapkv",
       "--budget", "232", "--buffer", "8", "--max-new", "48", "--max-replays", "4", "--horizon", "8",
       "--out", "{out}", "--no-figure"),
    _p("demo", "probes.demo", "--budget", "128", "--buffer", "16", "--max-new-tokens", "96", "--out", "{out}/demo",
       "--no-figure"),
    _p("grid_accuracy", "probes.grid", "{inputs}/grid_accuracy.toml", "--backend", "local", "--cpus-per-worker", "1",
       "--out", "{out}", "--no-figure"),
    _p("grid_passcode", "probes.grid", "{inputs}/grid_passcode.toml", "--backend", "local", "--cpus-per-worker", "1",
       "--out", "{out}", "--no-figure"),
    _p("bench_round_cost", "bench.round_cost", "--policies", "random", "snapkv", "--repeats", "1", "--warmup", "1",
       "--threads", "1", "--out", "{out}/round_cost.json"),
    _p("bench_replay_speed", "bench.replay_speed", "--new-tokens", "96", "--budget", "128", "--buffer", "16",
       "--threads", "1", "--policies", "random", "--out", "{out}/replay_speed.json"),
    # prompts of 85-95 tokens: T=112, r=8 and 40 new tokens make a round or two in the longer ones
    _p("bench_pack", "bench.pack", "--problems", "4", "--batch", "2", "--policies", "random", "--budget", "112",
       "--buffer", "8", "--max-new-tokens", "40", "--threads", "1", "--out", "{out}/pack.json"),
)
INPUTS = {"grid_accuracy.toml": GRID_ACCURACY, "grid_passcode.toml": GRID_PASSCODE}


def command(probe: Probe, out: Path, inputs: Path) -> list[str]:
    return [sys.executable, "-m", probe.module,
            *(a.replace("{out}", str(out)).replace("{inputs}", str(inputs)) for a in probe.args)]


# -- run --------------------------------------------------------------------------------------------------
def _env(root: Path) -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    return env


def _where_imported(root: Path) -> dict:
    code = ("import json, probes, randattn, bench, figures; "
            "print(json.dumps({m.__name__: m.__file__ for m in (probes, randattn, bench, figures)}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=_env(root), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"rows_identity: importing the packages from {root} failed:\n{done.stderr}")
    where = json.loads(done.stdout)
    wrong = {k: v for k, v in where.items() if not Path(v).resolve().is_relative_to(root)}
    if wrong:
        raise SystemExit(f"rows_identity: these packages import from outside {root}: {wrong}; run from the tree "
                         "whose code you mean to measure")
    return where


def _git_head(root: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    return done.stdout.strip()


def _children_cpu() -> float:
    """User + system CPU seconds of the finished child processes (a machine shared with other jobs inflates the
    wall time, not this)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _git_dirty(root: Path) -> list[str]:
    """``git status --porcelain`` lines: what of the tree a probe ran with was not committed (for the record)."""
    done = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
    return done.stdout.splitlines()


def run(out_dir: Path, only: Optional[list[str]] = None) -> int:
    root = Path.cwd().resolve()
    out_dir = out_dir.resolve()
    names = [p.name for p in PROBES]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise SystemExit(f"rows_identity: unknown probe(s) {unknown}; known: {names}")
    manifest_path = out_dir / MANIFEST
    if out_dir.exists() and any(out_dir.iterdir()) and not manifest_path.exists():
        raise SystemExit(f"rows_identity: {out_dir} is not empty and holds no {MANIFEST}: not ours, not touched")
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"probes": {}}
    head = _git_head(root)
    if manifest.get("root", str(root)) != str(root) or manifest.get("git_head", head) != head:
        raise SystemExit(f"rows_identity: {out_dir} was run from {manifest['root']} at {manifest['git_head']}, not "
                         f"{root} at {head}: one folder holds one tree's rows; use another OUT_DIR")
    if manifest.get("out", str(out_dir)) != str(out_dir):  # the folder was moved: its older rows name the old path
        manifest["earlier_outs"] = sorted(set(manifest.get("earlier_outs", [])) | {manifest["out"]})
    manifest.update(root=str(root), out=str(out_dir), git_head=head, imported_from=_where_imported(root),
                    python=sys.executable)
    inputs, logs = out_dir / "_inputs", out_dir / "_logs"
    inputs.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    for fname, text in INPUTS.items():
        (inputs / fname).write_text(text)
    failed = []
    t_all = time.perf_counter()
    for probe in PROBES:
        if only and probe.name not in only:
            continue
        out = out_dir / probe.name
        if out.exists():
            shutil.rmtree(out)  # inside our own OUT_DIR (it holds our manifest): a fresh run of this probe
        cmd = command(probe, out, inputs)
        print(f"[rows_identity] {probe.name}: {' '.join(cmd[1:])}", flush=True)
        t0, c0 = time.perf_counter(), _children_cpu()
        with open(logs / f"{probe.name}.log", "w") as log:
            rc = subprocess.run(cmd, cwd=root, env=_env(root), stdout=log, stderr=subprocess.STDOUT).returncode
        wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
        files = sorted(p.relative_to(out_dir).as_posix() for p in result_files(out_dir / probe.name))
        ok = rc == 0 and bool(files)
        manifest["probes"][probe.name] = {"module": probe.module, "args": list(probe.args), "rc": rc,
                                          "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "files": files,
                                          "ok": ok,
                                          "uncommitted": _git_dirty(root)}
        manifest_path.write_text(json.dumps(manifest, indent=1))
        verdict = "ok" if ok else (f"FAILED (exit {rc}; see {logs / (probe.name + '.log')})" if rc
                                   else "FAILED (wrote no results file)")
        print(f"[rows_identity] {probe.name}: {verdict}, {len(files)} files, {wall:.0f} s wall, {cpu:.0f} s CPU",
              flush=True)
        if not ok:
            failed.append(probe.name)
    manifest["wall_s_last_run"] = round(time.perf_counter() - t_all, 1)
    manifest_path.write_text(json.dumps(manifest, indent=1))
    print(f"[rows_identity] wall {manifest['wall_s_last_run']:.0f} s; manifest {manifest_path}")
    if failed:
        print(f"[rows_identity] FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


# -- compare ----------------------------------------------------------------------------------------------
def result_files(folder: Path) -> Iterable[Path]:
    """The results files under ``folder``: JSONL/CSV/JSON, not the manifest, not under a ``_``-folder."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in RESULT_SUFFIXES
                  and p.name != MANIFEST and not any(part.startswith("_") for part in p.relative_to(folder).parts[:-1]))


def _other_files(folder: Path) -> set:
    """Files under a run folder that are not compared (tables as Markdown/LaTeX, locks, ...), for the record."""
    rows = set(result_files(folder))
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p not in rows
            and p.name != MANIFEST and not p.relative_to(folder).parts[0].startswith("_")}


def excluded(key: str) -> bool:
    return key in EXCLUDED or key.endswith(EXCLUDED_SUFFIXES)


def load_rows(path: Path) -> list:
    """A file as a list of rows: JSONL lines, CSV rows (dicts of strings), a JSON file's ``rows`` list with the
    rest of the object as one more row, or the whole JSON value as one row."""
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    if path.suffix == ".npz":
        import numpy as np
        with np.load(path, allow_pickle=False) as z:
            return [{name: z[name].tolist() for name in sorted(z.files)}]
    data = json.loads(path.read_text())
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        return [{k: v for k, v in data.items() if k != "rows"}, *data["rows"]]
    return [data]


def flatten(value: Any, prefix: str, out: dict, seen_excluded: set, subst: list[tuple[str, str]]) -> dict:
    """``{dotted.path: leaf}`` of a row, excluded keys left out (and noted in ``seen_excluded``)."""
    if isinstance(value, dict):
        if not value:
            out[prefix] = {}
        for k, v in value.items():
            if excluded(str(k)):
                seen_excluded.add(str(k))
                continue
            flatten(v, f"{prefix}.{k}" if prefix else str(k), out, seen_excluded, subst)
    elif isinstance(value, list):
        if not value:
            out[prefix] = []
        for i, v in enumerate(value):
            flatten(v, f"{prefix}[{i}]", out, seen_excluded, subst)
    else:
        if isinstance(value, str):
            for old, new in subst:
                value = value.replace(old, new)
        out[prefix] = value
    return out


def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def same(a: Any, b: Any, atol: float) -> tuple[bool, float]:
    """Equal leaves (NaN equals NaN); floats within ``atol`` when ``atol > 0``. Returns (equal, |difference|)."""
    if a == b and type(a) is type(b):
        return True, 0.0
    x, y = _num(a), _num(b)
    if x is None or y is None or isinstance(a, bool) != isinstance(b, bool):
        return False, math.nan
    if math.isnan(x) and math.isnan(y):
        return True, 0.0
    if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return False, math.nan  # a string "1" and a number 1 are different rows
    d = abs(x - y)
    return d <= atol, d  # 1 and 1.0 are the same number


def _field_name(path: str) -> str:
    """``[3].config.budget`` -> ``config.budget``; list indices inside a row are dropped: ``heads[0]`` -> ``heads``."""
    return re.sub(r"\[\d+\]", "", path).lstrip(".")


def compare_file(a: Path, b: Path, atol: float, atol_fields: list[str], subst_a, subst_b,
                 seen_excluded: set) -> list[str]:
    """The differences between two results files, one line per differing field (empty: identical)."""
    ra, rb = load_rows(a), load_rows(b)
    problems = []
    if a.suffix == ".csv":
        with open(a, newline="") as fa, open(b, newline="") as fb:
            ha, hb = next(csv.reader(fa), []), next(csv.reader(fb), [])
        if set(ha) != set(hb):
            problems.append(f"columns differ: only before {sorted(set(ha) - set(hb))}, "
                            f"only after {sorted(set(hb) - set(ha))}")
    if len(ra) != len(rb):
        problems.append(f"{len(ra)} rows before, {len(rb)} after")
    fa = [flatten(r, "", {}, seen_excluded, subst_a) for r in ra]
    fb = [flatten(r, "", {}, seen_excluded, subst_b) for r in rb]
    fields: dict[str, dict] = {}  # field -> {"rows": n, "max": max |diff|}
    rows_differing = 0
    for x, y in zip(fa, fb):
        row_differs = False
        for key in sorted(set(x) | set(y)):
            name = _field_name(key)
            if key not in x or key not in y:
                eq, d = False, math.nan
                name += " (only before)" if key in x else " (only after)"
            else:
                tol = atol if any(fnmatch.fnmatch(name, g) for g in atol_fields) else 0.0
                eq, d = same(x[key], y[key], tol)
            if not eq:
                row_differs = True
                f = fields.setdefault(name, {"rows": set(), "max": 0.0, "example": (x.get(key), y.get(key))})
                f["rows"].add(id(x))
                if not math.isnan(d):
                    f["max"] = max(f["max"], d)
        rows_differing += row_differs
    if fields:
        n = min(len(fa), len(fb))
        if sorted(map(_canon, fa)) == sorted(map(_canon, fb)) and len(fa) == len(fb):
            problems.append(f"the same {n} rows in another order")
        else:
            problems.append(f"{rows_differing} of {n} rows differ")
        for name, f in sorted(fields.items()):
            mx = f" (max |diff| {f['max']:.3g})" if f["max"] else ""
            ex_a, ex_b = (str(v)[:60] for v in f["example"])
            problems.append(f"  {name}: {len(f['rows'])} rows{mx}, e.g. {ex_a!s} -> {ex_b!s}")
    return problems


def _canon(row: dict) -> str:
    return json.dumps(row, sort_keys=True, default=str)


def _manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.exists():
        raise SystemExit(f"rows_identity: {folder} holds no {MANIFEST}: not a `rows_identity run` folder")
    return json.loads(path.read_text())


def compare(before: Path, after: Path, atol: float = 0.0, atol_fields: Optional[list[str]] = None,
            out=sys.stdout, only: Optional[list[str]] = None, ignore: Optional[list[str]] = None) -> int:
    """Print a verdict per probe problem and per file; 0 when every probe ran on both sides and every file is
    identical. ``only``: these probes (their folders) alone, for a partial rerun; ``ignore``: globs of relative
    paths left out (say so in the report that uses them)."""
    before, after = before.resolve(), after.resolve()
    ma, mb = _manifest(before), _manifest(after)
    if only:
        unknown = sorted(set(only) - set(ma["probes"]) - set(mb["probes"]))
        if unknown:
            raise SystemExit(f"rows_identity: --only {unknown}: run on neither side")
        ma = {**ma, "probes": {k: v for k, v in ma["probes"].items() if k in only}}
        mb = {**mb, "probes": {k: v for k, v in mb["probes"].items() if k in only}}
    atol_fields = atol_fields or ["*"]
    failures = 0
    # every probe ran, and ran well, on both sides (a probe dropped or broken by a refactor is a failure)
    for name in sorted(set(ma["probes"]) | set(mb["probes"])):
        pa, pb = ma["probes"].get(name), mb["probes"].get(name)
        for side, p in (("before", pa), ("after", pb)):
            if p is None:
                print(f"FAIL probe {name}: not run {side}", file=out)
                failures += 1
            elif not p["ok"]:
                print(f"FAIL probe {name}: failed {side} (exit {p['rc']}, {len(p['files'])} files)", file=out)
                failures += 1
        if pa and pb and pa["args"] != pb["args"]:
            print(f"FAIL probe {name}: different command lines {pa['args']} vs {pb['args']}", file=out)
            failures += 1
    print(f"before: {ma['root']} at {ma.get('git_head', '?')[:10]}; after: {mb['root']} at "
          f"{mb.get('git_head', '?')[:10]}", file=out)
    # a folder moved after its run still compares: its path now and the one it was run into are both <OUT>
    subst_a = [*((o, "<OUT>") for o in [ma["out"], str(before), *ma.get("earlier_outs", [])]), (ma["root"], "<ROOT>")]
    subst_b = [*((o, "<OUT>") for o in [mb["out"], str(after), *mb.get("earlier_outs", [])]), (mb["root"], "<ROOT>")]
    # longest first: /work/rows_before must not eat the front of /work/rows_before2
    subst_a, subst_b = (sorted(x, key=lambda t: -len(t[0])) for x in (subst_a, subst_b))
    fa = {p.relative_to(before).as_posix(): p for p in result_files(before)}
    fb = {p.relative_to(after).as_posix(): p for p in result_files(after)}
    for pattern in ignore or ():
        gone = {k for k in set(fa) | set(fb) if fnmatch.fnmatch(k, pattern)}
        print(f"ignored by --ignore {pattern}: {len(gone)} files", file=out)
        fa = {k: v for k, v in fa.items() if k not in gone}
        fb = {k: v for k, v in fb.items() if k not in gone}
    if only:
        fa = {k: v for k, v in fa.items() if k.split("/")[0] in only}
        fb = {k: v for k, v in fb.items() if k.split("/")[0] in only}
    seen_excluded: set = set()
    identical = 0
    for rel in sorted(set(fa) | set(fb)):
        if rel not in fb:
            print(f"FAIL {rel}: missing after", file=out)
            failures += 1
            continue
        if rel not in fa:
            print(f"FAIL {rel}: new after (not in before)", file=out)
            failures += 1
            continue
        try:
            problems = compare_file(fa[rel], fb[rel], atol, atol_fields, subst_a, subst_b, seen_excluded)
        except (ValueError, json.JSONDecodeError) as e:
            problems = [f"unreadable: {e}"]
        if problems:
            failures += 1
            print(f"FAIL {rel}: " + problems[0], file=out)
            for line in problems[1:]:
                print(f"     {line}", file=out)
        else:
            identical += 1
            print(f"ok   {rel}: identical ({len(load_rows(fa[rel]))} rows)", file=out)
    others = {p for p in _other_files(before) | _other_files(after) if not only or p.split("/")[0] in only}
    if others:
        print(f"\nnot compared (not a rows file): {len(others)} files, "
              f"{', '.join(sorted({Path(p).suffix or p for p in others}))}", file=out)
    print(f"\nfields left out (where present): {', '.join(sorted(seen_excluded)) or 'none'}", file=out)
    tol = f"atol {atol:g} on {', '.join(atol_fields)}" if atol else "floats exact"
    print(f"{identical} of {len(set(fa) | set(fb))} files identical ({tol}); {failures} failure(s)", file=out)
    return 1 if failures else 0


# -- command line -----------------------------------------------------------------------------------------
def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rows_identity", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run every probe at its small configuration into OUT_DIR/NAME/")
    r.add_argument("out_dir", type=Path)
    r.add_argument("--only", nargs="+", metavar="NAME", help="run only these probes (the rest of OUT_DIR is kept)")
    c = sub.add_parser("compare", help="compare two run folders field by field")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--atol", type=float, default=0.0, help="absolute tolerance for numbers (default: exact)")
    c.add_argument("--atol-fields", nargs="+", metavar="GLOB",
                   help="field names (dotted, e.g. 'lp', 'config.*') the tolerance applies to (default: all)")
    c.add_argument("--only", nargs="+", metavar="NAME", help="compare only these probes (a partial rerun)")
    c.add_argument("--ignore", nargs="+", metavar="GLOB", default=[],
                   help="relative paths left out, e.g. 'grid_*/items/*' (the grid's per-item resume files)")
    sub.add_parser("list", help="print the probes and their command lines")
    args = p.parse_args(argv)
    if args.cmd == "run":
        return run(args.out_dir, args.only)
    if args.cmd == "compare":
        return compare(args.before, args.after, args.atol, args.atol_fields, only=args.only, ignore=args.ignore)
    for probe in PROBES:
        print(f"{probe.name:30s} python -m {probe.module} {' '.join(probe.args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
