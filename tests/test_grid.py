"""``probes.grid``: spec expansion and stable ids, the merged files equal to a single-machine run, the Ray backend
equal to the local one, a killed worker then a rerun with no duplicates or losses, and bad specs refused before
any work. Tiny 3-KV-head model with the real tokenizer (``tiny_dir``), a handful of items, short generations."""

import json
from pathlib import Path

import pytest

from probes import grid
from probes.grid_backends import FAIL_ENV, ItemStore
from probes.grid_spec import SpecError, read_spec

ACCURACY = """
probe = "accuracy"
task = "copy"
models = ["{model}"]
policies = ["full", "random", "recency"]
budgets = [224]
buffers = [8]
runs = 2
problems = {problems}
batch = 2
max_new_tokens = {max_new_tokens}
"""
# full and recency run once (greedy), random twice: (1 + 2 + 1) x 3 problems = 12 items in 8 batches of <= 2
ACCURACY_FLAGS = ["--task", "copy", "--policy", "full", "random", "recency", "--budget", "224", "--buffer", "8",
                  "--runs", "2", "--batch", "2"]
PASSCODE = """
probe = "passcode"
models = ["{model}"]
policies = ["random", "recency", "h2o"]
budgets = 96
buffers = 16
rounds = 5
instances = 3
batch = 2
"""


def _spec(tmp_path, text, name="spec.toml", **fields):
    path = tmp_path / name
    path.write_text(text.format(**fields))
    return str(path)


def _acc_spec(tmp_path, tiny_dir, problems=3, max_new_tokens=24, name="acc.toml"):
    return _spec(tmp_path, ACCURACY, name, model=tiny_dir, problems=problems, max_new_tokens=max_new_tokens)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _measured(rows):
    """Rows without what only says where they were measured (device, revision, versions: never compared)."""
    from probes.results import INFORMATIONAL

    return [{**r, "config": {k: v for k, v in r["config"].items() if k not in INFORMATIONAL}} for r in rows]


def _grid(spec, out, *flags):
    return grid.main([spec, "--out", str(out), "--no-figure", "--cpus-per-worker", "1", *flags])


def _merged(out, probe="accuracy"):
    return {p.relative_to(out).as_posix(): _rows(p) for p in sorted((out / probe).rglob("*.jsonl"))}


# -- spec and plan ----------------------------------------------------------------------------------
def _units(chains):
    return [u for c in chains for u in c.units]


def _items(chains):
    return [i for u in _units(chains) for i in u.ids]


def test_spec_expands_into_batches_with_stable_ids(tiny_dir, tmp_path):
    spec = _acc_spec(tmp_path, tiny_dir)
    _, chains = grid.make_plan(spec)
    units = _units(chains)
    assert len(_items(chains)) == 12 and len(set(_items(chains))) == 12 and len(units) == 8
    assert all(len(u.items) <= 2 and u.fixed["budget"] == (None if u.fixed["policy"] == "full" else 224) for u in units)
    keys = {(k["problem"], k["run"], u.fixed["policy"]) for u in units for k in u.items}
    assert keys == {(f"copy-{i}", run, pol) for i in range(3) for pol, runs in
                    (("full", 1), ("random", 2), ("recency", 1)) for run in range(runs)}
    assert _items(grid.make_plan(spec)[1]) == _items(chains)  # the same spec gives the same ids
    # more problems: finished batches keep their ids, only the last partial batch and the new ones are new work
    wider = _units(grid.make_plan(_acc_spec(tmp_path, tiny_dir, problems=4, name="wider.toml"))[1])
    kept = {u.id for u in units} & {u.id for u in wider}
    assert len(kept) == 4 and all(len(u.items) == 2 for u in units if u.id in kept)
    # anything that changes the rows changes every id
    longer = grid.make_plan(_acc_spec(tmp_path, tiny_dir, max_new_tokens=30, name="longer.toml"))[1]
    assert not set(_items(longer)) & set(_items(chains))

    _, pc = grid.make_plan(_spec(tmp_path, PASSCODE, model=tiny_dir))
    assert len(_items(pc)) == 3 * 3 + 2 * 3 and len(pc[0].outputs) == 3  # the references: 3 instances x 2 more
    # the units of probes.passcode's own run, in its order: each policy's batches, then Random's references
    assert [(u.output.split("-")[1], u.parts[0]["condition"]) for u in _units(pc)] == [
        ("random", "policy")] * 2 + [("random", "kept")] * 2 + [("random", "full")] * 2 + [
        ("recency", "policy")] * 2 + [("h2o", "policy")] * 2


def test_any_accuracy_option_is_a_key(tiny_dir, tmp_path):
    """``protocol = "grid"`` and every other accuracy flag are spec keys, checked by the accuracy Config itself."""
    text = ACCURACY.format(model=tiny_dir, problems=2, max_new_tokens=16) + 'protocol = "grid"\npack = true\n'
    spec, chains = grid.make_plan(_spec(tmp_path, text))
    (config,) = spec.configs
    assert (config.protocol, config.pack, config.runs) == ("grid", True, 2)
    (chain,) = chains
    assert chain.outputs[0].path.endswith("-packed-s0.jsonl")
    # the grid protocol runs each baseline in its native mode: recency protected, like Random
    assert {(u.fixed["policy"], u.fixed["protect_prompt"]) for u in chain.units} == {
        ("full", None), ("random", True), ("recency", True)}


def test_example_specs_parse():
    copy = read_spec("examples/grid_copy.toml")
    (config,) = copy.configs
    assert copy.probe == "accuracy" and config.task == "copy" and copy.models == ["smollm2-135m"]
    paper = read_spec("examples/grid_math500.toml")
    (config,) = paper.configs
    assert (config.task, config.budget, config.buffer, config.max_new_tokens) == ("math500", (1024,), 64, 32768)
    assert config.protocol == "matched"


@pytest.mark.parametrize("line,message", [
    ('policies = ["random", "nope"]', "policies: 'nope' is unknown; choose from h2o"),
    ('policies = ["random", "no_such_module:score"]', "cannot import 'no_such_module'"),
    ('task = "math5000"', "task: must be one of math500, aime"),
    ('models = ["/no/such/model"]', "models: '/no/such/model' is not a directory; give a local directory"),
    ('budgets = [100]', "budgets: T=100 cannot hold the protected prompt of 213 tokens plus one free slot beside "
                        "the recent window of 16; use T >= 230"),
    ('budgets = [0]', "budgets: must be a positive integer, got 0"),
    ('runs = true', "runs: expected an integer, got True"),
    ('protocol = "native"', "protocol: must be one of protected, score-only, matched, grid"),
    ('out = "elsewhere"', "out: set by the grid command"),
    ('polices = ["random"]', "polices: not a key of a grid with probe = \"accuracy\""),
    ('rounds = [5]', "rounds: not a key of a grid with probe = \"accuracy\"; it belongs to "),  # passcode, leaderboard
    ('[policy_options.h2o]\nrecent = 3', "policy_options: for h2o: policy 'h2o' does not take option(s) ['recent']"),
])
def test_bad_specs_stop_before_any_work(tiny_dir, tmp_path, capsys, monkeypatch, line, message):
    import randattn

    monkeypatch.setattr(randattn, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    base = {"models": f'models = ["{tiny_dir}"]', "task": 'task = "copy"', "policies": 'policies = ["full", "random"]'}
    text = "\n".join(['probe = "accuracy"', *(v for k, v in base.items() if not line.startswith(k)), line])
    spec = _spec(tmp_path, text + "\n")
    with pytest.raises(SystemExit):
        _grid(spec, tmp_path / "out")
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_bad_probe_and_flags(tmp_path, capsys):
    with pytest.raises(SpecError, match="probe: 'nothing' is not a probe kind; choose from accuracy"):
        read_spec(_spec(tmp_path, 'probe = "nothing"\n'))
    for flags, message in ((["--address", "auto"], "--address needs --backend ray"),
                           (["--workers", "2"], "--workers needs --backend ray")):
        with pytest.raises(SystemExit):
            grid.main(["examples/grid_copy.toml", *flags])
        assert message in capsys.readouterr().err


# -- local backend: the single-machine run's files ---------------------------------------------------
def test_local_grid_writes_the_single_machine_files_and_resumes(tiny_dir, tmp_path, capsys):
    from probes import accuracy

    out = tmp_path / "grid"
    spec = _acc_spec(tmp_path, tiny_dir)
    assert grid.main([spec, "--out", str(out)]) == 0  # with the figure
    (name, rows), = _merged(out).items()
    single = tmp_path / "single" / name.split("/")[-1]  # --out is a folder; the file name is the grid's
    assert accuracy.main(["--model", tiny_dir, *ACCURACY_FLAGS, "--problems", "3", "--max-new-tokens", "24",
                          "--out", str(single.parent), "--no-figure"]) == 0
    assert _measured(rows) == _measured(_rows(single))  # same rows, same config, same order
    for ext in (".summary.csv", ".table.md"):
        assert (out / name).with_suffix(ext).read_text() == single.with_suffix(ext).read_text()
    assert (out / "figures" / f"{single.stem}.png").exists()
    capsys.readouterr()

    items = {p: p.stat().st_mtime_ns for p in (out / "items").rglob("*.json")}
    assert len(items) == 12
    assert grid.main([spec, "--out", str(out), "--no-figure"]) == 0
    assert "12 items done, 0 units to run" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in (out / "items").rglob("*.json")} == items
    # and probes.accuracy finds every row already there in the merged file
    assert accuracy.main(["--model", tiny_dir, *ACCURACY_FLAGS, "--problems", "3", "--max-new-tokens", "24",
                          "--out", str((out / name).parent), "--no-figure"]) == 0
    assert _rows(out / name) == rows


def test_passcode_grid_writes_what_probes_passcode_writes(tiny_dir, tmp_path):
    from probes import passcode

    out = tmp_path / "grid"
    assert _grid(_spec(tmp_path, PASSCODE, model=tiny_dir), out) == 0
    single = tmp_path / "single"
    assert passcode.main(["--model", tiny_dir, "--out", str(single), "--no-figure", "--instances", "3", "--batch", "2",
                          "--parity", "0", "--budget", "96", "--buffer", "16", "--rounds", "5",
                          "--policies", "random", "recency", "h2o"]) == 0
    (combo,) = (out / "passcode").iterdir()  # one folder per geometry, as python -m probes.passcode --out writes it
    for policy in ("random", "recency", "h2o"):  # the same file names as the single-machine run's
        (grid_file,) = combo.glob(f"*-{policy}-K96-*.jsonl")
        assert _measured(_rows(grid_file)) == _measured(_rows(single / grid_file.name))  # same rows, same order
    (summary,) = combo.glob("summary-*.csv")
    assert summary.name == f"summary-{Path(tiny_dir).name}-K96-r16-n5-s0-protected.csv"
    assert summary.read_text() == (single / summary.name).read_text()


PLANTED = """
probe = "{probe}"
models = ["{model}"]
budget = 64
buffer = 12
distance = 90
batch = 2
instances = 3
"""
PLANTED_FLAGS = ["--budget", "64", "--buffer", "12", "--distance", "90", "--batch", "2", "--instances", "3",
                 "--parity", "0", "--no-figure"]


def _single(probe, tiny_dir, out):
    """The rows and summaries ``python -m probes.<probe>`` writes for the PLANTED spec's settings."""
    import importlib

    assert importlib.import_module(f"probes.{probe}").main(["--model", tiny_dir, "--out", str(out),
                                                             *PLANTED_FLAGS]) == 0
    return {p.name: (_measured(_rows(p)) if p.suffix == ".jsonl" else p.read_text()) for p in sorted(out.iterdir())
            if p.suffix in (".jsonl", ".csv")}


def _grid_files(out, probe):
    folder = out / probe
    return {p.name: (_measured(_rows(p)) if p.suffix == ".jsonl" else p.read_text()) for p in sorted(folder.iterdir())
            if p.suffix in (".jsonl", ".csv")}


@pytest.mark.parametrize("probe", ["head_pooling", "scatter", "two_facts"])
def test_planted_probes_on_a_grid_write_their_command_lines_files(probe, tiny_dir, tmp_path):
    """Any registered kind runs on a grid: the planted-fact probes' rows and summaries equal their command line's
    (its parity pre-check aside, which runs only on a command line)."""
    out = tmp_path / "grid"
    assert _grid(_spec(tmp_path, PLANTED, probe=probe, model=tiny_dir), out) == 0
    files = _grid_files(out, probe)
    assert len(files) == 2 and files == _single(probe, tiny_dir, tmp_path / "single")


def test_a_failing_unit_is_reported_and_a_rerun_completes(tiny_dir, tmp_path, capsys, monkeypatch):
    out, spec = tmp_path / "grid", _acc_spec(tmp_path, tiny_dir)
    monkeypatch.setenv(FAIL_ENV, "at=3")
    assert _grid(spec, out) == 1
    text = capsys.readouterr().out
    assert "INCOMPLETE" in text and "injected failure at unit 3" in text
    _, chains = grid.make_plan(spec)
    missing = set(_items(chains)) - ItemStore(out).done()
    assert missing == set(_units(chains)[2].ids)
    monkeypatch.delenv(FAIL_ENV)
    assert _grid(spec, out) == 0
    assert set(_items(chains)) == ItemStore(out).done()
    (rows,) = _merged(out).values()
    assert len(rows) == 12 and len({(r["problem"], r["run"], r["policy"]) for r in rows}) == 12


# -- Ray backend ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance (2 CPUs) for the module; probes.grid reuses it instead of starting its own."""
    ray = pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install 'randattn[grid]'")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def local_rows(tiny_dir, tmp_path_factory):
    """The local backend's merged accuracy rows: what the Ray backend must reproduce."""
    tmp = tmp_path_factory.mktemp("local")
    out = tmp / "grid"
    assert _grid(_acc_spec(tmp, tiny_dir), out) == 0
    return _merged(out)


def test_ray_backend_writes_exactly_the_local_rows(local_ray, local_rows, tiny_dir, tmp_path, capsys):
    out = tmp_path / "grid"
    assert _grid(_acc_spec(tmp_path, tiny_dir), out, "--backend", "ray") == 0
    text = capsys.readouterr().out
    assert "2 Ray workers (1 CPU each)" in text and "ran 12 items" in text
    assert _merged(out) == local_rows
    workers = {json.loads(p.read_text())["worker"] for p in (out / "items").rglob("*.json")}
    assert len(workers) == 2  # both workers took units


def test_killed_ray_worker_loses_its_unit_only_and_a_rerun_completes(local_ray, local_rows, tiny_dir, tmp_path,
                                                                      capsys, monkeypatch):
    out, spec = tmp_path / "grid", _acc_spec(tmp_path, tiny_dir)
    # the first worker to start its 2nd unit exits (like a killed process); no restarts
    monkeypatch.setenv(FAIL_ENV, f"at=2,how=exit,once={tmp_path / 'killed'}")
    assert _grid(spec, out, "--backend", "ray", "--retries", "0") == 1
    assert "worker died" in capsys.readouterr().out
    _, chains = grid.make_plan(spec)
    done = ItemStore(out).done()
    lost = [u for u in _units(chains) if not set(u.ids) <= done]
    assert len(lost) == 1 and set(_items(chains)) - done == set(lost[0].ids)  # only the unit in flight
    before = {p: p.read_bytes() for p in (out / "items").rglob("*.json")}
    assert not list((out / "items").rglob("*.tmp"))

    monkeypatch.delenv(FAIL_ENV)
    assert _grid(spec, out, "--backend", "ray") == 0
    after = {p: p.read_bytes() for p in (out / "items").rglob("*.json")}
    assert len(after) == 12 and all(after[p] == b for p, b in before.items())  # nothing rewritten
    assert _merged(out) == local_rows  # no duplicates, no losses


def test_crashed_ray_worker_is_restarted_and_its_unit_retried(local_ray, local_rows, tiny_dir, tmp_path, monkeypatch):
    out, marker = tmp_path / "grid", tmp_path / "crashed"
    monkeypatch.setenv(FAIL_ENV, f"at=1,how=exit,once={marker}")
    assert _grid(_acc_spec(tmp_path, tiny_dir), out, "--backend", "ray", "--retries", "1") == 0
    assert marker.exists()  # a worker did crash
    assert _merged(out) == local_rows


@pytest.mark.parametrize("probe", ["passcode", "head_pooling"])
def test_ray_backend_runs_any_kind_with_the_command_lines_rows(probe, local_ray, tiny_dir, tmp_path, capsys):
    out = tmp_path / "grid"
    if probe == "passcode":
        assert _grid(_spec(tmp_path, PASSCODE, model=tiny_dir), out, "--backend", "ray") == 0
        assert passcode_files(out) == passcode_files(_single_passcode(tiny_dir, tmp_path / "single"), grid=False)
    else:
        assert _grid(_spec(tmp_path, PLANTED, probe=probe, model=tiny_dir), out, "--backend", "ray") == 0
        assert _grid_files(out, probe) == _single(probe, tiny_dir, tmp_path / "single")
    assert "2 Ray workers" in capsys.readouterr().out


def _single_passcode(tiny_dir, single):
    from probes import passcode

    assert passcode.main(["--model", tiny_dir, "--out", str(single), "--no-figure", "--instances", "3", "--batch", "2",
                          "--parity", "0", "--budget", "96", "--buffer", "16", "--rounds", "5",
                          "--policies", "random", "recency", "h2o"]) == 0
    return single


def passcode_files(out, grid=True):
    """The passcode's rows and summary files by name (a grid's under its one geometry folder)."""
    folder = next((out / "passcode").iterdir()) if grid else out
    return {p.name: (_measured(_rows(p)) if p.suffix == ".jsonl" else p.read_text()) for p in sorted(folder.iterdir())
            if p.suffix in (".jsonl", ".csv")}


def test_the_probe_of_docs_adding_runs_resumes_and_runs_on_a_grid(tiny_dir, tmp_path, monkeypatch, capsys):
    """docs/adding.md's probe, as written there: its command line writes rows and resumes them, and a grid of it
    writes the same rows."""
    import importlib
    import re
    import sys

    doc = (Path(__file__).resolve().parents[1] / "docs" / "adding.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if b.startswith("# probes/my_probe.py")]
    (tmp_path / "my_probe.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_probe", None)
    my_probe = importlib.import_module("my_probe")
    argv = ["--model", tiny_dir, "--out", str(tmp_path / "single"), "--instances", "3", "--batch", "2"]
    assert my_probe.main(argv) == 0
    (single,) = (tmp_path / "single").glob("*.jsonl")
    rows = _rows(single)
    assert [r["instance"] for r in rows] == [0, 1, 2] and all(r["nll_random"] > 0 for r in rows)
    assert my_probe.main(argv) == 0 and _rows(single) == rows  # the rerun finds every row
    assert "nothing to compute" in capsys.readouterr().out
    spec = _spec(tmp_path, f'probe = "my_probe"\nmodels = ["{tiny_dir}"]\ninstances = 3\nbatch = 2\n')
    assert _grid(spec, tmp_path / "grid") == 0
    (merged,) = (tmp_path / "grid" / "my_probe").glob("*.jsonl")
    assert merged.name == single.name and _measured(_rows(merged)) == _measured(rows)
