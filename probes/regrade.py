"""Re-grade stored accuracy rows with the current graders, from the output text each row stores.

    python -m probes.regrade FILE.jsonl [FILE.jsonl ...]

A grader's rule can change after rows were measured (issue 37: the repeat task's one thresholded grade became two
endpoints, ``copies`` and ``fidelity``). Every accuracy row stores its generation's ``output`` text, so its grade is a
function of the row: this command recomputes, for every row of each file, ``grade`` and ``extracted`` and the
endpoint fields the task's grader adds (:class:`probes.tasks.Grade`'s ``endpoints``: the repeat task's ``copies`` and
``fidelity``, placed after ``extracted`` as a fresh run writes them) with the grader of the row's ``task``, and changes
no other field. A file is rewritten atomically (a temporary file beside it, then a rename; a kill leaves the old file or
the new one) and only when a row changed, so a second run changes nothing. Only results files of the accuracy
harness are touched (anything else is refused, unchanged), and not while another run holds their folder.

The graders need only the row's ``answer`` (the copy, repeat, math and multiple-choice tasks); code tasks, whose
grader runs the program against tests the row does not store, are refused.

When a file is a leaderboard task's rows (``<board>/<task>/FILE`` beside the board's ``spec.json``) and the grade the
board registered for that task is no longer the one the leaderboard registers for it, the registration is amended
(:func:`probes.registration.amend`: the new grade, the old one kept with the date, revision and reason).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from analysis.files import replacing

from .results import NotOurFile, RunInUse, hold_folder, release_folders
from .tasks import TASKS, Problem

#: the fields a re-grade may change (besides the endpoint fields a grader adds)
GRADE_FIELDS = ("grade", "extracted")


def regraded(row: dict) -> dict:
    """``row`` with its grade fields recomputed from its ``output`` by the current grader of its ``task``; every other
    field, and the order of the fields, unchanged (endpoint fields it did not have go after ``extracted``)."""
    task = TASKS.get(row.get("task"))
    if task is None:
        raise ValueError(f"task {row.get('task')!r} is not a task of probes/tasks.py")
    if task.kind == "code":
        raise ValueError(f"the {task.name} grader runs the generated program against tests the row does not store; "
                         "re-grade it by rerunning the accuracy harness")
    g = task.grade(row["output"], Problem(str(row["problem"]), "", row["answer"], task.kind))
    new = {"grade": g.score, "extracted": g.extracted, **(g.endpoints or {})}
    out: dict = {}
    for k, v in row.items():
        out[k] = new.pop(k) if k in new else v
        if k == "extracted":
            out.update({f: new.pop(f) for f in list(new) if f not in row})
    out.update(new)  # a row without 'extracted' (none is written so): its new fields last
    return out


def _rows(path: Path) -> list[dict]:
    """The rows of an accuracy results file; :class:`NotOurFile` (nothing changed) for anything else."""
    if not path.is_file():
        raise NotOurFile(f"{path}: no such results file")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise NotOurFile(f"{path}: line {n} is not JSON; not a results file of the accuracy harness, nothing was "
                             "changed") from None
        config = row.get("config") if isinstance(row, dict) else None
        if not isinstance(config, dict) or config.get("probe") != "accuracy" or "output" not in row \
                or "problem" not in row or "answer" not in row:
            raise NotOurFile(f"{path}: line {n} is not a generation row of the accuracy harness (probe 'accuracy', "
                             "with its output and answer); nothing was changed")
        rows.append(row)
    if not rows:
        raise NotOurFile(f"{path} holds no rows; nothing was changed")
    return rows


def regrade_file(path: "str | Path") -> dict:
    """Re-grade every row of one accuracy results file in place (atomically; not rewritten when nothing changed).
    Returns ``{"rows": n, "changed": rows changed, "path": path}``."""
    path = Path(path)
    hold_folder(path.parent)  # RunInUse while a run appends to the file
    rows = _rows(path)
    new = [regraded(r) for r in rows]
    changed = sum(a != b or list(a) != list(b) for a, b in zip(rows, new))
    if changed:
        blob = "".join(json.dumps(r) + "\n" for r in new)  # as probes.results.ResultsFile writes rows
        with replacing(path, check=False) as tmp:  # _rows above has shown the file to be ours
            Path(tmp).write_text(blob, encoding="utf-8")
    return {"path": str(path), "rows": len(rows), "changed": changed}


def amend_board(path: "str | Path") -> Optional[str]:
    """When ``path`` is a leaderboard task's rows file (``<board>/<task>/FILE`` beside ``<board>/spec.json``), amend the
    board's registered grade of that task to the leaderboard's current one if they differ; returns what was done."""
    from . import leaderboard, registration

    path = Path(path).resolve()
    root, folder = path.parent.parent, path.parent.name
    tasks = registration.read(root) if (root / registration.SPEC_FILE).exists() else {}
    slot = next((s for s, t in tasks.items() if s in ("copy", "repeat")
                 and (t["spec"].get("accuracy_task", s) if s == "copy" else s) == folder), None)
    if slot is None:
        return None
    spec = tasks[slot]["spec"]
    config = leaderboard.Config(tasks=(slot,), accuracy_task=spec.get("accuracy_task", "copy"))
    grade = leaderboard.grade_of(config, slot)
    if spec.get("grade") == grade:
        return None
    registration.amend(root, slot, {"grade": grade},
                       why=f"re-graded from the rows' output by python -m probes.regrade ({path.name})")
    return f"{root / registration.SPEC_FILE}: its {slot} task's registered grade amended to {grade!r}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m probes.regrade", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE.jsonl", help="accuracy results files (rewritten in place)")
    args = p.parse_args(argv)
    try:
        for f in args.files:
            result = regrade_file(f)
            print(f"{result['path']}: {result['changed']} of {result['rows']} rows re-graded"
                  + ("" if result["changed"] else " (nothing changed, file untouched)"))
            note = amend_board(f)
            if note:
                print(note)
    except (NotOurFile, RunInUse, ValueError) as exc:
        p.error(str(exc))
    finally:
        release_folders()
    return 0


if __name__ == "__main__":
    sys.exit(main())
