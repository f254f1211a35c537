"""One reader of eviction settings (issue 35 item 2): EvictionSpec.from_mapping / randattn.spec.read_settings, used by
the probe flags and --config TOML, the grid TOML, lm-eval model_args and vLLM additional_config. Each bad input (another
spelling of a key, a key the source does not take, a value of the wrong type) is one SettingError naming the source
and the key and listing the accepted keys; nothing runs."""

from __future__ import annotations

import pytest

import randattn
from randattn.spec import ALIASES, SPEC_KEYS, EvictionSpec, SettingError, read_settings, spec_default
from randattn.vllm import config as vcfg

VLLM = "additional_config['randattn']"


# -- the reader itself -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_another_spelling_of_a_key_is_refused_naming_the_key(alias):
    with pytest.raises(SettingError) as err:
        EvictionSpec.from_mapping({alias: 64}, where="somewhere")
    e = err.value
    assert str(e).startswith(f"somewhere: {alias}: not a key here; did you mean {ALIASES[alias]}?")
    assert e.where == "somewhere" and e.key == alias and e.field == ALIASES[alias] and e.accepted == SPEC_KEYS
    assert "the accepted keys are " + ", ".join(SPEC_KEYS) in str(e)


def test_unknown_key_wrong_type_and_spec_refusal_name_the_source():
    with pytest.raises(SettingError, match=r"^src: unknown keys \['bufer'\]: .*bufer: did you mean buffer\?"):
        EvictionSpec.from_mapping({"budget": 64, "bufer": 8}, where="src")
    with pytest.raises(SettingError, match=r"^src: budget: must be an integer, got '64' \(str\)"):
        EvictionSpec.from_mapping({"budget": "64"}, where="src")
    with pytest.raises(SettingError, match=r"^src: protect_prompt: must be true or false, got 'yes'"):
        EvictionSpec.from_mapping({"budget": 64, "protect_prompt": "yes"}, where="src")
    with pytest.raises(SettingError, match="^src: budget T=8 must exceed the recent window") as err:
        EvictionSpec.from_mapping({"budget": 8, "buffer": 8}, where="src")
    assert err.value.field == "budget"
    with pytest.raises(SettingError, match=r"^src:3: budget: must be an integer"):  # a file's line
        read_settings({"budget": 1.5}, where="src", lines={"budget": 3})


def test_from_mapping_equals_the_constructor_and_reads_the_spec_defaults():
    a = EvictionSpec.from_mapping({"policy": "snapkv", "budget": 64, "buffer": 8, "seed": 3}, where="x")
    assert a == EvictionSpec("snapkv", 64, 8, seed=3)
    b = EvictionSpec.from_mapping({"budget": 128, "recent": None, "options": None}, where="x")
    assert b == EvictionSpec(budget=128) and b.buffer == spec_default("buffer") == 64 and b.policy == "random"
    assert EvictionSpec.from_mapping({"budget": 64}, where="x", defaults={"buffer": 16}).buffer == 16


def test_a_setting_error_is_a_spec_error_and_a_value_error():
    assert issubclass(SettingError, randattn.spec.SpecError) and issubclass(SettingError, ValueError)


# -- each source -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("section,message", [
    ({"K": 64}, f"{VLLM}: K: not a key here; did you mean budget?"),
    ({"budget": 64, "r": 8}, f"{VLLM}: r: not a key here; did you mean buffer?"),
    ({"budget": 64, "window": 8}, f"{VLLM}: unknown keys ['window']: it sets window, which the plugin does not take"),
    ({"budget": "64"}, f"{VLLM}: budget: must be an integer, got '64' (str)"),
    ({"budget": 64, "stats": "x.pt"}, f"{VLLM}: unknown keys ['stats']"),  # the plugin takes no statistics
])
def test_vllm_additional_config(section, message):
    with pytest.raises(SettingError) as err:
        vcfg.parse_config(section)
    assert str(err.value).startswith(message) and "keep_log_dir" in str(err.value)  # the accepted keys


def test_lm_eval_model_args():
    pytest.importorskip("lm_eval")
    from probes.lm_eval_backend import ACCEPTED_ARGS, RandAttnLM

    with pytest.raises(SettingError) as err:
        RandAttnLM.create_from_arg_string("pretrained=/no/such/dir,K=512")
    assert str(err.value).startswith("--model_args: K: not a key here; did you mean budget?")
    assert ", ".join(ACCEPTED_ARGS) in str(err.value)
    with pytest.raises(TypeError) as err:  # still lm-eval's TypeError for a key no model takes
        RandAttnLM.create_from_arg_string("pretrained=/no/such/dir,window=3")
    assert isinstance(err.value, SettingError) and "--model_args window: not a randattn model argument" in str(err.value)
    with pytest.raises(SettingError, match=r"--model_args budget='12x': not an integer >= 1.*the accepted keys are "
                                           r"pretrained, policy"):
        RandAttnLM.create_from_arg_string("pretrained=/no/such/dir,budget=12x")


def _spec_file(tmp_path, text):
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("line,message", [
    ("K = [64]", ":2: K: not a key here; did you mean budget?"),
    ("r = 8", ":2: r: not a key here; did you mean buffer?"),
    ("window = 3", ':2: window: not a key of a grid with probe = "accuracy"'),
    ('budgets = ["64"]', ":2: budgets: expected an integer, got '64'"),
])
def test_grid_toml_names_the_file_and_line(tmp_path, line, message):
    from probes.grid_spec import SpecError, read_spec

    path = _spec_file(tmp_path, f'probe = "accuracy"\n{line}\n')
    with pytest.raises(SpecError) as err:
        read_spec(path)
    assert str(err.value).startswith(f"{path}{message}") and isinstance(err.value, SettingError)


@pytest.mark.parametrize("text,message", [
    ("budget = 64\nK = 3\n", "a.toml:2: K: not a key here; did you mean budget?"),
    ("bufer = 3\n", "a.toml:1: unknown keys ['bufer']: it sets bufer, which this command does not take; bufer: "
                    "did you mean buffer?"),
    ('budget = "12x"\n', "a.toml:1: --budget: expected an integer, got '12x'"),  # a string: read as the flag's text
    ("buffer = true\n", "a.toml:1: --buffer: must be an integer, got True (bool)"),
    ("buffer = [8, 16]\n", "a.toml:1: --buffer: takes one value, got the list [8, 16]"),
    ('policies = ["random", 3]\n', "a.toml:1: --policies: must be a string, got 3 (int)"),
])
def test_probe_config_file(tmp_path, monkeypatch, capsys, text, message):
    from probes import passcode

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.toml").write_text(text)
    with pytest.raises(SystemExit):
        passcode.main(["--config", "a.toml", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert f"--config: {message}" in err and "the accepted keys are " in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,message", [
    (["--K", "128"], "the command line: --K: not a key here; did you mean --budget?"),
    (["-T=128"], "the command line: -T: not a key here; did you mean --budget?"),
    (["-r", "8"], "the command line: -r: not a key here; did you mean --buffer?"),
])
def test_probe_flags(tmp_path, capsys, argv, message):
    from probes import passcode

    with pytest.raises(SystemExit):
        passcode.main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert message in err and "--budget, --buffer" in err
    assert not (tmp_path / "out").exists()


def test_probe_seed_check_is_the_cores():
    from probes.config import SEED
    from randattn.seeding import _check_seed

    for bad in (-1, 2**64, 1.5, True, "3"):
        with pytest.raises(ValueError) as err:
            _check_seed(bad)
        assert "seed " + SEED(bad) == str(err.value)
    assert SEED(0) is None and SEED(2**64 - 1) is None


# -- the protection of each policy: one table, the policy's own attribute ---------------------------------------
#: probes/accuracy.py's GRID_PROTECTION as it shipped (removed): the grid protocol's rows must not change.
SHIPPED_GRID_PROTECTION = {
    "random": True, "random-shared": True, "random-block": True, "recency": True, "triattention": True,
    "random-ppp": True, "snapkv": False, "snapkv-longbench": False, "rkv": False, "rkv-official": False,
    "vase": False, "h2o": False, "streamingllm": False, "random-pcap": False, "random-pmix": False}


def test_grid_protection_is_each_policys_own_attribute_and_unchanged():
    from probes.accuracy import protocol_arms
    from probes.policy_specs import grid_protection

    assert set(SHIPPED_GRID_PROTECTION) == set(randattn.known_policies())
    for name, protect in SHIPPED_GRID_PROTECTION.items():
        assert grid_protection(name) is protect, name
        assert [a.protect for a in protocol_arms("grid", [name], [256])] == [protect], name
    for mode, (_, _, protect) in randattn.PAPER_MODES.items():  # an alias names its own
        assert grid_protection(mode) is protect


def test_grid_protocol_refuses_a_policy_without_a_paper_mode(tmp_path, monkeypatch):
    from probes import accuracy
    from probes.config import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sel.py").write_text("import torch\ndef score(view):\n    return torch.zeros(view.shape)\n")
    with pytest.raises(ConfigError, match="--protocol: --protocol grid runs each policy in the paper grid's mode, and "
                                          "'sel.py:score' declares none"):
        accuracy.Config(policy=("full", "random", "sel.py:score"), protocol="grid", task="copy")
    with pytest.raises(ConfigError, match="declares none"):  # never defaulted at the arms either
        accuracy.protocol_arms("grid", ["sel.py:score"], [256])
    assert accuracy.Config(policy=("random", "sel.py:score"), protocol="protected", task="copy")  # other protocols run
