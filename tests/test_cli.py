"""The ``randattn`` console script (randattn/cli.py), called in-process; one test runs the installed entry point."""

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from randattn import cli

ROOT = Path(__file__).resolve().parents[1]


def _first_line(module) -> str:
    return module.__doc__.strip().splitlines()[0].strip()


@pytest.fixture
def recorder(monkeypatch):
    """recorder(module_name, attr="main") -> calls: replaces that function by one that records its argv and argv[0]."""
    calls = []

    def patch(module_name, result=0):
        module = importlib.import_module(module_name)

        def fake(argv=None):
            calls.append((module_name, list(argv), sys.argv[0]))
            return result

        monkeypatch.setattr(module, "main", fake)
        return calls

    return patch


@pytest.mark.parametrize("package", ["probes", "bench"])
def test_runnable_modules_are_the_ones_with_a_main_and_their_first_doc_line(package):
    found = cli.runnable_modules(package)
    assert found, f"no runnable modules found in {package}"
    assert not any(name.startswith("_") for name in found)
    for name, line in found.items():
        module = importlib.import_module(f"{package}.{name}")
        assert callable(module.main)
        assert line == _first_line(module)
    # Helpers without a main are not listed.
    assert "common" not in found


def test_list_prints_probes_benchmarks_and_the_other_commands(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for package in ("probes", "bench"):
        for name, line in cli.runnable_modules(package).items():
            assert any(row.split() and row.split()[0] == name and row.rstrip().endswith(line) for row in out.splitlines())
    assert "python -m probes.NAME" in out and "python -m bench.NAME" in out
    assert _first_line(importlib.import_module("figures.__main__")) in out
    assert _first_line(importlib.import_module("randattn.calibrate")) in out


@pytest.mark.parametrize("cmd,package", [("probe", "probes"), ("bench", "bench")])
def test_probe_and_bench_pass_the_rest_unchanged_to_main(recorder, cmd, package):
    name = next(iter(cli.runnable_modules(package)))
    calls = recorder(f"{package}.{name}")
    argv0 = sys.argv[0]
    assert cli.main([cmd, name, "--seed", "3", "--out", "x y.json", "--", "-h"]) == 0
    assert calls == [(f"{package}.{name}", ["--seed", "3", "--out", "x y.json", "--", "-h"], f"randattn {cmd} {name}")]
    assert sys.argv[0] == argv0  # restored


def test_figures_and_calibrate_dispatch(recorder):
    calls = recorder("figures.__main__")
    assert cli.main(["figures", "--probe", "scatter"]) == 0
    calls_c = recorder("randattn.calibrate", result=object())  # calibrate's main returns its statistics
    assert cli.main(["calibrate", "--out", "s.pt"]) == 0
    assert calls == calls_c == [("figures.__main__", ["--probe", "scatter"], "randattn figures"),
                                ("randattn.calibrate", ["--out", "s.pt"], "randattn calibrate")]


def test_a_main_exit_status_is_returned(recorder):
    name = next(iter(cli.runnable_modules("bench")))
    recorder(f"bench.{name}", result=3)
    assert cli.main(["bench", name]) == 3


@pytest.mark.parametrize("cmd,kind,package", [("probe", "probe", "probes"), ("bench", "benchmark", "bench")])
def test_unknown_name_lists_the_known_ones(capsys, cmd, kind, package):
    assert cli.main([cmd, "no_such_thing"]) == 2
    err = capsys.readouterr().err
    assert f"randattn {cmd}: unknown {kind} 'no_such_thing'" in err
    assert ", ".join(cli.runnable_modules(package)) in err and "randattn list" in err


def test_private_and_helper_modules_are_not_runnable(capsys):
    assert cli.main(["bench", "_kvpress_worker"]) == 2
    assert cli.main(["probe", "common"]) == 2
    assert "unknown probe 'common'" in capsys.readouterr().err


def test_unknown_command_lists_the_commands(capsys):
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "randattn: unknown command 'frobnicate'" in err
    for cmd in ("probe", "bench", "figures", "calibrate", "list"):
        assert cmd in err


def test_no_arguments_prints_usage_to_stderr_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: randattn COMMAND" in capsys.readouterr().err
    assert cli.main(["probe"]) == 2
    assert "usage: randattn probe NAME" in capsys.readouterr().err


def test_help_for_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("probe", "bench", "figures", "calibrate", "list"):
        assert f"  {cmd} " in out
    for cmd, package in (("probe", "probes"), ("bench", "bench")):
        assert cli.main([cmd, "--help"]) == 0
        out = capsys.readouterr().out
        assert f"usage: randattn {cmd} NAME [ARGS...]" in out and f"{package}.NAME.main(ARGS)" in out
        assert all(name in out for name in cli.runnable_modules(package))
    with pytest.raises(SystemExit) as exc:
        cli.main(["list", "--help"])
    assert exc.value.code == 0 and "usage: randattn list" in capsys.readouterr().out
    # The others hand --help to the module's own parser: its flags, under the randattn name where it takes one.
    for argv, needle in ((["figures", "--help"], "usage: randattn figures"), (["calibrate", "--help"], "--out OUT"),
                         (["bench", next(iter(cli.runnable_modules("bench"))), "--help"], "usage: randattn bench "),
                         (["probe", next(iter(cli.runnable_modules("probes"))), "--help"], "usage: randattn probe ")):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 0 and needle in capsys.readouterr().out, argv


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("randattn ") and "transformers " in out and "torch " in out


def test_pyproject_registers_the_script():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["randattn"] == "randattn.cli:main"


def test_installed_entry_point_runs():
    script = Path(sys.executable).with_name("randattn")
    script = script if script.exists() else shutil.which("randattn")
    if not script:
        pytest.skip("the randattn console script is not installed here (pip install -e . installs it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([str(script), "list"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert all(name in res.stdout for name in cli.runnable_modules("bench"))
