"""Typed probe configurations, and the one place that turns them into command lines.

Every probe is a :class:`Config` (a dataclass whose fields document themselves) plus ``run(config, ...)`` and an
analysis of its rows. The command line, the grid and the challenge all build the same ``Config``; nothing below the
command line sees an argparse Namespace::

    @dataclass
    @eviction(policy=DEFAULT, budget=256, buffer=16)    # eviction settings: once (SETTINGS); DEFAULT: the spec's
    class MyConfig(EvictionConfig):
        body: int = option(512, "tokens between question and answer", check=POSITIVE)   # the probe's own

    config = MyConfig(budget=128)            # from Python: validated on construction
    config = parse(MyConfig, argv, "doc")    # from a command line: the same validation, errors name the flag
    cache = config.spec().make_cache()       # its caches: from a randattn.EvictionSpec

A field becomes ``--field-name``; a ``bool`` field defaulting to False becomes a switch, one defaulting to True a
``--no-field-name`` switch; a ``tuple`` field takes one or more values. ``check`` names a range every value must be
in (``POSITIVE``, ``NONNEGATIVE``, ``FINITE``, ``PROBABILITY``, or a function returning an error text or None);
``Config.check()`` adds checks across fields. A failed check raises :class:`ConfigError` naming the field, which the
command line turns into a usage error naming the flag. Values come in layers: the defaults, then a ``--config``
TOML file, then the flags (:func:`parse_values`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from .config_errors import ConfigError, flag_of

__all__ = ["ConfigError", "Config", "RunConfig", "EvictionConfig", "eviction", "setting", "SETTINGS", "option", "parse",
           "parser_for", "DEFAULT", "POSITIVE", "NONNEGATIVE", "FINITE", "PROBABILITY", "SEED", "SEED_LIMIT", "flag_of"]


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


SEED_LIMIT = 2**64  # seeds are mixed as 64 bits (randattn.seeding)


def SEED(value) -> Optional[str]:
    """The one seed check of the lab: the core's, :func:`randattn.seeding._check_seed` (an integer in [0, 2**64)),
    its words without the leading ``seed`` (the flag names it). ``probes.common.seed_int`` (argparse) uses it too."""
    from randattn.seeding import _check_seed

    try:
        _check_seed(value)
    except ValueError as exc:
        return str(exc).removeprefix("seed ")
    return None


def PROBABILITY(value) -> Optional[str]:
    if not _number(value) or not 0 <= value <= 1:
        return f"must be a number in [0, 1], got {value!r}"
    return None


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

    model: Optional[str] = option(None, "HF hub id, local directory or local GGUF file; default: embedded SmolLM2-135M-Instruct")
    device: str = option("auto", "'auto' (CUDA when present), 'cpu' or 'cuda[:N]'")
    seed: int = option(0, "seed of the eviction draws (per seed, layer, round)", check=SEED)
    out: Optional[str] = option(None, "where results go (default: data/results/<probe>/ under the current folder)")
    restart: bool = option(False, "discard earlier results of this configuration (only files randattn wrote)")
    no_figure: bool = option(False, "do not draw the figure")
    figure_dir: Optional[str] = option(None, "where the figure goes (default: figures/ under the current folder)")
    processes: int = option(0, "processes running the units side by side, one torch thread each (0: auto, 2 on a "
                               "CPU with 2+ cores when the model is small enough, else 1); the rows are the same",
                            check=NONNEGATIVE)

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
    p.add_argument(CONFIG_FLAG, dest="config_file", default=None, metavar="FILE",
                   help="a TOML file of these settings (keys: the names above without the dashes, e.g. budget = 128, "
                        "policies = [\"random\"]): defaults, then the file, then the flags given here, which win")
    return p


def parse(cls, argv=None, description: str = "", *, defaults: Optional[dict] = None):
    """Parse ``argv`` into a validated ``cls``; a value out of range is a usage error that names the flag."""
    p = parser_for(cls, description, defaults=defaults)
    return build(cls, p, parse_values(cls, p, argv))


CONFIG_FLAG = "--config"


def parse_values(cls, parser: argparse.ArgumentParser, argv=None) -> dict:
    """The field values of ``cls`` from three layers: the fields' defaults, then a TOML file given as ``--config
    FILE`` (keys: the field names, as a grid's TOML spells them, e.g. ``budget = 128``, ``policies = ["random"]``),
    then the flags on the command line, which win."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument(CONFIG_FLAG, dest="config_file", default=None)
    known, rest = pre.parse_known_args(argv)
    _refuse_aliases(cls, parser, rest)
    if known.config_file is not None:
        parser.set_defaults(**file_values(cls, parser, known.config_file))
    values = vars(parser.parse_args(argv))
    values.pop("config_file", None)
    return values


def _refuse_aliases(cls, parser: argparse.ArgumentParser, argv) -> None:
    """``--K 128`` or ``-T 128`` for ``--budget``, ``--r 8`` for ``--buffer``: the settings reader's refusal
    ("did you mean --budget?"), before argparse reads a prefix of another flag into it."""
    from randattn.spec import ALIASES, SettingError, read_settings

    names = [f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]
    for arg in argv or ():
        key = arg.lstrip("-").split("=", 1)[0] if isinstance(arg, str) and arg.startswith("-") else None
        if key in ALIASES and key not in names:
            try:
                given = arg.split("=", 1)[0]
                read_settings({key: None}, where="the command line", accepted=names,
                              spell=lambda k: given if k == key else flag_of(k))
            except SettingError as exc:
                parser.error(str(exc))


def file_values(cls, parser: argparse.ArgumentParser, path: str) -> dict:
    """The settings a ``--config`` TOML file gives ``cls`` (lists as tuples); a file that cannot be read, or a key
    that is no setting of this probe's command line, is a usage error naming ``--config`` and the fix."""
    import tomllib

    from randattn.spec import SettingError, key_lines, read_settings

    try:
        with open(path, "rb") as f:
            data = f.read()
        table = tomllib.loads(data.decode())
    except FileNotFoundError:
        parser.error(f"{CONFIG_FLAG}: {path} does not exist; give a TOML file of this probe's settings")
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        parser.error(f"{CONFIG_FLAG}: cannot read {path} as TOML ({exc}); write one 'name = value' line per setting")
    names = sorted(f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", True))
    values = {str(k).replace("-", "_"): v for k, v in table.items()}
    lines = {str(k).replace("-", "_"): n for k, n in key_lines(data.decode()).items()}
    hints = typing.get_type_hints(cls)
    try:  # the settings reader: another spelling (K for budget), a key this probe does not take
        read_settings(values, where=f"{CONFIG_FLAG}: {path}", accepted=names, lines=lines, taker="this command",
                      types=False)
        for key, value in values.items():  # a value of the wrong type, named with its file and line
            problem = _type_problem(value, hints[key])
            if problem:
                raise SettingError(key, f"{flag_of(key)}: {problem}; the accepted keys are {', '.join(names)}",
                                   where=f"{CONFIG_FLAG}: {path}:{lines[key]}" if key in lines else
                                   f"{CONFIG_FLAG}: {path}", key=key, accepted=names)
    except SettingError as exc:
        parser.error(str(exc))
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


def _type_problem(value, tp) -> Optional[str]:
    """Whether a TOML value has the field's type (a list where the field takes several; an int is a number)."""
    if value is None:
        return None
    kind, several = _base_type(tp), _is_sequence(tp)
    if isinstance(value, str) and not several and kind in (int, float):
        try:  # a string is read as the flag's text would be (argparse converts a string default): threads = '2'
            _argtype(kind)(value)
        except argparse.ArgumentTypeError as exc:
            return str(exc)
        return None
    if several and not isinstance(value, list):
        value = [value]
    if isinstance(value, list) and not several:
        return f"takes one value, got the list {value!r}"
    what = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(kind)
    for v in value if isinstance(value, list) else [value]:
        ok = {int: lambda x: isinstance(x, int) and not isinstance(x, bool),
              float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
              bool: lambda x: isinstance(x, bool), str: lambda x: isinstance(x, str)}.get(kind, lambda x: True)
        if not ok(v):
            return f"must be {what}, got {v!r} ({type(v).__name__})"
    return None


def build(cls, parser: argparse.ArgumentParser, values: dict):
    """``cls(**values)``, with a :class:`ConfigError` turned into ``parser.error``."""
    values = {k: v for k, v in values.items() if k != "config_file"}
    hints = typing.get_type_hints(cls)
    for name, value in list(values.items()):
        if isinstance(value, list) and _is_sequence(hints.get(name)):
            values[name] = tuple(value)
    try:
        return cls(**values)
    except ConfigError as exc:
        parser.error(str(exc))


# -- the eviction settings, defined once ---------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One eviction setting as every probe's flag: its type, its help and its range check."""

    type: Any
    help: str
    check: Optional[Callable] = None
    metavar: Optional[str] = None
    help_off: Optional[str] = None  # a bool setting's help when its default is True (the --no-... switch)
    default: Any = None  # the spec's default (randattn.EvictionSpec), where it has one (see ``has_default``)
    has_default: bool = False


def _spec_default(name: str, *, many: bool = False) -> dict:
    """``default=`` and ``has_default=`` of a :class:`Setting` whose default is the spec's field ``name``."""
    from randattn.spec import spec_default

    value = spec_default(name)
    return {"default": (value,) if many else value, "has_default": True}


#: The eviction settings a probe may have, each defined once: the fields :func:`eviction` adds. Their values become
#: a :class:`randattn.EvictionSpec` (:meth:`EvictionConfig.spec`), which checks them with the core's rules.
SETTINGS = {
    "policy": Setting(str, "the eviction policy: a registered name, a paper mode (e.g. attn_pp) or your own selector "
                           "as MODULE:CALLABLE or path/to/file.py:CALLABLE", metavar="POLICY",
                      **_spec_default("policy")),
    "policies": Setting(tuple[str, ...], "the policies compared (each a registered name, a paper mode or "
                                         "MODULE:CALLABLE)", metavar="POLICY", **_spec_default("policy", many=True)),
    "budget": Setting(int, "T: pairs each KV head holds right after a round, the newest r among them",
                      check=POSITIVE),
    "buffer": Setting(int, "r: new pairs between rounds (the recent window: the newest r pairs are never "
                           "candidates)", check=POSITIVE, **_spec_default("buffer")),
    "protect_prompt": Setting(bool, "protect the prompt: pin it in every head (by default it competes with "
                                    "everything else)",
                              help_off="score only: the prompt competes with everything else (by default it is "
                                       "pinned in every head)"),
    "stats": Setting(Optional[str], "calibration statistics for a policy that reads them (TriAttention: `python -m "
                                    "randattn.calibrate`); the embedded model's ship with the package",
                     metavar="FILE", **_spec_default("stats")),
}


@dataclass(frozen=True)
class _Default:
    value: Any
    several: bool
    overrides: dict


class _SpecDefault:
    def __repr__(self) -> str:
        return "DEFAULT"


#: In :func:`eviction`: this setting with the spec's own default (:class:`randattn.EvictionSpec`), not restated.
DEFAULT = _SpecDefault()


def setting(default: Any = DEFAULT, *, several: bool = False, **overrides) -> _Default:
    """A probe's default for one eviction setting in :func:`eviction`, with what the probe words its own way:
    ``help``, ``cli=False`` (set from code only), ``choices``, ``metavar``. ``several``: the field takes a list
    (``--budget 128 256``, a sweep); a ``None`` default makes the field optional (the probe fills it in); no default
    (:data:`DEFAULT`): the spec's."""
    return _Default(default, several, overrides)


def eviction(**defaults):
    """A class decorator, under ``@dataclass``: the named eviction settings (:data:`SETTINGS`) become the class's
    first fields, each with its one definition and this probe's default (a value, or :func:`setting`)::

        @dataclass
        @eviction(policy=DEFAULT, budget=128, buffer=32, protect_prompt=True)
        class Config(EvictionConfig): ...

    :data:`DEFAULT` (or ``setting(help=...)`` without a value) takes the spec's default (``policy="random"``,
    ``buffer=64``, ``stats=None``), so a probe states only the defaults that differ. A subclass names only what it
    changes (``@eviction(protect_prompt=True)``)."""
    unknown = sorted(set(defaults) - set(SETTINGS))
    if unknown:
        raise TypeError(f"not an eviction setting: {', '.join(unknown)}; the settings are {', '.join(SETTINGS)}")

    def add(cls):
        own = dict(cls.__dict__.get("__annotations__", {}))
        clash = sorted(set(own) & set(defaults))
        if clash:
            raise TypeError(f"{cls.__name__} declares {', '.join(clash)} itself; an eviction setting comes from "
                            "@eviction only")
        added = {}
        for name, given in defaults.items():
            d = given if isinstance(given, _Default) else _Default(given, False, {})
            s = SETTINGS[name]
            if d.value is DEFAULT:  # the spec's default, declared once there
                if not s.has_default:
                    raise TypeError(f"{name} has no spec default; give {cls.__name__}'s own")
                value = s.default
                if d.several and not isinstance(value, tuple):  # a list of the one default: ("random",)
                    value = (value,)
                d = _Default(value, d.several, d.overrides)
            tp = s.type
            # a list-valued default (or ``several``) makes a one-value setting a tuple of them; ``policies`` is one
            # already (``tuple[str, ...] is tuple[str, ...]`` is False: each spelling is a new alias, so never ``is``)
            if (d.several or isinstance(d.value, tuple)) and not _is_sequence(tp):
                tp = tuple[tp, ...]
            if d.value is None and not _optional(tp):
                tp = Optional[tp]
            help_text = s.help_off if s.help_off and d.value is True else s.help
            meta = dict(help=help_text, check=s.check, metavar=s.metavar)
            meta.update(d.overrides)
            added[name] = tp
            setattr(cls, name, option(d.value, meta.pop("help"), **meta))
        cls.__annotations__ = {**added, **own}
        return cls

    return add


@dataclass
class EvictionConfig(RunConfig):
    """A probe configuration whose eviction settings come from :func:`eviction`: it checks them once, with the
    core's rules (:class:`randattn.EvictionSpec`), and hands each run its :meth:`spec`. A probe never restates a
    size rule, a policy check or the prompt-fits rule."""

    #: The fields that name policies, in the order a run uses them (a probe adds its own, e.g. ``baselines``).
    policy_fields: typing.ClassVar[tuple[str, ...]] = ("policies", "policy")
    #: Whether ``full`` (full attention, no eviction) may be named among the policies (the accuracy probe's arm).
    full_allowed: typing.ClassVar[bool] = False

    def policy_names(self) -> tuple[str, ...]:
        """Every policy this run evicts with (from :attr:`policy_fields`; an empty name left out, and ``full`` where
        :attr:`full_allowed`): the first field present (``policies``, else ``policy``), then a probe's own
        (``baselines``)."""
        primary = getattr(self, "policies", None)
        if primary is None:
            primary = getattr(self, "policy", ())
        names = [primary] if isinstance(primary, str) else list(primary or ())
        for extra in self.policy_fields:
            if extra not in ("policies", "policy"):
                names += list(getattr(self, extra, None) or ())
        return tuple(dict.fromkeys(n for n in names if n and not (self.full_allowed and n == "full")))

    def policy_field(self, name: str) -> str:
        """The field a policy name came from (``policies``, ``policy``, or a probe's own, e.g. ``baselines``)."""
        present = [f for f in self.policy_fields if hasattr(self, f)]
        for f in present:
            value = getattr(self, f)
            if value == name or isinstance(value, tuple) and name in value:
                return f
        return present[0] if present else "policy"

    def spec(self, policy: Optional[str] = None, *, fields: Optional[dict] = None, **changes):
        """The :class:`randattn.EvictionSpec` of ``policy`` (default: the run's one policy) under this config: its
        ``budget``, ``buffer``, ``protect_prompt``, ``seed`` and ``stats``, with ``changes`` (any spec field: a
        batch's seed, a policy's options, an arm's budget) on top. A refusal is a :class:`ConfigError` naming the
        field to change (``fields`` maps a spec field to the probe's, e.g. ``{"protect_prompt": "modes"}``)."""
        import randattn
        from randattn.spec import SpecError

        if policy is None:  # the one being run: ``policy`` (a probe comparing ``policies`` sets it per run)
            single = getattr(self, "policy", None)
            policy = single if isinstance(single, str) and single else (*self.policy_names(), "random")[0]
        from randattn.spec import spec_default

        values = {"budget": getattr(self, "budget", None), "buffer": getattr(self, "buffer", spec_default("buffer")),
                  "protect_prompt": getattr(self, "protect_prompt", None), "seed": self.seed,
                  "stats": getattr(self, "stats", None)}
        values.update(changes)
        if policy == "full":
            return randattn.EvictionSpec.full()
        try:
            return randattn.EvictionSpec(policy, **values)
        except SpecError as exc:
            raise self.spec_error(exc, policy, fields) from None
        except FileNotFoundError as exc:  # a --stats file that is not there
            raise ConfigError("stats", str(exc)) from None

    def bind(self, spec, model, *, field: Optional[str] = None):
        """Bind ``spec``'s policy to ``model`` before a run (:meth:`randattn.EvictionSpec.bind`): a policy that
        cannot serve it is a :class:`ConfigError` naming ``field`` (default: the field the policy came from)."""
        try:
            return spec.bind(model)
        except FileNotFoundError as exc:  # statistics named but not there
            raise ConfigError("stats", str(exc)) from None
        except (ValueError, TypeError) as exc:
            name = spec.policy if isinstance(spec.policy, str) else spec.policy_object.name
            raise ConfigError(field or self.policy_field(name), f"{name}: {exc}") from None

    def spec_error(self, exc, policy: Optional[str] = None, fields: Optional[dict] = None) -> ConfigError:
        """A :class:`SpecError` as the :class:`ConfigError` of the field it names."""
        name = (fields or {}).get(exc.field)
        if name is None:
            name = {"policy": self.policy_field(policy) if policy else "policy", "options": "policy",
                    "recent": "buffer", "seed": "seed"}.get(exc.field, exc.field)
            if not any(f.name == name for f in dataclasses.fields(self)):
                name = "budget" if exc.field in ("recent", "buffer") else self.policy_field(policy or "")
        return ConfigError(name, str(exc))

    def check(self) -> None:
        self.check_eviction()

    def check_eviction(self, *, fields: Optional[dict] = None) -> None:
        """The sizes obey the core's rules (T > r, ...), every policy named is one (a registered name, a paper
        mode, a loadable ``MODULE:CALLABLE``) and its spec is valid (protection, options), and a ``stats`` file is
        read by some policy of the run. Each problem a :class:`ConfigError` naming its field."""
        from randattn.rules import SpecError, check_sizes, resolve_recent

        from .policy_specs import check_policy, check_stats_used

        budget, buffer = getattr(self, "budget", None), getattr(self, "buffer", None)
        budgets = tuple(t for t in (budget if isinstance(budget, tuple) else (budget,)) if t is not None)
        if buffer is not None:  # else the task's default, filled in (and checked) when the run resolves it
            for t in budgets:
                try:
                    check_sizes(t, buffer)
                    resolve_recent(t, buffer, None)
                except SpecError as exc:
                    if exc.field != "budget":
                        raise self.spec_error(exc, fields=fields) from None
                    raise ConfigError("budget", f"T={t} must exceed the recent window r={buffer} (the newest r pairs "
                                                f"are kept untouched and T - r of the older ones selected); use "
                                                f"--budget > {buffer} or a smaller --buffer") from None
        names = self.policy_names()
        for name in names:
            check_policy(self.policy_field(name), name)
        if buffer is not None:
            for t in budgets:
                for name in names:  # protection and options by the core's rules; statistics are read at the run
                    self.spec(name, fields=fields, budget=t, buffer=buffer, stats=None,
                              protect_prompt=self.protection_of(name))
        if hasattr(self, "stats"):
            check_stats_used(self.stats, names)

    def protection_of(self, policy: str) -> Optional[bool]:
        """The ``protect_prompt`` a spec of ``policy`` gets (a probe that runs several modes decides per arm)."""
        return getattr(self, "protect_prompt", None)

    def fits(self, spec, prompt_len: int, *, what: Optional[str] = None, fix: Optional[str] = None) -> None:
        """The one prompt-fits rule (:meth:`randattn.EvictionSpec.validate`): a :class:`ConfigError` naming
        ``--budget`` when a protected ``prompt_len``-token prompt does not fit ``spec`` (``None``: this config's T and
        r, the prompt protected), with the smallest T that fits. ``what`` says whose prompt; ``fix`` the other way
        out (default ``--no-protect-prompt`` where the probe has that flag)."""
        from randattn.rules import prompt_fits_problem

        if spec is None:
            budget, recent = self.budget, self.buffer
            problem = prompt_fits_problem(prompt_len, budget=budget, recent=recent, protect=True)
        else:
            budget, recent = spec.budget, spec.recent_window
            problem = spec.validate(prompt_len)
        if problem:
            protect = next((f for f in dataclasses.fields(self) if f.name == "protect_prompt"), None)
            if fix is None and protect is not None:
                fix = "--no-protect-prompt" if protect.default else "without --protect-prompt"
            raise ConfigError(problem.field, problem.worded(budget_text=f"{what + ': ' if what else ''}T={budget}",
                                                            use="--budget", fix=fix))
