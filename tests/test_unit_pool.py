"""Units side by side (probes.unit_pool): the same rows file, byte for byte, as one process writes, and the auto rule."""

import json

import pytest
import torch

from probes import unit_pool

SMALL = ["--budget", "64", "--buffer", "12", "--distance", "90", "--batch", "2", "--parity", "0", "--no-figure"]


def test_two_processes_write_the_file_one_process_writes(tiny_dir, tmp_path):
    from probes import head_pooling

    files = {}
    for n in (1, 2):
        out = tmp_path / f"p{n}"
        assert head_pooling.main(["--model", tiny_dir, "--out", str(out), "--instances", "6", "--processes", str(n),
                                  *SMALL]) == 0
        files[n] = {p.name: p.read_bytes() for p in out.glob("*.jsonl")}
    assert files[1] and files[1] == files[2]
    # resumed by one process after two: nothing recomputed, the file unchanged
    out = tmp_path / "p2"
    assert head_pooling.main(["--model", tiny_dir, "--out", str(out), "--instances", "6", "--processes", "1",
                              *SMALL]) == 0
    assert {p.name: p.read_bytes() for p in out.glob("*.jsonl")} == files[1]


class _Unit:
    def __init__(self, kind):
        self.kind = kind


def test_auto_rule(tiny, monkeypatch):
    from probes.units import KINDS

    model = tiny("llama")
    units = [_Unit("planted"), _Unit("planted")]
    monkeypatch.setattr(unit_pool, "_cores", lambda: 2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert unit_pool.pool_size(0, model, units, KINDS) == 2
        assert unit_pool.pool_size(0, model, units[:1], KINDS) == 1  # one unit: nothing to share
        assert unit_pool.pool_size(0, model, [_Unit("made-here"), _Unit("planted")], KINDS) == 1  # not importable there
        assert unit_pool.pool_size(3, model, units, KINDS) == 2  # never more processes than units
        monkeypatch.setattr(unit_pool, "_ram", lambda: 1000)  # two more copies do not fit
        assert unit_pool.pool_size(0, model, units, KINDS) == 1
        torch.set_num_threads(1)  # OMP_NUM_THREADS=1: one core asked for
        monkeypatch.setattr(unit_pool, "_ram", lambda: 2**40)
        assert unit_pool.pool_size(0, model, units, KINDS) == 1
        assert unit_pool.pool_size(2, model, units, KINDS) == 2  # unless asked
    finally:
        torch.set_num_threads(threads)


def test_processes_must_not_be_negative(tiny_dir, tmp_path, capsys):
    from probes import head_pooling

    with pytest.raises(SystemExit):
        head_pooling.main(["--model", tiny_dir, "--out", str(tmp_path), "--processes", "-1", *SMALL])
    assert "processes" in capsys.readouterr().err


def test_the_leaderboards_passcode_and_planted_batches_run_in_one_process(tiny_dir, tmp_path):
    """Their batches extend one scratch run per policy (probes.leaderboard): --processes 2 runs them in plan order in
    one process (it once broke the pool: two workers locked one scratch folder) and writes the one-process rows."""
    from probes import leaderboard

    small = ["--model", tiny_dir, "--tasks", "passcode", "planted", "--policies", "recency", "--passcode-instances",
             "4", "--planted-instances", "4", "--rounds", "3", "--distance", "60", "--batch", "2", "--budget", "240",
             "--buffer", "8", "--no-figure"]
    rows = {}
    for n in (1, 2):
        out = tmp_path / f"p{n}"
        assert leaderboard.main([*small, "--out", str(out), "--processes", str(n)]) == 0
        rows[n] = {p.name: [{k: v for k, v in json.loads(line).items() if k != "config"}
                            for line in p.read_text().splitlines()] for p in out.glob("*/*.jsonl")}
    assert set(rows[1]) == {"passcode.jsonl", "planted.jsonl"} and rows[1] == rows[2]


def test_a_workers_refusal_reaches_the_driver_as_itself():
    """A ConfigError raised in a pool process is pickled back whole (field and message), not a broken pool."""
    import pickle

    from probes.config_errors import ConfigError

    back = pickle.loads(pickle.dumps(ConfigError("budget", "must be positive")))
    assert isinstance(back, ConfigError) and (back.field, back.message) == ("budget", "must be positive")
    assert str(back) == "--budget: must be positive"
