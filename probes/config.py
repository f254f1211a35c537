"""Typed probe configurations, and the one place that turns them into command lines.

Every probe is a :class:`Config` (a dataclass whose fields document themselves) plus ``run(config, ...)`` and an
analysis of its rows. The command line, the grid and the challenge all build the same ``Config``; nothing below the
command line sees an argparse Namespace::

    @dataclass
    class MyConfig(RunConfig):
        budget: int = option(256, "T: pairs per KV head right after a round", check=POSITIVE)

    config = MyConfig(budget=128)            # from Python: validated on construction
    config = parse(MyConfig, argv, "doc")    # from a command line: the same validation, errors name the flag

A field becomes ``--field-name``; a ``bool`` field defaulting to False becomes a switch, one defaulting to True a
``--no-field-name`` switch; a ``tuple`` field takes one or more values. ``check`` names a range every value must be
in (``POSITIVE``, ``NONNEGATIVE``, ``FINITE``, ``PROBABILITY``, or a function returning an error text or None);
``Config.check()`` adds checks across fields. A failed check raises :class:`ConfigError` naming the field, which the
command line turns into a usage error naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["ConfigError", "Config", "RunConfig", "option", "parse", "parser_for", "POSITIVE", "NONNEGATIVE",
           "FINITE", "PROBABILITY", "SEED", "flag_of"]


class ConfigError(ValueError):
    """A configuration value is out of range; ``field`` names it (``--field-name`` on the command line)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{flag_of(field_name)}: {message}")
        self.field = field_name
        self.message = message


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kind(value) -> str:
    return "integer" if isinstance(value, int) and not isinstance(value, bool) else "number"


def POSITIVE(value) -> Optional[str]:
    if not _number(value) or not value > 0 or value == math.inf:
        return f"must be a positive {_kind(value)}, got {value!r}"
    return None


def NONNEGATIVE(value) -> Optional[str]:
    if not _number(value) or not value >= 0 or value == math.inf:
        return f"must be a non-negative {_kind(value)}, got {value!r}"
    return None


def FINITE(value) -> Optional[str]:
    if not _number(value) or not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    return None


def SEED(value) -> Optional[str]:
    if not _number(value) or not value >= 0:
        return NONNEGATIVE(value)
    if value >= 2**64:
        return f"must be below 2**64, got {value!r} (seeds are mixed as 64 bits); pass a seed in range"
    return None


def PROBABILITY(value) -> Optional[str]:
    if not _number(value) or not 0 <= value <= 1:
        return f"must be a number in [0, 1], got {value!r}"
    return None


def check_budget(budget: int, buffer: int, field: str = "budget") -> None:
    """T must exceed r: the newest r pairs are the recent window, never candidates, so T - r are selected."""
    if buffer >= budget:
        raise ConfigError(field, f"T={budget} must exceed r={buffer} (the recent window is r)")


def option(default: Any, help: str, *, check: Optional[Callable] = None, choices=None, metavar: Optional[str] = None,
           cli: bool = True, flag: Optional[str] = None):
    """A documented config field. ``cli=False`` keeps it off the command line (set from code only); ``flag`` overrides
    the flag's name."""
    meta = {"help": help, "check": check, "choices": choices, "metavar": metavar, "cli": cli, "flag": flag}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Config:
    """Base of every probe configuration: validates on construction."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            check = f.metadata.get("check")
            values = value if isinstance(value, (tuple, list)) else [value]
            if value is None and _optional(hints.get(f.name)):
                continue
            if _base_type(hints.get(f.name)) is int:
                for v in values:
                    if isinstance(v, bool) or not isinstance(v, int):
                        raise ConfigError(f.name, f"must be an integer, got {v!r}")
            if isinstance(value, (tuple, list)):
                twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
                if twice is not None:
                    raise ConfigError(f.name, f"lists {twice!r} twice; list each value once")
            for v in values:
                if choices is not None and v not in choices:
                    raise ConfigError(f.name, f"must be one of {', '.join(map(str, choices))}, got {v!r}")
                if check is not None:
                    problem = check(v)
                    if problem:
                        raise ConfigError(f.name, problem)
        self.check()

    def check(self) -> None:
        """Checks across fields (subclasses); raise :class:`ConfigError` naming the field to change."""

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


@dataclass
class RunConfig(Config):
    """The flags that mean the same in every probe."""

    model: Optional[str] = option(None, "HF hub id or local directory; default: embedded SmolLM2-135M-Instruct")
    device: str = option("auto", "'auto' (CUDA when present), 'cpu' or 'cuda[:N]'")
    seed: int = option(0, "seed of the eviction draws (per seed, layer, round)", check=SEED)
    out: Optional[str] = option(None, "where results go (default: data/results/<probe>/ under the current folder)")
    restart: bool = option(False, "discard earlier results of this configuration (only files randattn wrote)")
    no_figure: bool = option(False, "do not draw the figure")
    figure_dir: Optional[str] = option(None, "where the figure goes (default: figures/ under the current folder)")

    def validate(self) -> None:
        super().validate()
        if self.figure_dir is not None and not self.no_figure:
            for p in (Path(self.figure_dir), *Path(self.figure_dir).parents):
                if p.exists() and not p.is_dir():
                    raise ConfigError("figure_dir", f"{p} is a file, not a folder; give a folder for the figure, or "
                                                    "--no-figure")


# -- the command line ------------------------------------------------------------------------------
def _optional(tp) -> bool:
    return typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp)


def _base_type(tp):
    if _optional(tp):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return args[0] if args else str
    return tp


def _is_sequence(tp) -> bool:
    if _optional(tp):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return typing.get_origin(tp) in (tuple, list)


def _argtype(kind):
    """An argparse type that accepts what the field's Python type accepts and says so when it does not."""
    if kind is int:
        def parse_int(text):
            try:
                return int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        return parse_int
    if kind is float:
        def parse_float(text):
            try:
                return float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        return parse_float
    return str


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` to a flag's help, unless the help already says its default, and never for switches."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.nargs == 0 or action.default is None:
            return text
        return super()._get_help_string(action)


def parser_for(cls, description: str, *, defaults: Optional[dict] = None) -> argparse.ArgumentParser:
    """The argparse parser of a config class: one flag per field, its help and default from the field."""
    p = argparse.ArgumentParser(description=description, formatter_class=_DefaultsFormatter)
    hints = typing.get_type_hints(cls)
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        tp = hints[f.name]
        default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
        flag = f.metadata.get("flag") or flag_of(f.name)
        help_text = f.metadata.get("help", "")
        if _base_type(tp) is bool and not _is_sequence(tp):
            if default:
                p.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=help_text)
            else:
                p.add_argument(flag, dest=f.name, action="store_true", help=help_text)
            continue
        kwargs = dict(dest=f.name, default=default, help=help_text, type=_argtype(_base_type(tp)))
        if f.metadata.get("choices") is not None:
            kwargs["choices"] = list(f.metadata["choices"])
        if f.metadata.get("metavar"):
            kwargs["metavar"] = f.metadata["metavar"]
        if _is_sequence(tp):
            kwargs["nargs"] = "+"
        p.add_argument(flag, **kwargs)
    return p


def parse(cls, argv=None, description: str = "", *, defaults: Optional[dict] = None):
    """Parse ``argv`` into a validated ``cls``; a value out of range is a usage error that names the flag."""
    p = parser_for(cls, description, defaults=defaults)
    ns = p.parse_args(argv)
    return build(cls, p, vars(ns))


def build(cls, parser: argparse.ArgumentParser, values: dict):
    """``cls(**values)``, with a :class:`ConfigError` turned into ``parser.error``."""
    hints = typing.get_type_hints(cls)
    for name, value in list(values.items()):
        if isinstance(value, list) and _is_sequence(hints.get(name)):
            values[name] = tuple(value)
    try:
        return cls(**values)
    except ConfigError as exc:
        parser.error(str(exc))
