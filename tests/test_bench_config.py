"""The benchmarks' command lines read into typed configs by the probes' one layered parser (issue 28, item 1):
defaults, then ``--config FILE.toml``, then the flags; every flag and default the docs name still works, and a bad
value, from a flag or from the file, is a usage error naming the flag. Parsing only: no model is loaded."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATION = ("decode", "batch_scaling", "equal_memory", "memory", "replay_speed", "kvpress_peer")
ALL = (*GENERATION, "pack", "round_cost", "grid_overhead")


def _parse(name, argv):
    from bench.common import parse

    mod = importlib.import_module(f"bench.{name}")
    return parse(mod.Config, argv, mod.__doc__.splitlines()[0])[1]


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default --out under data/results/bench/ is then a new file


def test_the_defaults_are_the_old_flags_defaults():
    from bench import kvpress_peer, replay_speed
    from bench._kvpress_env import DEFAULT_VENV

    common = dict(model=None, device="auto", seed=0, out=None, threads=None, budget=1024, buffer=64, new_tokens=4096)
    expected = {
        "decode": dict(common, batches=(1, 8), policies=("random",), repeats=1, no_full=False, no_window=False,
                       stats=None),
        "batch_scaling": dict(common, batches=(1, 2, 4, 8, 16, 32, 64),
                              policies=("random", "snapkv", "rkv", "triattention"), no_full=False, stats=None),
        "equal_memory": dict(common, base_batch=8, kv_memory=None, policies=("random",), stats=None),
        "memory": dict(common, new_tokens=8000, batch=1, policies=("random",), stats=None, arm=None),
        "replay_speed": dict(common, batch=1, policies=("random",), traces=str(replay_speed.DEFAULT_TRACES),
                             stats=None),
        "kvpress_peer": dict(common, batches=(1, 8), repeats=1, policies=kvpress_peer.POLICIES, no_full=False,
                             peer_python=None, venv=str(DEFAULT_VENV), skip_peer=False,
                             check_tokens=1024 + 8 * 64, snapkv_window=32, snapkv_kernel=5),
        "pack": dict(model=None, problems=16, batch=8, policies=("full", "random"), budget=128, buffer=16,
                     max_new_tokens=128, threads=None, out="data/results/bench/pack.json"),
        "round_cost": dict(policies=None, repeats=30, warmup=3, prompt=64, threads=None, seed=0,
                           out="data/results/bench/round_cost.json"),
        "grid_overhead": dict(spec=str(ROOT / "examples" / "grid_copy.toml"), arms=("local", "local1", "ray"),
                              out="data/results/bench/grid_overhead.json"),
    }
    assert set(expected) == set(ALL)
    for name, values in expected.items():
        config = _parse(name, [])
        assert {k: getattr(config, k) for k in values} == values, name


@pytest.mark.parametrize("name", GENERATION + ("pack",))
def test_a_config_file_is_layered_under_the_flags(name, tmp_path):
    path = tmp_path / "bench.toml"
    path.write_text('budget = 96\nbuffer = 8\npolicies = ["random"]\n'
                    + ("max_new_tokens = 40\n" if name == "pack" else "new_tokens = 40\n"))
    config = _parse(name, ["--config", str(path), "--budget", "80"])
    assert (config.budget, config.buffer, config.policies) == (80, 8, ("random",))  # the flag wins; the file fills in
    assert (config.max_new_tokens if name == "pack" else config.new_tokens) == 40
    # a key spelt as the flag is (dashes) is the same setting
    path.write_text("new-tokens = 48\n" if name != "pack" else "max-new-tokens = 48\n")
    config = _parse(name, ["--config", str(path)])
    assert (config.max_new_tokens if name == "pack" else config.new_tokens) == 48 and config.budget in (1024, 128)


def test_the_other_benchmarks_take_a_config_file_too(tmp_path):
    path = tmp_path / "bench.toml"
    path.write_text("repeats = 5\nwarmup = 2\npolicies = [\"random\", \"snapkv\"]\n")
    config = _parse("round_cost", ["--config", str(path), "--warmup", "1"])
    assert (config.repeats, config.warmup, config.policies) == (5, 1, ("random", "snapkv"))
    path.write_text('arms = ["local"]\n')
    assert _parse("grid_overhead", ["--config", str(path)]).arms == ("local",)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("toml, flags, message", [
    ("", ["--threads", "-2"], "--threads: must be a positive integer, got -2"),
    ("threads = 0\n", [], "--threads: must be a positive integer, got 0"),
    ("threads = 'two'\n", [], "--threads: expected an integer, got 'two'"),  # a string: read as the flag's text
    ("nope = 1\n", [], "sets nope, which this command does not take"),
    ("threads = [\n", [], "--config: cannot read"),
])
def test_a_bad_value_from_a_flag_or_the_file_names_the_flag(name, toml, flags, message, tmp_path, capsys):
    if name == "grid_overhead" and "threads" in toml + " ".join(flags):
        toml, flags, message = toml.replace("threads", "arms"), [a.replace("threads", "arms") for a in flags], None
    argv = list(flags)
    if toml:
        path = tmp_path / "bench.toml"
        path.write_text(toml)
        argv = ["--config", str(path), *argv]
    with pytest.raises(SystemExit) as exc:
        _parse(name, argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    if message is not None:
        assert message in err, err


@pytest.mark.parametrize("name, toml, message", [
    ("decode", "budget = 0\n", "--budget: must be a positive integer, got 0"),
    ("decode", "batches = [1, 0]\n", "--batches: must be a positive integer, got 0"),
    ("batch_scaling", "policies = ['nope']\n", "--policies: 'nope' is unknown"),
    ("equal_memory", "budget = 8\nbuffer = 8\n", "--budget: T=8 must exceed the recent window r=8"),
    ("memory", "stats = 'x.pt'\n", "--stats: no policy of this run reads calibration statistics"),
    ("replay_speed", "new_tokens = 1.5\n", "--new-tokens: must be an integer, got 1.5"),
    ("kvpress_peer", "policies = ['h2o']\n", "--policies: must be one of random, streamingllm, snapkv, got 'h2o'"),
    ("kvpress_peer", "snapkv_window = 8\nbuffer = 8\n", "--snapkv-window: 8 must be below --buffer 8"),
    ("kvpress_peer", "skip_peer = true\npeer_python = 'x'\n", "--peer-python: contradicts --skip-peer"),
    ("pack", "problems = 0\n", "--problems: must be a positive integer, got 0"),
    ("round_cost", "prompt = -1\n", "--prompt: must be a positive integer, got -1"),
    ("grid_overhead", "spec = 'none.toml'\n", "--spec: none.toml is not a file"),
    ("grid_overhead", "arms = ['slurm']\n", "--arms: must be one of local, local1, ray, got 'slurm'"),
])
def test_each_benchmarks_own_checks_hold_for_the_file(name, toml, message, tmp_path, capsys):
    path = tmp_path / "bench.toml"
    path.write_text(toml)
    with pytest.raises(SystemExit) as exc:
        _parse(name, ["--config", str(path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def _documented_commands():
    """Every ``python -m bench.NAME FLAGS`` the docs, the README and the benchmarks' own docstrings print (the vLLM
    benchmarks, in their own environment, and the rows-identity driver left out)."""
    found = set()
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *(ROOT / "bench" / f"{n}.py" for n in ALL)]
    for doc in docs:
        for name, flags in re.findall(r"python -m bench\.(\w+)((?: +[\w./=:-]+)*)", doc.read_text()):
            if name in ALL:
                found.add((name, flags.strip()))
    return sorted(found)


def test_every_documented_command_line_still_parses(monkeypatch, tmp_path):
    commands = _documented_commands()
    assert len(commands) >= 20 and {n for n, _ in commands} == set(ALL)
    # the docs' --out paths are the shipped result files (ours: they may be rewritten), relative to the checkout
    (tmp_path / "data").symlink_to(ROOT / "data")
    (tmp_path / "my_grid.toml").write_text("")  # the user's own spec in bench.grid_overhead's docstring
    (tmp_path / "mine.toml").write_text("budget = 256\n")  # the --config example of docs/benchmarks.md
    monkeypatch.chdir(tmp_path)
    for name, flags in commands:
        config = _parse(name, flags.split())
        if "--budget" in flags:
            assert str(config.budget) == flags.split()[flags.split().index("--budget") + 1]


def test_the_memory_children_get_one_policy_and_only_the_statistics_it_reads(tmp_path):
    from bench import memory

    args = _parse("memory", ["--policies", "random", "triattention", "--stats", "x.pt", "--batch", "2"])
    argvs = {arm: memory.child_args(args, arm)[3:] for arm in ("full", "random", "triattention")}
    assert "--policies" not in argvs["full"] and "--stats" not in argvs["full"] + argvs["random"]
    assert argvs["triattention"][-2:] == ["--stats", "x.pt"]
    for arm, argv in argvs.items():
        child = _parse("memory", argv)
        assert child.arm == arm and child.batch == 2 and child.budget == args.budget
        assert child.policies == (("random",) if arm == "full" else (arm,))


@pytest.mark.parametrize("name", ALL)
def test_help_names_the_config_file(name, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(name, ["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "--config FILE" in out
    assert "--restart" not in out and "--figure-dir" not in out and "--arm " not in out


def test_a_benchmark_runs_from_a_config_file(tiny_dir, tmp_path):
    import json

    from bench import decode

    path = tmp_path / "decode.toml"
    path.write_text(f'model = "{tiny_dir}"\nnew_tokens = 40\nbudget = 96\nbuffer = 8\nbatches = [2]\nno_full = true\n'
                    'no_window = true\n')
    out = tmp_path / "decode.json"
    assert decode.main(["--config", str(path), "--budget", "80", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["meta"]["budget"], data["meta"]["buffer"], data["meta"]["new_tokens"]) == (80, 8, 40)
    assert [(r["policy"], r["batch"], r["budget"]) for r in data["rows"]] == [("random", 2, 80)]


@pytest.fixture()
def model_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # what bench.vllm checks for: an HF model folder
    return str(folder)


def test_the_vllm_benchmark_reads_the_same_layers(model_folder, tmp_path):
    """bench.vllm (run in the plugin's environment) parses into a Config of the same parser: the old flags'
    defaults, a TOML file under the flags."""
    defaults = _parse("vllm", ["--model", model_folder])
    assert {k: getattr(defaults, k) for k in ("requests", "new_tokens", "budget", "buffer", "block_size", "blocks",
                                              "hf_batches", "arms", "dtype", "threads", "memory_utilization", "out")} \
        == dict(requests=16, new_tokens=1024, budget=256, buffer=32, block_size=32, blocks=None, hf_batches=(1, 4, 16),
                arms=("vllm full", "vllm random", "vllm triattention", "vllm rkv", "vllm h2o", "hf random"),  # issue 39
                dtype="float32", threads=2, memory_utilization=0.3,
                out="data/results/bench/vllm.json")
    path = tmp_path / "vllm.toml"
    path.write_text(f'model = "{model_folder}"\nrequests = 4\nhf_batches = [2]\nblocks = 40\narms = ["vllm random"]\n')
    config = _parse("vllm", ["--config", str(path), "--blocks", "48"])
    assert (config.requests, config.hf_batches, config.blocks, config.arms) == (4, (2,), 48, ("vllm random",))
    shipped = ("--requests 16 --new-tokens 1024 --budget 256 --buffer 32 --block-size 32 --blocks 140 --hf-batches 1 "
               "4 16 --threads 2").split()  # the shipped table's command (docs/benchmarks.md)
    assert _parse("vllm", [*shipped, "--model", model_folder]).blocks == 140


@pytest.mark.parametrize("flags, message", [
    (["--block-size", "40"], "--block-size: 40: vLLM's CPU attention takes multiples of 32"),
    (["--block-size", "0"], "--block-size: must be a positive integer, got 0"),
    (["--requests", "2", "--hf-batches", "1", "4"], "--hf-batches: [1, 4]: each must be between 1 and --requests (2)"),
    (["--memory-utilization", "0"], "--memory-utilization: must be a number in (0, 1], got 0"),
    (["--arms", "sglang"], "argument --arms: invalid choice: 'sglang'"),
    (["--budget", "32"], "--budget: T=32 must exceed the recent window r=32"),
    (["--model", "/nowhere"], "--model: /nowhere: no HF model folder there"),
])
def test_the_vllm_benchmarks_bad_values_name_the_flag(flags, message, model_folder, capsys):
    argv = ["--model", model_folder, *flags] if "--model" not in flags else flags
    with pytest.raises(SystemExit) as exc:
        _parse("vllm", argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err, err


def test_the_vllm_diagnostics_read_the_same_layers(model_folder, tmp_path, capsys):
    """bench.vllm_agreement and bench.vllm_profile: the old flags' defaults, a TOML file under the flags, errors
    naming the flag (bench.vllm_smoke, a standalone check of the vLLM environment, keeps plain argparse)."""
    agreement = _parse("vllm_agreement", ["--model", model_folder])
    assert (agreement.requests, agreement.new_tokens, agreement.budget, agreement.buffer, agreement.tiny_blocks,
            agreement.bench_blocks, agreement.arms, agreement.no_generate) == \
        (2, 1024, 256, 32, 12, 140, ("bs32", "bs128", "bs32-preempt", "bench"), False)
    profile = _parse("vllm_profile", ["--model", model_folder])
    assert (profile.arm, profile.requests, profile.new_tokens, profile.block_size, profile.blocks, profile.threads,
            profile.case, profile.from_profile, profile.note) == ("vllm random", 16, 512, 32, 140, 1, None, None, "")
    path = tmp_path / "profile.toml"
    path.write_text(f'model = "{model_folder}"\narm = "vllm full"\nnew_tokens = 64\n')
    profile = _parse("vllm_profile", ["--config", str(path), "--new-tokens", "32"])
    assert (profile.arm, profile.new_tokens) == ("vllm full", 32)
    path.write_text(f'model = "{model_folder}"\ntiny_blocks = 0\n')
    with pytest.raises(SystemExit) as exc:
        _parse("vllm_agreement", ["--config", str(path)])
    assert exc.value.code == 2 and "--tiny-blocks: must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        _parse("vllm_profile", ["--model", model_folder, "--block-size", "48"])
    assert exc.value.code == 2 and "--block-size: 48: vLLM's CPU attention takes multiples of 32" in \
        capsys.readouterr().err
