"""probes.leaderboard: every selector against protected Random on the embedded tasks, as units of its own kind.

On the tiny model (``tiny_dir``), small: the board's rows are the paired comparisons of the rows on disk; Random in
disguise ties Random exactly on every task; the copy units are the accuracy kind's own; Random's units are shared, so
a second selector computes only its own; a killed run resumes to the uninterrupted rows; the figure draws from the
saved table alone.
"""

from __future__ import annotations

import csv
import textwrap
from pathlib import Path

import pytest

from test_kill_resume import _count_lines, _kill_once_rows_exist, _measured, _rows

DISGUISE = textwrap.dedent('''
    import torch


    def random_again(view):
        """Random in disguise: the same draw as the registered policy, under another name."""
        return torch.rand(view.shape, generator=view.generator, device=view.keys.device, dtype=torch.float32)
''')

SMALL = ["--problems", "2", "--instances", "2", "--passcode-instances", "2", "--planted-instances", "2",
         "--rounds", "3", "--body", "64", "--distance", "60", "--cost-repeats", "1", "--cost-rounds", "2",
         "--cost-batch", "1", "--batch", "2", "--max-new-tokens", "40", "--budget", "240", "--buffer", "8",
         "--no-figure"]
TASKS = ["--tasks", "copy", "question", "passcode", "planted", "cost"]


@pytest.fixture()
def disguise(tmp_path):
    path = tmp_path / "disguise.py"
    path.write_text(DISGUISE)
    return f"{path}:random_again"


def _board(root: Path) -> list[dict]:
    (path,) = root.rglob("leaderboard.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


def _main(*flags) -> int:
    from probes import leaderboard

    return leaderboard.main(list(flags))


def test_random_in_disguise_ties_random_on_every_task_and_the_board_is_the_rows_paired(disguise, tiny_dir, tmp_path):
    out = tmp_path / "lb"
    assert _main("--model", tiny_dir, "--out", str(out), "--policies", "recency", "--selector", disguise,
                 *TASKS, *SMALL) == 0
    board = _board(out)
    tasks = ["copy", "question", "passcode", "planted"]
    assert sorted((r["policy"], r["test"]) for r in board) == sorted((p, t) for p in ("recency", disguise)
                                                                     for t in tasks)
    for r in board:
        assert r["verdict"] in ("better", "worse", "no detectable difference")
        assert float(r["value_lo"]) <= float(r["value"]) <= float(r["value_hi"])
        assert float(r["delta_lo"]) <= float(r["delta"]) <= float(r["delta_hi"])
        assert float(r["round_cost_ratio"]) > 0 and float(r["throughput_ratio"]) > 0
        assert int(r["n"]) == 2
    for r in (r for r in board if r["policy"] == disguise):  # the same draws as Random: the same rows, delta 0
        assert float(r["delta"]) == 0.0 and r["value"] == r["random"], r
        assert r["verdict"] == "no detectable difference"
    # The board's numbers are the rows' own: copy accuracy is the mean grade of each policy's rows on disk.
    (copy_rows,) = (out.glob("*/copy/*.jsonl"))
    grades = {}
    for row in _rows(copy_rows):
        grades.setdefault(row["policy"], []).append(row["grade"])
    copy = next(r for r in board if r["policy"] == "recency" and r["test"] == "copy")
    assert float(copy["value"]) == pytest.approx(sum(grades["recency"]) / 2)
    assert float(copy["random"]) == pytest.approx(sum(grades["random"]) / 2)
    assert float(copy["gen_len"]) > 0


def test_the_copy_units_are_the_accuracy_kinds_and_randoms_units_are_planned_once(tiny_dir):
    import randattn
    from probes import accuracy, leaderboard
    from probes.units import ModelInfo

    model, tok = randattn.load_model(tiny_dir, device="cpu")
    info = ModelInfo.loaded(tiny_dir, model, tok)
    config = leaderboard.Config(model=tiny_dir, policies=("recency", "snapkv"), tasks=("copy", "question"),
                                problems=2, instances=4, batch=2, budget=240, buffer=8, max_new_tokens=8,
                                out="/nonexistent-never-written")
    plan = leaderboard.plan(config, info)
    assert {u.kind for u in plan.units} == {"leaderboard"}
    copy = [u for u in plan.units if u.work["task"] == "copy"]
    inner = accuracy.plan(leaderboard.accuracy_config(config, "copy", Path(plan.meta["root"])), info)
    assert [u.ids for u in copy] == [u.ids for u in inner.units]  # the accuracy kind's units, ids and all
    assert all(u.work["inner"].kind == "accuracy" for u in copy)
    question = [u for u in plan.units if u.work["task"] == "question"]
    per_policy = {}
    for u in question:
        per_policy.setdefault(u.fixed["policy"], []).extend(i["instance"] for i in u.items)
    assert per_policy == {"recency": [0, 1, 2, 3], "snapkv": [0, 1, 2, 3], "random": [0, 1, 2, 3]}
    assert len({i for u in plan.units for i in u.ids}) == len(plan.items)  # no item planned twice


def test_a_second_selector_computes_only_its_own_units(tiny_dir, tmp_path, capsys):
    out = tmp_path / "lb"
    flags = ["--model", tiny_dir, "--out", str(out), "--tasks", "question", "passcode", *SMALL]
    assert _main(*flags, "--policies", "recency") == 0
    before = {p.name: _rows(p) for p in out.glob("*/*.jsonl")}
    capsys.readouterr()
    assert _main(*flags, "--policies", "recency", "streamingllm") == 0
    printed = capsys.readouterr()
    assert "already there" in printed.out + printed.err
    after = {p.name: _rows(p) for p in out.glob("*/*.jsonl")}
    for name, rows in before.items():
        assert after[name][: len(rows)] == rows  # nothing recomputed or rewritten
        added = after[name][len(rows):]
        assert added and {r["policy"] for r in added} == {"streamingllm"}
    assert {r["policy"] for r in _board(out)} == {"recency", "streamingllm"}


def test_a_killed_leaderboard_resumes_to_the_uninterrupted_rows(tiny_dir, tmp_path):
    flags = ["--policies", "recency", *TASKS, *SMALL]
    assert _main("--model", tiny_dir, "--out", str(tmp_path / "whole"), *flags) == 0
    cut = tmp_path / "cut"

    def files(root):
        return sorted(p for p in root.rglob("*.jsonl") if "work" not in p.relative_to(root).parts)

    killed = _kill_once_rows_exist(["probes.leaderboard", "--model", tiny_dir, "--out", str(cut), *flags],
                                   lambda: files(cut), seed=7, timeout=300)
    total = _count_lines(files(tmp_path / "whole"))
    partial = _count_lines(files(cut))
    assert killed and 0 < partial < total, f"killed={killed} with {partial} of {total} rows: make the run longer"
    assert _main("--model", tiny_dir, "--out", str(cut), *flags) == 0
    whole = {p.relative_to(tmp_path / "whole").as_posix(): p for p in files(tmp_path / "whole")}
    resumed = {p.relative_to(cut).as_posix(): p for p in files(cut)}
    assert resumed.keys() == whole.keys()
    for name, path in whole.items():
        a, b = _measured(_rows(path)), _measured(_rows(resumed[name]))
        if name.endswith("/cost.jsonl"):  # timings: the same rows, measured anew
            key = lambda r: (r["policy"], r["metric"])  # noqa: E731
            assert sorted(map(key, b)) == sorted(map(key, a))
        else:
            assert b == a, name


def test_the_figure_draws_from_the_saved_table_alone(tmp_path):
    from figures.__main__ import draw

    rows = []
    for rank, pol in enumerate(("snapkv", "rkv"), 1):
        for task, d in (("copy", 0.05), ("passcode", -0.2)):
            rows.append({"rank": rank, "policy": pol, "test": task, "metric": f"{task} score", "n": 8,
                         "value": 0.5 + d, "random": 0.5, "delta": d, "delta_lo": d - 0.1, "delta_hi": d + 0.1,
                         "verdict": "worse" if d < -0.1 else "no detectable difference",
                         "round_cost_ratio": 2.0 * rank})
    table = tmp_path / "leaderboard.csv"
    with open(table, "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    paths = draw("leaderboard", table, tmp_path / "figs")
    assert {p.suffix for p in paths} == {".png", ".pdf"} and all(p.stat().st_size > 1000 for p in paths)


def test_the_shipped_board_matches_its_rows():
    """The shipped leaderboard.csv is what the shipped rows give (the table in docs/probes.md is rendered from it)."""
    from analysis.names import shipped_name
    from figures.table_io import result_path

    from probes import leaderboard

    folder = result_path(shipped_name("leaderboard", "folder"))
    board = _board(folder)
    rows = {str(p): _rows(p) for p in folder.rglob("*.jsonl") if "work" not in p.relative_to(folder).parts}
    assert rows and board
    for r in board:
        assert r["verdict"] in leaderboard.VERDICTS.values()
    copy = [r for r in board if r["test"] == "copy"]
    for r in copy:
        (path,) = [p for p in rows if "/copy/" in p]
        mine = [x["grade"] for x in rows[path] if x["policy"] == r["policy"]]
        assert float(r["value"]) == pytest.approx(sum(mine) / len(mine))


GRID = """
probe = "leaderboard"
models = ["{model}"]
policies = ["recency"]
tasks = ["question", "passcode"]
budget = 240
buffer = 8
instances = 2
passcode_instances = 2
rounds = 3
body = 64
batch = 2
"""


def test_a_grid_of_the_leaderboard_kind_writes_the_command_lines_rows(tiny_dir, tmp_path):
    from probes import grid

    spec = tmp_path / "board.toml"
    spec.write_text(GRID.format(model=tiny_dir))
    assert grid.main([str(spec), "--out", str(tmp_path / "grid"), "--no-figure", "--cpus-per-worker", "1"]) == 0
    assert _main("--model", tiny_dir, "--out", str(tmp_path / "single"), "--policies", "recency", "--tasks",
                 "question", "passcode", "--budget", "240", "--buffer", "8", "--instances", "2",
                 "--passcode-instances", "2", "--rounds", "3", "--body", "64", "--batch", "2", "--no-figure") == 0
    (board,) = (tmp_path / "grid" / "leaderboard").iterdir()
    for name in ("question.jsonl", "passcode.jsonl"):
        assert _measured(_rows(board / name)) == _measured(_rows(tmp_path / "single" / board.name / name)), name
    assert [(r["policy"], r["test"], r["delta"]) for r in _board(board)] == \
        [(r["policy"], r["test"], r["delta"]) for r in _board(tmp_path / "single")]


def test_the_shipped_board_is_resumed_by_its_command_with_nothing_pending(embedded):
    """The shipped rows are what the shipped command (figures.tables.LEADERBOARD_COMMAND) plans: every unit of it
    is on disk, so a rerun computes nothing (the challenge's additions, off by default, change no shipped row)."""
    import shlex

    import randattn
    from analysis.names import shipped_name
    from figures.table_io import result_path
    from figures.tables import LEADERBOARD_COMMAND
    from probes import leaderboard
    from probes.config import build, parse_values, parser_for
    from probes.results import INFORMATIONAL
    from probes.units import ModelInfo

    argv = shlex.split(LEADERBOARD_COMMAND)[3:]
    parser = parser_for(leaderboard.Config, "leaderboard")
    config = build(leaderboard.Config, parser, parse_values(leaderboard.Config, parser, argv))
    folder = result_path(shipped_name("leaderboard", "folder"))
    config = config.replace(root=str(folder))
    plan = leaderboard.plan(config, ModelInfo.loaded(randattn.DEFAULT_MODEL, *embedded))
    assert plan.units and plan.then is not None  # the repeat task's policies: a second stage, T from full attention
    pending = []
    mine = lambda c: {k: v for k, v in c.items() if k not in INFORMATIONAL}  # noqa: E731
    rows = {o.path: _rows(Path(o.path)) for o in plan.outputs}  # read as the local backend reads them (no writes)
    stage = plan.then(rows)
    assert stage.units and stage.then is None
    for o in plan.outputs:
        assert all(mine(r["config"]) == mine(o.config) for r in rows[o.path]), o.path  # the same configuration
        done = {tuple(r[k] for k in o.key) for r in rows[o.path]}
        pending += [u.label for u in plan.units + stage.units
                    if u.output == o.path and u.pending(done, o.key) is not None]
    assert pending == []


def test_recall_adds_only_the_endpoints_and_leaves_the_policys_rows_as_they_were(tiny_dir, tmp_path):
    """Planted rows measured without --recall are resumed by a run with it: the policy's rows stay byte-equal, R's
    two endpoints are added, and R comes out in the board; the same draws as a run with --recall from scratch."""
    flags = ["--model", tiny_dir, "--policies", "recency", "--tasks", "planted", *SMALL, "--buffer", "12"]
    out = tmp_path / "lb"
    assert _main("--out", str(out), *flags) == 0
    (path,) = out.glob("*/planted.jsonl")
    before = _rows(path)
    assert {r["condition"] for r in before} == {"policy"}
    assert _main("--out", str(out), *flags, "--recall") == 0
    after = _rows(path)
    assert after[: len(before)] == before
    assert {r["condition"] for r in after[len(before):]} == {"deleted", "all"}
    (row,) = _board(out)
    assert row["recall"] != "" and row["random_recall"] != ""
    assert float(row["recall_lo"]) <= float(row["recall"]) <= float(row["recall_hi"])
    fresh = tmp_path / "fresh"
    assert _main("--out", str(fresh), *flags, "--recall") == 0
    key = lambda r: (r["policy"], r["instance"], r["condition"])  # noqa: E731
    assert sorted(_measured(_rows(next(fresh.glob("*/planted.jsonl")))), key=key) == \
        sorted(_measured(after), key=key)


def test_another_accuracy_task_and_the_full_attention_ceiling(tiny_dir, tmp_path):
    """--accuracy-task runs any task in the copy slot (its rows in <folder>/<task>/, its board rows named after it);
    --full-attention adds full attention's score on the same problems."""
    import json

    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"id": f"m{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(2)))
    out = tmp_path / "lb"
    assert _main("--model", tiny_dir, "--out", str(out), "--policies", "recency", "--tasks", "copy",
                 "--accuracy-task", "math500", "--data", str(data), "--full-attention", *SMALL) == 0
    (row,) = _board(out)
    assert row["test"] == "math500" and row["metric"] == "math500 accuracy" and row["n"] == "2"
    assert 0 <= float(row["full_attention"]) <= 1
    (rows_file,) = out.glob("*/math500/*.jsonl")
    assert {r["policy"] for r in _rows(rows_file)} == {"full", "recency", "random"}


def test_the_repeat_slot_gives_two_endpoint_rows_and_the_reference_log_prob_its_lp_columns(tiny_dir, tmp_path):
    """The repeat task is two scored rows per selector, copies written as a share of 64 and the fidelity of the copies
    written, both in the board's Holm family; --reference-lp gives the copy row and the repeat task's fidelity row the
    reference continuation's log-prob compared with Random (lp columns). The tiny model writes no copy, so its repeat
    outputs are replaced by written ones and re-graded (python -m probes.regrade); the board is re-merged from them."""
    import json

    from probes import regrade
    from probes.leaderboard import REPEAT_COPIES, REPEAT_FIDELITY

    flags = ["--model", tiny_dir, "--out", str(tmp_path / "lb"), "--policies", "recency", "--tasks", "copy", "repeat",
             "--problems", "2", "--repeat-problems", "2", "--max-new-tokens", "40", "--compression", "0.5",
             "--budget", "240", "--buffer", "8", "--no-figure", "--reference-lp"]
    assert _main(*flags) == 0
    (rows_file,) = (tmp_path / "lb").glob("*/repeat/*-s0.jsonl")
    (ref_file,) = (tmp_path / "lb").glob("*/repeat/*.reference_lp.jsonl")
    assert {r["policy"] for r in _rows(ref_file)} == {"full", "recency", "random"}
    written = {"recency": [50, 30], "random": [20, 10], "full": [64, 64]}  # copies per problem
    rows = []
    for r in _rows(rows_file):
        n, line = written[r["policy"]][int(r["problem"].split("-")[1])], r["answer"]
        wrong = "1111 2222 3333 4444" if r["policy"] == "random" else line  # Random's last copy is wrong
        text = f" {line}\n" + "".join(f"{k}. {line if k < n + 1 else wrong}\n" for k in range(3, n + 2))
        rows.append({**r, "output": text})
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    regrade.regrade_file(rows_file)
    assert _main(*flags) == 0  # nothing pending: the board from the rows on disk
    board = _board(tmp_path / "lb")
    assert [(r["test"], r["metric"]) for r in board] == [
        ("copy", "copy accuracy"), ("repeat copies", REPEAT_COPIES), ("repeat fidelity", REPEAT_FIDELITY)]
    copy, copies, fidelity = board
    assert float(copies["value"]) == pytest.approx((50 + 30) / 2 / 64)
    assert float(copies["random"]) == pytest.approx((20 + 10) / 2 / 64)
    assert float(copies["full_attention"]) == pytest.approx(1.0)
    assert float(fidelity["value"]) == 1.0 and float(fidelity["random"]) == pytest.approx((19 / 20 + 9 / 10) / 2)
    for r in (copy, fidelity):  # the reference log-prob: on the copy row and the repeat task's content row
        assert r["lp_delta"] != "" and float(r["lp_delta_lo"]) <= float(r["lp_delta"]) <= float(r["lp_delta_hi"])
        assert r["lp_verdict"] in leaderboard_verdicts() and r["full_attention_lp"] != ""
    assert copies["lp_delta"] == ""  # one log-prob comparison per task and selector
    assert {int(r["family"]) for r in board} == {3 + 2}  # three scores and two log-probs, one Holm family
    refs = {(r["problem"], r["run"], r["policy"]): r for r in _rows(ref_file)}
    lps = [refs[(p, 0, "recency")]["ref_lp"] - refs[(p, 0, "random")]["ref_lp"] for p in ("repeat-0", "repeat-1")]
    assert float(fidelity["lp_delta"]) == pytest.approx(sum(lps) / 2)


def leaderboard_verdicts():
    from probes import leaderboard

    return set(leaderboard.VERDICTS.values())


def test_the_timed_cost_units_never_run_side_by_side(tiny_dir):
    """The cost task times each selector against Random: a second process on the same cores would be in the timing,
    so its units run one at a time whatever --processes asks (the copy task's units still run side by side)."""
    import randattn
    from probes import leaderboard
    from probes.unit_pool import pool_size
    from probes.units import KINDS, ModelInfo

    model, tok = randattn.load_model(tiny_dir, device="cpu")
    config = leaderboard.Config(model=tiny_dir, policies=("recency", "snapkv"), tasks=("copy", "cost"),
                                problems=2, budget=240, buffer=8, max_new_tokens=8, out="/nonexistent-never-written")
    plan = leaderboard.plan(config, ModelInfo.loaded(tiny_dir, model, tok))
    cost = [u for u in plan.units if u.work["task"] == "cost"]
    copy = [u for u in plan.units if u.work["task"] == "copy"]
    assert len(cost) == 2 and all(u.serial for u in cost)
    assert pool_size(2, model, cost, KINDS) == 1
    assert pool_size(2, model, copy, KINDS) == 2
