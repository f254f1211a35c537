"""``probes.grid``: spec expansion and stable ids, the merged files equal to a single-machine run, the Ray backend
equal to the local one, a killed worker then a rerun with no duplicates or losses, and bad specs refused before
any work. Tiny 3-KV-head model with the real tokenizer (``tiny_dir``), a handful of items, short generations."""

import json

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
def test_spec_expands_into_batches_with_stable_ids(tiny_dir, tmp_path):
    spec = _acc_spec(tmp_path, tiny_dir)
    _, plan = grid.make_plan(spec)
    assert len(plan.items) == 12 and len(set(plan.items)) == 12 and len(plan.units) == 8
    assert all(len(u.items) <= 2 and len({k["policy"] for k in u.keys}) == 1 for u in plan.units)
    keys = {(k["problem"], k["run"], k["policy"]) for u in plan.units for k in u.keys}
    assert keys == {(f"copy-{i}", run, pol) for i in range(3) for pol, runs in
                    (("full", 1), ("random", 2), ("recency", 1)) for run in range(runs)}
    assert grid.make_plan(spec)[1].items == plan.items  # the same spec gives the same ids
    # more problems: finished batches keep their ids, only the last partial batch and the new ones are new work
    wider = grid.make_plan(_acc_spec(tmp_path, tiny_dir, problems=4, name="wider.toml"))[1]
    kept = {u.id for u in plan.units} & {u.id for u in wider.units}
    assert len(kept) == 4 and all(len(u.items) == 2 for u in plan.units if u.id in kept)
    # anything that changes the rows changes every id
    longer = grid.make_plan(_acc_spec(tmp_path, tiny_dir, max_new_tokens=30, name="longer.toml"))[1]
    assert not set(longer.items) & set(plan.items)

    _, pc = grid.make_plan(_spec(tmp_path, PASSCODE, model=tiny_dir))
    assert len(pc.items) == 3 * 3 and len(pc.units) == 3 * 2 and len(pc.outputs) == 3
    assert {u.keys[0]["policy"]: u.keys[0]["conditions"] for u in pc.units} == {
        "random": ["policy", "kept", "full"], "recency": ["policy"], "h2o": ["policy"]}


def test_example_specs_parse():
    copy = read_spec("examples/grid_copy.toml")
    assert copy.probe == "accuracy" and copy.task == "copy" and copy.models == ["smollm2-135m"]
    paper = read_spec("examples/grid_math500.toml")
    assert (paper.task, paper.budgets, paper.buffers, paper.max_new_tokens) == ("math500", [1024], [64], 32768)
    assert paper.protect_prompt == [True, False]


@pytest.mark.parametrize("line,message", [
    ('policies = ["random", "nope"]', "policies: 'nope' is unknown; choose from full, h2o"),
    ('policies = ["random", "no_such_module:score"]', "cannot import 'no_such_module'"),
    ('task = "math5000"', "task: 'math5000' unknown; choose from math500"),
    ('models = ["/no/such/model"]', "models: '/no/such/model' is not a directory; give a local directory"),
    ('budgets = [100]', "budgets: K=100 cannot hold the protected 213-token prompt"),
    ('budgets = [0]', "budgets: expected a positive integer"),
    ('runs = true', "runs: expected a positive integer, got True"),
    ('polices = ["random"]', "polices: not a key of a grid with probe = \"accuracy\""),
    ('rounds = [5]', "rounds: not a key of a grid with probe = \"accuracy\"; it belongs to probe = \"passcode\""),
    ('[policy_options.h2o]\nrecent = 3', "policy_options.h2o: policy 'h2o' does not take option(s) ['recent']"),
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
    with pytest.raises(SpecError, match="probe: 'head_pooling' is not a grid probe; choose from accuracy, passcode"):
        read_spec(_spec(tmp_path, 'probe = "head_pooling"\n'))
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
    (combo,) = (out / "passcode").iterdir()
    for policy in ("random", "recency", "h2o"):  # the same file names as the single-machine run's
        (grid_file,) = combo.glob(f"*-{policy}-K96-*.jsonl")
        assert _measured(_rows(grid_file)) == _measured(_rows(single / grid_file.name))
    summary = f"summary-{combo.name}.csv"
    assert (combo / summary).read_text() == (single / summary).read_text()


def test_a_failing_unit_is_reported_and_a_rerun_completes(tiny_dir, tmp_path, capsys, monkeypatch):
    out, spec = tmp_path / "grid", _acc_spec(tmp_path, tiny_dir)
    monkeypatch.setenv(FAIL_ENV, "at=3")
    assert _grid(spec, out) == 1
    text = capsys.readouterr().out
    assert "INCOMPLETE" in text and "injected failure at unit 3" in text
    _, plan = grid.make_plan(spec)
    missing = set(plan.items) - ItemStore(out).done()
    assert missing == set(plan.units[2].items)
    monkeypatch.delenv(FAIL_ENV)
    assert _grid(spec, out) == 0
    assert set(plan.items) == ItemStore(out).done()
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
    _, plan = grid.make_plan(spec)
    done = ItemStore(out).done()
    lost = [u for u in plan.units if not set(u.items) <= done]
    assert len(lost) == 1 and set(plan.items) - done == set(lost[0].items)  # only the unit in flight
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
