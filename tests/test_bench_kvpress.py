"""The kvpress peer benchmark without kvpress: our side end to end on a tiny model (--skip-peer), the worker's
request parsing, the reading of its output, and the key-matching order check. Timing is never asserted."""

import json

import pytest
import torch

from bench import _kvpress_worker as worker  # imports only torch: no kvpress needed

K, R = 80, 8  # the tiny prompt is 70 tokens


def test_our_side_runs_and_checks_positions(tiny_dir, tmp_path):
    from bench import kvpress_peer

    out = tmp_path / "peer.json"
    assert kvpress_peer.main(["--model", tiny_dir, "--skip-peer", "--out", str(out), "--new-tokens", "40",
                              "--budget", str(K), "--buffer", str(R), "--batches", "1", "2", "--check-tokens", "60"]) == 0
    data = json.loads(out.read_text())
    assert {"model", "torch_threads", "machine", "ours_versions", "budget", "buffer", "new_tokens"} <= set(data["meta"])
    assert "peer" not in data["meta"]
    policies = ["full", "random", "streamingllm", "snapkv"]
    assert [(r["side"], r["batch"], r["policy"]) for r in data["rows"]] == \
        [("ours", b, p) for b in (1, 2) for p in policies]
    assert all(r["rounds_per_layer"] >= 3 for r in data["rows"] if r["policy"] != "full")
    for c in data["comparison"]:
        assert c["ours_tokens_per_s"] > 0 and c["kvpress_tokens_per_s"] is None and c["ours_over_kvpress"] is None
    checks = data["order_checks"]["ours"]
    assert set(checks) == set(policies[1:])
    for c in checks.values():
        # Our cache: exact post-RoPE keys, every head chronological, the recovered positions are the cache's own.
        assert c["keys_exact"] and c["distinct"] and c["matches_cache_positions"]
        assert c["chronological_heads"] == c["heads"] == 3 and K <= c["kept_per_head"] < K + R
        assert c["newest_kept"] == c["newest_position"] == 70 + 60 - 2


def test_repeats_time_every_arm_again_and_report_medians(tiny_dir, tmp_path):
    from bench import kvpress_peer

    out = tmp_path / "peer.json"
    assert kvpress_peer.main(["--model", tiny_dir, "--skip-peer", "--out", str(out), "--new-tokens", "24",
                              "--budget", str(K), "--buffer", str(R), "--batches", "1", "--repeats", "3",
                              "--policies", "random", "--check-tokens", "0"]) == 0
    data = json.loads(out.read_text())
    assert [(r["policy"], r["repeat"]) for r in data["rows"]] == [(p, i) for i in range(3) for p in ("full", "random")]
    [full, rnd] = data["comparison"]
    assert rnd["repeats"] == 3 and len(rnd["ours_runs"]) == 3
    assert rnd["ours_tokens_per_s"] == sorted(rnd["ours_runs"])[1]
    assert rnd["ours_x_full"] == pytest.approx(rnd["ours_tokens_per_s"] / sorted(full["ours_runs"])[1])


def test_no_full_times_the_evicting_arms_only(tiny_dir, tmp_path, capsys):
    from bench import kvpress_peer

    out = tmp_path / "peer.json"
    assert kvpress_peer.main(["--model", tiny_dir, "--skip-peer", "--out", str(out), "--new-tokens", "24",
                              "--budget", str(K), "--buffer", str(R), "--batches", "2", "--policies", "random",
                              "--no-full", "--check-tokens", "0"]) == 0
    data = json.loads(out.read_text())
    assert [(r["batch"], r["policy"]) for r in data["rows"]] == [(2, "random")]
    [rnd] = data["comparison"]
    assert rnd["ours_tokens_per_s"] > 0 and rnd["ours_x_full"] is None
    assert kvpress_peer.peer_request(kvpress_peer.parse_args(["--no-full"])[1], torch.tensor([[1, 2]]), 8,
                                     check=False)["full"] is False
    assert "random" in capsys.readouterr().out  # the table prints without ratios to full attention


def test_medians_pair_each_side_with_its_own_full_attention():
    from bench.kvpress_peer import ratio_rows

    rows = [{"side": side, "batch": 8, "policy": policy, "tokens_per_s": tps}
            for side, policy, values in (("ours", "full", (60, 75, 65)), ("ours", "random", (90, 80, 40)),
                                         ("kvpress", "full", (50, 30, 45)), ("kvpress", "random", (40, 60, 55)))
            for tps in values]
    [full, rnd] = ratio_rows(rows)
    assert (rnd["ours_tokens_per_s"], rnd["kvpress_tokens_per_s"]) == (80, 55)
    assert rnd["ours_x_full"] == pytest.approx(80 / 65) and rnd["kvpress_x_full"] == pytest.approx(55 / 45)
    assert rnd["ours_over_kvpress"] == pytest.approx(80 / 55) and full["ours_over_kvpress"] == pytest.approx(65 / 45)


def test_flag_errors_name_the_flag(capsys):
    from bench import kvpress_peer

    with pytest.raises(SystemExit):
        kvpress_peer.main(["--buffer", "8", "--snapkv-window", "8"])
    assert "--snapkv-window: 8 must be below --buffer 8" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        kvpress_peer.main(["--peer-python", "/nonexistent/bin/python"])
    assert exc.value.code == 1 and "--peer-python /nonexistent/bin/python does not exist" in capsys.readouterr().err


def _request(**over):
    req = {"model": {"gguf": "/x/m.gguf"}, "prompt_ids": [1, 2, 3], "batch": 1, "new_tokens": 8, "budget": 4,
           "buffer": 2, "policies": ["random"]}
    req.update(over)
    return json.dumps({k: v for k, v in req.items() if v is not None})


def test_worker_request_parsing():
    req = worker.parse_request(_request())
    assert req["check_tokens"] == 0 and req["threads"] is None and req["n_sink"] == 4 and req["full"] is True
    assert worker.parse_request(_request(full=False))["full"] is False
    bad = {
        "'full' must be bool": _request(full=0),
        "lacks 'budget'": _request(budget=None),
        "'batch' must be int": _request(batch="1"),
        "'buffer' must be positive": _request(buffer=0),
        "no counterpart": _request(policies=["h2o"]),
        "'model' must be": _request(model={"path": "x"}),
        "unknown fields": _request(extra=1),
        "snapkv_window 32 must be below buffer 2": _request(policies=["snapkv"]),
        "not JSON": "{",
    }
    for message, text in bad.items():
        with pytest.raises(worker.RequestError, match=message):
            worker.parse_request(text)


def test_worker_main_refuses_a_bad_request(tmp_path, capsys):
    path = tmp_path / "req.json"
    path.write_text(_request(policies=["h2o"]))
    assert worker.main([str(path)]) == 2
    assert "kvpress has no counterpart" in capsys.readouterr().err


def test_worker_output_is_read_from_its_last_line():
    from bench._kvpress_env import PeerEnvError
    from bench.kvpress_peer import parse_worker_output

    assert parse_worker_output('noise\n{"rows": [], "versions": {}}\n')["rows"] == []
    for text in ("", "Traceback ...", '{"versions": {}}'):
        with pytest.raises(PeerEnvError):
            parse_worker_output(text)


def test_key_matching_recovers_positions_and_order():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 50, 16, generator=g)
    chrono = torch.tensor([[0, 1, 7, 30, 49], [2, 3, 4, 40, 49]])
    scrambled = torch.tensor([[30, 0, 49, 7, 1], [2, 49, 3, 40, 4]])
    for kept, expect_sorted in ((chrono, 2), (scrambled, 0)):
        keys = torch.stack([full[h, kept[h]] for h in range(2)]) + 1e-7
        pos, rel = worker.match_positions(keys, full)
        assert torch.equal(pos, kept) and float(rel.max()) < 1e-4
        s = worker.order_summary(pos, rel, prompt_len=5, seq_len=50)
        assert s["chronological_heads"] == expect_sorted and s["keys_exact"] and s["newest_kept"] == 49
        assert s["prompt_kept_per_head"] == [2, 3]
    # A key rotated to the wrong position matches nothing exactly.
    pos, rel = worker.match_positions(full[:, :3] * 1.5, full)
    assert not worker.order_summary(pos, rel, prompt_len=5, seq_len=50)["keys_exact"]
