"""Pre-registered board tasks: a task's spec is fixed in the board's folder before its rows, and a later run that
asks for another setting of it is refused by field, before any model loads.

A board's verdict means something only if its settings were chosen before its rows were seen. So every task a
leaderboard run plans is registered in ``<board folder>/spec.json`` (the model, T, r, protection, seed, the task's
own knobs: units, runs, rounds, distance, its grade, and the verdict rule: alpha, the adjustment, the power of the
MDE) when its first run starts. A later run into the same folder may add tasks (each registered when it first
runs) and selectors (the board is built to grow by selectors), but a registered task's spec never changes:
asking for a different value is a :class:`ConfigError` naming the flag, the registered value and the way out
(another ``--out`` for another setting, or ``--restart``, which registers anew). Commit ``spec.json`` before the
rows, and the board is pre-registered; a board whose rows predate its ``spec.json`` says so
(``"preregistered": false`` per task).

Two changes a registered board can take, each recorded: a field added to a task's spec after the board was registered
(:data:`ADDED_FIELDS`) is read, for a spec without it, as the value every run had before it existed (so the board's
rows still merge, and a run asking another value is refused as for any field); and a grade re-defined after the rows
(``python -m probes.regrade``, which re-grades the rows from their stored output) is amended in the spec by
:func:`amend`, the earlier grade kept beside it with the date, revision and reason.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from analysis.files import replacing

from .config_errors import ConfigError
from .results import git_revision

SPEC_FILE = "spec.json"
FORMAT = "randattn board spec 1"
#: Per task, the Config fields that set its rows and verdict (besides the eviction setting every task shares). Not
#: among them: ``--full-attention`` and ``--recall``, which add descriptive columns (a ceiling, Recall R) beside the
#: verdict and rows beside the policy's, never changing either, so a registered board may gain them.
TASK_FIELDS = {
    "copy": ("accuracy_task", "data", "problems", "runs", "max_new_tokens", "temperature", "top_p", "reference_lp",
             "reference_tokens"),
    "repeat": ("repeat_problems", "compression", "runs", "max_new_tokens", "temperature", "top_p", "reference_lp",
               "reference_tokens", "repeat_buffer"),
    "question": ("instances", "body", "batch"),
    "passcode": ("passcode_instances", "rounds", "batch"),
    "planted": ("planted_instances", "distance", "batch"),
    "cost": ("cost_repeats", "cost_rounds", "cost_batch"),
}
SHARED_FIELDS = ("model", "budget", "buffer", "protect_prompt", "seed", "stats", "traces")
#: Fields added to a task's spec after boards were registered without them (issue 37: sampling and the reference
#: log-prob of the copy and repeat tasks), with the value every run had before they existed: a registered spec that
#: lacks one is read as having that value.
ADDED_FIELDS = {"temperature": 0.0, "top_p": 1.0, "reference_lp": False, "reference_tokens": None,
                "repeat_buffer": None}


def task_spec(config, task: str, *, grade: str, verdict: dict) -> dict:
    """What fixes one task of ``config``'s board: the shared eviction setting, the task's own fields, its grade
    and the verdict rule."""
    fields = {f: getattr(config, f) for f in (*SHARED_FIELDS, *TASK_FIELDS[task])}
    return {**{k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}, "grade": grade,
            "verdict": dict(verdict)}


def read(root: Path) -> dict:
    """The board's registered tasks (``{}`` when nothing is registered); a file that is not a board spec is a
    :class:`ConfigError` on ``--out`` naming it."""
    path = Path(root) / SPEC_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("out", f"{path} is not a board spec randattn wrote ({exc}); move it aside") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("tasks"), dict):
        raise ConfigError("out", f"{path} is not a board spec randattn wrote (no format {FORMAT!r}); move it aside")
    return data["tasks"]


def check(root: Path, wanted: dict, *, restart: bool = False) -> None:
    """Refuse a run whose tasks disagree with the board's registered ones, by field (nothing is written)."""
    if restart:
        return
    registered = read(root)
    for task, spec in wanted.items():
        old = registered.get(task)
        if old is None:
            continue
        for field in sorted(set(spec) | set(old.get("spec", {}))):
            before, now = old["spec"].get(field, ADDED_FIELDS.get(field)), spec.get(field)
            if before != now:
                flag = "tasks" if field in ("grade", "verdict") else field
                raise ConfigError(flag, f"the board in {root} registered its {task} task with {field} = {before!r} "
                                        f"(spec.json, {old.get('date', '?')}); this run asks for {now!r}. A "
                                        f"registered task's setting is fixed before its rows: use another --out for "
                                        f"another setting, or --restart to register the board anew")


def record(root: Path, wanted: dict, *, restart: bool = False, rows_exist: dict | None = None) -> Path:
    """Register the tasks of ``wanted`` not yet registered (all of them anew with ``restart``); ``rows_exist``
    marks tasks whose rows were already on disk when registered (``preregistered: false``)."""
    root = Path(root)
    registered = read(root)  # refuses a spec.json that is not ours, also under --restart
    if restart:
        registered = {}
    added = {t: s for t, s in wanted.items() if t not in registered}
    path = root / SPEC_FILE
    if not added and path.exists():
        return path
    stamp = {"date": datetime.now(timezone.utc).date().isoformat(), "revision": git_revision()}
    for task, spec in added.items():
        registered[task] = {"spec": spec, **stamp, "preregistered": not (rows_exist or {}).get(task, False)}
    root.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"format": FORMAT, "tasks": registered}, indent=2, sort_keys=True) + "\n"
    with replacing(path, check=False) as tmp:  # read() above has shown an existing one to be ours
        Path(tmp).write_text(text)
    return path


def amend(root: Path, task: str, fields: dict, *, why: str) -> Path:
    """Change registered fields of ``task`` (a grade re-defined after the rows, which were re-graded from their stored
    output): the spec takes the new values, and ``amended`` lists each change with the value before, the date, the
    revision and ``why``. A :class:`ConfigError` on ``--out`` when the board holds no such task."""
    root = Path(root)
    registered = read(root)
    if task not in registered:
        raise ConfigError("out", f"the board in {root} has no registered {task} task to amend")
    entry = registered[task]
    stamp = {"date": datetime.now(timezone.utc).date().isoformat(), "revision": git_revision(), "why": why}
    for field, value in fields.items():
        before = entry["spec"].get(field)
        if before == value:
            continue
        entry.setdefault("amended", []).append({"field": field, "before": before, "after": value, **stamp})
        entry["spec"][field] = value
    text = json.dumps({"format": FORMAT, "tasks": registered}, indent=2, sort_keys=True) + "\n"
    path = root / SPEC_FILE
    with replacing(path, check=False) as tmp:  # read() above has shown it to be ours
        Path(tmp).write_text(text)
    return path
