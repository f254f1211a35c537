"""``bench.grid_overhead``: the per-arm summary read from a grid's item files, and two local arms end to end on the
tiny model writing the same rows. Timing is never asserted."""

import json
from datetime import datetime

import pytest

from bench import grid_overhead
from test_grid import _acc_spec  # 12 items in 8 batches of <= 2 on the tiny model


def _item(unit, seconds, finished, worker="w0"):
    return {"id": f"{unit}-{seconds}", "unit": unit, "seconds": seconds, "finished": finished, "worker": worker}


def test_summary_sums_each_batch_and_finds_the_first():
    started = datetime(2026, 12, 1, 10, 0, 0).timestamp()
    records = [_item("a", 2.0, "2026-12-01T10:00:09"), _item("a", 2.0, "2026-12-01T10:00:09"),
               _item("b", 3.0, "2026-12-01T10:00:15", "w1")]
    s = grid_overhead.summarize(records, started, wall=20.0)
    # batch a: 2 items x 2 s = 4 s, ended 9 s after the start, so it began at 5 s; batch b took 3 s
    assert s["start_to_first_batch_s"] == pytest.approx(5.0)
    assert s["median_batch_s"] == pytest.approx(3.5) and s["batches"] == 2 and s["workers"] == 2
    assert s["items"] == 3 and s["items_per_s"] == pytest.approx(3 / 20)


def test_two_local_arms_write_the_same_rows(tiny_dir, tmp_path, capsys):
    out = tmp_path / "overhead.json"
    spec = _acc_spec(tmp_path, tiny_dir)
    assert grid_overhead.main(["--spec", spec, "--arms", "local", "local1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["engine"] == "paper" and data["meta"]["arms"] == ["local", "local1"]
    assert [r["arm"] for r in data["rows"]] == ["local", "local1"]
    for r in data["rows"]:
        assert r["items"] == 12 and r["batches"] == 8 and r["workers"] == 1 and r["same_rows_as_first_arm"]
        assert 0 < r["median_batch_s"] < r["wall_s"] and 0 <= r["start_to_first_batch_s"] < r["wall_s"]


def test_a_missing_spec_names_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        grid_overhead.main(["--spec", str(tmp_path / "none.toml")])
    assert exc.value.code == 2 and "--spec" in capsys.readouterr().err
