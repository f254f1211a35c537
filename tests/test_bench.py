"""Every benchmark end to end on a tiny model in seconds: result structure and the invariants that can fail
(KV bytes at the K + r bound, batches within the memory budget, replay equal to token-by-token). Timing is
never asserted."""

import json
from pathlib import Path

import pytest
import torch

PROMPT_LEN = 70  # bench.common.PROMPT under SmolLM2's chat template
K, R = 80, 8
BYTES_PER_POS = 2 * 2 * 3 * 16 * 4  # K and V x 2 layers x 3 KV heads x head dim 16 x fp32 (tiny_dir)


def _load(path):
    data = json.loads(Path(path).read_text())
    assert {"model", "device", "dtype", "torch_threads", "git", "budget", "buffer"} <= set(data["meta"])
    return data["rows"]


@pytest.fixture(scope="module")
def tiny_stats(tiny_dir, tmp_path_factory):
    """TriAttention statistics of the tiny model (a few random sequences are enough to have the right shape)."""
    import randattn
    from randattn.calibrate import calibrate

    model, _ = randattn.load_model(tiny_dir, device="cpu")
    path = tmp_path_factory.mktemp("stats") / "tiny.pt"
    calibrate(model, [torch.randint(3, 1000, (1, 48), generator=torch.Generator().manual_seed(0))],
              progress=False).save(path)
    return str(path)


def test_decode_reuses_the_shared_runner(tiny_dir, tmp_path):
    from bench import decode

    out = tmp_path / "decode.json"
    assert decode.main(["--model", tiny_dir, "--out", str(out), "--new-tokens", "40", "--budget", str(K),
                        "--buffer", str(R), "--batches", "2", "--repeats", "2"]) == 0
    rows = _load(out)
    # the arms run twice, the second time in reverse order
    assert [(r["policy"], r["repeat"]) for r in rows] == [("full", 0), ("window", 0), ("random", 0), ("random", 1),
                                                          ("window", 1), ("full", 1)]
    full, window, rnd = rows[:3]
    assert full["policy"] == "full" and full["kv_bytes_end"] == 2 * (PROMPT_LEN + 40 - 1) * BYTES_PER_POS
    assert rnd["kv_bytes_end"] == 2 * (K + R) * BYTES_PER_POS and rnd["rounds_per_layer"] >= 3
    # HF's sliding window holds the last T + r - 1 pairs between steps: the same memory as the evicting cache
    assert window["window"] == K + R and window["kv_bytes_end"] == 2 * (K + R - 1) * BYTES_PER_POS
    assert {"engine", "git", "date"} <= set(json.loads(out.read_text())["meta"])


def test_decode_without_full_attention_runs_the_window_and_the_policies(tiny_dir, tmp_path, capsys):
    from bench import decode

    out = tmp_path / "decode.json"
    assert decode.main(["--model", tiny_dir, "--out", str(out), "--new-tokens", "40", "--budget", str(K),
                        "--buffer", str(R), "--batches", "2", "--no-full"]) == 0
    assert [r["policy"] for r in _load(out)] == ["window", "random"]
    printed = capsys.readouterr().out
    assert "random" in printed and "wrote" in printed


def test_equal_memory_fits_each_cache_in_the_budget(tiny_dir, tmp_path):
    from bench import equal_memory

    out = tmp_path / "em.json"
    assert equal_memory.main(["--model", tiny_dir, "--out", str(out), "--new-tokens", "100", "--budget", str(K),
                              "--buffer", str(R), "--base-batch", "3", "--policies", "random", "recency"]) == 0
    rows = _load(out)
    memory = 3 * (PROMPT_LEN + 100 - 1) * BYTES_PER_POS
    assert [r["policy"] for r in rows] == ["full", "random", "recency"]
    assert rows[0]["batch"] == 3 and rows[0]["kv_bytes_peak"] == memory
    for r in rows[1:]:
        assert r["batch"] == memory // ((K + R) * BYTES_PER_POS) > 3  # the largest batch that fits
        assert r["kv_bytes_peak"] == r["kv_bytes_end"] == r["batch"] * (K + R) * BYTES_PER_POS
        assert r["rounds_per_layer"] >= 10
    assert all(r["kv_memory"] == memory and r["fits"] and r["kv_bytes_peak"] <= memory for r in rows)
    assert rows[0]["x_full_tokens_per_s"] == 1.0


def test_batch_scaling_runs_every_selector(tiny_dir, tiny_stats, tmp_path):
    from bench import batch_scaling

    out = tmp_path / "bs.json"
    assert batch_scaling.main(["--model", tiny_dir, "--out", str(out), "--new-tokens", "60", "--budget", "110",
                               "--buffer", str(R), "--batches", "1", "3", "--stats", tiny_stats]) == 0
    rows = _load(out)
    assert [(r["batch"], r["policy"]) for r in rows] == [
        (b, p) for b in (1, 3) for p in ("full", "random", "snapkv", "rkv", "triattention")]
    for r in rows:
        if r["policy"] == "full":
            assert r["x_full"] == 1.0 and "round_share" not in r
        else:
            assert r["rounds_per_layer"] >= 2 and r["rounds_all_layers_equal"]
            assert 0 < r["round_share"] < 1 and r["ms_per_round"] > 0
            assert r["kv_bytes_end"] == r["batch"] * (110 + R) * BYTES_PER_POS


def test_replay_speed_matches_token_by_token(tiny_dir, tmp_path):
    from bench import replay_speed

    out = tmp_path / "rs.json"
    assert replay_speed.main(["--model", tiny_dir, "--out", str(out), "--new-tokens", "90", "--budget", "110",
                              "--buffer", str(R), "--batch", "2", "--policies", "random", "snapkv"]) == 0
    rows = _load(out)
    assert [r["policy"] for r in rows] == ["random", "snapkv"]
    for r in rows:
        assert r["rounds_per_layer"] >= 5
        assert r["same_keep_sets"] and r["same_argmax"] and r["same_rounds"]
        assert r["max_abs_logprob_diff"] <= 1e-4
        assert r["tokenwise_forwards"] == 1 + 90 and r["replay_forwards"] < r["tokenwise_forwards"] / 4


def test_memory_runs_each_arm_in_its_own_process(tiny_dir, tmp_path):
    from bench import memory

    out = tmp_path / "mem.json"
    assert memory.main(["--model", tiny_dir, "--out", str(out), "--new-tokens", "60", "--budget", str(K),
                        "--buffer", str(R), "--batch", "2"]) == 0
    full, rnd = _load(out)
    assert full["kv_bytes_peak"] == 2 * (PROMPT_LEN + 60 - 1) * BYTES_PER_POS
    assert rnd["kv_bytes_peak"] == 2 * (K + R) * BYTES_PER_POS and rnd["rounds_per_layer"] >= 3
    for r in (full, rnd):
        assert r["rss_peak"] >= r["rss_peak_before"] > 50 * 2**20  # a real process high-water mark, not zero


@pytest.mark.parametrize("script,flags,needle", [
    ("equal_memory", ["--policies", "nope"], "--policies: 'nope' is unknown"),
    ("batch_scaling", ["--policies", "triattention"], "--stats FILE"),
    ("replay_speed", ["--traces", "missing.jsonl"], "--traces missing.jsonl: no such file"),
    ("memory", ["--budget", "40"], "--budget 40 cannot hold the protected prompt of 70 tokens"),
    ("equal_memory", ["--new-tokens", "5"], "raise --new-tokens"),
])
def test_bad_flags_name_the_flag(tiny_dir, script, flags, needle, capsys, tmp_path):
    import importlib

    mod = importlib.import_module(f"bench.{script}")
    with pytest.raises(SystemExit):
        mod.main(["--model", tiny_dir, "--out", str(tmp_path / "x.json"), "--budget", str(K), "--buffer", str(R),
                  *flags])
    assert needle in capsys.readouterr().err


def test_bench_is_a_package_without_sys_path_edits():
    """bench/ imports probes and its own modules by package (installed, or the checkout as cwd), never by editing sys.path."""
    root = Path(__file__).resolve().parents[1]
    for f in sorted((root / "bench").glob("*.py")):
        assert "sys.path" not in f.read_text(), f"{f.name} edits sys.path"


def test_python_m_bench_runs_from_the_repo_root():
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # `python -m` puts the cwd first on sys.path
    res = subprocess.run([sys.executable, "-m", "bench.round_cost", "--help"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout and "--repeats" in res.stdout
