"""probes.calibrate_regime (issue 37 item 1): the pre-declared rule, the readers of each probe's rows, the refusal to
pick silently, and the sweep end to end on a tiny model through the probes' real command lines."""

from __future__ import annotations

import csv
import json

import pytest

from probes import calibrate_regime as cr


def _p(value, ceiling, random, recency):
    return {"value": value, "scores": {"ceiling": ceiling, "random": random, "recency": recency}}


def test_the_rule_picks_random_closest_to_half_among_qualifying_points():
    points = [_p(4, 1.0, 0.95, 0.2),   # Random at the ceiling: cannot tell
              _p(8, 0.9, 0.7, 0.4),    # qualifies
              _p(16, 0.85, 0.45, 0.1),  # qualifies, Random closest to 0.5
              _p(32, 0.7, 0.3, 0.0),   # the ceiling fails
              _p(57, 0.9, 0.0, 0.0)]   # Random at the floor
    chosen, reason = cr.choose(points)
    assert chosen["value"] == 16 and "2 of 5 points qualify" in reason


def test_ties_go_to_the_earlier_value_and_a_missing_arm_never_qualifies():
    chosen, _ = cr.choose([_p(8, 0.9, 0.4, 0.1), _p(16, 0.9, 0.6, 0.1)])
    assert chosen["value"] == 8
    chosen, reason = cr.choose([{"value": 8, "scores": {"ceiling": 0.9, "random": 0.5, "recency": None}}])
    assert chosen is None and "no point satisfies" in reason


def test_no_discriminating_point_is_reported_with_the_sweep():
    chosen, reason = cr.choose([_p(8, 0.9, 0.0, 0.0), _p(16, 0.9, 0.0, 0.0)])
    assert chosen is None
    assert "ceiling >= 0.8, recency <= 0.5, 0.1 <= Random <= 0.9" in reason and "16: ceiling 0.900" in reason


def test_the_fallback_tier_is_used_only_when_asked_and_only_when_the_rule_finds_nothing():
    # the passcode's shape at T=512, r=64: recency holds the fact while Random is off the floor, then both lose it
    points = [_p(4, 1.0, 0.25, 1.0), _p(6, 0.875, 0.125, 0.875), _p(8, 0.875, 0.062, 0.938), _p(10, 0.9, 0.0, 0.0)]
    assert cr.choose(points)[0] is None  # the rule alone never picks silently
    chosen, reason = cr.choose(points, fallback=True)
    assert chosen["value"] == 4 and chosen["tier"] == "fallback"
    assert "fallback" in reason and "recency is not below Random" in reason and "no point satisfies" in reason
    # a point that satisfies the rule wins over the fallback, which then plays no part
    chosen, reason = cr.choose(points + [_p(12, 0.9, 0.2, 0.3)], fallback=True)
    assert chosen["value"] == 12 and chosen["tier"] == "rule" and "fallback" not in reason
    # the fallback still needs a ceiling that succeeds and Random off the floor
    chosen, reason = cr.choose([_p(4, 0.7, 0.25, 1.0), _p(8, 0.9, 0.05, 0.9)], fallback=True)
    assert chosen is None and "fallback" in reason


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_readers_take_each_arm_from_the_probes_rows(tmp_path):
    pc = tmp_path / "pc"
    _write(pc / "random.jsonl", [{"condition": "policy", "retrieved": True, "config": {"policy": "random"}},
                                 {"condition": "full", "retrieved": True, "config": {"policy": "random"}},
                                 {"condition": "kept", "retrieved": True, "config": {"policy": "random"}}])
    _write(pc / "recency.jsonl", [{"condition": "policy", "retrieved": False, "config": {"policy": "recency"}}])
    assert cr._passcode_read(pc, 8) == {"ceiling": [1.0], "random": [1.0], "recency": [0.0]}
    pl = tmp_path / "pl"
    _write(pl / "planted.jsonl", [{"policy": "random", "condition": "all", "retrieved": True},
                                  {"policy": "random", "condition": "deleted", "retrieved": False},
                                  {"policy": "random", "condition": "policy", "retrieved": False},
                                  {"policy": "recency", "condition": "all", "retrieved": True},
                                  {"policy": "recency", "condition": "policy", "retrieved": False}])
    _write(pl / "work" / "planted" / "x" / "planted.jsonl", [{"policy": "random", "condition": "policy",
                                                              "retrieved": True}])  # scratch: not read
    assert cr._board_read("planted")(pl, 8) == {"ceiling": [1.0], "random": [0.0], "recency": [0.0]}
    cp = tmp_path / "cp"
    _write(cp / "copy.jsonl", [{"policy": "full", "budget": None, "grade": 1.0},
                               {"policy": "random", "budget": 128, "grade": 0.25},
                               {"policy": "random", "budget": 192, "grade": 0.75},
                               {"policy": "recency", "budget": 128, "grade": 0.0}])
    assert cr._copy_read(cp, 128) == {"ceiling": [1.0], "random": [0.25], "recency": [0.0]}


@pytest.mark.parametrize("argv,words", [(["passcode", "--values", "8", "8"], "distinct positive"),
                                        (["passcode", "--values", "0"], "distinct positive"),
                                        (["copy", "--values", "128", "--units", "0"], "--units must be a positive")])
def test_bad_arguments_are_refused(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        cr.main(argv)
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_a_sweep_that_finds_nothing_writes_it_and_exits_3(tmp_path, monkeypatch):
    def fake_call(cmd):  # the probe's run: every arm at the floor but the ceiling
        out = cmd[cmd.index("--out") + 1]
        from pathlib import Path
        _write(Path(out) / "random.jsonl", [{"condition": c, "retrieved": c == "full", "config": {"policy": "random"}}
                                            for c in ("policy", "full")])
        _write(Path(out) / "recency.jsonl", [{"condition": "policy", "retrieved": False,
                                              "config": {"policy": "recency"}}])
        return 0

    monkeypatch.setattr(cr.subprocess, "call", fake_call)
    assert cr.main(["passcode", "--values", "4", "8", "--out", str(tmp_path)]) == 3
    regime = json.loads((tmp_path / "passcode" / "regime.json").read_text())
    assert regime["chosen"] is None and "no point satisfies" in regime["reason"]
    assert regime["rule"] == cr.RULE and regime["settings"]["buffer"] == 64
    rows = list(csv.DictReader(open(tmp_path / "passcode" / "sweep.csv")))
    assert [(r["value"], r["arm"], r["score"]) for r in rows[:3]] == [("4", "ceiling", "1.0"), ("4", "random", "0.0"),
                                                                        ("4", "recency", "0.0")]


def test_the_sweep_runs_the_real_probe_on_a_tiny_model(tiny_dir, tmp_path):
    """Two passcode points through ``python -m probes.passcode`` itself: the command lines are the probe's, every
    arm gets its rows, and the rule is applied (a random-weight model retrieves nothing, so nothing qualifies)."""
    rc = cr.main(["passcode", "--values", "3", "4", "--units", "2", "--budget", "80", "--buffer", "12",
                  "--model", tiny_dir, "--out", str(tmp_path)])
    regime = json.loads((tmp_path / "passcode" / "regime.json").read_text())
    assert rc == (0 if regime["chosen"] else 3)
    for point in regime["points"]:
        assert set(point["scores"]) == {"ceiling", "random", "recency"}
        assert all(v is not None for v in point["scores"].values()), point
    rows = list(csv.DictReader(open(tmp_path / "passcode" / "sweep.csv")))
    assert len(rows) == 6 and all(r["n"] == "2" for r in rows)
