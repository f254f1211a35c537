"""Rows read back are checked field by field (issue 29, section 2): a wrong type or a missing field is a clear error
naming the file, the line and the field, never a traceback, an extra row counted twice or a NaN summary. The same
check keeps a grid item with valid JSON but bogus rows from counting as done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from probes.results import ResultsFile
from analysis.rows import BadRow, read_rows

KEY = ("instance", "condition", "fact")
CONFIG = {"probe": "head_pooling", "model": "tiny"}
GOOD = {"instance": 0, "condition": "a", "fact": 0, "lp": -1.5, "retrieved": True, "config": CONFIG}

# (id, the second row's changes, the message) -- each a row a summary would miscount
BAD = [
    ("instance-string", {"instance": "0"}, "field 'instance' must be an integer, got \"0\""),
    ("lp-nan", {"lp": float("nan")}, "field 'lp' must be a finite number, got NaN"),
    ("lp-string", {"lp": "x"}, "field 'lp' must be a finite number, got \"x\""),
    ("lp-missing", {"lp": None}, "field 'lp' is missing"),
    ("retrieved-string", {"retrieved": "false"}, "field 'retrieved' must be true or false, got \"false\""),
    ("instance-bool", {"instance": True}, "field 'instance' must be an integer, got true"),
]


def _write(path: Path, change: dict) -> bytes:
    bad = {**GOOD, "instance": 1, **change}
    if change.get("lp", 0) is None:
        del bad["lp"]
    blob = (json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n").encode()
    path.write_bytes(blob)
    return blob


@pytest.mark.parametrize("change,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_row_is_refused_on_resume_naming_file_line_and_field(tmp_path, change, message):
    path = tmp_path / "rows.jsonl"
    blob = _write(path, change)
    with pytest.raises(BadRow) as info:
        ResultsFile(path, CONFIG, KEY)
    assert str(info.value).startswith(f"{path}:2: {message}")
    assert "--restart" in str(info.value)
    assert path.read_bytes() == blob  # nothing repaired, nothing appended


@pytest.mark.parametrize("change,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_row_is_refused_when_drawn(tmp_path, change, message):
    path = tmp_path / "rows.jsonl"
    _write(path, change)
    with pytest.raises(BadRow, match="^" + __import__("re").escape(f"{path}:2: {message}")):
        read_rows(path)


def test_restart_still_discards_a_file_of_ours_with_bad_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    _write(path, {"lp": "x"})
    rf = ResultsFile(path, CONFIG, KEY, restart=True)
    assert rf.rows == [] and not path.exists()


def test_good_and_shipped_rows_pass():
    repo = Path(__file__).resolve().parents[1]
    files = sorted((repo / "data" / "results").rglob("*.jsonl"))
    assert len(files) > 20
    for f in files:
        assert read_rows(f)


def test_figures_names_the_bad_line_without_a_traceback(tmp_path, capsys):
    from figures.__main__ import main

    path = tmp_path / "rows.jsonl"
    _write(path, {"lp": "x"})
    assert main(["--probe", "head_pooling", "--results", str(path), "--out", str(tmp_path / "figs")]) == 1
    err = capsys.readouterr().err
    assert f"{path}:2: field 'lp' must be a finite number, got \"x\"" in err
    assert "Traceback" not in err and not (tmp_path / "figs").exists()


def test_a_grid_item_with_valid_json_but_bogus_rows_is_moved_aside(tmp_path, capsys):
    from probes.grid_backends import ItemStore

    store = ItemStore(tmp_path)
    good = {k: v for k, v in GOOD.items() if k != "config"}
    store.write("ab12", {"id": "ab12", "rows": [good]})
    store.write("cd34", {"id": "cd34", "rows": [good, {**good, "lp": "x"}]})
    store.write("ef56", {"id": "ef56", "rows": [good, 3]})
    assert store.done() == {"ab12"}
    err = capsys.readouterr().err
    assert "cd34.json is damaged (row 1: field 'lp' must be a finite number" in err
    assert "ef56.json is damaged (row 1 is not a JSON object)" in err
    assert store.path("cd34").with_name("cd34.json.damaged").exists()  # moved aside, recomputed, never deleted


def test_a_probe_resuming_a_file_with_a_bad_row_is_a_usage_error_naming_the_line(tiny_dir, tmp_path, capsys):
    from probes.head_pooling import main

    out = tmp_path / "out"
    args = ["--model", tiny_dir, "--out", str(out), "--budget", "64", "--buffer", "12", "--distance", "90",
            "--instances", "2", "--batch", "2", "--no-figure"]
    assert main(args) == 0
    (rows,) = out.glob("*.jsonl")
    lines = rows.read_text().splitlines()
    bad = json.loads(lines[1])
    bad["lp"] = "x"
    lines[1] = json.dumps(bad)
    rows.write_text("\n".join(lines) + "\n")
    before = {p: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--out: {rows}:2: field 'lp' must be a finite number, got \"x\"; nothing was changed" in err
    assert "Traceback" not in err
    assert {p: p.read_bytes() for p in out.iterdir()} == before
