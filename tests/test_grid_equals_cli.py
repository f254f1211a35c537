"""The grid equals the command line for every registered probe kind: a local grid of a small configuration writes
the files ``python -m probes.<kind>`` writes with the same settings (rows and summaries, by name, in every folder),
on the tiny random-config model (``tiny_dir``). The kinds tested elsewhere are named in :data:`ELSEWHERE`; a kind
added to ``analysis/registry.py`` without a test here or there fails :func:`test_every_registered_kind_is_covered`."""

import importlib
import json

import pytest

from analysis.registry import PROBES

#: kind -> (grid spec keys, the same settings as flags): each runs in seconds on the tiny model.
CASES = {
    "blocks": ("budget = 64\nbuffer = 12\ndistance = 90\nbatch = 2\ninstances = 2\nblocks = [1, 32]\nsequences = 2\n"
               "length = 160\n",
               ["--budget", "64", "--buffer", "12", "--distance", "90", "--batch", "2", "--instances", "2",
                "--blocks", "1", "32", "--sequences", "2", "--length", "160", "--parity", "0"]),
    "shared_draw": ("budget = 64\nbuffer = 12\ndistance = 90\nbatch = 2\ninstances = 2\nsequences = 2\nlength = 160\n"
                    "rounds = 4\npasscode_instances = 2\n",
                    ["--budget", "64", "--buffer", "12", "--distance", "90", "--batch", "2", "--instances", "2",
                     "--sequences", "2", "--length", "160", "--rounds", "4", "--passcode-instances", "2",
                     "--parity", "0"]),
    "prompt_protection": ('instances = 3\nbatch = 2\nbudget = 128\nbuffer = 8\nbody = 120\n'
                          'policies = ["random", "snapkv"]\n',
                          ["--instances", "3", "--batch", "2", "--budget", "128", "--buffer", "8", "--body", "120",
                           "--policies", "random", "snapkv"]),
    "survival": ('budget = 128\nbuffer = 8\nrounds = 6\nsequences = 2\nbatch = 2\npolicies = ["random", "recency"]\n',
                 ["--budget", "128", "--buffer", "8", "--rounds", "6", "--sequences", "2", "--batch", "2",
                  "--policies", "random", "recency"]),
    "autopsy": ('task = "copy"\nproblems = 1\npolicies = ["random"]\nbudget = 232\nbuffer = 8\nmax_new = 24\n'
                'max_replays = 2\nhorizon = 4\n',
                ["--task", "copy", "--problems", "1", "--policy", "random", "--budget", "232", "--buffer", "8",
                 "--max-new", "24", "--max-replays", "2", "--horizon", "4"]),
}
#: kinds whose grid-equals-command-line test is elsewhere.
ELSEWHERE = {
    "accuracy": "tests/test_grid.py::test_local_grid_writes_the_single_machine_files_and_resumes",
    "passcode": "tests/test_grid.py::test_passcode_grid_writes_what_probes_passcode_writes",
    "head_pooling": "tests/test_grid.py::test_planted_probes_on_a_grid_write_their_command_lines_files",
    "scatter": "tests/test_grid.py::test_planted_probes_on_a_grid_write_their_command_lines_files",
    "two_facts": "tests/test_grid.py::test_planted_probes_on_a_grid_write_their_command_lines_files",
    "leaderboard": "tests/test_leaderboard.py::test_a_grid_of_the_leaderboard_kind_writes_the_command_lines_rows",
}


TIMING = {"seconds"}  # a row's wall time (survival, autopsy): everything else in a row is deterministic


def _measured(rows):
    from probes.results import INFORMATIONAL

    return [{**{k: v for k, v in r.items() if k not in TIMING},
             "config": {k: v for k, v in r["config"].items() if k not in INFORMATIONAL}} for r in rows]


def _files(folder):
    """Every rows file (measured fields only) and summary table under ``folder``, by relative path."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.suffix == ".jsonl":
            out[p.relative_to(folder).as_posix()] = _measured([json.loads(x) for x in p.read_text().splitlines()
                                                                if x.strip()])
        elif p.suffix == ".csv":
            out[p.relative_to(folder).as_posix()] = p.read_text()
    return out


def test_every_registered_kind_is_covered():
    assert {p.name for p in PROBES} == set(CASES) | set(ELSEWHERE)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_grid_writes_the_command_lines_files(kind, tiny_dir, tmp_path):
    from probes import grid, units

    keys, flags = CASES[kind]
    spec = tmp_path / "spec.toml"
    spec.write_text(f'probe = "{kind}"\nmodels = ["{tiny_dir}"]\n{keys}')
    assert grid.main([str(spec), "--out", str(tmp_path / "grid"), "--no-figure", "--cpus-per-worker", "1"]) == 0
    single = tmp_path / "single"
    main = importlib.import_module(units.KINDS[kind]).main
    assert main(["--model", tiny_dir, "--out", str(single), "--no-figure", *flags]) == 0
    got, want = _files(tmp_path / "grid" / units.kind(kind).results), _files(single)
    assert got and got == want
