"""Result files for long runs: one JSON row per item, appended batch by batch, resumable.

Every row carries the run's ``config`` (model, K, r, policy, seed, ...), so a file can always be
traced back to what produced it and a figure regenerated from it. Reopening a file with a
different config is refused rather than mixed.

A results file is only ever written if it is one of ours (every complete line a row with a
``config`` and the key fields) or does not exist yet: anything else given as ``--out`` is refused
before a byte changes. Each batch goes to disk in one ``write`` and one ``fsync``, rows whose key is
already there are never written again, and rows read back are de-duplicated by key, so a resume
after a kill cannot count a row twice.
"""

from __future__ import annotations

import fcntl
import functools
import importlib
import itertools
import json
import os
import re
import signal
import subprocess
import weakref
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from analysis import registry
from analysis.files import DiskFull, NotOurs, disk_full, table_header, why_not_ours
from analysis.names import protection_tag  # noqa: F401 (the spelling in result names; re-exported)
from analysis.rows import BadRow, check_row

__all__ = ["ResultsFile", "NotOurFile", "RunInUse", "hold_folder", "release_folders", "git_revision", "REPO_ROOT", "DEFAULT_TRACES", "shipped", "out_folder",
           "protection_tag", "run_record", "trace_label", "versions", "INFORMATIONAL", "check_domain",
           "check_tables_beside", "tables_beside", "opened", "openings", "rows_on_disk", "interrupted"]

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Config entries that describe where and with what a row was measured, not what was measured: never compared on
#: resume, so a run continued after an upgrade or on another device still finds its rows.
INFORMATIONAL = ("revision", "versions", "device", "date")


class NotOurFile(NotOurs):
    """The path exists but is not a results file this toolkit wrote; nothing was changed."""


class RunInUse(ValueError):
    """Another live process holds the results folder's lock."""


# -- where things are --------------------------------------------------------------------------------------------
from randattn.shipped import shipped  # noqa: E402

DEFAULT_TRACES = shipped("traces/smollm2-135m.jsonl")


def out_folder(probe: str, out: "str | os.PathLike | None") -> Path:
    """Where a probe's rows go: ``--out`` (a folder), else ``data/results/<probe>/`` under the current folder.
    Refuses (:class:`~probes.config.ConfigError` naming ``out``) a path that is, or lies under, an existing file."""
    from .config import ConfigError

    folder = Path(out) if out is not None else Path("data") / "results" / probe
    for p in (folder, *folder.parents):
        if p.is_symlink() and not p.exists():
            raise ConfigError("out", f"{p} is a symbolic link to {os.readlink(p)}, which does not exist; create that "
                                     "folder, or give --out another folder")
        if p.exists() and not p.is_dir():
            raise ConfigError("out", f"{p} is a file, not a folder; --out names the folder the results go into "
                                     "(each file is named after its configuration), e.g. --out results/")
    return folder


def trace_label(path: Path) -> str:
    """How a config records its traces file: ``data/traces/<name>`` for a shipped one, else the path given."""
    if Path(path).resolve() == DEFAULT_TRACES.resolve():
        return "data/traces/" + DEFAULT_TRACES.name
    return str(path)


def _checkout() -> Optional[Path]:
    """The randattn source checkout this code runs from, if any (an editable install or a clone): never the user's
    own repository that an installed package merely sits inside."""
    root = REPO_ROOT
    try:
        if (root / ".git").exists() and 'name = "randattn"' in (root / "pyproject.toml").read_text():
            return root
    except OSError:
        pass
    return None


def git_revision() -> Optional[str]:
    """The short commit of the randattn checkout the code runs from; None when installed from a wheel."""
    root = _checkout()
    if root is None:
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict:
    """The package versions a result was measured with."""
    import torch
    import transformers

    import randattn

    return {"randattn": randattn.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def run_record(model=None) -> dict:
    """What every results file records besides the configuration: versions, device, the (UTC) date of the run and
    the git revision of the checkout when run from one (informational: see :data:`INFORMATIONAL`)."""
    record = {"versions": versions(), "revision": git_revision(), "date": datetime.now(timezone.utc).date().isoformat()}
    if model is not None:
        record["device"] = str(getattr(model, "device", "cpu"))
    return record


class ResultsFile:
    """Append-only JSONL of result rows keyed by ``key_fields``; knows which keys are done.

    ``config`` is stored in every row under ``"config"``; its :data:`INFORMATIONAL` entries (git revision,
    versions, device) are not compared on resume. ``restart`` discards the rows of an existing file, only once
    it is shown to be ours.

    While it lives, the object holds ``<folder>/.randattn.lock`` (a second process on the folder is refused with
    :class:`RunInUse`; the kernel drops the lock when a process dies, so a killed run never blocks its resume). An
    existing file in a folder nobody can write is opened read-only (a finished run still re-prints its tables);
    :meth:`append` then refuses new rows.
    """

    def __init__(self, path: "str | os.PathLike", config: dict, key_fields: tuple[str, ...], *, restart: bool = False):
        self.path = Path(path)
        self.config = dict(config)
        self.key_fields = tuple(key_fields)
        self.rows: list[dict] = []
        self.duplicates = 0  # rows read back whose key was already seen (dropped)
        self.read_only = not _check_writable(self.path)
        if self.path.exists():
            self._read_ours(validate=not restart)  # refuse a file not ours before the lock file is made beside it
        # The tables this file's summary writes beside it, checked now (before any row is computed), not only when
        # they are written at the end of the run.
        check_tables_beside(self.path, self.config)
        self._lock = None if self.read_only else hold_folder(self.path.parent)
        _OPENED.pop(str(self.path), None)
        _OPENED[str(self.path)] = next(_OPENINGS)
        if self.path.exists():
            rows, torn = self._read_ours(validate=not restart)
            if restart:
                self._need_write("--restart discards its rows")
                self.path.unlink()
            else:
                self._check_config(rows)
                if torn is not None:
                    # A run killed mid-write leaves one torn last line of ours: cut it so new rows start clean.
                    self._need_write("its torn last line must be cut before the run resumes")
                    with open(self.path, "r+b") as f:
                        f.truncate(torn)
                self._adopt(rows)
        self.done = {self.key(r) for r in self.rows}

    # -- reading --------------------------------------------------------------------------------
    def _refuse(self, why: str) -> NotOurFile:
        return NotOurFile(f"{self.path} is not a results file written by randattn ({why}); nothing was changed. "
                          "Give --out a new file name (or a folder of your results).")

    def _need_write(self, why: str) -> None:
        if self.read_only:
            raise PermissionError(f"{self.path} is on read-only media or in a folder nobody can write, and {why}; "
                                  "copy it to a folder you can write and give that as --out")

    def _is_row(self, obj) -> bool:
        return isinstance(obj, dict) and isinstance(obj.get("config"), dict) and all(k in obj for k in self.key_fields)

    def _read_ours(self, validate: bool = True) -> "tuple[list[dict], int | None]":
        """Every row of an existing file, and where a torn last line of ours starts (None: none). Raises
        :class:`NotOurFile` (touching nothing) if any line is not one of our rows, and (``validate``) :class:`BadRow`
        if one of our rows has a field its summary cannot use."""
        if self.path.is_dir():
            raise self._refuse("it is a folder")
        data = self.path.read_bytes()
        cut = None
        if data and not data.endswith(b"\n"):
            start = data.rfind(b"\n") + 1
            tail = data[start:]
            try:
                obj = json.loads(tail)
            except (json.JSONDecodeError, UnicodeDecodeError):
                obj = None
            if obj is not None:
                raise self._refuse("its last line is complete JSON but has no line end, which randattn never writes")
            # Only a fragment that starts the way our rows start can be ours; anything else is the user's.
            if not tail.startswith(b'{"' + self.key_fields[0].encode() + b'": '):
                raise self._refuse("its last line is not the start of a result row")
            cut, data = start, data[:start]
        rows = []
        for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise self._refuse(f"line {n} is not JSON") from None
            if not self._is_row(row):
                raise self._refuse(f"line {n} is not a result row with a config and the fields "
                                   f"{', '.join(self.key_fields)}")
            if validate:
                try:
                    check_row(row, f"{self.path}:{n}")
                    check_domain(row, f"{self.path}:{n}")
                except BadRow as exc:
                    raise BadRow(f"{exc}; nothing was changed. Correct or delete that line, or pass --restart to "
                                 "discard the file's rows") from None
            rows.append(row)
        return rows, cut

    def _check_config(self, rows: list[dict]) -> None:
        mine = {k: v for k, v in self.config.items() if k not in INFORMATIONAL}
        for row in rows:
            theirs = {k: v for k, v in row["config"].items() if k not in INFORMATIONAL}
            if theirs != mine:
                diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
                raise ValueError(
                    f"{self.path} holds results of a different configuration (differs in {', '.join(diff)}: "
                    + "; ".join(f"{k}: file {theirs.get(k)!r} vs now {mine.get(k)!r}" for k in diff[:4])
                    + "). Pass --out to write elsewhere, or --restart to discard the old results."
                )

    def _adopt(self, rows: list[dict]) -> None:
        seen = set()
        for row in rows:
            k = self.key(row)
            if k in seen:
                self.duplicates += 1
                continue
            seen.add(k)
            self.rows.append(row)

    def key(self, row: dict) -> tuple:
        return tuple(_hashable(row[k]) for k in self.key_fields)

    # -- writing --------------------------------------------------------------------------------
    def append(self, rows: Iterable[dict]) -> list[dict]:
        """Write the rows whose key is not there yet, in one write and one fsync (so an interrupted run loses
        at most the batch in flight, never half of it). Returns the rows written."""
        fresh, keys = [], set()
        for r in rows:
            k = self.key(r)
            if k in self.done or k in keys:
                continue
            keys.add(k)
            # Key fields first: a torn last line is then recognisable as ours by how it starts.
            fresh.append({**{f: r[f] for f in self.key_fields}, **r, "config": self.config})
        if not fresh:
            return []
        if self.read_only:
            from .config import ConfigError

            raise ConfigError("out", f"{self.path}: cannot add rows, its folder is on read-only media or nobody can "
                                     "write it; copy the file to a folder you can write and give that as --out to "
                                     "resume")
        blob = "".join(json.dumps(r) + "\n" for r in fresh).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _ctrl_c_held():  # a Ctrl-C lands before the batch or after it is on disk and counted, never inside
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    view = memoryview(blob)
                    while view:  # a regular file takes it in one write; loop only if the kernel says otherwise
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                if not disk_full(exc):
                    raise
                raise DiskFull(exc.errno, f"{self.path}: the disk is full or a file-size limit is reached "
                                          f"({exc.strerror}); the {len(self.rows)} rows written before are safe (a "
                                          "torn last line is cut on resume). Free space and rerun the same command "
                                          "to resume") from None
            self.rows.extend(fresh)
            self.done.update(keys)
        return fresh


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


@contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """SIGINT held back while the block runs, then handled as it would have been (Ctrl-C's KeyboardInterrupt after the
    block). Python runs signal handlers in the main thread only, so only there is anything held."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:  # a handler installed outside Python: leave it alone
        yield
        return
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            if callable(previous):
                previous(signal.SIGINT, held[0])  # default_int_handler: KeyboardInterrupt, now
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)


# -- what a Ctrl-C leaves ------------------------------------------------------------------------------------------
#: Every results file this process opened (str(path) -> when, last opening): what an interrupted run names as safe.
_OPENED: dict[str, int] = {}
_OPENINGS = itertools.count(1)


def openings() -> int:
    """A mark for :func:`opened`: files opened after it are the ones opened from now on."""
    return max(_OPENED.values(), default=0)


def opened(since: int = 0) -> list[Path]:
    """The results files this process opened after the mark ``since`` (:func:`openings`), in the order of their last
    opening; a temporary merge file (a hidden name) left out."""
    return [Path(p) for p, when in sorted(_OPENED.items(), key=lambda x: x[1])
            if when > since and not Path(p).name.startswith(".")]


def rows_on_disk(path: "str | os.PathLike") -> int:
    """How many complete rows ``path`` holds now (0 when it does not exist)."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return 0
    return sum(1 for line in data[: data.rfind(b"\n") + 1].splitlines() if line.strip())


def interrupted(since: int = 0) -> str:
    """The one line a command interrupted by Ctrl-C prints: how many rows are safe where, and how to resume."""
    safe = [(p, n) for p in opened(since) if (n := rows_on_disk(p))]
    if not safe:
        return "interrupted before any row was written; rerun the same command to start the run"
    rows = lambda n: f"{n} row{'' if n == 1 else 's'}"  # noqa: E731
    if len(safe) == 1:
        (path, n), = safe
        where = f"{rows(n)} {'is' if n == 1 else 'are'} safe in {path}"
    else:
        shown = ", ".join(f"{n} in {p}" for p, n in safe[:3]) + (f", ... ({len(safe) - 3} more files)"
                                                                  if len(safe) > 3 else "")
        where = f"{rows(sum(n for _, n in safe))} are safe in {len(safe)} files ({shown})"
    return f"interrupted: {where}; rerun the same command to resume"


# -- rows no run of their configuration writes ---------------------------------------------------------------------
def _ints(*values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


@functools.lru_cache(maxsize=None)
def planted_conditions(probe: str, kv_heads: int, box_width: int) -> "Optional[tuple[tuple[str, ...], Callable]]":
    """``(names, accepts)``: the conditions the planted-fact probe ``probe`` writes for a model of ``kv_heads`` KV heads
    (from the probe's own condition lists), and a test a name passes when it is one of them; None when ``probe`` is
    not a planted-fact probe this knows (its conditions are then not checked)."""
    from types import SimpleNamespace

    session = SimpleNamespace(n_heads=kv_heads, config=SimpleNamespace(box_width=box_width))
    extra = None
    # The probes sit above this module (they import it), so their condition lists are looked up by name at call time,
    # never imported here: a registry's lookup, not an import cycle.
    probe_module = lambda name: importlib.import_module(f"probes.{name}")  # noqa: E731
    try:
        if probe == "head_pooling":
            names = [c.name for c in probe_module("head_pooling").pooling_conditions(kv_heads, box_width)]
            if kv_heads > 8:  # the best-k chain, planned from the single heads' rows: k = 3 .. H-1 heads
                extra = _best_k(kv_heads)
        elif getattr(registry.probe(probe), "planted", False):  # its module's conditions(session)
            names = [c.name for c in probe_module(probe).conditions(session)]
        elif probe == "passcode":
            names = ["policy", "kept", "full"]  # probes.passcode.plan: the policy's, and Random's two references
        elif probe == "leaderboard_planted":
            names = list(probe_module("leaderboard").planted_conditions(SimpleNamespace(recall=True)))
        else:
            return None
    except (ValueError, ImportError):  # the probe refuses such a model (scatter under 3 KV heads, two facts under 2)
        return None
    known = frozenset(names)
    return tuple(names), (lambda name: name in known or (extra is not None and extra(name)))


def _best_k(n_heads: int) -> Callable[[str], bool]:
    pattern = re.compile(r"best(\d+):h(\d+(?:\+\d+)*)")

    def accepts(name: str) -> bool:
        m = pattern.fullmatch(name)
        if not m:
            return False
        k, heads = int(m.group(1)), [int(h) for h in m.group(2).split("+")]
        return 3 <= k < n_heads and len(heads) == k and heads == sorted(set(heads)) and heads[-1] < n_heads

    return accepts


def check_domain(row: dict, where: str) -> None:
    """Raise :class:`BadRow` (``where``: ``FILE:LINE``) when a key field of ``row`` holds a value no run of the
    configuration recorded in the row writes: a negative ``instance``, ``sequence``, ``run`` or ``fact``; a ``fact``
    past the record's ``n_facts``; a survival ``sequence`` past its ``sequences`` (they are in the file's name); a
    planted-fact ``condition`` the recorded probe does not write for the recorded model. Instances past this run's
    ``--instances`` are no such value: a run with more instances wrote them, and a rerun with fewer keeps them (its
    summary is ``<rows>.n<N>.summary.csv``). Types are :func:`analysis.rows.check_row`'s (run it first)."""
    config = row.get("config") if isinstance(row.get("config"), dict) else {}
    for field in ("instance", "sequence", "run", "fact"):
        if _ints(row.get(field)) and row[field] < 0:
            raise BadRow(f"{where}: field {field!r} must be >= 0, got {row[field]}")
    n_facts = config.get("n_facts")
    if _ints(row.get("fact"), n_facts) and row["fact"] >= n_facts:
        raise BadRow(f"{where}: field 'fact' must be in 0..{n_facts - 1} (the file's n_facts is {n_facts}), "
                     f"got {row['fact']}")
    sequences = config.get("sequences")
    if config.get("probe") == "survival" and _ints(row.get("sequence"), sequences) and row["sequence"] >= sequences:
        raise BadRow(f"{where}: field 'sequence' must be in 0..{sequences - 1} (the file's {sequences} sequences), "
                     f"got {row['sequence']}")
    if isinstance(row.get("condition"), str) and isinstance(config.get("probe"), str) \
            and _ints(config.get("kv_heads"), config.get("box_width")):
        known = planted_conditions(config["probe"], config["kv_heads"], config["box_width"])
        if known is not None and not known[1](row["condition"]):
            names = known[0]
            shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
            chain = " or a best-k chain 'best<k>:h<i>+...'" if config["kv_heads"] > 8 and config["probe"] == \
                "head_pooling" else ""
            raise BadRow(f"{where}: field 'condition' must be one of {shown}{chain} (what {config['probe']} writes for "
                         f"{config['kv_heads']} KV heads), got {json.dumps(row['condition'])}")


# -- the tables a summary writes beside its rows -------------------------------------------------------------------
_TABLES = (".csv", ".md", ".tex")


def tables_beside(path: "str | os.PathLike", config: dict) -> "list[tuple[Path, Optional[Path]]]":
    """``[(table, reference)]``: the summary tables the probe that recorded ``config`` writes from the rows file
    ``path`` (every table part :data:`analysis.names.PARTS` names for it: ``<rows>.summary.csv``, a ``summary-*.csv``,
    accuracy's ``.protection.csv`` and its comparison table, also as ``.md`` and ``.tex``), each with the shipped table
    of that part (None: none is shipped), which shows the first column a summary of that probe starts with. Empty when
    ``path`` is not the name that probe gives the rows of ``config`` (a temporary merge file, a scratch file)."""
    from analysis.names import PARTS, SHIPPED, result_name, shipped_name
    from analysis.shipped import shipped_result

    path = Path(path)
    probe = config.get("probe") if isinstance(config, dict) else None
    parts = PARTS.get(probe) if isinstance(probe, str) else None
    if not parts or "rows" not in parts:
        return []
    try:
        if result_name(probe, config) != path.name:
            return []
    except (KeyError, TypeError, ValueError, AttributeError):
        return []
    names = {}
    for part in parts:
        try:
            names[part] = result_name(probe, config, part)
        except (KeyError, TypeError, ValueError, AttributeError):  # a part named by fields these rows do not record
            continue  # (blocks' next-token-loss rows by their length): no table
    ship = next((name for name, (_, p, _) in SHIPPED.items() if p == probe), None)
    out = []
    for part, name in names.items():
        if part == "rows" or not name.endswith(_TABLES) or "/" in name:
            continue
        formats = [name] + ([name[: -len(".csv")] + ext for ext in (".md", ".tex")] if name.endswith(".table.csv")
                            else [])
        for target in formats:
            reference = None
            if ship is not None:
                try:
                    ref = shipped_result(shipped_name(ship, part))
                    reference = ref.with_name(ref.name[: -len(".csv")] + target[len(name) - 4:]) if target != name \
                        else ref
                except (KeyError, TypeError, ValueError):
                    reference = None
            out.append((path.parent / target, reference))
    return out


@functools.lru_cache(maxsize=None)
def _first_column(reference: Path) -> Optional[str]:
    try:
        header = table_header(reference.read_text(encoding="utf-8"), reference.suffix.lower())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return header[0] if header else None


def check_tables_beside(path: "str | os.PathLike", config: dict) -> None:
    """Refuse (:class:`NotOurs`, reading only) a file where the summary of the rows ``path`` will be written when it is
    certainly not one randattn wrote: not a table, or a table whose first column is not the one that probe's summaries
    start with (the shipped summary's), so its write at the end of the run would be refused. Run before anything is
    computed; the write itself still compares the whole header (:func:`analysis.files.check_ours`)."""
    for target, reference in tables_beside(path, config):
        why = why_not_ours(target)
        if why is None and reference is not None and target.is_file() and not target.is_symlink():
            try:
                old = table_header(target.read_text(encoding="utf-8"), target.suffix.lower())
            except (OSError, UnicodeDecodeError, ValueError):
                old = None
            first = _first_column(reference)
            if old and first is not None and (len(old) < 2 or old[0] != first):
                why = (f"its columns ({', '.join(old[:4])}{', ...' if len(old) > 4 else ''}) are not the table "
                       "written there")
        if why is not None:
            raise NotOurs(f"{target} was not written by randattn ({why}); nothing was changed. Give --out another "
                          "folder, or move the file away")


def _check_writable(path: Path) -> bool:
    """Refuse before any compute a results path nobody can write: its folder is created and a scratch file made and
    removed in it (permission bits alone say nothing for root, a read-only mount or /proc). An existing file that
    cannot be written is no refusal yet (False: read it only; a finished run needs no write)."""
    import tempfile

    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if path.is_file() and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
        return False
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PermissionError(f"{path}: {parent if not path.exists() else path} is not writable; give --out a folder "
                              "you can write to")
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path.parent, prefix=".randattn-write-check-"):
                pass
        except OSError as exc:
            raise PermissionError(f"{path}: cannot write in {path.parent} ({exc.strerror or exc}); give --out a folder "
                                  "you can write to") from None
    return True


LOCK_NAME = ".randattn.lock"
_HELD: "weakref.WeakValueDictionary[str, _FolderLock]" = weakref.WeakValueDictionary()


class _FolderLock:
    """An exclusive ``flock`` on ``<folder>/.randattn.lock``, released when the last holder lets go of it (or the
    process dies). The pid written in the file only names the holder in a refusal."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunInUse(f"{folder} is in use by another run (pid {pid}); wait for it or use another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.release = weakref.finalize(self, os.close, fd)  # runs once: at release() or when collected


def hold_folder(folder: "str | os.PathLike") -> _FolderLock:
    """This process's lock on a results folder (taken once, shared by every results file in it)."""
    key = os.path.realpath(folder)
    lock = _HELD.get(key)
    if lock is None or not lock.release.alive:
        lock = _HELD[key] = _FolderLock(Path(folder))
    return lock


def release_folders() -> None:
    """Let go of every folder lock this process holds (a probe's command line calls it when its run ends)."""
    for lock in list(_HELD.values()):
        lock.release()
    _HELD.clear()


def check_ours(path: "str | os.PathLike", key_fields: tuple[str, ...]) -> None:
    """Raise :class:`NotOurFile` unless ``path`` is absent or one of our results files (reads only)."""
    path = Path(path)
    if path.exists():
        probe = ResultsFile.__new__(ResultsFile)
        probe.path, probe.key_fields = path, tuple(key_fields)
        probe._read_ours()


OUT_MARKER = ".randattn-out"  # written into every results folder a command creates or adopts


class OutputFolder:
    """A results folder a command owns: created new, adopted while empty, or recognised by its marker.

    :meth:`check` runs before any compute and refuses a folder holding files randattn did not write;
    :meth:`open` (after the run's own trial checks) creates it, or with ``restart`` moves the old one
    aside to ``<name>.previous-<n>`` -- nothing is ever deleted.
    """

    def __init__(self, path: "str | os.PathLike", *, restart: bool = False):
        self.path = Path(path)
        self.restart = restart
        self.moved_to: "Path | None" = None

    def check(self) -> None:
        p = self.path
        if p.exists() and not p.is_dir():
            raise NotOurFile(f"--out {p} is a file, not a folder; give a folder for the results")
        if p.is_dir() and not (p / OUT_MARKER).exists():
            found = sorted(x.name + ("/" if x.is_dir() else "") for x in p.iterdir())
            if found:
                shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")
                raise NotOurFile(f"--out {p} already holds files randattn did not write ({shown}); nothing was changed. "
                                 "Give --out a new or empty folder.")
        parent = p.parent if not p.exists() else p
        while not parent.exists():
            parent = parent.parent
        if not os.access(parent, os.W_OK):
            raise PermissionError(f"--out {p}: {parent} is not writable; give --out a folder you can write to")

    def open(self) -> Path:
        self.check()
        p = self.path
        if self.restart and p.is_dir():
            n = 1
            while p.with_name(f"{p.name}.previous-{n}").exists():
                n += 1
            self.moved_to = p.with_name(f"{p.name}.previous-{n}")
            p.rename(self.moved_to)
        p.mkdir(parents=True, exist_ok=True)
        (p / OUT_MARKER).write_text("results folder written by randattn; --restart moves it aside, never deletes it\n")
        return p
