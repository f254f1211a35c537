"""The ``randattn`` command: one entry point for the probes, benchmarks, figures and calibration.

    randattn list                          # the probes and benchmarks, one line each
    randattn probe head_pooling --restart  # = python -m probes.head_pooling --restart
    randattn bench decode --repeats 2      # = python -m bench.decode --repeats 2
    randattn figures --probe scatter       # = python -m figures --probe scatter
    randattn calibrate --out stats.pt      # = python -m randattn.calibrate --out stats.pt

Every subcommand hands its remaining arguments unchanged to that module's ``main(argv)``, so the flags,
defaults and outputs are the same as with ``python -m``. Relative paths (``--out``, the default result
folders under ``data/results/``) are taken from the current directory, as with ``python -m``: run it
from the repository root to read and write the shipped results.

The probes and benchmarks are found, not listed here: every module of the ``probes`` / ``bench``
package whose name does not start with ``_`` and that defines a top-level ``main`` function. Their
sources are read, not imported, to list them, so ``randattn list`` stays fast.

This module is the core's console script, but the probes, benchmarks and figures are the lab (``probes``,
``bench``, ``figures``, with the ``lab`` extra's matplotlib, seaborn and math-verify), and the core imports
nothing of the lab (tests/test_layers.py). So the lab is looked up by name at run time, as ``python -m`` does:
``importlib.import_module(f"{package}.{name}")`` for the module a subcommand names, then its ``main(argv)``.
No lab module is imported statically here, none at all for ``randattn --help``/``--version``/``calibrate``,
and ``randattn list`` reads sources without importing them. Calling ``main(argv)`` in this process (not
``runpy``) keeps a probe's exit status and a test's stand-in ``main`` working. Where the lab's packages are
missing (``pip install randattn`` without ``[lab]``) the subcommand says so and which extra to install.
The console script stays in the core so that ``randattn calibrate`` and ``randattn list`` need no extra.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import pkgutil
import sys
from typing import Callable, Optional, Sequence

__all__ = ["main", "runnable_modules"]

PROG = "randattn"

# subcommand -> (package, the python -m form, what one of its modules is called): lab packages, named, never imported here
# by an import statement.
_GROUPS = {
    "probe": ("probes", "python -m probes.NAME", "probe"),
    "bench": ("bench", "python -m bench.NAME", "benchmark"),
}
# The import names of the `lab` extra's packages (pyproject.toml; tests/test_layers.py checks they agree).
LAB_IMPORTS = ("matplotlib", "seaborn", "math_verify")
_COMMANDS = {
    "probe": "run a probe: randattn probe NAME [ARGS...] = python -m probes.NAME [ARGS...]",
    "bench": "run a benchmark: randattn bench NAME [ARGS...] = python -m bench.NAME [ARGS...]",
    "figures": "redraw figures from saved results: randattn figures [ARGS...] = python -m figures [ARGS...]",
    "calibrate": "TriAttention statistics: randattn calibrate [ARGS...] = python -m randattn.calibrate [ARGS...]",
    "list": "print the available probes and benchmarks with their one-line descriptions",
}


class CLIError(Exception):
    """A usage error: printed as ``randattn COMMAND: message`` with exit status 2."""


def _first_doc_line(tree: ast.Module) -> str:
    doc = ast.get_docstring(tree) or ""
    return doc.strip().splitlines()[0].strip() if doc.strip() else ""


def runnable_modules(package: str) -> dict[str, str]:
    """``{name: first docstring line}`` of the modules of ``package`` that define a top-level ``main``
    (names starting with ``_`` left out), sorted by name. Reads the sources; imports only the package."""
    try:
        pkg = importlib.import_module(package)
    except ImportError as exc:
        raise CLIError(f"the {package!r} package cannot be imported ({exc}); install randattn with it "
                       f"(pip install -e \".[lab]\" from the repository) or run from the repository root") from exc
    out = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_") or info.ispkg:
            continue
        spec = importlib.util.find_spec(f"{package}.{info.name}")
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        try:
            with open(spec.origin, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=spec.origin)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            out[info.name] = _first_doc_line(tree)
    return dict(sorted(out.items()))


@contextlib.contextmanager
def _prog(name: str):
    """argparse names the program after ``sys.argv[0]``: show ``randattn probe NAME`` in usage lines and errors."""
    saved = sys.argv[0] if sys.argv else None
    if sys.argv:
        sys.argv[0] = name
    else:
        sys.argv.append(name)
    try:
        yield
    finally:
        if saved is None:
            sys.argv.clear()
        else:
            sys.argv[0] = saved


def _run(fn: Callable, argv: list, prog: str) -> int:
    with _prog(prog):
        rc = fn(argv)
    # main() returns an exit status (int or None); randattn.calibrate's returns the statistics it made.
    return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0


def _table(items: dict[str, str], indent: str = "  ") -> str:
    width = max((len(n) for n in items), default=0)
    return "\n".join(f"{indent}{n:<{width}}  {d}".rstrip() for n, d in items.items())


def _top_help() -> str:
    lines = [f"usage: {PROG} COMMAND [ARGS...]", "",
             "One entry point for the probes, benchmarks, figures and calibration of randattn.", "", "commands:",
             _table(_COMMANDS), "",
             f"`{PROG} COMMAND --help` describes one command; `{PROG} probe NAME --help` the flags of one probe.",
             f"{PROG} --version prints the versions of randattn, torch and transformers."]
    return "\n".join(lines)


def _group_help(cmd: str) -> str:
    package, form, kind = _GROUPS[cmd]
    try:
        table = _table(runnable_modules(package)) or "  (none found)"
    except CLIError as exc:
        table = f"  ({exc})"
    return "\n".join([
        f"usage: {PROG} {cmd} NAME [ARGS...]", "",
        f"Run the {kind} NAME: calls {package}.NAME.main(ARGS), the same as `{form} ARGS`.",
        f"`{PROG} {cmd} NAME --help` lists that {kind}'s own flags.", "",
        f"{kind}s:", table,
    ])


def _version_text() -> str:
    import importlib.metadata

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return " ".join(f"{d} {version(d)}" for d in ("randattn", "torch", "transformers"))


def _group(cmd: str, rest: list) -> int:
    package, form, kind = _GROUPS[cmd]
    if not rest or rest[0] in ("-h", "--help"):
        print(_group_help(cmd), file=sys.stdout if rest else sys.stderr)
        return 0 if rest else 2
    name, args = rest[0], rest[1:]
    known = runnable_modules(package)
    if name not in known:
        raise CLIError(f"unknown {kind} {name!r}; known {kind}s: {', '.join(known) or '(none)'} "
                       f"(`{PROG} list` describes them)")
    return _run_lab(f"{package}.{name}", args, f"{PROG} {cmd} {name}")


def _run_lab(module: str, argv: list, prog: str) -> int:
    """Import the lab module named ``module`` by name (see the module docstring) and run its ``main(argv)``.

    A package of the ``lab`` extra that is missing, at the import or inside ``main`` (figures import their plotting
    modules late), is a usage error naming the extra; anything else fails as with ``python -m``."""
    try:
        return _run(importlib.import_module(module).main, argv, prog)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in LAB_IMPORTS:
            raise
        raise CLIError(f"{module} needs {missing!r}, which is not installed: the probes, benchmarks and figures come "
                       f"with the lab extra (pip install \"randattn[lab]\", or pip install -e \".[lab]\" in the "
                       f"repository)") from exc


def _list(rest: list) -> int:
    p = argparse.ArgumentParser(prog=f"{PROG} list", description=_COMMANDS["list"] + " (the first line of each "
                                "module's docstring), and the other commands")
    p.parse_args(rest)
    for cmd, (package, form, kind) in _GROUPS.items():
        print(f"{kind}s ({PROG} {cmd} NAME [ARGS...], or {form}):")
        print(_table(runnable_modules(package)) or "  (none found)")
        print()
    print("also:")
    print(_table({"figures": "python -m figures: " + _module_doc("figures.__main__"),
                  "calibrate": "python -m randattn.calibrate: " + _module_doc("randattn.calibrate")}))
    return 0


def _module_doc(module: str) -> str:
    spec = importlib.util.find_spec(module)
    try:
        with open(spec.origin, encoding="utf-8") as f:
            return _first_doc_line(ast.parse(f.read()))
    except (AttributeError, TypeError, OSError, SyntaxError):
        return ""


def _figures(rest: list) -> int:
    return _run_lab("figures.__main__", rest, f"{PROG} figures")


def _calibrate(rest: list) -> int:
    from randattn.calibrate import main as calibrate_main

    return _run(calibrate_main, rest, f"{PROG} calibrate")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``randattn ARGS`` in this process; returns the exit status (usage errors: 2).

    A probe's or benchmark's own usage errors leave through ``SystemExit``, as with ``python -m``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_help(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(_version_text())
        return 0
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd in _GROUPS:
            return _group(cmd, rest)
        if cmd == "list":
            return _list(rest)
        if cmd == "figures":
            return _figures(rest)
        if cmd == "calibrate":
            return _calibrate(rest)
        raise CLIError(f"unknown command {cmd!r}; known commands: {', '.join(_COMMANDS)} (`{PROG} --help`)")
    except CLIError as exc:
        print(f"{PROG} {cmd}: {exc}" if cmd in _COMMANDS else f"{PROG}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
