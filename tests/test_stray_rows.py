"""Files and rows randattn did not write (issue 38, items b and c).

- A file of the user's at the path a probe's summary takes is refused before anything is computed: no rows file, no
  lock file, nothing written (it was refused only after every row had been computed, with a new rows file beside it).
  Every probe's summary tables (``<rows>.summary.csv``, ``summary-*.csv``, accuracy's protection and comparison
  tables) are checked by the one check every results file goes through when it is opened.
- A row no run of its file's configuration writes (an unknown ``condition``, a ``fact`` past ``n_facts``, a negative
  ``instance``, a survival ``sequence`` past the file's sequences) is refused on resume and when read back for a
  summary, naming the file, line, field and the values expected. Instances past this run's ``--instances`` are not
  stray: a run with more instances wrote them, and a rerun with fewer keeps them and writes
  ``<rows>.n<N>.summary.csv``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.files import NotOurs
from analysis.names import result_name
from analysis.rows import BadRow
from probes import results
from probes.results import ResultsFile, release_folders

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--budget", "64", "--buffer", "12", "--distance", "90", "--batch", "2", "--parity", "0", "--instances", "2",
         "--no-figure"]
USERS = "instance,my_score\n0,0.7\n"  # the user's own analysis, saved under the summary's name


def _planted_name(tiny_dir: str, part: str = "rows") -> str:
    record = {"model": tiny_dir, "policy": "random", "policy_options": {}, "budget": 64, "buffer": 12,
              "distance": 90, "seed": 0, "protect_prompt": False}
    return result_name("head_pooling", record, part)


def _files(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


# -- b: a user's file where a summary goes --------------------------------------------------------------------------
def test_a_users_summary_is_refused_before_any_row_is_computed(tiny_dir, tmp_path, capsys):
    from probes.head_pooling import main

    out = tmp_path / "out"
    out.mkdir()
    summary = out / _planted_name(tiny_dir, "summary")
    summary.write_text(USERS)
    with pytest.raises(SystemExit) as info:
        main(["--model", tiny_dir, "--out", str(out), *SMALL])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (f"--out: {summary} was not written by randattn (its columns (instance, my_score) are not the table "
            "written there); nothing was changed" in err)
    assert "Traceback" not in err
    assert _files(out) == {summary.name: USERS.encode()}  # no rows file, no lock file: nothing was written


def test_a_users_summary_dash_csv_is_refused_before_any_row_is_computed(tiny_dir, tmp_path, capsys):
    """The passcode probe's summary is named by its configuration (``summary-*.csv``), not after a rows file."""
    from probes.passcode import main

    out = tmp_path / "out"
    out.mkdir()
    record = {"model": tiny_dir, "budget": 96, "buffer": 16, "rounds": 5, "seed": 0, "protect_prompt": True}
    summary = out / result_name("passcode", record, "summary")
    summary.write_text(USERS)
    with pytest.raises(SystemExit) as info:
        main(["--model", tiny_dir, "--out", str(out), "--no-figure", "--instances", "2", "--batch", "2", "--parity",
              "0", "--budget", "96", "--buffer", "16", "--rounds", "5", "--policies", "random", "recency"])
    assert info.value.code == 2
    assert f"--out: {summary} was not written by randattn" in capsys.readouterr().err
    assert _files(out) == {summary.name: USERS.encode()}


def test_our_own_summary_is_still_replaced_also_when_its_rows_are_gone(tiny_dir, tmp_path):
    from probes.head_pooling import main

    out = tmp_path / "out"
    args = ["--model", tiny_dir, "--out", str(out), *SMALL]
    assert main(args) == 0
    rows, summary = out / _planted_name(tiny_dir), out / _planted_name(tiny_dir, "summary")
    first = summary.read_bytes()
    rows.unlink()  # the user removes the rows to recompute them (instead of --restart)
    assert main(args) == 0
    assert summary.read_bytes() == first and rows.exists()


def test_every_probes_summary_tables_are_found_from_its_rows_and_the_shipped_ones_pass():
    """Where each probe writes its tables, as the check before compute finds them from a rows file's record: every
    table shipped beside (or for) a shipped rows file is one of them, and each passes."""
    shipped = REPO / "data" / "results"
    found = set()
    for rows in sorted(shipped.rglob("*.jsonl")):
        first = json.loads(rows.read_text().splitlines()[0])
        targets = results.tables_beside(rows, first["config"])
        found |= {t for t, _ in targets}
        results.check_tables_beside(rows, first["config"])
        assert all(ref is None or ref.exists() for _, ref in targets)
    tables = {p for p in shipped.rglob("*") if p.suffix in (".csv", ".md", ".tex")}
    # The challenge's, the leaderboard's, the board's and the regime calibration's own tables live in their folders
    # (written by those commands from their stages, not from one rows file); every other shipped table is a probe's
    # summary found from its rows.
    own_folders = {"challenge", "leaderboard", "board", "calibration"}
    probe_tables = {p for p in tables if not own_folders & set(p.relative_to(shipped).parts)}
    assert probe_tables and probe_tables <= found, sorted(map(str, probe_tables - found))


@pytest.mark.parametrize("content, why", [
    (USERS, "its columns (instance, my_score) are not the table written there"),
    ("condition\nmine\n", "its columns (condition) are not the table written there"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "it is not a text table"),
])
def test_the_check_before_compute_reads_the_header_only(tmp_path, content, why):
    config = {"probe": "head_pooling", "model": "tiny", "policy": "random", "policy_options": {}, "budget": 64,
              "buffer": 12, "distance": 90, "seed": 0, "protect_prompt": False}
    rows = tmp_path / result_name("head_pooling", config)
    summary = tmp_path / result_name("head_pooling", config, "summary")
    (summary.write_bytes if isinstance(content, bytes) else summary.write_text)(content)
    with pytest.raises(NotOurs, match=f"was not written by randattn \\({why.replace('(', '[(]').replace(')', '[)]')}"
                                      "\\); nothing was changed"):
        ResultsFile(rows, config, ("instance", "condition", "fact"))
    assert not rows.exists() and sorted(p.name for p in tmp_path.iterdir()) == [summary.name]
    summary.write_text("condition,n,retrieval\nall,2,0.5\n")  # a summary of ours (its first column)
    ResultsFile(rows, config, ("instance", "condition", "fact"))
    release_folders()


# -- c: rows no run of the file's configuration writes --------------------------------------------------------------
PLANTED = {"probe": "head_pooling", "model": "tiny", "budget": 64, "buffer": 12, "distance": 90, "box_width": 12,
           "policy": "random", "policy_options": {}, "protect_prompt": False, "seed": 0, "batch": 2, "n_facts": 1,
           "kv_heads": 3, "layers": 2}
KEY = ("instance", "condition", "fact")
ROW = {"instance": 0, "condition": "policy", "fact": 0, "lp": -1.5, "retrieved": False}
SURVIVAL = {"probe": "survival", "model": "tiny", "budget": 128, "buffer": 8, "rounds": 4, "length": 160,
            "sequences": 4, "batch": 2, "seed": 0}

STRAY = [  # (id, config, key, the second row, the message after FILE:2: )
    ("unknown-condition", PLANTED, KEY, {**ROW, "condition": "bogus"},
     "field 'condition' must be one of deleted, h0, h1, h2, h0+1, h0+2, h1+2, all, policy, full (what head_pooling "
     "writes for 3 KV heads), got \"bogus\""),
    ("head-past-the-model", PLANTED, KEY, {**ROW, "condition": "h3"}, "field 'condition' must be one of"),
    ("other-probes-condition", {**PLANTED, "probe": "passcode"}, KEY, {**ROW, "condition": "h0"},
     "field 'condition' must be one of policy, kept, full (what passcode writes for 3 KV heads), got \"h0\""),
    ("fact-past-n-facts", PLANTED, KEY, {**ROW, "fact": 1},
     "field 'fact' must be in 0..0 (the file's n_facts is 1), got 1"),
    ("negative-instance", PLANTED, KEY, {**ROW, "instance": -1}, "field 'instance' must be >= 0, got -1"),
    ("sequence-past-the-file", SURVIVAL, ("policy", "mode", "sequence"),
     {"policy": "random", "mode": "per-head", "sequence": 4},
     "field 'sequence' must be in 0..3 (the file's 4 sequences), got 4"),
]


def _write(path: Path, config: dict, key: tuple, stray: dict) -> bytes:
    good = ROW if "condition" in key else {"policy": "random", "mode": "per-head", "sequence": 0}
    blob = "".join(json.dumps({**r, "config": config}) + "\n" for r in (good, stray)).encode()
    path.write_bytes(blob)
    return blob


@pytest.mark.parametrize("config, key, stray, message", [s[1:] for s in STRAY], ids=[s[0] for s in STRAY])
def test_a_stray_row_is_refused_on_resume_naming_file_line_field_and_the_values(tmp_path, config, key, stray,
                                                                                message):
    path = tmp_path / "rows.jsonl"
    blob = _write(path, config, key, stray)
    with pytest.raises(BadRow) as info:
        ResultsFile(path, config, key)
    assert str(info.value).startswith(f"{path}:2: {message}"), str(info.value)
    assert "nothing was changed" in str(info.value) and "--restart" in str(info.value)
    assert path.read_bytes() == blob and sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]
    ResultsFile(path, config, key, restart=True)  # --restart still discards a file of ours
    assert not path.exists()
    release_folders()


def test_a_probe_resuming_a_file_with_a_stray_condition_is_a_usage_error(tiny_dir, tmp_path, capsys):
    from probes.head_pooling import main

    out = tmp_path / "out"
    args = ["--model", tiny_dir, "--out", str(out), *SMALL]
    assert main(args) == 0
    rows = out / _planted_name(tiny_dir)
    lines = rows.read_text().splitlines()
    stray = {**json.loads(lines[0]), "condition": "bogus"}
    rows.write_text("\n".join(lines + [json.dumps(stray)]) + "\n")
    before = _files(out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (f"--out: {rows}:{len(lines) + 1}: field 'condition' must be one of deleted, h0, h1, h2, h0+1, h0+2, "
            "h1+2, all, policy, full (what head_pooling writes for 3 KV heads), got \"bogus\"; nothing was changed"
            in err)
    assert "Traceback" not in err and _files(out) == before


def test_instances_past_this_runs_are_kept_and_summarised_apart(tiny_dir, tmp_path):
    """Not stray: rows of instances this run does not ask for are what a run with more instances wrote. The file
    keeps them, this run's summary covers its own instances and goes to <rows>.n<N>.summary.csv."""
    from probes.head_pooling import main

    out = tmp_path / "out"
    assert main(["--model", tiny_dir, "--out", str(out), *SMALL[:-3], "--instances", "3", "--no-figure"]) == 0
    rows = out / _planted_name(tiny_dir)
    blob = rows.read_bytes()
    assert main(["--model", tiny_dir, "--out", str(out), *SMALL]) == 0  # --instances 2
    assert rows.read_bytes() == blob
    assert (out / _planted_name(tiny_dir, "rows").replace(".jsonl", ".n2.summary.csv")).exists()


def test_the_conditions_every_planted_probe_writes_pass():
    """Each planted-fact probe's own conditions (the lists its plan runs) pass the check for the model it ran on, and
    so does every shipped row; a best-k chain (more than 8 KV heads) too."""
    from probes import head_pooling
    planted_conditions = results.planted_conditions

    for heads in (1, 2, 3, 4, 8, 9, 12):
        for probe in ("head_pooling", "scatter", "two_facts", "blocks", "shared_draw", "passcode",
                      "leaderboard_planted"):
            known = planted_conditions(probe, heads, 12)
            if known is None:
                assert (probe, heads) in {("scatter", 1), ("scatter", 2), ("two_facts", 1)}
                continue
            assert all(known[1](n) for n in known[0])
        assert all(planted_conditions("head_pooling", heads, 12)[1](c.name)
                   for c in head_pooling.pooling_conditions(heads, 12))
    chain = head_pooling.chain_conditions(list(range(12))[::-1], 12, 12)
    assert chain and all(planted_conditions("head_pooling", 12, 12)[1](c.name) for c in chain)
    assert not planted_conditions("head_pooling", 12, 12)[1]("best3:h11+12+13")
    assert not planted_conditions("head_pooling", 3, 12)[1]("best3:h0+1+2")
    for path in sorted((REPO / "data" / "results").rglob("*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row.get("config"), dict):
                results.check_domain(row, f"{path}:{n}")
