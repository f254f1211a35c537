"""The board: every leaderboard task at its own pre-registered setting, one verdict across all of them.

    python -m probes.board register data/boards/NAME.toml          # write each task's spec.json: commit them first
    python -m probes.board run data/boards/NAME.toml [--tasks passcode planted] [--processes N] [--device auto]
    python -m probes.board merge data/boards/NAME.toml [--target-mde 0.2] [--no-figure] [--figure-dir DIR]

A board is a committed TOML file: a ``[board]`` table (``name``, ``model``, ``seed``, ``protect_prompt``,
``selectors``, ``out``, ``stats``, ``traces``, and the verdict rule, declared: ``alpha`` and ``adjustment`` =
``"holm"`` or ``"bh"``) and one ``[tasks.<task>]`` table per leaderboard task (``copy``, ``repeat``, ``question``,
``passcode``, ``planted``, ``cost``) with that task's eviction setting (``budget``, ``buffer``) and the leaderboard
options the task registers (:data:`probes.registration.TASK_FIELDS`, named without the task's prefix:
``instances`` for the passcode's ``passcode_instances``; the leaderboard's own name works too) plus the descriptive
columns it may add (``full_attention``, ``recall``). A knob may be ``"calibrated"`` with ``calibration =
"path/to/regime.json"`` (``python -m probes.calibrate_regime``): its value is the value that file chose.

Each task is one leaderboard run (``probes.leaderboard``, through its Python API as ``probes.challenge`` drives it)
in its own folder ``<out>/<task>/``:

- ``register`` builds every task's leaderboard configuration, plans it on the model's tokenizer and config (no
  weights: a prompt that does not fit T, a selector that cannot serve the model, are refused here), and writes each
  task's ``spec.json`` (:mod:`probes.registration`) before any row exists, with the board's verdict rule in it, and
  ``<out>/board.json``: the board as resolved (calibrated values filled in, the calibration files' choices and
  hashes). Committing these files before ``run`` is the pre-registration.
- ``run`` runs the registered tasks one after the other, cheap ones first (:data:`probes.leaderboard.RUN_ORDER`),
  the model loaded once; each resumes its rows (a killed run resumes to the same rows) and writes its folder's
  ``leaderboard.csv``. A task that is not registered, or whose registration differs from the spec, is refused
  before the model loads.
- ``merge`` (no model) reads every task's ``leaderboard.csv`` and cost rows, puts every comparison of every task
  (each selector's score and each log-prob endpoint) into one family, and recomputes, across that whole family,
  ``p_adjusted`` (Holm's step-down, or Benjamini-Hochberg where declared), the MDE at 80% power at the board's
  level (alpha / family) and the verdict by the paper's rule on the adjusted p
  (:func:`probes.leaderboard.adjust_board`). Writes ``<out>/board.csv`` (one tidy row per task, endpoint and
  selector; a task or selector without rows yet is a ``missing`` row) and the figure ``<out>/board.png``.

Every refusal names the spec file, the line and the key (``board.toml:12: [tasks.passcode] instances: must be a
positive integer, got 0``) and changes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from analysis.files import replacing
from analysis.names import result_name

from . import leaderboard, registration
from .calibrate_regime import PAPER_BUFFER
from .config_errors import ConfigError, flag_of

FORMAT = "randattn board 1"
CALIBRATED = "calibrated"
#: A key of the [board] table -> (its type, what it is, its default: ``REQUIRED`` when the spec must declare it).
REQUIRED = object()
BOARD_KEYS: dict[str, tuple[Any, str, Any]] = {
    "name": (str, "the board's name (default: the spec file's name)", None),
    "model": (Optional[str], "the model (default: the embedded SmolLM2-135M-Instruct)", None),
    "seed": (int, "the eviction draws' seed", 0),
    "protect_prompt": (bool, "the prompt pinned in every head", True),
    "selectors": (tuple[str, ...], "the selectors ranked against Random (default: every one the paper compared)",
                  None),
    "out": (str, "the board's folder (default: data/results/board/<name>)", None),
    "stats": (Optional[str], "calibration statistics for a selector that reads them (TriAttention)", None),
    "traces": (Optional[str], "the traces the question, passcode and planted tasks are built from", None),
    "alpha": (float, "the board's error rate", REQUIRED),
    "adjustment": (str, "holm (family-wise error rate) or bh (false discovery rate)", REQUIRED),
}
ADJUSTMENTS = ("holm", "bh")
#: The leaderboard Config fields the [board] table sets (its ``selectors`` are the Config's ``policies`` and
#: ``selector``).
BOARD_FIELDS = ("model", "seed", "protect_prompt", "stats", "traces")
#: The descriptive options (they add columns beside the verdict and are not registered, probes.registration):
#: the tasks each applies to.
DESCRIPTIVE = {"full_attention": ("copy", "question"), "recall": ("planted",)}
EVICTION = ("budget", "buffer")
#: What each scored endpoint measures (one line), by the leaderboard's name of it (its ``test``), and a log-prob's.
MEASURES = {
    "copy": "content kept: the share of the list reproduced in order",
    "repeat copies": "generation behaviour: the copies written (share of the 64 asked), i.e. when the model stopped",
    "repeat fidelity": "content kept: the fidelity of the copies written",
    "question": "retrieval: the question's digits recalled after its restatement",
    "passcode": "retrieval: the passcode stated once, answered exactly (greedy)",
    "planted": "retrieval: the fact planted in a real trace, answered exactly (greedy)",
}
LOG_PROB = {"copy": "log-prob: full attention's output teacher-forced under the selector's cache (mean nats per token)",
            "repeat": "log-prob: full attention's output teacher-forced under the selector's cache (mean nats per "
                      "token)"}
ANSWER_LOG_PROB = "log-prob: the answer teacher-forced (mean nats per token)"
RESOLVED = "board.json"
TABLE = "board.csv"
FIGURE = "board"
MISSING = "missing"


class BoardError(ValueError):
    """A refusal of the board spec or its stage; the message names the spec file (and line) and the key."""


# -- reading the spec ---------------------------------------------------------------------------------------
_HEADER = re.compile(r"^\s*\[(?!\[)\s*([^\]]+?)\s*\]")
_KEY = re.compile(r"""^\s*(["']?)([A-Za-z0-9_-]+)\1\s*=""")


def _lines(text: str) -> dict:
    """``{(table, key): line}`` and ``{(table, None): header line}`` of a TOML text (tomllib keeps no positions)."""
    table, out = "", {}
    for n, line in enumerate(text.splitlines(), 1):
        m = _HEADER.match(line)
        if m:
            table = ".".join(p.strip().strip("\"'") for p in m.group(1).split("."))
            out.setdefault((table, None), n)
            continue
        m = _KEY.match(line)
        if m:
            out.setdefault((table, m.group(2)), n)
    return out


def _optional(tp) -> bool:
    return typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp)


def _strip(tp):
    return next(a for a in typing.get_args(tp) if a is not type(None)) if _optional(tp) else tp


def _several(tp) -> bool:
    return typing.get_origin(_strip(tp)) in (tuple, list)


def _element(tp):
    tp = _strip(tp)
    if typing.get_origin(tp) in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return args[0] if args else str
    return tp


_WHAT = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_OK = {int: lambda x: isinstance(x, int) and not isinstance(x, bool),
       float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
       bool: lambda x: isinstance(x, bool), str: lambda x: isinstance(x, str)}


def _typed(value, tp) -> tuple[Any, Optional[str]]:
    """``(value as the field takes it, problem or None)``: a list for a field of several values (a tuple), an int
    as a float where a number is wanted; a bool is no integer."""
    kind = _element(tp)
    what = _WHAT.get(kind, "a value")
    if _several(tp):
        if not isinstance(value, list):
            return value, f"must be a list of {what}s, got {value!r} ({type(value).__name__})"
        items = value
    else:
        if isinstance(value, list):
            return value, f"takes one value, got the list {value!r}"
        items = [value]
    ok = _OK.get(kind, lambda x: True)
    for v in items:
        if not ok(v):
            return value, f"must be {what}, got {v!r} ({type(v).__name__})"
    conv = (lambda x: float(x)) if kind is float else (lambda x: x)
    return (tuple(conv(v) for v in items) if _several(tp) else conv(value)), None


def task_keys(task: str) -> dict[str, str]:
    """``{spec key: leaderboard Config field}`` a ``[tasks.<task>]`` table takes besides ``budget``, ``buffer`` and
    ``calibration``: the fields the task registers (:data:`probes.registration.TASK_FIELDS`) by their name without
    the task's prefix (``instances`` for ``passcode_instances``) and by their own, and the descriptive options that
    apply to it."""
    out: dict[str, str] = {}
    for name in registration.TASK_FIELDS[task]:
        if name == "repeat_buffer":  # the repeat task's r is its table's buffer (set by _read_task), not a key
            continue
        out.setdefault(name.removeprefix(f"{task}_"), name)
        out.setdefault(name, name)
    for name, tasks in DESCRIPTIVE.items():
        if task in tasks:
            out[name] = name
    return out


@dataclass
class Calibration:
    """Where a calibrated knob's value came from."""

    key: str
    file: str
    value: Any
    sha256: str
    reason: str
    scores: dict


@dataclass
class Task:
    """One task of the board: its folder and leaderboard configuration, and where its spec keys are."""

    name: str
    folder: Path
    config: Any  # leaderboard.Config
    settings: dict  # spec key -> resolved value (what the table says, calibrated values filled in)
    keys: dict  # Config field -> the spec key that set it
    calibration: Optional[Calibration] = None


@dataclass
class Board:
    """A read and checked board spec."""

    path: Path
    text: str
    lines: dict
    name: str
    out: Path
    alpha: float
    adjustment: str
    settings: dict  # [board] key -> resolved value
    tasks: dict = field(default_factory=dict)  # task -> Task, in leaderboard.TASKS order

    def where(self, table: Optional[str] = None, key: Optional[str] = None) -> str:
        """``FILE:LINE`` of a key (or its table's header), else ``FILE``."""
        line = self.lines.get((table, key)) if key is not None else None
        line = line or (self.lines.get((table, None)) if table else None)
        return f"{self.path}:{line}" if line else str(self.path)

    def refuse(self, table: Optional[str], key: Optional[str], message: str) -> BoardError:
        label = f"[{table}] {key}" if key else f"[{table}]" if table else ""
        return BoardError(f"{self.where(table, key)}: {label + ': ' if label else ''}{message}")

    def verdict(self) -> dict:
        """The verdict rule each task registers: the board's alpha and adjustment across the whole board."""
        return {"alpha": self.alpha, "adjustment": self.adjustment, "power": leaderboard.POWER,
                "family": f"board {self.name}: every comparison of every task, selector and endpoint"}

    def wanted(self, task: str) -> dict:
        """``{task: spec}`` to register for ``task``: the leaderboard's spec of it, the board's verdict rule."""
        spec = leaderboard.registered(self.tasks[task].config)[task]
        return {task: {**spec, "verdict": self.verdict()}}

    def ordered(self, only=None) -> list[str]:
        """The board's tasks (or ``only``) in run order: the cheap ones first."""
        names = [t for t in self.tasks if only is None or t in only]
        return sorted(names, key=leaderboard.RUN_ORDER.index)

    def resolved(self) -> dict:
        """The board as resolved: what ``board.json`` holds (no date: a re-registration of the same board leaves
        the file as it was)."""
        data = self.path.read_bytes()
        tasks = {}
        for name, t in self.tasks.items():
            cal = t.calibration
            tasks[name] = {"folder": str(t.folder), "settings": _plain(t.settings),
                           "leaderboard": {f: _plain(getattr(t.config, f)) for f in t.keys},
                           **({"calibrated": dataclasses.asdict(cal)} if cal else {})}
        return {"format": FORMAT, "name": self.name, "spec": str(self.path),
                "spec_sha256": hashlib.sha256(data).hexdigest(), "board": _plain(self.settings),
                "verdict": self.verdict(), "tasks": tasks}


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return list(value) if isinstance(value, tuple) else value


def _unknown(board: Board, table: Optional[str], key: str, accepted, what: str) -> BoardError:
    close = difflib.get_close_matches(key, list(accepted), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return board.refuse(table, key, f"{what}{hint}; the accepted ones are {', '.join(accepted)}")


def read(path: "str | os.PathLike") -> Board:
    """Read and check a board spec; a :class:`BoardError` naming the file, line and key for anything wrong (nothing
    is written). Calibrated values are read from their regime files; every task's leaderboard configuration is
    built (its own checks, worded with the spec's keys)."""
    import tomllib

    path = Path(path)
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise BoardError(f"{path}: no such file; give the board's TOML spec (e.g. data/boards/NAME.toml)") from None
    except IsADirectoryError:
        raise BoardError(f"{path}: is a folder; give the board's TOML spec file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BoardError(f"{path}: cannot be read as text ({exc})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
        where = f"{path}:{m.group(1)}" if m else str(path)
        raise BoardError(f"{where}: not valid TOML ({exc}); the spec is a [board] table and one [tasks.<task>] "
                         "table per task") from None
    lines = _lines(text)
    board = Board(path, text, lines, "", Path("."), 0.0, "", {})
    for key in data:
        if key not in ("board", "tasks"):
            what = (f"unknown table [{key}]" if isinstance(data[key], dict) else
                    f"{key} = ... outside a table")
            raise BoardError(f"{board.where(key if isinstance(data[key], dict) else '', key)}: {what}; the spec has "
                             f"the tables [board] and [tasks.<task>] (tasks: {', '.join(leaderboard.TASKS)})")
    if not isinstance(data.get("board"), dict):
        raise BoardError(f"{path}: no [board] table; it declares the board's alpha and adjustment (and its name, "
                         f"model, seed, selectors, out)")
    _read_board(board, data["board"])
    tasks = data.get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        raise BoardError(f"{board.where('tasks')}: no [tasks.<task>] table; give one per task the board runs "
                         f"({', '.join(leaderboard.TASKS)})")
    for name, table in tasks.items():
        if name not in leaderboard.TASKS:
            close = difflib.get_close_matches(name, leaderboard.TASKS, n=1)
            raise board.refuse(f"tasks.{name}", None, f"unknown task {name!r}"
                               + (f"; did you mean {close[0]}?" if close else "")
                               + f"; the tasks are {', '.join(leaderboard.TASKS)}")
        if not isinstance(table, dict):
            raise BoardError(f"{board.where('tasks', name)}: [tasks] {name}: must be a table ([tasks.{name}] with its "
                             f"budget, buffer and options), got {table!r}")
    for name in leaderboard.TASKS:  # the leaderboard's order
        if name in tasks:
            board.tasks[name] = _read_task(board, name, tasks[name])
    return board


def _read_board(board: Board, table: dict) -> None:
    hints = typing.get_type_hints(leaderboard.Config)
    for key in table:
        if key not in BOARD_KEYS:
            raise _unknown(board, "board", key, list(BOARD_KEYS), "not a key of the [board] table")
    values = {}
    for key, (tp, _, default) in BOARD_KEYS.items():
        if key not in table:
            if default is REQUIRED:
                raise board.refuse("board", None, f"declare {key} ({BOARD_KEYS[key][1]}): the verdict rule is part of "
                                                  f"what a board pre-registers")
            values[key] = default
            continue
        value, problem = _typed(table[key], hints.get(key, tp) if key in BOARD_FIELDS else tp)
        if problem:
            raise board.refuse("board", key, problem)
        values[key] = value
    if values["name"] is None:
        values["name"] = board.path.stem
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", values["name"]):
        raise board.refuse("board", "name" if "name" in table else None,
                           f"the board's name {values['name']!r} names its folder: use letters, digits, '.', '_' and "
                           f"'-'")
    if not 0 < values["alpha"] < 1:
        raise board.refuse("board", "alpha", f"must be strictly between 0 and 1, got {values['alpha']!r}")
    if values["adjustment"] not in ADJUSTMENTS:
        raise board.refuse("board", "adjustment", f"must be one of {', '.join(ADJUSTMENTS)} (Holm's step-down: the "
                                                  f"family-wise error rate; Benjamini-Hochberg: the false discovery "
                                                  f"rate), got {values['adjustment']!r}")
    if values["selectors"] is not None and not values["selectors"]:
        raise board.refuse("board", "selectors", "no selector to rank; leave the key out for the leaderboard's "
                                                 "default (every selector the paper compared with Random)")
    out = Path(values["out"]) if values["out"] else Path("data") / "results" / "board" / result_name("board", values, "folder")
    from .results import out_folder

    try:
        out = out_folder("board", str(out))
    except ConfigError as exc:
        raise board.refuse("board", "out" if "out" in table else None, exc.message) from None
    board.name, board.out, board.alpha, board.adjustment = values["name"], out, values["alpha"], values["adjustment"]
    board.settings = {**values, "out": str(out)}


def _selectors(board: Board) -> dict:
    chosen = board.settings["selectors"]
    if chosen is None:
        return {"policies": leaderboard.DEFAULT_SELECTORS, "selector": ()}
    return {"policies": tuple(s for s in chosen if ":" not in s), "selector": tuple(s for s in chosen if ":" in s)}


def _read_task(board: Board, task: str, table: dict) -> Task:
    where = f"tasks.{task}"
    accepted = {**{k: k for k in EVICTION}, **task_keys(task)}
    for key in table:
        if key not in accepted and key != "calibration":
            raise _unknown(board, where, key, [*accepted, "calibration"], f"the {task} task does not take {key}")
    for key in EVICTION:
        if key not in table:
            raise board.refuse(where, None, f"give {key} ({'T' if key == 'budget' else 'r'}): every task declares its "
                                            f"eviction setting (the paper's r = 64 wherever the task's length allows)")
    fields: dict[str, str] = {}  # Config field -> spec key
    for key in table:
        if key == "calibration":
            continue
        name = accepted[key]
        if name in fields:
            raise board.refuse(where, key, f"sets {name}, which {fields[name]} sets too; give it once")
        fields[name] = key
    calibration = _calibrate(board, task, table)
    hints = typing.get_type_hints(leaderboard.Config)
    values: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    for name, key in fields.items():
        raw = calibration.value if calibration is not None and key == calibration.key else table[key]
        value, problem = _typed(raw, hints[name])
        if problem:
            raise board.refuse(where, key, problem)
        values[name] = value
        settings[key] = value
    if calibration is not None:
        settings["calibration"] = calibration.file
    if task == "repeat":  # the leaderboard hands the accuracy harness the repeat task's own r unless told
        values["repeat_buffer"] = values["buffer"]
    folder = board.out / task
    common = {f: board.settings[f] for f in BOARD_FIELDS}
    try:
        config = leaderboard.Config(**common, **_selectors(board), tasks=(task,), **values, root=str(folder),
                                    no_figure=True)
    except ConfigError as exc:
        raise _config_error(board, task, fields, exc) from None
    return Task(task, folder, config, settings, {**{f: f for f in BOARD_FIELDS}, **fields}, calibration)


def _config_error(board: Board, task: str, fields: dict, exc: ConfigError) -> BoardError:
    """The leaderboard Config's refusal, worded with the spec's keys (its own ``--flag`` names replaced)."""
    table, key = _key_of(board, task, fields, exc.field)
    message = exc.message.replace("--no-protect-prompt", "protect_prompt = false")
    spelled = {**{f: f"[board] {f}" for f in BOARD_FIELDS}, "policies": "[board] selectors",
               "selector": "[board] selectors", **{f: k for f, k in fields.items()}}
    for name, words in sorted(spelled.items(), key=lambda x: -len(x[0])):
        message = re.sub(re.escape(flag_of(name)) + r"(?![\w-])", words, message)
    return board.refuse(table, key, message)


def _key_of(board: Board, task: str, fields: dict, name: str) -> tuple[str, Optional[str]]:
    if name in fields:
        return f"tasks.{task}", fields[name]
    if name in ("policies", "selector"):
        return "board", "selectors"
    if name in BOARD_FIELDS or name == "out":
        return "board", name
    return f"tasks.{task}", None


def _calibrate(board: Board, task: str, table: dict) -> Optional[Calibration]:
    """The calibrated knob of a task table (``KEY = "calibrated"`` and ``calibration = FILE``), read from the regime
    file ``probes.calibrate_regime`` wrote; None when the table calibrates nothing."""
    where = f"tasks.{task}"
    keys = [k for k, v in table.items() if v == CALIBRATED]
    file = table.get("calibration")
    if file is None:
        if keys:
            raise board.refuse(where, keys[0], f"'{CALIBRATED}' needs calibration = \"path/to/regime.json\" in the "
                                               f"same table (`python -m probes.calibrate_regime {task} ...` writes it)")
        return None
    if not isinstance(file, str):
        raise board.refuse(where, "calibration", f"must be a string (the regime.json path), got {file!r}")
    if not keys:
        raise board.refuse(where, "calibration", f"no key of [tasks.{task}] says \"{CALIBRATED}\"; give the knob the "
                                                 f"file chose as KNOB = \"{CALIBRATED}\", or drop calibration")
    key = keys[0]
    path = Path(file)
    try:
        raw = path.read_bytes()
        regime = json.loads(raw)
    except FileNotFoundError:
        raise board.refuse(where, key, f"the calibration file {file} does not exist; `python -m "
                                       f"probes.calibrate_regime {task} --values ...` writes it") from None
    except (OSError, ValueError) as exc:
        raise board.refuse(where, key, f"the calibration file {file} cannot be read as JSON ({exc})") from None
    if not isinstance(regime, dict) or not {"task", "knob", "chosen"} <= set(regime):
        raise board.refuse(where, key, f"{file} is not a regime file `python -m probes.calibrate_regime` wrote (no "
                                       f"task, knob and chosen)")
    if regime["task"] != task:
        raise board.refuse(where, key, f"{file} is the regime of the {regime['task']} task, not of {task}; give "
                                       f"[tasks.{task}] the file of its own calibration")
    if regime["knob"] != key and task_keys(task).get(key, key) != regime["knob"]:
        raise board.refuse(where, key, f"{file} calibrated the {task} task's {regime['knob']}, not {key}; write "
                                       f"{regime['knob']} = \"{CALIBRATED}\" and give {key} a value")
    if len(keys) > 1:
        raise board.refuse(where, keys[1], f"{file} calibrated {regime['knob']} only; give {keys[1]} a value")
    chosen = regime["chosen"]
    if chosen is None:
        raise board.refuse(where, key, f"{file} chose nothing: {regime.get('reason', 'no reason recorded')}. No value "
                                       f"of {key} qualifies by the calibration's rule; calibrate over other values (or "
                                       f"another setting) before registering this task")
    if not isinstance(chosen, dict) or regime["knob"] not in chosen:
        raise board.refuse(where, key, f"{file}'s chosen point has no {regime['knob']}; it is not a regime file "
                                       f"`python -m probes.calibrate_regime` wrote")
    settings = regime.get("settings") or {}
    import randattn

    model = board.settings["model"] or randattn.DEFAULT_MODEL
    theirs = settings.get("model") or randattn.DEFAULT_MODEL
    if "model" in settings and theirs != model:
        raise board.refuse(where, key, f"{file} was calibrated on the model {theirs}; the board runs {model}")
    for name in EVICTION:
        if name == regime["knob"] or name not in settings or name not in table or table[name] == CALIBRATED:
            continue
        if settings[name] != table[name]:
            raise board.refuse(where, name, f"{file} was calibrated at {name} = {settings[name]}; this task runs at "
                                            f"{table[name]}, where the calibration says nothing. Calibrate at the "
                                            f"task's setting (python -m probes.calibrate_regime {task} --{name} "
                                            f"{table[name]} ...)")
    return Calibration(key, file, chosen[regime["knob"]], hashlib.sha256(raw).hexdigest(),
                       str(regime.get("reason", "")), dict(chosen.get("scores") or {}))


# -- register -----------------------------------------------------------------------------------------------
def _rows_in(folder: Path) -> bool:
    return folder.exists() and any(p for p in folder.rglob("*.jsonl") if "work" not in p.relative_to(folder).parts)


def check_registered(board: Board, task: str, *, required: bool) -> None:
    """Refuse a task whose registration (``<folder>/spec.json``) disagrees with the spec, naming the spec's key, the
    registered value and this spec's; with ``required``, also one that is not registered."""
    t = board.tasks[task]
    wanted = board.wanted(task)
    try:
        registered = registration.read(t.folder)
    except ConfigError as exc:
        raise board.refuse("board", "out" if "out" in _board_keys(board) else None, exc.message) from None
    if task not in registered:
        if required:
            raise board.refuse(f"tasks.{task}", None, f"the {task} task is not registered in {t.folder / registration.SPEC_FILE}; "
                                                      f"run `python -m probes.board register {board.path}` (and "
                                                      f"commit the spec.json files) before running it")
        return
    try:
        registration.check(t.folder, wanted)
    except ConfigError as exc:
        added = getattr(registration, "ADDED_FIELDS", {})  # fields a spec registered before them reads as these
        old = {**{f: v for f, v in added.items() if f in wanted[task]}, **registered[task].get("spec", {})}
        new = wanted[task]
        differ = [f for f in sorted(set(old) | set(new)) if old.get(f) != new.get(f)] or [exc.field]
        name = differ[0]
        if name == "verdict":
            table, key = "board", "alpha" if (old.get("verdict") or {}).get("alpha") != board.alpha else "adjustment"
        else:
            table, key = _key_of(board, task, {f: k for f, k in t.keys.items() if f not in BOARD_FIELDS}, name)
        raise board.refuse(table, key, f"the board registered its {task} task with {name} = {old.get(name)!r} "
                                       f"({t.folder / registration.SPEC_FILE}, {registered[task].get('date', '?')}); "
                                       f"this spec asks for {new.get(name)!r}. A registered task's setting is fixed "
                                       f"before its rows: give [board] out another folder for another setting") from None


def _board_keys(board: Board) -> set:
    return {k for (table, k) in board.lines if table == "board" and k}


def _model_info(board: Board):
    """The model as a plan sees it, without its weights (tokenizer, config): register plans every task on it."""
    from randattn.rules import SettingError

    from .grid_spec import check_model

    import randattn

    try:
        return check_model(board.settings["model"] or randattn.DEFAULT_MODEL, "model")
    except SettingError as exc:
        raise board.refuse("board", "model" if "model" in _board_keys(board) else None,
                           str(exc).removeprefix("model: ")) from None


def _plan_error(board: Board, task: str, exc: ConfigError) -> BoardError:
    t = board.tasks[task]
    return _config_error(board, task, {f: k for f, k in t.keys.items() if f not in BOARD_FIELDS}, exc)


def register(board: Board, *, plan: bool = True) -> list[Path]:
    """Register every task of the board (``spec.json`` in its folder, before its rows) and write ``board.json``;
    every check first, so a refusal writes nothing. ``plan``: plan each task on the model's tokenizer and config (no
    weights), refusing what its run would refuse."""
    for task in board.tasks:
        check_registered(board, task, required=False)
    if plan:
        info = _model_info(board)
        for task, t in board.tasks.items():
            try:
                leaderboard.plan(t.config, info)
            except ConfigError as exc:
                raise _plan_error(board, task, exc) from None
    existing = board.out / RESOLVED
    resolved = board.resolved()
    if existing.exists():
        try:
            old = json.loads(existing.read_text())
        except (OSError, ValueError):
            old = None
        if not isinstance(old, dict) or old.get("format") != FORMAT:
            raise board.refuse("board", "out" if "out" in _board_keys(board) else None,
                               f"{existing} is not a board file randattn wrote; move it aside")
    written = []
    for task, t in board.tasks.items():
        late = _rows_in(t.folder) and task not in registration.read(t.folder)
        written.append(registration.record(t.folder, board.wanted(task), rows_exist={task: late}))
        if late:
            print(f"{task}: rows were in {t.folder} before its registration: spec.json says preregistered: false")
    old = json.loads(existing.read_text()) if existing.exists() else {}
    if {k: v for k, v in old.items() if k not in ("date", "revision")} != resolved:
        from .results import git_revision

        stamp = {"date": datetime.now(timezone.utc).date().isoformat(), "revision": git_revision()}
        board.out.mkdir(parents=True, exist_ok=True)
        with replacing(existing, check=False) as tmp:  # checked above: absent, or ours
            Path(tmp).write_text(json.dumps({**resolved, **stamp}, indent=2, sort_keys=True) + "\n")
    written.append(existing)
    return written


def describe(board: Board) -> list[str]:
    """One line per task: its folder, T, r and options, and where a calibrated value came from."""
    out = []
    for task in board.ordered():
        t = board.tasks[task]
        opts = ", ".join(f"{k} = {_plain(v)!r}" for k, v in t.settings.items() if k not in (*EVICTION, "calibration"))
        cal = (f"; {t.calibration.key} calibrated by {t.calibration.file} ({t.calibration.reason})"
               if t.calibration else "")
        out.append(f"  {task:<9} T={t.config.budget}, r={t.config.buffer}{', ' + opts if opts else ''}{cal} -> "
                   f"{t.folder}")
    if "repeat" in board.tasks:  # T from compression; r as the leaderboard hands the accuracy harness its run
        from .tasks import TASKS as ACCURACY_TASKS

        t = board.tasks["repeat"]
        r = leaderboard.accuracy_config(t.config, "repeat", t.folder).buffer or ACCURACY_TASKS["repeat"].buffer
        out.append(f"  repeat: T = full attention's mean length / {t.config.compression:g} and r = {r} (the table's "
                   f"buffer); its budget {t.config.budget} is registered, not used")
    ablations = [t for t in board.ordered() if board.tasks[t].config.buffer != PAPER_BUFFER]
    if ablations:
        out.append(f"  r != {PAPER_BUFFER} (the paper's) for {', '.join(ablations)}: label them ablations unless the "
                   f"task's length does not allow r = {PAPER_BUFFER}")
    return out


# -- run ----------------------------------------------------------------------------------------------------
def run(board: Board, only: Optional[list[str]] = None, *, processes: int = 0, device: str = "auto") -> list[Path]:
    """Run the board's registered tasks (or ``only``) one after the other, cheap ones first, the model loaded once;
    each task's rows resume, and its folder's ``leaderboard.csv`` is written when it finishes. Returns those
    tables."""
    import randattn
    from tqdm.auto import tqdm

    from .planted_run import write_csv
    from .units import ModelInfo, Plan, load, open_files, run_local

    tasks = board.ordered(only)
    for task in tasks:  # before the model loads
        check_registered(board, task, required=True)
    first = board.tasks[tasks[0]].config
    try:
        model, tok = load(first.replace(device=device))
    except ConfigError as exc:
        if exc.field == "device":
            raise BoardError(f"--device: {exc.message}") from None
        raise board.refuse("board", "model", exc.message) from None
    name = first.model or randattn.DEFAULT_MODEL
    info = ModelInfo.loaded(name, model, tok)
    tables = []
    for task in tasks:
        t = board.tasks[task]
        config = t.config.replace(processes=processes, device=device)
        # the repeat task's T comes from full attention's mean length (printed when measured), not its budget
        budget = (f"full attention's mean length / {config.compression:g}" if task == "repeat"
                  else str(config.budget))
        tqdm.write(f"board {board.name}: {task} | {', '.join(config.selectors)} vs random | T={budget}, "
                   f"r={config.buffer} | {t.folder}")
        try:
            plan = leaderboard.plan(config, info)
            files = open_files(plan)
        except ConfigError as exc:
            raise _plan_error(board, task, exc) from None
        stages: list = []
        files = run_local(plan, model, tok, files=files, stages=stages, desc=f"board: {task}")
        last = stages[-1]
        outputs = list({o.path: o for s in stages for o in s.outputs}.values())
        merged = Plan(last.kind, last.config, outputs, [u for s in stages for u in s.units], meta=last.meta)
        rows = {path: rf.rows for path, rf in files.items()}
        if task == "cost":  # ratios, no comparison: the merge reads its rows
            tqdm.write(f"board {board.name}: cost done, its rows in {t.folder}")
            continue
        table = leaderboard.board(config, merged.units, merged.outputs, rows)
        path = t.folder / Path(result_name("leaderboard", config, "table", model=name)).name
        tables.append(write_csv(path, table))
        tqdm.write(f"board {board.name}: {task} done, {len(table)} selector rows in {path} (the board's verdicts: "
                   f"python -m probes.board merge {board.path})")
    return tables


# -- merge --------------------------------------------------------------------------------------------------
_TEXT = ("test", "metric", "unit", "policy", "verdict", "adjustment", "mde_method")


def _value(column: str, text: str):
    """A cell of a leaderboard.csv as the board wrote it: None, a bool, an int, a float or text."""
    if text == "":
        return None
    if any(column in (c, "lp_" + c) for c in _TEXT):  # not a suffix match: ``signed_unit`` is a bool, not a unit
        return text
    if text in ("True", "False"):
        return text == "True"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def read_table(path: Path) -> list[dict]:
    """A task folder's ``leaderboard.csv`` with its cells typed back (as :func:`probes.leaderboard.board` made them)."""
    import csv

    with open(path, newline="") as f:
        return [{k: _value(k, v) for k, v in r.items()} for r in csv.DictReader(f)]


def _recorded_buffer(folder: Path) -> Optional[int]:
    """r as the task's rows record it (the repeat task's is its own)."""
    for p in sorted(folder.rglob("*.jsonl")):
        if "work" in p.relative_to(folder).parts:
            continue
        with open(p) as f:
            line = f.readline()
        try:
            return json.loads(line)["config"]["buffer"]
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _cost(folder: Path) -> Optional[dict]:
    """``{(policy, metric): ratio}`` from the cost task's rows, None when it has none."""
    path = folder / result_name("leaderboard_cost", {})
    if not path.exists():
        return None
    out = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out[(r["policy"], r["metric"])] = r.get("ratio")
    return out or None


def endpoints(row: dict) -> list[str]:
    """The prefixes of a board row's adjusted comparisons: ``""`` (the score), ``"lp_"`` (the answer's log-prob) and
    any other endpoint the leaderboard adjusts (each has ``<prefix>p_adjusted``)."""
    return [""] + sorted(k[: -len("p_adjusted")] for k in row if k.endswith("p_adjusted") and k != "p_adjusted"
                         and row[k] is not None)


def _endpoint_name(task: str, test: str, prefix: str) -> str:
    """``score`` (a task's one scored endpoint), the repeat task's ``copies`` and ``fidelity`` (its test named after
    the task), ``log-prob``, or another adjusted endpoint's prefix."""
    if prefix:
        return "log-prob" if prefix == "lp_" else prefix.rstrip("_")
    return test[len(task) + 1:] if test.startswith(task + " ") else "score"


def merge(board: Board, *, target_mde: Optional[float] = None, figures: bool = True,
          figure_dir: Optional[str] = None) -> Path:
    """``board.csv`` from every task's rows, every comparison of the board one family (no model loads)."""
    from .planted_run import write_csv

    for task in board.tasks:  # a spec changed after registration (another alpha, another adjustment) is refused
        check_registered(board, task, required=False)
    wide, missing, short, rs, costs = [], [], [], {}, {}
    selectors = list(board.tasks[next(iter(board.tasks))].config.selectors)
    for task, t in board.tasks.items():
        rs[task] = _recorded_buffer(t.folder) or t.config.buffer
        if task == "cost":
            costs = _cost(t.folder)
            if costs is None:
                missing.append((task, None))
            else:
                missing += [(task, s) for s in selectors if (s, leaderboard.ROUND_COST) not in costs]
            continue
        path = t.folder / Path(result_name("leaderboard", t.config, "table",
                                           model=t.config.model or _default_model())).name
        rows = read_table(path) if path.exists() else []
        if not rows:
            missing.append((task, None))
            continue
        have = {r["policy"] for r in rows}
        missing += [(task, s) for s in selectors if s not in have]
        n, registered = max(int(r["n"]) for r in rows), registered_units(task, t.config)
        if n < registered:  # a verdict on fewer units than registered is flagged, never passed off as the spec's
            short.append((task, n, registered))
        for r in rows:
            if r["policy"] in selectors:
                wide.append({**r, "task": task})
    leaderboard.adjust_board(wide, alpha=board.alpha, method=board.adjustment)
    costs = costs or {}
    tidy = []
    order = {s: i for i, s in enumerate(selectors)}
    wide.sort(key=lambda r: (leaderboard.TASKS.index(r["task"]), order[r["policy"]]))
    for r in wide:
        t = board.tasks[r["task"]]
        for pre in endpoints(r):
            tidy.append(_tidy(board, t, r, pre, rs[r["task"]], costs))
    tidy.sort(key=lambda x: (leaderboard.TASKS.index(x["task"]), x["endpoint"] == "log-prob", x["endpoint"],
                             order[x["selector"]]))
    for task, sel in missing:
        t = board.tasks[task]
        for s in ([sel] if sel else selectors):
            tidy.append({"task": task, "test": task, "endpoint": "cost" if task == "cost" else "", "selector": s,
                         "verdict": MISSING, "T": t.config.budget, "r": t.config.buffer,
                         "note": f"no rows yet: python -m probes.board run {board.path} --tasks {task}"})
    for x in tidy:
        x["note"] = x["note"] or next((f"n = {n} units, fewer than the {reg} registered" for task, n, reg in short
                                       if task == x["task"]), "")
    path = write_csv(board.out / TABLE, tidy)
    print_board(board, tidy, missing)
    for task, n, reg in short:
        print(f"short: {task} has rows for {n} units, fewer than the {reg} its spec registered; run its stage again "
              f"(python -m probes.board run {board.path} --tasks {task}) or say why in the docs")
    if target_mde is not None:
        scored = [r for r in wide if r.get("family")]
        if scored:
            leaderboard.print_plan(leaderboard.planned_units(scored, target_mde, board.alpha))
    print(f"\nboard: {path}")
    if figures and any(r["verdict"] != MISSING for r in tidy):
        draw(path, figure_dir or board.out)
    return path


def registered_units(task: str, config) -> int:
    """The units (instances or problems) a task's spec asks for: the n its comparisons should reach."""
    return {"question": config.instances, "passcode": config.passcode_instances,
            "planted": config.planted_instances, "copy": config.problems,
            "repeat": config.repeat_problems}[task]


def _default_model() -> str:
    import randattn

    return randattn.DEFAULT_MODEL


def _tidy(board: Board, t: Task, r: dict, pre: str, r_recorded, costs: dict) -> dict:
    """One tidy row of ``board.csv``: one endpoint of one selector on one task."""
    name = _endpoint_name(t.name, r["test"], pre)
    score = not pre
    value = r.get("value") if score else r.get(f"{pre}value", r.get(pre.rstrip("_")))
    random_value = r.get("random") if score else r.get(f"{pre}random", r.get(f"random_{pre.rstrip('_')}"))
    if score:
        measures = MEASURES.get(r["test"]) or (f"accuracy on {r['test']} (graded as its task grades it)"
                                              if t.name == "copy" else r["metric"])
    else:
        measures = r.get(f"{pre}measures") or (LOG_PROB.get(t.name, ANSWER_LOG_PROB) if pre == "lp_" else
                                               r.get(f"{pre}metric") or name)
    full = r.get("full_attention") if score else r.get(f"full_attention_{pre.rstrip('_')}",
                                                       r.get(f"{pre}full_attention"))
    mde = r.get("mde") if score else r.get(f"{pre}mde")
    method = r.get("mde_method") if score else r.get(f"{pre}mde_method") or "normal"
    return {
        "task": t.name, "test": r["test"], "endpoint": name, "measures": measures,
        "metric": r["metric"] if score else f"{r['test']} {name}", "selector": r["policy"],
        "n": r.get(f"{pre}n", r["n"]),
        "value": value, "value_lo": r.get(f"{pre}value_lo"), "value_hi": r.get(f"{pre}value_hi"),
        "random": random_value, "random_lo": r.get(f"{pre}random_lo"), "random_hi": r.get(f"{pre}random_hi"),
        "full_attention": full,
        "delta": r[f"{pre}delta"], "delta_lo": r[f"{pre}delta_lo"], "delta_hi": r[f"{pre}delta_hi"],
        "wins": r.get(f"{pre}wins"), "losses": r.get(f"{pre}losses"), "ties": r.get(f"{pre}ties"),
        "p": r[f"{pre}p"], "p_adjusted": r[f"{pre}p_adjusted"], "family": r[f"{pre}family"],
        "adjustment": r[f"{pre}adjustment"], "alpha": board.alpha, "mde": mde, "mde_method": method,
        "mde_units": "score" if score else "nats" if "lp" in pre else name,
        "verdict": r[f"{pre}verdict"], "T": r.get("budget") or t.config.budget, "r": r_recorded,
        "round_cost_ratio": costs.get((r["policy"], leaderboard.ROUND_COST)),
        "throughput_ratio": costs.get((r["policy"], leaderboard.THROUGHPUT)), "note": "",
    }


def _fmt(x, spec=".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float) and math.isinf(x):
        return "none"
    return format(x, spec)


def print_board(board: Board, tidy: list[dict], missing: list) -> None:
    print(f"\n{'task':<9} {'endpoint':<9} {'selector':<22} {'n':>4} {'T':>5} {'r':>3}  {'value [95% CI]':<22} "
          f"{'random':>7}  {'difference [95% CI]':<25} {'p':>6} {'p_adj':>6} {'MDE':>6}  verdict")
    for r in tidy:
        if r["verdict"] == MISSING:
            print(f"{r['task']:<9} {r['endpoint']:<9} {r['selector'][:22]:<22} {'':>4} {r['T']:>5} {r['r']:>3}  "
                  f"missing ({r['note']})")
            continue
        ci = (f"[{_fmt(r['value_lo'])}, {_fmt(r['value_hi'])}]" if r["value_lo"] is not None else "")
        print(f"{r['task']:<9} {r['endpoint']:<9} {r['selector'][:22]:<22} {r['n']:>4} {r['T']:>5} {r['r']:>3}  "
              f"{_fmt(r['value']):>6} {ci:<15} {_fmt(r['random']):>7}  "
              f"{r['delta']:+.3f} [{r['delta_lo']:+.3f}, {r['delta_hi']:+.3f}]  {r['p']:>6.3f} "
              f"{r['p_adjusted']:>6.3f} {_fmt(r['mde'], '.2f'):>6}  {r['verdict']}")
    family = next((r["family"] for r in tidy if r["verdict"] != MISSING), 0)
    how = {"holm": "Holm's step-down adjustment", "bh": "Benjamini-Hochberg's adjustment"}[board.adjustment]
    print(f"verdict: better or worse only when the paired bootstrap 95% CI excludes no difference and p (the larger of "
          f"the bootstrap's and the exact sign test's) stays below {board.alpha} after {how} across the whole "
          f"board's {family} comparisons (every task, selector and endpoint); MDE: the difference detectable with "
          f"{leaderboard.POWER:.0%} power at {board.alpha}/{family} ('none': no difference is detectable at this n)")
    if missing:
        gone = sorted({t for t, _ in missing}, key=leaderboard.TASKS.index)
        print(f"incomplete: no rows yet for {', '.join(gone)} (missing rows above); the family, the adjusted p and the "
              f"verdicts change when they come: python -m probes.board run {board.path}")


def draw(table: Path, out_dir) -> list[str]:
    """Draw ``board.png`` from ``table`` with ``python -m figures.board`` (probes never import figures)."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    done = subprocess.run([sys.executable, "-m", "figures.board", str(table), "--out", str(out_dir)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(f"figure {FIGURE}: not drawn ({(done.stderr.strip().splitlines() or ['?'])[-1]})", file=sys.stderr)
        return []
    files = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if line.startswith(f"{FIGURE}: ")]
    for f in files:
        print(f"figure: {f}")
    return files


# -- the command line ---------------------------------------------------------------------------------------
def _parser() -> tuple[argparse.ArgumentParser, dict]:
    p = argparse.ArgumentParser(prog="python -m probes.board", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="stage", required=True, metavar="{register,run,merge}")
    reg = sub.add_parser("register", help="write each task's spec.json (and board.json) before any row")
    reg.add_argument("spec", help="the board's TOML spec")
    r = sub.add_parser("run", help="run the registered tasks, cheap ones first, the model loaded once")
    r.add_argument("spec")
    r.add_argument("--tasks", nargs="+", choices=leaderboard.TASKS, default=None,
                   help="only these of the spec's tasks (default: all), in the board's run order")
    r.add_argument("--processes", type=int, default=0, help="processes running a task's units side by side, one "
                                                            "torch thread each (0: auto); the rows are the same")
    r.add_argument("--device", default="auto", help="'auto' (CUDA when present), 'cpu' or 'cuda[:N]'")
    m = sub.add_parser("merge", help="board.csv: every comparison of every task, one family (no model)")
    m.add_argument("spec")
    m.add_argument("--target-mde", type=float, default=None, metavar="X",
                   help="also print, per task, the units that make a difference of X detectable with 80%% power at "
                        "the board's level")
    m.add_argument("--no-figure", action="store_true", help="do not draw board.png")
    m.add_argument("--figure-dir", default=None, help="where board.png goes (default: the board's folder)")
    return p, {"register": reg, "run": r, "merge": m}


def main(argv=None) -> int:
    from .results import interrupted, openings, release_folders

    parser, stages = _parser()
    args = parser.parse_args(argv)
    sub = stages[args.stage]  # the stage's own parser: its usage in errors
    if args.stage == "merge" and args.target_mde is not None and not 0 < args.target_mde < 1:
        sub.error(f"--target-mde: must be strictly between 0 and 1 (a difference in the score's units), got "
                  f"{args.target_mde!r}")
    if args.stage == "run" and args.processes < 0:
        sub.error(f"--processes: must be a non-negative integer, got {args.processes}")
    mark = openings()
    try:
        board = read(args.spec)
        if args.stage == "register":
            paths = register(board)
            print(f"board {board.name}: registered {len(board.tasks)} task(s), verdict {board.adjustment} at "
                  f"alpha {board.alpha} across the whole board:")
            print("\n".join(describe(board)))
            print(f"commit before running: git add {' '.join(str(p) for p in paths)}")
        elif args.stage == "run":
            unknown = [t for t in args.tasks or () if t not in board.tasks]
            if unknown:
                sub.error(f"--tasks: {', '.join(unknown)} not in {board.path} (its tasks: {', '.join(board.tasks)})")
            run(board, args.tasks, processes=args.processes, device=args.device)
        else:
            merge(board, target_mde=args.target_mde, figures=not args.no_figure, figure_dir=args.figure_dir)
    except BoardError as exc:
        sub.error(str(exc))
    except ConfigError as exc:  # a results file not ours, a folder in use
        sub.error(str(exc))
    except KeyboardInterrupt:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
        print(f"python -m probes.board {args.stage}: {interrupted(mark)}", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError, TypeError) as exc:
        from .cli import selector_failure

        failure = selector_failure(exc)
        if failure is None:
            raise
        sub.exit(2, f"{sub.prog}: error: [board] selectors: {failure.rstrip('.')}. The rows computed before it are "
                    "kept; fix the selector and rerun the same command: it resumes from those rows.\n")
    finally:
        release_folders()
    return 0


if __name__ == "__main__":
    sys.exit(main())
