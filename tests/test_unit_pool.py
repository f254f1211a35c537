"""Units side by side (probes.unit_pool): the same rows file, byte for byte, as one process writes, and the auto rule."""

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
