"""Files shipped with randattn: the embedded model's traces and the results the docs report.

They are the installed package ``randattn_data`` (the repository's ``data/`` folder; ``pyproject.toml`` maps it), read
through :mod:`importlib.resources`, so an installed wheel has them wherever it runs. From a checkout that is not
installed, the same files are read from ``data/`` beside the package.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["shipped", "shipped_result", "CHECKOUT"]

CHECKOUT = Path(__file__).resolve().parents[1]


def shipped(relative: str) -> Path:
    """The shipped file ``data/<relative>`` (it may not exist: callers say what to run to make it)."""
    try:
        from importlib.resources import files

        path = Path(str(files("randattn_data") / relative))
        if path.exists() or not (CHECKOUT / "data" / relative).exists():
            return path
    except ModuleNotFoundError:
        pass
    return CHECKOUT / "data" / relative


def shipped_result(relative: str) -> Path:
    """A shipped result file ``data/results/<relative>``."""
    return shipped(f"results/{relative}")
