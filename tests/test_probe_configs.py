"""Every probe configuration takes its eviction settings from one definition (``probes.config.SETTINGS`` through
``@eviction``), checks them with the core's rules, and builds its caches from an ``EvictionSpec``.

The source check is the grep of issue 28: no probe module declares ``budget``, ``buffer``, ``policy``,
``policies``, ``protect_prompt`` or ``stats`` as a field of its own.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import typing
from pathlib import Path

import pytest

import randattn
from probes.config import SETTINGS, ConfigError, EvictionConfig, eviction, parser_for

PROBES = Path(__file__).resolve().parents[1] / "probes"
MODULES = ("head_pooling", "scatter", "two_facts", "blocks", "shared_draw", "passcode", "survival",
           "prompt_protection", "accuracy", "autopsy", "challenge", "demo")


def _declared_fields(path: Path) -> list[tuple[str, str, int]]:
    """(class, field, line) of every annotated class attribute in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    out.append((node.name, stmt.target.id, stmt.lineno))
    return out


def test_no_probe_declares_an_eviction_setting_itself():
    own = [f"{path.name}:{line} {cls}.{name}" for path in sorted(PROBES.glob("*.py")) if path.name != "config.py"
           for cls, name, line in _declared_fields(path)
           if name in SETTINGS and cls.endswith("Config")]
    assert own == [], "declare eviction settings with @eviction (probes.config.SETTINGS), not as fields: " + str(own)


@pytest.mark.parametrize("module", MODULES)
def test_every_probe_config_holds_its_settings_from_the_one_definition(module):
    cls = importlib.import_module(f"probes.{module}").Config
    assert issubclass(cls, EvictionConfig)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    present = [name for name in SETTINGS if name in fields]
    assert "budget" in present and "buffer" in present
    for name in present:
        base = SETTINGS[name].type
        allowed = (base, typing.Optional[base])
        if typing.get_origin(base) is not tuple:  # a setting of several values (policies) is never wrapped again
            allowed += (tuple[base, ...], typing.Optional[tuple[base, ...]])
        assert hints[name] in allowed, (name, hints[name])
        assert fields[name].metadata["check"] is SETTINGS[name].check  # the one range check
    config = cls(**({"policy": "snapkv"} if module == "challenge" else {}))
    sizes = {"budget": 224, "buffer": 8} if module == "accuracy" else {}  # the task's, resolved at the run
    for name in config.policy_names():
        spec = config.spec(name, protect_prompt=config.protection_of(name), stats=None, **sizes)
        assert isinstance(spec, randattn.EvictionSpec) and spec.policy == name
        assert (spec.budget, spec.buffer) == ((224, 8) if sizes else (config.budget, config.buffer))
        assert spec.seed == config.seed


def test_the_decorator_refuses_a_setting_declared_twice_or_unknown():
    with pytest.raises(TypeError, match="not an eviction setting"):
        eviction(window=3)
    with pytest.raises(TypeError, match="declares budget itself"):
        @dataclasses.dataclass
        @eviction(budget=128)
        class Twice(EvictionConfig):
            budget: int = 3


def test_a_probe_default_reaches_construction_and_the_command_line():
    demo = importlib.import_module("probes.demo").Config
    assert (demo().budget, demo().buffer, demo().protect_prompt) == (128, 32, True)
    flags = parser_for(demo, "demo").format_help()
    assert "--no-protect-prompt" in flags and "--budget BUDGET" in flags and "(default: 128)" in flags
    planted = importlib.import_module("probes.head_pooling").Config
    assert planted().protect_prompt is False and "--protect-prompt" in parser_for(planted, "hp").format_help()
    assert importlib.import_module("probes.passcode").Config().protect_prompt is True  # a subclass's own default


@pytest.mark.parametrize("make, field, words", [
    (lambda m: m.head_pooling.Config(budget=16, buffer=16), "budget", "T=16 must exceed the recent window r=16"),
    (lambda m: m.head_pooling.Config(policy="nope"), "policy", "'nope' is unknown"),
    (lambda m: m.head_pooling.Config(policy="attn_pp"), "protect_prompt", "runs with the prompt protected"),
    (lambda m: m.passcode.Config(policies=("random", "full")), "policies", "'full' is unknown"),
    (lambda m: m.challenge.Config(policy="snapkv", baselines=("nope",)), "baselines", "'nope' is unknown"),
    (lambda m: m.autopsy.Config(policy=("attn",), protection="protected"), "protection", "attn"),
    (lambda m: m.survival.Config(policies=("random",), stats="smollm2-135m"), "stats", "no policy of this run"),
    (lambda m: m.demo.Config(seed=2**64), "seed", "must be an integer in [0, 2**64)"),
])
def test_a_refused_setting_names_its_field(make, field, words):
    import probes.autopsy, probes.challenge, probes.demo, probes.head_pooling, probes.passcode, probes.survival  # noqa

    class M:
        autopsy, challenge, demo = probes.autopsy, probes.challenge, probes.demo
        head_pooling, passcode, survival = probes.head_pooling, probes.passcode, probes.survival

    with pytest.raises(ConfigError) as info:
        make(M)
    assert info.value.field == field and words in info.value.message, (info.value.field, info.value.message)


def test_fits_is_the_core_rule_with_the_probes_flags():
    config = importlib.import_module("probes.demo").Config(budget=40, buffer=8)
    spec = config.spec()
    config.fits(spec, 31)  # 31 + 1 + 8 = 40
    with pytest.raises(ConfigError) as info:
        config.fits(spec, 32)
    assert info.value.field == "budget"
    assert info.value.message == ("T=40 cannot hold the protected prompt of 32 tokens plus one free slot beside the "
                                  "recent window of 8; use --budget >= 41 or --no-protect-prompt")
    assert spec.validate(32).need == 41
    config.fits(config.spec(protect_prompt=False), 10_000)  # an unprotected prompt competes: it always fits


def test_a_probe_comparing_policies_builds_the_spec_of_the_one_it_runs():
    passcode = importlib.import_module("probes.passcode")
    config = passcode.Config(policies=("snapkv", "random"))
    assert config.policy_names() == ("snapkv", "random")
    assert config.replace(policy="random").spec().policy == "random"  # not the first of the list
    assert config.replace(policy="snapkv").spec().policy == "snapkv"


def test_one_layered_parser_defaults_then_file_then_flags(tmp_path, capsys):
    from probes.config import parse

    passcode = importlib.import_module("probes.passcode").Config
    toml = tmp_path / "run.toml"
    toml.write_text('budget = 128\nbuffer = 8\npolicies = ["random", "snapkv"]\nprotect-prompt = false\nrounds = 6\n')
    config = parse(passcode, ["--config", str(toml), "--budget", "192"])
    assert (config.budget, config.buffer, config.policies, config.protect_prompt, config.rounds) == \
        (192, 8, ("random", "snapkv"), False, 6)  # the flag wins over the file, the file over the defaults
    assert parse(passcode, []).budget == 256 and parse(passcode, ["--config", str(toml)]).budget == 128
    with pytest.raises(SystemExit):
        parse(passcode, ["--config", str(toml), "--buffer", "128"])
    assert "--budget: T=128 must exceed the recent window r=128" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("budget = 128\nwindow = 3\n")
    with pytest.raises(SystemExit):
        parse(passcode, ["--config", str(bad)])
    assert "--config: " in (err := capsys.readouterr().err) and "sets window, which this command does not take" in err
    with pytest.raises(SystemExit):
        parse(passcode, ["--config", str(tmp_path / "none.toml")])
    assert "does not exist" in capsys.readouterr().err
