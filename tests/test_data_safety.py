"""Nothing a user owns is destroyed or corrupted: --out refuses foreign files, --restart moves aside and never
deletes, and a resume after a partly written batch counts no row twice."""

import hashlib
import json

import pytest

from probes.results import NotOurFile, OutputFolder, ResultsFile, check_ours

KEY = ("instance", "condition")
CFG = {"model": "m", "budget": 8, "revision": "abc"}


def _digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("content", [b'{"important":1}', b'{"important": 1}\n{"also": 2}\n', b"name,value\na,1\n",
                                     b'{"important": 1}\n{"instance": 0, "condition": "a", "config": {}}\npartial',
                                     b"\x00\x01binary"])
def test_a_file_that_is_not_ours_is_refused_untouched(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    for restart in (False, True):
        with pytest.raises(NotOurFile, match="not a results file written by randattn.*nothing was changed"):
            ResultsFile(path, CFG, KEY, restart=restart)
        assert path.read_bytes() == content
    with pytest.raises(NotOurFile):
        check_ours(path, KEY)
    assert path.read_bytes() == content


def test_a_folder_given_as_a_results_file_is_refused(tmp_path):
    with pytest.raises(NotOurFile, match="folder"):
        ResultsFile(tmp_path, CFG, KEY)


def test_only_our_own_torn_last_line_is_repaired(tmp_path):
    path = tmp_path / "r.jsonl"
    rf = ResultsFile(path, CFG, KEY)
    rf.append([{"instance": 0, "condition": "a", "lp": -1.0}])
    good = path.read_bytes()
    path.write_bytes(good + b'{"instance": 1, "condit')  # killed mid-write
    again = ResultsFile(path, CFG, KEY)
    assert path.read_bytes() == good and again.done == {(0, "a")}
    # a torn first (and only) row is ours too
    path.write_bytes(b'{"instance": 0, "con')
    assert ResultsFile(path, CFG, KEY).done == set() and path.read_bytes() == b""


def test_a_mismatched_config_is_refused_before_any_repair(tmp_path):
    path = tmp_path / "r.jsonl"
    ResultsFile(path, CFG, KEY).append([{"instance": 0, "condition": "a"}])
    torn = path.read_bytes() + b'{"instance": 1, "co'
    path.write_bytes(torn)
    with pytest.raises(ValueError, match="different configuration"):
        ResultsFile(path, {**CFG, "budget": 16}, KEY)
    assert path.read_bytes() == torn


def test_a_resume_after_a_partly_written_batch_writes_and_counts_no_row_twice(tmp_path):
    path = tmp_path / "r.jsonl"
    batch = [{"instance": i, "condition": c, "lp": float(-i)} for i in range(4) for c in ("a", "b")]
    ResultsFile(path, CFG, KEY).append(batch)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:5]) + lines[5][:20])  # a kill halfway through the batch
    resumed = ResultsFile(path, CFG, KEY)
    assert len(resumed.rows) == 5
    written = resumed.append(batch)  # the probe recomputes the whole batch
    assert len(written) == 3
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 8 and len({(r["instance"], r["condition"]) for r in rows}) == 8
    # A file that already holds duplicates (an older version's resume) is read back de-duplicated.
    path.write_text(path.read_text() + json.dumps({**rows[0], "lp": 99.0}) + "\n")
    again = ResultsFile(path, CFG, KEY)
    assert len(again.rows) == 8 and again.duplicates == 1 and again.rows[0]["lp"] == rows[0]["lp"]


def test_restart_discards_only_our_own_file(tmp_path):
    path = tmp_path / "r.jsonl"
    ResultsFile(path, CFG, KEY).append([{"instance": 0, "condition": "a"}])
    assert ResultsFile(path, {**CFG, "budget": 16}, KEY, restart=True).done == set()
    assert not path.exists()


def test_output_folder_refuses_foreign_files_and_moves_its_own_aside(tmp_path):
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "thesis.tex").write_text("x")
    before = _digest(victim)
    for restart in (False, True):
        with pytest.raises(NotOurFile, match="thesis.tex.*nothing was changed"):
            OutputFolder(victim, restart=restart).open()
    assert _digest(victim) == before and (victim / "sub").is_dir()
    ours = OutputFolder(tmp_path / "ours").open()
    (ours / "verdict.csv").write_text("a\n")
    OutputFolder(ours).open()  # resume: adopted, nothing moved
    assert (ours / "verdict.csv").exists()
    folder = OutputFolder(ours, restart=True)
    folder.open()
    assert folder.moved_to == tmp_path / "ours.previous-1" and (folder.moved_to / "verdict.csv").read_text() == "a\n"
    assert not (ours / "verdict.csv").exists()
    with pytest.raises(NotOurFile, match="is a file"):
        OutputFolder(victim / "thesis.tex").check()


def test_challenge_restart_never_empties_a_users_folder(tiny_dir, tmp_path, capsys):
    from probes import challenge

    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "thesis.tex").write_text("x")
    before = _digest(victim)
    (tmp_path / "bad.py").write_text("def score(view):\n    return None\n")
    with pytest.raises(SystemExit):
        challenge.main(["--policy", f"{tmp_path / 'bad.py'}:score", "--model", tiny_dir, "--quick", "--out", str(victim),
                        "--restart"])
    assert "thesis.tex" in capsys.readouterr().err
    assert _digest(victim) == before and (victim / "sub").is_dir()
    # Our own earlier results survive a --restart whose selector then fails its trial run.
    ours = OutputFolder(tmp_path / "ours").open()
    (ours / "verdict.csv").write_text("earlier\n")
    with pytest.raises(SystemExit):
        challenge.main(["--policy", f"{tmp_path / 'bad.py'}:score", "--model", tiny_dir, "--quick", "--out", str(ours),
                        "--restart"])
    assert "trial run" in capsys.readouterr().err
    assert (ours / "verdict.csv").read_text() == "earlier\n" and not (tmp_path / "ours.previous-1").exists()


def test_head_pooling_refuses_a_foreign_out_file_before_loading_anything(tiny_dir, tmp_path, capsys):
    from probes import head_pooling

    flags = ["--model", tiny_dir, "--budget", "64", "--buffer", "12", "--distance", "90", "--instances", "2",
             "--batch", "2", "--parity", "0", "--no-figure"]
    cfg = tmp_path / "config.json"
    cfg.write_text('{"important":1}')
    with pytest.raises(SystemExit):  # --out is a folder: a file given there is refused, untouched
        head_pooling.main([*flags, "--out", str(cfg)])
    assert "--out: " in capsys.readouterr().err and cfg.read_text() == '{"important":1}'
    # a foreign file that has the results file's name in the folder is refused too, untouched
    folder = tmp_path / "mine"
    assert head_pooling.main([*flags, "--out", str(folder)]) == 0
    (path,) = folder.glob("*.jsonl")
    path.write_text('{"important":1}')
    with pytest.raises(SystemExit):
        head_pooling.main([*flags, "--out", str(folder)])
    assert "not a results file written by randattn" in capsys.readouterr().err
    assert path.read_text() == '{"important":1}'


def test_planted_probe_resume_after_a_torn_batch_matches_an_uninterrupted_run(tiny_dir, tmp_path):
    from probes import head_pooling
    from analysis.planted import summarize

    args = ["--model", tiny_dir, "--budget", "64", "--buffer", "12", "--distance", "90", "--instances", "4",
            "--batch", "2", "--parity", "0", "--no-figure"]
    assert head_pooling.main(args + ["--out", str(tmp_path / "whole")]) == 0
    (whole,) = (tmp_path / "whole").glob("*.jsonl")
    cut = tmp_path / "cut" / whole.name
    cut.parent.mkdir()
    lines = whole.read_bytes().splitlines(keepends=True)
    cut.write_bytes(b"".join(lines[:19]) + lines[19][:30])  # mid-batch, mid-line
    assert head_pooling.main(args + ["--out", str(cut.parent)]) == 0
    a = [json.loads(x) for x in whole.read_text().splitlines()]
    b = [json.loads(x) for x in cut.read_text().splitlines()]
    strip = lambda rows: sorted((json.dumps({k: v for k, v in r.items() if k != "config"}, sort_keys=True)  # noqa: E731
                                 for r in rows))
    assert strip(a) == strip(b) and len(b) == len(a)
    names = sorted({r["condition"] for r in a})
    sa, sb = summarize(a, names), summarize(b, names)
    assert all(sa[n].recall.value == sb[n].recall.value if sa[n].recall else True for n in names)
