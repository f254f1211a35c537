"""The command line of every probe: parse a :class:`~probes.config.Config`, run, and hand the figure to ``figures``.

Probes never import ``figures``: a probe's command line asks the figures command (``python -m figures``) to draw
from the rows it just wrote, so figures stay a layer that only plots.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

from .config import ConfigError, build, parser_for

__all__ = ["main", "draw"]


def main(config_cls, body: Callable, argv=None, doc: str = "", *, defaults: Optional[dict] = None) -> int:
    """Parse ``argv`` into ``config_cls`` and call ``body(config)``; a :class:`ConfigError` raised by either becomes a
    usage error that names the flag (exit status 2), before or after the model loads. Returns the exit status: 0,
    or the int ``body`` returned."""
    parser = parser_for(config_cls, (doc or config_cls.__doc__ or "").strip().splitlines()[0], defaults=defaults)
    config = build(config_cls, parser, vars(parser.parse_args(argv)))
    try:
        status = body(config)  # a probe's run may return what it wrote; only an int is an exit status
    except ConfigError as exc:
        parser.error(str(exc))
    return status if isinstance(status, int) and not isinstance(status, bool) else 0


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
