"""Grid specs: a TOML file naming a probe kind and its configuration, read and checked before any work starts.

The keys are the probe's own configuration fields (its command-line flags, with underscores: ``--max-new-tokens``
is ``max_new_tokens``), checked by the probe's own ``Config``, so a grid runs what the command line runs::

    probe = "accuracy"                    # any registered kind: accuracy, passcode (probes.units.KINDS)
    models = ["Qwen/Qwen3-4B"]            # hub ids, local directories, or "smollm2-135m" (the default)
    policies = ["full", "random", "snapkv", "my_selector:score"]   # accuracy: --policy; passcode: --policies
    budgets = [1024]                      # accuracy: --budget (one file, a budget sweep); passcode: one run each
    buffers = [64]                        # r; a list: one run each
    protocol = "grid"                     # accuracy: protected, score-only, matched, grid
    seeds = [0]
    task = "math500"
    data = "math500.jsonl"                # instead of the HF dataset (read by the driver only)
    runs = 4
    max_new_tokens = 32768
    [policy_options.h2o]                  # accuracy: --policy-option h2o:recent_fraction=0.25
    recent_fraction = 0.25

A list given for a field that takes one value runs every value (a sweep: one run of the probe per combination,
in the order the keys are written, models first); a field that takes several (``policy``, ``budget`` of the
accuracy harness, ``policies`` of the passcode) takes the list as its value. ``models``, ``seeds``, ``budgets``,
``buffers`` and ``policies`` are the plural spellings of ``model``, ``seed``, ``budget``, ``buffer`` and
``policy``. ``protect_prompt = [true, false]`` is what a probe's ``Config.both_protections`` says (the accuracy
harness: ``protocol = "matched"``); elsewhere it sweeps the two values. Defaults are the
probe's own (``python -m probes.<probe>``); ``out``, ``restart``, ``no_figure`` and ``figure_dir`` are the grid
command's. Paths are relative to the working directory, as on a command line. A wrong key, type, value, policy,
task or model is a :class:`SpecError` naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import itertools
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

import randattn
from randattn.spec import ALIASES, SettingError, key_lines, read_settings

from . import units
from .config import ConfigError
from .units import ModelInfo

#: Plural spellings of fields (the spec files of earlier releases used them).
PLURALS = {"models": "model", "seeds": "seed", "budgets": "budget", "buffers": "buffer", "policies": "policy"}
#: Fields the grid command sets, never a spec.
COMMAND = {"out", "restart", "no_figure", "figure_dir"}
#: Fields kept off the command line that a grid may still set.
GRID_ONLY = {"references"}


class SpecError(SettingError):
    """A bad grid spec; the message starts with the key (after ``FILE:LINE`` where the key's line is known) and
    says how to fix it. The settings' one error type (:class:`randattn.spec.SettingError`)."""

    def __init__(self, message: str, *, where=None, key=None, accepted=()):
        super().__init__(key or message.split(":", 1)[0], message, where=where, key=key, accepted=accepted)


@dataclass
class Spec:
    """A checked spec: one probe configuration per combination of its swept keys."""

    path: Path
    probe: str
    configs: list
    device: str = "auto"
    keys: dict = field(default_factory=dict)  # field -> the key the spec wrote for it (errors name that key)

    def key_of(self, field_name: str) -> str:
        return self.keys.get(field_name, field_name)

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(c.model or randattn.DEFAULT_MODEL for c in self.configs))


def _fields(cls) -> dict:
    """``{name: (type hint, field)}`` of the fields a spec may set."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)
            if f.name not in COMMAND and (f.metadata.get("cli", True) or f.name in GRID_ONLY)}


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


def _coerce(key: str, value, tp):
    """One TOML value as the field's element type (an int is a float where a number is wanted; a bool is no int)."""
    kind = _element(tp)
    what = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(kind, str(kind))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    simple = kind in (int, float, str, bool)
    if simple and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise SpecError(f"{key}: expected {what}, got {value!r}")
    return value


def _value_lists(key: str, value, tp) -> list:
    """The values a key sweeps over (a one-element list when it does not sweep)."""
    if _several(tp):
        lists = value if isinstance(value, list) and value and all(isinstance(v, list) for v in value) else [value]
        return [tuple(_coerce(key, v, tp) for v in (vs if isinstance(vs, list) else [vs])) for vs in lists]
    values = value if isinstance(value, list) else [value]
    if not values:
        raise SpecError(f"{key}: an empty list; give a value or a non-empty list of them")
    values = [_coerce(key, v, tp) for v in values]
    if len(set(map(repr, values))) != len(values):
        raise SpecError(f"{key}: {value!r} lists a value twice; list each once")
    return values


def _policy_options(key: str, table) -> tuple[str, ...]:
    """``[policy_options.POLICY]`` tables as ``--policy-option POLICY:KEY=VALUE`` strings."""
    if not isinstance(table, dict) or not all(isinstance(t, dict) for t in table.values()):
        raise SpecError(f"{key}: expected a table of tables, e.g. [policy_options.h2o] then key = value lines")
    return tuple(f"{pol}:{k}={v!r}" for pol, opts in table.items() for k, v in opts.items())


def _other_kinds(probe: str) -> list[str]:
    """The other kinds a grid can run (for hints)."""
    out = []
    for k in sorted(units.KINDS):
        try:
            if k != probe and units.kind(k).plan is not None:
                out.append(k)
        except (ImportError, AttributeError):  # a kind that cannot load here gives no hint
            continue
    return out


def read_spec(path: "str | Path", *, out: "str | Path | None" = None, figures: bool = False) -> Spec:
    """Parse and check a spec file into the probe's configurations (no model is loaded); ``out``: the grid's
    directory (each configuration writes under ``out/<probe>/``, figures under ``out/figures/``)."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"spec: no file {path}; give a TOML file (see examples/grid_copy.toml)")
    try:
        text = path.read_text()
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"spec: {path} is not valid TOML ({exc})") from None
    probe = raw.pop("probe", None)
    if probe is None:
        raise SpecError(f'probe: missing; add probe = "accuracy" (kinds: {", ".join(sorted(units.KINDS))})')
    try:
        kind = units.kind(probe) if isinstance(probe, str) else units.kind(repr(probe))
    except KeyError as exc:
        raise SpecError(f"probe: {exc.args[0]} (the other probes run on one machine: python -m probes.<name>)") \
            from None
    if kind.plan is None:
        raise SpecError(f"probe: {probe!r} only runs the units other probes plan; name a probe (kinds: "
                        f"{', '.join(_other_kinds(probe))})")
    fields = _fields(kind.config)
    lines = key_lines(text)
    at = lambda key: f"{path}:{lines[key]}" if key in lines else str(path)  # noqa: E731
    keys, swept, fixed = {}, [], {}
    first = [k for k in ("models", "model") if k in raw]
    raw = {**{k: raw.pop(k) for k in first}, **raw}  # models sweep first
    for key, value in raw.items():
        name = key if key in fields else PLURALS.get(key)
        if key == "policy_options" and "policy_option" in fields:
            name, value = "policy_option", list(_policy_options(key, value))
        if name == "policy" and name not in fields and "policies" in fields:
            name = "policies"
        if key in COMMAND:
            raise SpecError(f"{key}: set by the grid command (--out, --no-figure), not in a spec")
        if name not in fields and key in ALIASES:  # K, T, r: the settings reader's "did you mean budget?"
            try:
                read_settings({key: value}, where=at(key), accepted=sorted({*fields, *PLURALS}))
            except SettingError as exc:
                raise SpecError(exc.message, where=exc.where, key=key, accepted=exc.accepted) from None
        if name not in fields:
            others = [k for k in _other_kinds(probe) if {key, PLURALS.get(key)} & set(_fields(units.kind(k).config))]
            hint = ("it belongs to " + " or ".join(f'probe = "{k}"' for k in others) if others else
                    f"known keys for probe = \"{probe}\": {', '.join(sorted(fields))}")
            raise SpecError(f"{key}: not a key of a grid with probe = \"{probe}\"; {hint}", where=at(key), key=key,
                            accepted=sorted(fields))
        keys[name] = key
        tp = fields[name][0]
        both_modes = getattr(kind.config, "both_protections", None)  # a probe's own (field, value), declared there
        if both_modes and name == "protect_prompt" and isinstance(value, list):
            if sorted(set(value)) == [False, True]:
                field_, meaning = both_modes
                if field_ in raw:
                    raise SpecError(f"protect_prompt: [true, false] is {field_} = \"{meaning}\"; drop one of the keys")
                keys[field_] = key
                fixed[field_] = meaning
                continue
            value = value[0] if len(value) == 1 else value
        try:
            values = _value_lists(key, value, tp)
        except SpecError as exc:  # a wrong type or an empty list: the file and line, and the keys, too
            raise SpecError(f"{exc}; the accepted keys are {', '.join(sorted(fields))}", where=at(key), key=key,
                            accepted=sorted(fields)) from None
        if len(values) == 1:
            fixed[name] = values[0]
        else:
            swept.append((name, values))
    device = fixed.get("device", "auto")
    configs = []
    grid_dir = Path(out) if out is not None else None
    place = {} if grid_dir is None else {"out": str(grid_dir / kind.results), "figure_dir": str(grid_dir / "figures")}
    for combo in itertools.product(*(values for _, values in swept)):
        values = {**fixed, **dict(zip((n for n, _ in swept), combo)), **place, "no_figure": not figures}
        try:
            config = kind.config(**values)
            if kind.grid_folder is not None and grid_dir is not None:
                config = config.replace(out=str(Path(config.out) / kind.grid_folder(config)))
        except ConfigError as exc:
            raise SpecError(f"{keys.get(exc.field, exc.field)}: {exc.message}") from None
        configs.append(config)
    return Spec(path, probe, configs, device, keys)


# -- models -----------------------------------------------------------------------------------------
def check_model(name: str, key: str = "models") -> ModelInfo:
    """The model as a plan sees it (tokenizer, config, generation config, which embedded model it is), read on the
    driver without loading weights: it plans batches by prompt length and refuses policies that cannot serve the
    model. Anything unloadable is a :class:`SpecError` naming ``key``."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from randattn.models import converted_embedded, converted_gguf, embedded_name, local_gguf, looks_like_path

    fix = (f"give a local directory with config.json, tokenizer and weights, a local GGUF file, a hub id this machine "
           f"can reach, or '{randattn.DEFAULT_MODEL}' (the embedded model)")
    embedded = embedded_name(name)
    path = Path(name).expanduser()
    try:
        gguf = local_gguf(name) if embedded is None else None
        if gguf is not None:  # converted once, as load_model converts it; then checked as the folder it became
            path = converted_gguf(gguf)
    except (OSError, ValueError) as exc:
        raise SpecError(f"{key}: {exc}") from None  # the message already says what to give
    if embedded is None and (path.exists() or looks_like_path(name)):
        if not path.is_dir():
            raise SpecError(f"{key}: {name!r} is not a directory; {fix}")
        if not (path / "config.json").exists():
            raise SpecError(f"{key}: {name!r} has no config.json; {fix}")
        if not any(path.glob(p) for p in ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.pt")):
            raise SpecError(f"{key}: {name!r} has no weights (*.safetensors or *.bin); {fix}")
    try:
        source = converted_embedded(embedded) if embedded else (str(path) if gguf is not None else name)
        config = AutoConfig.from_pretrained(source)
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # missing, gated, offline, not a causal LM: all mean "cannot plan with this model"
        first = (str(exc).splitlines() or [""])[0][:200]
        raise SpecError(f"{key}: cannot load {name!r} here ({type(exc).__name__}: {first}); {fix}") from None
    try:
        generation = GenerationConfig.from_pretrained(source)
    except Exception:  # no generation_config.json: the model's defaults (greedy)
        generation = None
    return ModelInfo(name, tok, config, ref=randattn.ModelRef.of(name), generation_config=generation)


def plans(spec: Spec) -> list:
    """Every configuration of the spec planned on its model (read once per model, without weights); a refusal is
    a :class:`SpecError` naming the spec's key."""
    models = {m: check_model(m, spec.key_of("model") if "model" in spec.keys else "models") for m in spec.models}
    names = [Path(m).name for m in models]
    clash = next((n for n in names if names.count(n) > 1), None)
    if clash:
        raise SpecError(f"models: two models end in {clash!r}, so their result files would share a name; copy or "
                        "link one under another directory name")
    kind = units.kind(spec.probe)
    out = []
    for config in spec.configs:
        try:
            out.append(kind.plan(config, models[config.model or randattn.DEFAULT_MODEL]))
        except ConfigError as exc:
            raise SpecError(f"{spec.key_of(exc.field)}: {exc.message}") from None
        except (ValueError, TypeError, FileNotFoundError) as exc:
            raise SpecError(f"{spec.probe}: {exc}") from None
    paths = [o.path for p in out for o in p.outputs]
    twice = next((p for p in paths if paths.count(p) > 1), None)
    if twice:
        raise SpecError(f"{spec.probe}: two combinations of the spec write {twice}; a swept key the file name does "
                        "not carry cannot vary in one grid (split the spec)")
    return out
