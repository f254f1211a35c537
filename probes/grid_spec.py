"""Grid specs: a TOML file naming a probe or accuracy grid, read and checked before any work starts.

One key per dimension; a scalar or a list wherever a list is shown (every combination is run)::

    probe = "accuracy"                    # or "passcode"
    models = ["Qwen/Qwen3-4B"]            # hub ids, local directories, or "smollm2-135m" (the default)
    policies = ["full", "random", "snapkv", "my_selector:score"]   # names or MODULE:CALLABLE
    budgets = [1024]                      # K
    buffers = [64]                        # r
    protect_prompt = [true, false]        # protected prompt and/or score only
    seeds = [0]
    batch = 16                            # items generated together (same arm and prompt length)
    device = "auto"
    stats = "qwen3-4b-stats.pt"           # TriAttention statistics (python -m randattn.calibrate)
    [policy_options.h2o]                  # options passed to a policy's constructor
    recent_fraction = 0.25

    # accuracy only
    task = "math500"                      # see probes/tasks.py
    data = "math500.jsonl"                # instead of the HF dataset (read by the driver only)
    runs = 4
    problems = 500
    max_new_tokens = 32768
    temperature = 0.0
    top_p = 1.0

    # passcode only
    rounds = [57]
    instances = 16
    box_width = 20
    traces = "data/traces/smollm2-135m.jsonl"
    references = true                     # full attention and the passcode pinned everywhere, in Random's file

Defaults are the probes' own (``python -m probes.accuracy`` / ``python -m probes.passcode``). Paths
are relative to the working directory, as on a command line. A wrong key, type, value, policy, task
or model is a :class:`SpecError` naming the key and the fix.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import randattn

from .accuracy import FULL
from .config import ConfigError
from .policy_specs import bind_policies, check_policy

PROBES = ("accuracy", "passcode")
COMMON = {"probe", "models", "policies", "budgets", "buffers", "protect_prompt", "seeds", "batch", "device", "stats",
          "policy_options"}
ONLY = {"accuracy": {"task", "data", "runs", "problems", "max_new_tokens", "temperature", "top_p"},
        "passcode": {"rounds", "instances", "box_width", "traces", "references"}}


class SpecError(ValueError):
    """A bad grid spec; the message starts with the key and says how to fix it."""


@dataclass
class Spec:
    """A checked spec. ``None`` means the probe's or the task's default."""

    path: Path
    probe: str
    models: list[str]
    policies: list[str]
    budgets: Optional[list[int]]
    buffers: Optional[list[int]]
    protect_prompt: list[bool]
    seeds: list[int]
    batch: int
    device: str = "auto"
    stats: Optional[str] = None
    policy_options: dict = field(default_factory=dict)
    task: str = "copy"
    data: Optional[str] = None
    runs: int = 3
    problems: Optional[int] = None
    max_new_tokens: Optional[int] = None
    temperature: float = 0.0
    top_p: float = 1.0
    rounds: list[int] = field(default_factory=lambda: [57])
    instances: int = 16
    box_width: int = 20
    traces: Optional[str] = None
    references: bool = True


@dataclass
class Unit:
    """Items one worker runs together, as one batch of a single-machine run (same model, arm, prompt length): the
    batch is fixed by the spec, not by scheduling, so every backend computes the same rows."""

    kind: str
    model: str
    output: str  # the merged result file its rows go to, relative to the grid's directory
    items: list[str]  # item ids, in row order
    keys: list[dict]  # per item: what it is (model, policy, K, ..., problem and run, or instance)
    work: dict  # everything the worker needs besides the model weights
    id: str = ""

    def __post_init__(self):
        self.id = self.id or stable_id(self.items)


def stable_id(*parts: Any) -> str:
    """A short hash of JSON-able parts (dict keys sorted), the same on every machine and run."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


# -- reading ----------------------------------------------------------------------------------------
def _list(raw: dict, key: str, kind, what: str, default=None, check=lambda v: True) -> Optional[list]:
    """``raw[key]`` as a list of ``kind`` (a scalar is a one-element list) passing ``check``, without repeats."""
    if key not in raw:
        return default
    value = raw[key]
    values = value if isinstance(value, list) else [value]
    # bool is an int subclass in Python; TOML's true must not pass as K = 1
    ok = values and all(isinstance(v, kind) and not (kind is not bool and isinstance(v, bool)) and check(v)
                        for v in values)
    if not ok:
        raise SpecError(f"{key}: expected {what} or a non-empty list of them, got {value!r}")
    if len(set(map(repr, values))) != len(values):
        raise SpecError(f"{key}: {value!r} lists a value twice; list each once")
    return values


def _one(raw: dict, key: str, kind, what: str, default, check=lambda v: True):
    if key not in raw:
        return default
    value = raw[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)) or not check(value):
        raise SpecError(f"{key}: expected {what}, got {value!r}")
    return float(value) if float in kinds else value


def _positive(v) -> bool:
    return v > 0


def read_spec(path: "str | Path") -> Spec:
    """Parse and check a spec file's keys, types and values (no model is loaded)."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"spec: no file {path}; give a TOML file (see examples/grid_copy.toml)")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"spec: {path} is not valid TOML ({exc})") from None
    probe = raw.get("probe")
    if probe is None:
        raise SpecError('probe: missing; add probe = "accuracy" or probe = "passcode"')
    if probe not in PROBES:
        raise SpecError(f"probe: {probe!r} is not a grid probe; choose from {', '.join(PROBES)} (the other probes run "
                        "on one machine: python -m probes.<name>)")
    allowed = COMMON | ONLY[probe]
    for key in raw:
        if key not in allowed:
            other = next((p for p, keys in ONLY.items() if key in keys), None)
            hint = (f"it belongs to probe = \"{other}\"" if other else
                    f"known keys for probe = \"{probe}\": {', '.join(sorted(allowed))}")
            raise SpecError(f"{key}: not a key of a grid with probe = \"{probe}\"; {hint}")
    int_pos = "a positive integer"
    spec = Spec(
        path=path, probe=probe,
        models=_list(raw, "models", str, "a model (hub id, directory or 'smollm2-135m')", [randattn.DEFAULT_MODEL]),
        policies=_list(raw, "policies", str, "a policy name or MODULE:CALLABLE",
                       [FULL, *randattn.COMPARED_POLICIES] if probe == "accuracy" else list(randattn.COMPARED_POLICIES)),
        budgets=_list(raw, "budgets", int, int_pos, None, _positive),
        buffers=_list(raw, "buffers", int, int_pos, None, _positive),
        protect_prompt=_list(raw, "protect_prompt", bool, "true or false", [True]),
        seeds=_list(raw, "seeds", int, "an integer", [0]),
        batch=_one(raw, "batch", int, int_pos, 32 if probe == "accuracy" else 8, _positive),
        device=_one(raw, "device", str, "'auto', 'cpu' or 'cuda'", "auto"),
        stats=_one(raw, "stats", str, "a TriAttention statistics file", None),
        policy_options=_one(raw, "policy_options", dict, "a table of tables, e.g. [policy_options.h2o]", {}),
    )
    if probe == "accuracy":
        spec.task = _one(raw, "task", str, "a task name", "copy")
        spec.data = _one(raw, "data", str, "a JSONL file path", None)
        spec.runs = _one(raw, "runs", int, int_pos, 3, _positive)
        spec.problems = _one(raw, "problems", int, int_pos, None, _positive)
        spec.max_new_tokens = _one(raw, "max_new_tokens", int, int_pos, None, _positive)
        spec.temperature = _one(raw, "temperature", (int, float), "a number >= 0 (0 = greedy)", 0.0, lambda v: v >= 0)
        spec.top_p = _one(raw, "top_p", (int, float), "a number in (0, 1]", 1.0, lambda v: 0 < v <= 1)
        if spec.top_p != 1.0 and spec.temperature == 0:
            raise SpecError("top_p: applies only when sampling; with temperature = 0 (greedy) it is ignored: set "
                            "temperature > 0 too, or drop top_p")
    else:
        spec.rounds = _list(raw, "rounds", int, int_pos, [57], _positive)
        spec.instances = _one(raw, "instances", int, int_pos, 16, _positive)
        spec.box_width = _one(raw, "box_width", int, int_pos, 20, _positive)
        spec.traces = _one(raw, "traces", str, "a traces JSONL path", None)
        spec.references = _one(raw, "references", bool, "true or false", True)
    _check_policies(spec)
    return spec


def _check_policies(spec: Spec) -> None:
    extra = (FULL,) if spec.probe == "accuracy" else ()
    try:
        for pol in spec.policies:
            check_policy("policies", pol, extra=extra)
    except ConfigError as exc:
        raise SpecError(f"policies: {exc.message}") from None
    if spec.probe == "passcode" and FULL in spec.policies:
        raise SpecError("policies: 'full' is not a passcode policy; full attention is one of the references "
                        "(references = true puts it in Random's file)")
    for pol, opts in spec.policy_options.items():
        if not isinstance(opts, dict):
            raise SpecError(f"policy_options.{pol}: expected a table of options, e.g. [policy_options.{pol}] then "
                            "key = value lines")
        try:
            randattn.make_policy(pol, **opts)
        except (ValueError, TypeError, FileNotFoundError) as exc:
            raise SpecError(f"policy_options.{pol}: {exc}") from None


# -- models -----------------------------------------------------------------------------------------
def embedded_name(name: str) -> Optional[str]:
    """The embedded model's canonical name when ``name`` is one of its aliases, else None."""
    from randattn.models import _EMBEDDED, _EMBEDDED_ALIASES

    key = _EMBEDDED_ALIASES.get(name.lower(), name.lower())
    return key if key in _EMBEDDED else None


def check_model(name: str, key: str = "models"):
    """Tokenizer, ``(KV heads, layers)`` and a weightless stand-in (its config, which embedded model it is) that
    policies can :meth:`~randattn.Policy.bind` to, read on the driver without loading weights (it plans batches by
    prompt length and refuses policies that cannot serve the model); anything unloadable is a :class:`SpecError`
    naming ``key``."""
    from transformers import AutoConfig, AutoTokenizer

    from randattn.models import _converted_embedded, _looks_like_path

    from .planted import model_shape

    fix = (f"give a local directory with config.json, tokenizer and weights, a hub id this machine can reach, or "
           f"'{randattn.DEFAULT_MODEL}' (the embedded model)")
    embedded = embedded_name(name)
    path = Path(name).expanduser()
    if embedded is None and (path.exists() or _looks_like_path(name)):
        if not path.is_dir():
            raise SpecError(f"{key}: {name!r} is not a directory; {fix}")
        if not (path / "config.json").exists():
            raise SpecError(f"{key}: {name!r} has no config.json; {fix}")
        if not any(path.glob(p) for p in ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.pt")):
            raise SpecError(f"{key}: {name!r} has no weights (*.safetensors or *.bin); {fix}")
    try:
        source = _converted_embedded(embedded) if embedded else name
        config = AutoConfig.from_pretrained(source)
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # missing, gated, offline, not a causal LM: all mean "cannot plan with this model"
        first = (str(exc).splitlines() or [""])[0][:200]
        raise SpecError(f"{key}: cannot load {name!r} here ({type(exc).__name__}: {first}); {fix}") from None
    stand_in = SimpleNamespace(config=config, _randattn_embedded=embedded)
    return tok, model_shape(stand_in), stand_in


def bind_check(spec: "Spec", model: str, stand_in, options: dict) -> None:
    """Every policy of the spec, with its options, binds to the model (e.g. TriAttention has statistics for it)."""
    try:
        bind_policies("policies", [p for p in spec.policies if p != FULL], stand_in, lambda pol: options.get(pol, {}))
    except ConfigError as exc:
        raise SpecError(f"policies (for {model}): {exc.message} (in a spec: stats = \"stats.pt\")") from None
