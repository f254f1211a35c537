"""Writing whole files so that a kill leaves the previous good file or the new one, never a torn or empty one, and
never over a file randattn did not write.

Every summary, table and figure goes to a hidden temporary name beside its target, is flushed to disk and then
renamed into place (``os.replace`` is atomic on one file system). Before the rename the target, if there, must be
recognisably ours (:func:`check_ours`):

- a figure (PNG, PDF) carries ``randattn`` in its metadata (:data:`FIGURE_METADATA`, written by ``figures.style``);
- a text table (CSV, Markdown, LaTeX) has randattn's column header: the one this write produces, or one with the
  same first column and columns only added, only dropped, or at least half of them shared (a rerun with another
  budget or other parts);
- an empty file holds nothing to lose.

Anything else raises :class:`NotOurs` and nothing is written.
"""

from __future__ import annotations

import errno
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

__all__ = ["NotOurs", "DiskFull", "FIGURE_METADATA", "check_ours", "replacing", "write_bytes", "write_text",
           "table_header", "disk_full"]

MARK = "randattn"
#: ``savefig(metadata=...)`` per format: the mark, and no creation date (a redrawn figure keeps its bytes).
FIGURE_METADATA = {"png": {"Software": f"{MARK} (python -m figures)"},
                   "pdf": {"Creator": f"{MARK} (python -m figures)", "CreationDate": None}}
_FIGURE_MARKS = {".png": b"Software\x00" + MARK.encode(), ".pdf": b"/Creator (" + MARK.encode()}
#: Test hook: seconds to pause half-way through writing a temporary file (so a test can kill a writer mid-write).
SLOW_ENV = "RANDATTN_TEST_SLOW_WRITE"
_TMP = ".randattn-tmp-"
FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class NotOurs(ValueError):
    """The path holds a file randattn did not write; nothing was changed."""


class DiskFull(OSError):
    """The disk (or a file-size limit) is full; the message says what is already safe and how to resume."""


def disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


# -- recognising our files ---------------------------------------------------------------------------------------
def table_header(text: str, suffix: str) -> Optional[list[str]]:
    """The column names of a CSV, Markdown or LaTeX table (None: no header found)."""
    lines = [x for x in text.splitlines() if x.strip()]
    if suffix == ".csv":
        import csv

        return next(csv.reader(lines[:1]), None)
    if suffix == ".md":
        row = next((x for x in lines if x.lstrip().startswith("|")), None)
        return [c.strip() for c in row.strip().strip("|").split("|")] if row else None
    if suffix == ".tex":
        row = next((x for x in lines if "&" in x), None)
        return [c.strip() for c in row.rstrip().removesuffix("\\\\").split("&")] if row else None
    return None


def _same_table(old: list[str], new: list[str]) -> bool:
    if old == new:
        return True
    if len(old) < 2 or len(new) < 2 or old[0] != new[0]:
        return False
    # A rerun may add columns, drop some, or both (the challenge's verdict columns follow the parts that ran): the
    # same first column and most of the columns shared is the table written there.
    return set(old) <= set(new) or set(new) <= set(old) or 2 * len(set(old) & set(new)) >= max(len(old), len(new))


def why_not_ours(path: Path, new: Optional[bytes] = None) -> Optional[str]:
    """Why ``path`` is not a file randattn wrote (None: it is ours, empty or absent). ``new``: the bytes about to
    replace a text table (its header is compared)."""
    try:
        if path.is_symlink() or not path.exists():
            return None if not path.is_symlink() else "it is a symbolic link"
        if path.is_dir():
            return "it is a folder"
        data = path.read_bytes()
    except OSError as exc:
        return f"it cannot be read ({exc.strerror or exc})"
    if not data:
        return None
    suffix = path.suffix.lower()
    if suffix in _FIGURE_MARKS:
        return None if _FIGURE_MARKS[suffix] in data else "it has no randattn mark in its metadata"
    if suffix in (".csv", ".md", ".tex"):
        try:
            old = table_header(data.decode("utf-8"), suffix)
        except (UnicodeDecodeError, ValueError):
            return "it is not a text table"
        mine = table_header(new.decode("utf-8"), suffix) if new is not None else None
        if old is None:
            return "it has no table header"
        if mine is not None and not _same_table(old, mine):
            return f"its columns ({', '.join(old[:4])}{', ...' if len(old) > 4 else ''}) are not the table written there"
        return None
    return "randattn writes no file of this kind"


def check_ours(path: "str | os.PathLike", new: Optional[bytes] = None, *, flag: str = "--out") -> None:
    """Raise :class:`NotOurs` unless ``path`` is absent, empty, or a file randattn wrote (reads only)."""
    path = Path(path)
    why = why_not_ours(path, new)
    if why is not None:
        raise NotOurs(f"{path} was not written by randattn ({why}); nothing was changed. Give {flag} another folder, "
                      "or move the file away")


# -- writing -------------------------------------------------------------------------------------------------------
def _sweep(path: Path) -> None:
    """Remove temporaries of ``path`` left by writers that are gone (a SIGKILL or SIGTERM skips their cleanup)."""
    for tmp in path.parent.glob(f".{path.name}{_TMP}*"):
        try:
            pid = int(tmp.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, OSError):
            pass


def _pause() -> None:
    delay = os.environ.get(SLOW_ENV)
    if delay:
        time.sleep(float(delay))


@contextmanager
def replacing(path: "str | os.PathLike", *, check: bool = True, flag: str = "--out") -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; on success it is flushed and renamed onto ``path``. On any
    error (or Ctrl-C) the temporary is removed and ``path`` keeps its old bytes."""
    path = Path(path)
    if check:
        check_ours(path, flag=flag)
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep(path)
    tmp = path.with_name(f".{path.name}{_TMP}{os.getpid()}")
    try:
        yield tmp
        _pause()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if disk_full(exc):
            raise DiskFull(exc.errno, f"{path}: not written, the disk is full or a file-size limit is reached "
                                      f"({exc.strerror}); its previous version, if any, is unchanged") from None
        raise


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(path: "str | os.PathLike", data: bytes, *, flag: str = "--out") -> Path:
    """Replace ``path`` with ``data`` atomically, only if ``path`` is ours (:func:`check_ours`, header compared for
    tables). Unchanged bytes are not rewritten (a finished run on read-only media re-prints, writes nothing)."""
    path = Path(path)
    check_ours(path, data, flag=flag)
    try:
        if path.is_file() and path.read_bytes() == data:
            return path
    except OSError:
        pass
    with replacing(path, check=False) as tmp:
        with open(tmp, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])
            if os.environ.get(SLOW_ENV):
                f.flush()
                _pause()
            f.write(data[half:])
    return path


def write_text(path: "str | os.PathLike", text: str, *, flag: str = "--out") -> Path:
    return write_bytes(path, text.encode("utf-8"), flag=flag)
