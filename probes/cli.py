"""The command line of every probe: parse a :class:`~probes.config.Config`, run, and hand the figure to ``figures``.

Probes never import ``figures``: a probe's command line asks the figures command (``python -m figures``) to draw
from the rows it just wrote, so figures stay a layer that only plots.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

from analysis.files import DiskFull, NotOurs
from analysis.rows import BadRow

from .config import ConfigError, build, flag_of, parse_values, parser_for
from .results import RunInUse, interrupted, openings, release_folders

__all__ = ["main", "draw", "SelectorFailed", "selector_failure"]

# How randattn's core names a selector that failed mid-run: "policy 'NAME' failed at layer L, round R: ...",
# "policy 'NAME' returned NaN scores at layer L, round R", "... pinned ... (policy 'NAME' scored them +inf) ...";
# select() may prefix "layer L: ", and a probe may wrap the message in its own.
_NAME = r"policy ('[^']*'|\"[^\"]*\")"
_FROM_NAME = re.compile(r"(?:^|: )(?:layer \d+: )?(" + _NAME + ".*)", re.S)


def selector_failure(exc: BaseException) -> Optional[str]:
    """The core's message naming the selector that failed, found in ``exc`` or what it was raised from; else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if isinstance(exc, (RuntimeError, ValueError, TypeError)) and re.search(_NAME, text):
            found = _FROM_NAME.search(text)
            text = found.group(1) if found else re.sub(r"^layer \d+: ", "", text)
            return " ".join(text.split())  # one paragraph, whatever the selector's own text held
        exc = exc.__cause__ or exc.__context__
    return None


class SelectorFailed(Exception):
    """A selector failed mid-run: ``failure`` is the core's message (selector, layer, round), ``step`` where in the
    probe (e.g. "challenge part 'planted'"), ``kept`` what of the run is on disk and what was not written."""

    def __init__(self, failure: str, *, step: str = "", kept: str = ""):
        super().__init__(failure)
        self.failure, self.step, self.kept = failure, step, kept


def _flag_naming(config, failure: str) -> str:
    """The flag that gave the failing selector (``--policy``, ``--policies``, ``--baselines``, ...)."""
    name = re.search(_NAME, failure)
    spec = name.group(1)[1:-1] if name else None
    for f in dataclasses.fields(config) if dataclasses.is_dataclass(config) else ():
        value = getattr(config, f.name)
        if spec is not None and (value == spec or (isinstance(value, (tuple, list)) and spec in value)):
            return flag_of(f.name)
    return "--policy"


def _selector_refusal(parser, config, exc: BaseException) -> None:
    """Exit 2 with one paragraph (no usage block) when ``exc`` is a selector failing mid-run; else return."""
    failed = exc if isinstance(exc, SelectorFailed) else None
    failure = failed.failure if failed else selector_failure(exc)
    if failure is None:
        return
    _close_bars()  # bars the failure left open end first: the message stands alone
    where = f" (in {failed.step})" if failed and failed.step else ""
    kept = failed.kept if failed and failed.kept else "The rows computed before it are kept"
    parser.exit(2, f"{parser.prog}: error: {_flag_naming(config, failure)}: {failure.rstrip('.')}{where}. {kept}; "
                   "fix the selector and rerun the same command: it resumes from those rows.\n")


def _close_bars() -> None:
    """Close the progress bars a failure or an interrupt left open, so the message after them stands alone."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def main(config_cls, body: Callable, argv=None, doc: str = "", *, defaults: Optional[dict] = None) -> int:
    """Parse ``argv`` into ``config_cls`` and call ``body(config)``; a :class:`ConfigError` raised by either becomes a
    usage error that names the flag (exit status 2), before or after the model loads, and so does a selector that
    fails mid-run (:class:`SelectorFailed`, or the core's error naming it): one paragraph, no traceback. Ctrl-C
    (SIGINT) is one line saying how many rows are safe in which file (exit status 130, no traceback). Returns the
    exit status: 0, or the int ``body`` returned."""
    parser = parser_for(config_cls, (doc or config_cls.__doc__ or "").strip().splitlines()[0], defaults=defaults)
    mark = openings()
    try:
        return _main(parser, config_cls, body, argv)
    except KeyboardInterrupt:
        # Rows go to disk batch by batch (a batch whole or not at all, Ctrl-C held off while one is written) and
        # summaries and figures through a temporary renamed into place, so what is on disk is what a resume reads.
        _close_bars()
        print(f"{parser.prog}: {interrupted(mark)}", file=sys.stderr)
        return 130
    finally:
        release_folders()  # the run is over: its results folders are free for the next one


def _main(parser, config_cls, body: Callable, argv) -> int:
    config = build(config_cls, parser, parse_values(config_cls, parser, argv))  # defaults <- --config FILE <- flags
    problem = cache_problem(getattr(config, "model", "")) if hasattr(config, "model") else None
    if problem:
        parser.error(problem)
    try:
        status = body(config)  # a probe's run may return what it wrote; only an int is an exit status
    except ConfigError as exc:
        parser.error(str(exc))
    except (NotOurs, RunInUse, BadRow) as exc:  # a summary or table not ours, a folder in use, a bad row read back
        parser.error(f"--out: {exc}")
    except DiskFull as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 1
    except (SelectorFailed, RuntimeError, ValueError, TypeError) as exc:
        # A selector that fails mid-run (NaN, inf, a raise, another device) is a --policy refusal like the ones
        # before the run; the rows already written stay for the rerun. Anything else keeps its traceback.
        _selector_refusal(parser, config, exc)
        raise
    return status if isinstance(status, int) and not isinstance(status, bool) else 0


def cache_problem(model: Optional[str]) -> Optional[str]:
    """Why the embedded model cannot be converted into its cache (``$RANDATTN_CACHE``, else ``$HOME/.cache``), named
    after that variable rather than ``--model``; None when it can, or when ``model`` is not an embedded one."""
    from randattn import models

    name = models.embedded_name(model)
    if name is None:
        return None
    var = "RANDATTN_CACHE" if os.environ.get("RANDATTN_CACHE") else "HOME"
    root = models.cache_root()
    if models.is_converted(name):
        return None  # converted before: read only
    fix = (f"set RANDATTN_CACHE to a folder you can write (the embedded model {name} is converted there once, "
           "about 0.5 GB)")
    for p in (root, *root.parents):
        if p.exists() and not p.is_dir():
            where = "" if p == root else f", so {root} cannot hold the converted model"
            return f"{var}: {p} is a file, not a folder{where}; {fix}"
        if p.is_dir():
            try:
                import tempfile

                with tempfile.TemporaryFile(dir=p, prefix=".randattn-write-check-"):
                    pass
            except OSError as exc:
                return f"{var}: cannot write in {p} ({exc.strerror or exc}); {fix}"
            return None
    return None


def draw(figure: str, results: "str | Path", figure_dir: "str | Path | None", *extra: str) -> list[str]:
    """Draw ``figure`` from ``results`` with the figures command, into ``figure_dir`` (default ``figures/`` under the
    current folder); prints and returns the files written."""
    cmd = [sys.executable, "-m", "figures", "--probe", figure, "--results", str(results)]
    if figure_dir is not None:
        cmd += ["--out", str(figure_dir)]
    cmd += list(extra)
    # The figures package beside this probes package, not whichever one the environment happens to import first
    # (an editable install of another checkout would draw with other code, into its own folder).
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(f"figure {figure}: not drawn ({(done.stderr.strip().splitlines() or ['?'])[-1]})", file=sys.stderr)
        return []
    files = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if line.startswith(f"{figure}: ")]
    for f in files:
        print(f"figure: {f}")
    return files
