"""probes.board: a board spec's tasks registered before their rows, run (resumable) and merged into one family.

On the tiny model (``tiny_dir``): two small tasks at different T register (spec.json preregistered, before any
row), run, resume after a SIGKILL to the uninterrupted rows, and merge into a board.csv whose family is every
comparison of both tasks; the whole-board Holm and BH adjustments equal independent implementations written here;
a calibrated value is read from its regime file; a registration that differs from the spec is refused by the spec's
key; a task without rows is listed as missing; the figure draws from board.csv alone. The spec's other refusals are
rows of tests/test_bad_inputs.py.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from test_kill_resume import _count_lines, _kill_once_rows_exist, _measured, _rows

SPEC = """
[board]
name = "{name}"
model = "{model}"
selectors = ["recency", "streamingllm"]
out = "{out}"
alpha = 0.05
adjustment = "{adjustment}"

[tasks.question]
budget = 200
buffer = 8
instances = 2
body = 64
batch = 2

[tasks.passcode]
budget = 96
buffer = 16
instances = 2
rounds = {rounds}
batch = 2
"""


def _spec(tmp_path: Path, model: str, name: str = "tiny", adjustment: str = "holm", rounds="5", **extra) -> Path:
    path = tmp_path / f"{name}.toml"
    text = SPEC.format(name=name, model=model, out=tmp_path / name, adjustment=adjustment, rounds=rounds)
    for line in extra.get("passcode_lines", ()):
        text += line + "\n"
    path.write_text(text)
    return path


def _main(*argv) -> int:
    from probes import board

    try:
        return board.main([str(a) for a in argv])
    except SystemExit as exc:
        return exc.code


def _table(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _rows_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.jsonl") if "work" not in p.relative_to(root).parts)


def holm(p: list[float]) -> list[float]:
    """Holm's step-down adjustment, written from its definition: the i-th smallest p times (m - i), made monotone."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    out, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out


def bh(p: list[float]) -> list[float]:
    """Benjamini-Hochberg's step-up adjustment: the i-th smallest p times m / i, the minimum over the larger ones."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    out, running = [0.0] * m, 1.0
    for rank in range(m - 1, -1, -1):
        i = order[rank]
        running = min(running, min(1.0, p[i] * m / (rank + 1)))
        out[i] = running
    return out


def test_two_tasks_register_before_rows_run_resume_and_merge_into_one_family(tiny_dir, tmp_path, capsys):
    whole = _spec(tmp_path, tiny_dir, "whole")
    cut = _spec(tmp_path, tiny_dir, "cut")
    assert _main("register", cut) == 0
    for task in ("question", "passcode"):
        spec = json.loads((tmp_path / "cut" / task / "spec.json").read_text())["tasks"][task]
        assert spec["preregistered"] is True
        assert spec["spec"]["verdict"]["adjustment"] == "holm" and spec["spec"]["verdict"]["alpha"] == 0.05
    assert spec["spec"]["budget"] == 96 and spec["spec"]["buffer"] == 16 and spec["spec"]["passcode_instances"] == 2
    assert _rows_files(tmp_path / "cut") == []  # registered before any row exists
    resolved = json.loads((tmp_path / "cut" / "board.json").read_text())
    assert resolved["tasks"]["question"]["leaderboard"]["budget"] == 200
    assert resolved["tasks"]["passcode"]["leaderboard"]["rounds"] == 5
    registered = {t: (tmp_path / "cut" / t / "spec.json").read_bytes() for t in ("question", "passcode")}
    assert _main("register", cut) == 0  # registering again changes nothing
    assert registered == {t: (tmp_path / "cut" / t / "spec.json").read_bytes() for t in ("question", "passcode")}

    assert _main("register", whole) == 0 and _main("run", whole) == 0
    killed = _kill_once_rows_exist(["probes.board", "run", str(cut)], lambda: _rows_files(tmp_path / "cut"), seed=3,
                                   timeout=300)
    total, partial = _count_lines(_rows_files(tmp_path / "whole")), _count_lines(_rows_files(tmp_path / "cut"))
    assert killed and 0 < partial < total, f"killed={killed} with {partial} of {total} rows: make the run longer"
    assert _main("run", cut) == 0
    names = lambda root: [p.relative_to(root).as_posix() for p in _rows_files(root)]  # noqa: E731
    assert names(tmp_path / "cut") == names(tmp_path / "whole") == ["passcode/passcode.jsonl",
                                                                    "question/question.jsonl"]
    for name in names(tmp_path / "whole"):
        assert _measured(_rows(tmp_path / "cut" / name)) == _measured(_rows(tmp_path / "whole" / name)), name
    assert registered == {t: (tmp_path / "cut" / t / "spec.json").read_bytes() for t in ("question", "passcode")}

    capsys.readouterr()
    assert _main("merge", cut, "--no-figure", "--target-mde", "0.3") == 0
    printed = capsys.readouterr().out
    assert "across the whole board's 8 comparisons" in printed and "units for an MDE of 0.3" in printed
    table = _table(tmp_path / "cut" / "board.csv")
    # every comparison of both tasks: 2 tasks x 2 selectors x (score + log-prob)
    assert len(table) == 8 and {r["verdict"] for r in table} <= {"better", "worse", "no detectable difference"}
    assert {(r["task"], r["endpoint"], r["selector"]) for r in table} == {
        (t, e, s) for t in ("question", "passcode") for e in ("score", "log-prob") for s in ("recency", "streamingllm")}
    assert all(r["family"] == "8" and r["adjustment"] == "holm" for r in table)
    for r in table:
        assert r["n"] == "2" and r["p"] != "" and r["p_adjusted"] != "" and r["mde"] != "" and r["measures"]
        assert (r["T"], r["r"]) == (("200", "8") if r["task"] == "question" else ("96", "16"))
    p = [float(r["p"]) for r in table]
    assert [float(r["p_adjusted"]) for r in table] == pytest.approx(holm(p), abs=1e-12)
    import pandas as pd

    assert len(pd.read_csv(tmp_path / "cut" / "board.csv")) == 8


def _synthetic_rows(task: str, selectors: list[str], rng: random.Random, n: int = 12) -> list[dict]:
    """Leaderboard rows as its board() makes them (its own compared()), on paired scores with planted effects."""
    from probes import leaderboard

    out = []
    ref = {i: [float(rng.random() < 0.4)] for i in range(n)}
    ref_lp = {i: [rng.gauss(-5, 1)] for i in range(n)}
    for k, pol in enumerate(selectors):
        shift = (0.0, 0.5, 0.9)[k % 3]
        a = {i: [float(rng.random() < 0.4 + shift * 0.6)] for i in range(n)}
        lp = {i: [ref_lp[i][0] + shift * 3 + rng.gauss(0, 0.5)] for i in range(n)}
        row = leaderboard.compared(task, f"{task} score", "instances", pol, a, ref, 0)
        row.update({"value_lo": 0.0, "value_hi": 1.0, "random_lo": 0.0, "random_hi": 1.0, "budget": 96})
        c = leaderboard.compared(task, "log-prob", "instances", pol, lp, ref_lp, 0)
        row.update({"lp": c["value"], "random_lp": c["random"], "lp_delta": c["delta"], "lp_delta_lo": c["delta_lo"],
                    "lp_delta_hi": c["delta_hi"], "lp_p": c["p"], "lp_sd_delta": c["sd_delta"]})
        leaderboard.adjust_board([row])  # the per-folder adjustment the leaderboard wrote; the board redoes it
        out.append(row)
    return out


@pytest.mark.parametrize("adjustment, reference", [("holm", holm), ("bh", bh)])
def test_the_whole_board_adjustment_equals_an_independent_implementation(adjustment, reference, tiny_dir, tmp_path):
    from probes import board
    from probes.planted_run import write_csv

    spec = _spec(tmp_path, tiny_dir, adjustment=adjustment)
    text = spec.read_text().replace('["recency", "streamingllm"]', '["recency", "streamingllm", "snapkv"]')
    spec.write_text(text)
    assert _main("register", spec) == 0
    b = board.read(spec)
    rng = random.Random(5)
    selectors = ["recency", "streamingllm", "snapkv"]
    made = {"question": _synthetic_rows("question", selectors, rng)}
    write_csv(b.tasks["question"].folder / "leaderboard.csv", made["question"])
    # a task without rows is listed as missing, not dropped; the family is what is there
    assert _main("merge", spec, "--no-figure") == 0
    table = _table(b.out / "board.csv")
    missing = [r for r in table if r["verdict"] == "missing"]
    assert {(r["task"], r["selector"]) for r in missing} == {("passcode", s) for s in selectors}
    assert {r["family"] for r in table if r["verdict"] != "missing"} == {"6"}

    made["passcode"] = _synthetic_rows("passcode", selectors, rng)
    write_csv(b.tasks["passcode"].folder / "leaderboard.csv", made["passcode"])
    assert _main("merge", spec, "--no-figure") == 0
    table = _table(b.out / "board.csv")
    assert len(table) == 12 and not [r for r in table if r["verdict"] == "missing"]
    p = [float(r["p"]) for r in table]
    assert len(set(p)) > 3, "the planted effects give the p-values a spread"
    assert [float(r["p_adjusted"]) for r in table] == pytest.approx(reference(p), abs=1e-12)
    for r in table:
        assert r["family"] == "12" and r["adjustment"] == adjustment
        excludes = float(r["delta_lo"]) > 0 or float(r["delta_hi"]) < 0
        detected = excludes and float(r["p_adjusted"]) < 0.05
        assert r["verdict"] == (("better" if float(r["delta"]) > 0 else "worse") if detected
                                else "no detectable difference"), r
    assert {r["verdict"] for r in table} > {"no detectable difference"}, "some planted effect is detected"
    # the MDE is stated at the board's level (alpha / family), in each endpoint's units
    from probes.leaderboard import mde
    from randattn.power import mde_normal

    level = 0.05 / 12
    for r in table:
        row = next(x for x in made[r["task"]] if x["policy"] == r["selector"])
        if r["endpoint"] == "score":
            assert (float(r["mde"]), r["mde_method"]) == (pytest.approx(mde(row, level)[0]), mde(row, level)[1])
            assert r["mde_units"] == "score"
        else:
            assert float(r["mde"]) == pytest.approx(mde_normal(row["lp_sd_delta"], 12, alpha=level))
            assert r["mde_units"] == "nats"


def test_a_calibrated_value_is_read_from_its_regime_file(tiny_dir, tmp_path, capsys):
    from probes import board

    regime = tmp_path / "regime.json"
    record = {"task": "passcode", "knob": "rounds", "settings": {"budget": 96, "buffer": 16, "seed": 0, "units": 4,
                                                                "model": tiny_dir},
              "chosen": {"rounds": 4, "scores": {"ceiling": 1.0, "random": 0.5, "recency": 0.0}},
              "reason": "1 of 3 points qualify; Random closest to 0.5 at 4"}
    regime.write_text(json.dumps(record))
    spec = _spec(tmp_path, tiny_dir, rounds='"calibrated"', passcode_lines=[f'calibration = "{regime}"'])
    b = board.read(spec)
    assert b.tasks["passcode"].config.rounds == 4
    assert _main("register", spec) == 0
    registered = json.loads((b.out / "passcode" / "spec.json").read_text())["tasks"]["passcode"]["spec"]
    assert registered["rounds"] == 4
    resolved = json.loads((b.out / "board.json").read_text())["tasks"]["passcode"]
    assert resolved["settings"]["rounds"] == 4 and resolved["calibrated"]["value"] == 4
    assert resolved["calibrated"]["file"] == str(regime) and len(resolved["calibrated"]["sha256"]) == 64

    regime.write_text(json.dumps({**record, "chosen": None, "reason": "no point satisfies ceiling >= 0.8 (4: ...)"}))
    capsys.readouterr()
    assert _main("register", spec) == 2
    err = capsys.readouterr().err
    assert "[tasks.passcode] rounds:" in err and "chose nothing: no point satisfies ceiling >= 0.8" in err
    assert f"{spec}:" in err


def test_a_registration_that_differs_from_the_spec_is_refused_by_the_specs_key(tiny_dir, tmp_path, capsys):
    spec = _spec(tmp_path, tiny_dir)
    assert _main("register", spec) == 0
    folder = tmp_path / "tiny"
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    text = spec.read_text()
    for old, new, key, field in (("instances = 2\nrounds", "instances = 3\nrounds", "[tasks.passcode] instances",
                                  "passcode_instances = 2"),
                                 ('adjustment = "holm"', 'adjustment = "bh"', "[board] adjustment", "verdict = "),
                                 ("budget = 200", "budget = 224", "[tasks.question] budget", "budget = 200")):
        spec.write_text(text.replace(old, new))
        for stage in ("register", "run", "merge"):
            capsys.readouterr()
            assert _main(stage, spec) == 2, stage
            err = capsys.readouterr().err
            assert key in err and field in err and "give [board] out another folder" in err, (stage, err)
            assert "Traceback" not in err
    assert before == {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_the_figure_draws_from_board_csv_alone(tmp_path):
    from figures import board as figure
    from probes.planted_run import write_csv

    rows = []
    for task, r in (("copy", 64), ("passcode", 64)):
        for endpoint, units in (("score", "score"), ("log-prob", "nats")):
            for k, sel in enumerate(("snapkv", "rkv")):
                d = 0.1 * (k + 1) * (-1 if task == "passcode" else 1)
                rows.append({"task": task, "test": task, "endpoint": endpoint, "selector": sel, "n": 64,
                             "delta": d, "delta_lo": d - 0.05, "delta_hi": d + 0.05, "p": 0.01, "p_adjusted": 0.04,
                             "family": 8, "adjustment": "holm", "alpha": 0.05,
                             "mde": float("inf") if k else 0.12, "mde_units": units,
                             "verdict": "worse" if d < 0 else "better", "T": 512, "r": r})
    rows.append({"task": "planted", "endpoint": "", "selector": "snapkv", "verdict": "missing", "T": 512, "r": 64})
    table = write_csv(tmp_path / "board.csv", rows)
    assert figure.main([str(table), "--out", str(tmp_path / "figs")]) == 0
    paths = [tmp_path / "figs" / f"board.{ext}" for ext in ("png", "pdf")]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_the_repeat_task_runs_at_its_tables_buffer(tiny_dir, tmp_path):
    """A board's [tasks.repeat] buffer is the r its accuracy runs get (a plain leaderboard run keeps the repeat task's
    own r = 8: the shipped board's rows are at r = 8), and it is registered, so another r is refused by field."""
    from probes import board, leaderboard

    path = tmp_path / "rep.toml"
    path.write_text(f'[board]\nmodel = "{tiny_dir}"\nselectors = ["recency"]\nout = "{tmp_path / "rep"}"\n'
                    'alpha = 0.05\nadjustment = "holm"\n\n[tasks.repeat]\nbudget = 96\nbuffer = 64\nproblems = 2\n')
    t = board.read(path).tasks["repeat"]
    assert t.config.repeat_buffer == 64
    assert leaderboard.accuracy_config(t.config, "repeat", t.folder).buffer == 64
    assert leaderboard.registered(t.config)["repeat"]["repeat_buffer"] == 64
    plain = leaderboard.Config(tasks=("repeat",))
    assert plain.repeat_buffer is None and leaderboard.accuracy_config(plain, "repeat", tmp_path).buffer is None


def test_a_task_with_fewer_units_than_registered_is_flagged_in_the_table_and_the_output(tiny_dir, tmp_path, capsys):
    from probes import board
    from probes.planted_run import write_csv

    spec = _spec(tmp_path, tiny_dir, "short")
    spec.write_text(spec.read_text().replace("instances = 2\nbody", "instances = 20\nbody"))
    assert _main("register", spec) == 0
    b = board.read(spec)
    rng = random.Random(7)
    for task in ("question", "passcode"):  # 12 units each: the question registered 20, the passcode 2
        write_csv(b.tasks[task].folder / "leaderboard.csv", _synthetic_rows(task, ["recency", "streamingllm"], rng))
    capsys.readouterr()
    assert _main("merge", spec, "--no-figure") == 0
    printed = capsys.readouterr().out
    assert "short: question has rows for 12 units, fewer than the 20 its spec registered" in printed
    assert "short: passcode" not in printed
    notes = {(r["task"], r["note"]) for r in _table(b.out / "board.csv")}
    assert notes == {("question", "n = 12 units, fewer than the 20 registered"), ("passcode", "")}
