"""Re-grading stored accuracy rows (``python -m probes.regrade``): only the grade fields change, from the stored output,
as a fresh run would write them; a second run changes nothing; every shipped accuracy row is already what the current
graders give; a board's registered grade is amended, the old one kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from probes import regrade

REPO = Path(__file__).resolve().parents[1]
GRADE_FIELDS = {"grade", "extracted", "copies", "fidelity"}


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _repeat_rows(tiny_dir, folder: Path) -> Path:
    from probes import accuracy

    assert accuracy.main(["--model", tiny_dir, "--task", "repeat", "--policy", "full", "random", "--budget", "80",
                          "--problems", "3", "--runs", "1", "--max-new-tokens", "24", "--out", str(folder),
                          "--no-figure"]) == 0
    (path,) = folder.glob("*.jsonl")
    return path


def test_regrade_changes_only_the_grade_fields_is_idempotent_and_matches_a_fresh_run(tiny_dir, tmp_path, capsys):
    path = _repeat_rows(tiny_dir, tmp_path / "acc")
    fresh = path.read_bytes()
    rows = _rows(path)
    def texts(line):  # three outputs: a wrong third copy, none, 70 copies (capped at 64)
        return [f" {line}\n3. {line}\n4. 1111 2222 3333 4444\nthe end", "",
                f" {line}\n" + "".join(f"{k}. {line}\n" for k in range(3, 72))]

    old = []  # rows as the old grader wrote them: no endpoint fields, a thresholded grade; and other outputs
    for n, r in enumerate(rows):
        r = {k: v for k, v in r.items() if k not in ("copies", "fidelity")}
        old.append({**r, "output": texts(r["answer"])[n % 3], "grade": 0.0, "extracted": "3 copies"})
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    assert regrade.main([str(path)]) == 0
    new = _rows(path)
    assert len(new) == len(old)
    for a, b in zip(old, new):
        assert {k: v for k, v in a.items() if k not in GRADE_FIELDS} == \
            {k: v for k, v in b.items() if k not in GRADE_FIELDS}  # every other field as it was
        assert list(b) == list(json.loads(fresh.splitlines()[0]))  # the fields in a fresh run's order
    endpoints = [(r["copies"], r["fidelity"], r["grade"]) for r in new]
    assert endpoints == [(3, pytest.approx(2 / 3), pytest.approx(2 / 3)), (0, None, 0.0), (64, 1.0, 1.0)] * 2
    assert new[0]["extracted"].startswith("4. ") and new[1]["extracted"] is None
    once = path.read_bytes()
    mtime = path.stat().st_mtime_ns
    assert regrade.main([str(path)]) == 0  # idempotent: nothing changes, the file is not even rewritten
    assert path.read_bytes() == once and path.stat().st_mtime_ns == mtime
    assert "0 of 6 rows re-graded (nothing changed, file untouched)" in capsys.readouterr().out
    # the rows of a fresh run are what the grader gives: re-grading them changes no byte
    path.write_bytes(fresh)
    assert regrade.regrade_file(path)["changed"] == 0 and path.read_bytes() == fresh


def test_a_code_task_or_another_probes_file_is_refused_and_left_as_it_was(tmp_path):
    row = {"problem": "p", "run": 0, "policy": "full", "task": "livecodebench", "output": "x", "answer": "1 tests",
           "grade": 0.0, "extracted": None, "config": {"probe": "accuracy"}}
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps(row) + "\n")
    before = path.read_bytes()
    with pytest.raises(ValueError, match="runs the generated program against tests the row does not store"):
        regrade.regrade_file(path)
    other = tmp_path / "hp.jsonl"
    other.write_text(json.dumps({**row, "config": {"probe": "head_pooling"}}) + "\n")
    with pytest.raises(ValueError, match="not a generation row of the accuracy harness"):
        regrade.regrade_file(other)
    assert path.read_bytes() == before


@pytest.mark.parametrize("path", sorted(p for p in (REPO / "data" / "results").rglob("*.jsonl")
                                        if '"probe": "accuracy"' in p.open().readline()
                                        and ".reference_lp" not in p.name),
                         ids=lambda p: str(p.relative_to(REPO / "data" / "results")))
def test_every_shipped_accuracy_row_is_graded_by_the_current_grader(path):
    """The shipped rows hold what the current graders give (the repeat rows were re-graded into two endpoints)."""
    for row in _rows(path):
        assert regrade.regraded(row) == row
        if row["task"] == "repeat":
            assert {"copies", "fidelity"} <= set(row)


def test_a_boards_registered_grade_is_amended_with_the_old_one_kept(tiny_dir, tmp_path):
    from probes import leaderboard, registration

    config = leaderboard.Config(tasks=("repeat",))
    root = tmp_path / "board"
    registration.record(root, leaderboard.registered(config))
    tasks = json.loads((root / "spec.json").read_text())
    tasks["tasks"]["repeat"]["spec"]["grade"] = "repeat accuracy, paired by problems"  # as boards registered it
    (root / "spec.json").write_text(json.dumps(tasks))
    rows = _repeat_rows(tiny_dir, root / "repeat")
    assert regrade.main([str(rows)]) == 0
    entry = registration.read(root)["repeat"]
    assert entry["spec"]["grade"] == leaderboard.grade_of(config, "repeat")
    (change,) = entry["amended"]
    assert change["field"] == "grade" and change["before"] == "repeat accuracy, paired by problems"
    assert "probes.regrade" in change["why"] and change["date"]
    registration.check(root, leaderboard.registered(config))  # the board's runs are accepted again
    assert regrade.amend_board(rows) is None  # nothing left to amend
