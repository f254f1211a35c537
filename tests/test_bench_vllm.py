"""``bench.vllm``: its result file and the docs' table rendered from it. The end-to-end run needs the vLLM
environment (``vllm`` marker, skipped without it); the table test runs anywhere."""

from __future__ import annotations

import json
import subprocess

import pytest

from figures import vllm_table
from tests.test_vllm_memory import ROOT, VENV_PYTHON, vllm_env

ARM_KEYS = {"arm", "batch", "wall_s", "requests_finished", "generated_tokens", "prompt_tokens", "kv_bytes",
            "max_running", "total_tokens_per_s", "output_tokens_per_s", "x_vllm_full", "cpu_s",
            "total_tokens_per_cpu_s"}
VLLM_KEYS = {"peak_blocks_used", "max_request_blocks", "running_steps", "steps", "preemptions", "tokens_computed",
             "num_blocks", "block_bytes"}


def _rendered(tmp_path, monkeypatch, data: dict) -> str:
    (tmp_path / "data" / "results" / "bench").mkdir(parents=True)
    (tmp_path / "data" / "results" / "bench" / "vllm.json").write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)  # figures.table_io reads data/results/ under the current folder first
    return "\n".join(vllm_table.table())


def _row(arm, batch, wall, **extra):
    row = {"arm": arm, "batch": batch, "wall_s": wall, "requests_finished": batch, "generated_tokens": 100 * batch,
           "prompt_tokens": 10 * batch, "kv_bytes": 2**20, "max_running": batch,
           "total_tokens_per_s": 110 * batch / wall, "output_tokens_per_s": 100 * batch / wall,
           "total_tokens_per_cpu_s": 55 * batch / wall, "cpu_s": 2 * wall, **extra}
    return row


def test_the_table_shows_every_arm_and_the_command(tmp_path, monkeypatch):
    counters = dict(peak_blocks_used=8, running_steps=30, steps=10, preemptions=2, tokens_computed=1234)
    rows = [_row("vllm full", 4, 10.0, **counters), _row("vllm random", 4, 4.0, **counters),
            _row("hf random", 1, 5.0)]
    for r in rows:
        r["x_vllm_full"] = r["total_tokens_per_s"] / rows[0]["total_tokens_per_s"]
    meta = {"requests": 4, "new_tokens": 100, "budget": 64, "buffer": 16, "block_size": 32, "blocks": 8,
            "hf_batches": [1], "torch_threads": 2, "prompt_lengths": [5, 13], "full_blocks_per_request": 4,
            "capped_blocks_per_request": 2, "vllm": "0.32.0", "torch": "2.13.0+cpu", "git": "abc1234",
            "engine": "paper", "date": "2026-12-02"}
    text = _rendered(tmp_path, monkeypatch, {"meta": meta, "rows": rows})
    lines = [line for line in text.splitlines() if line.startswith("| ")][1:]
    assert [line.split(" | ")[0] for line in lines] == [
        "| vLLM, full attention", "| vLLM + randattn Random", "| HF engine (EvictingCache Random), batch 1"]
    assert "**2.50×**" in lines[1] and "| 3.0 |" in lines[1]  # 2.5x full's tokens/s; 30 running over 10 steps
    assert ("--requests 4 --new-tokens 100 --budget 64 --buffer 16 --block-size 32 --blocks 8 --hf-batches 1 "
            "--threads 2") in text and "revision abc1234" in text


def test_both_engines_mask_eos_the_same_way():
    """Regression: the vLLM arms had ``ignore_eos`` only, which lets greedy pick EOS and go on from it, while the HF
    arm's ``min_new_tokens`` masks EOS; request 0 picks EOS at its 262nd token, so the arms' tokens parted there
    (bench/vllm_agreement.py measured it: vLLM equals the HF engine's unmasked decode loop over all 1,024 tokens).
    Both arms must now mask EOS for every token they generate."""
    from bench.vllm import hf_generation, vllm_sampling

    v, h = vllm_sampling(1024), hf_generation(1024)
    assert v["min_tokens"] == v["max_tokens"] == h["min_new_tokens"] == h["max_new_tokens"] == 1024
    assert v["temperature"] == 0.0 and v["ignore_eos"] and h["do_sample"] is False


def test_hf_batches_are_checked_only_when_the_hf_arm_runs(tmp_path, capsys):
    """Regression (issue 39): ``--arms "vllm full" "vllm random" --requests 8`` was refused because the HF arm's default
    batches (1 4 16) exceed 8, though that arm was excluded."""
    from bench.vllm import parse_args

    (tmp_path / "config.json").write_text("{}")
    model = ["--model", str(tmp_path)]
    args = parse_args(["--arms", "vllm full", "vllm random", "--requests", "8", *model])
    assert args.arms == ("vllm full", "vllm random") and args.requests == 8
    assert parse_args(["--requests", "8", "--hf-batches", "1", "4", "8", *model]).hf_batches == (1, 4, 8)
    with pytest.raises(SystemExit):  # the HF arm runs (the default arms): its batches must fit --requests
        parse_args(["--requests", "8", *model])
    err = capsys.readouterr().err
    assert "--hf-batches" in err and "[1, 4, 16]" in err and "--arms without 'hf random'" in err


@pytest.mark.vllm
@pytest.mark.skipif(not VENV_PYTHON.exists(), reason=f"no vLLM environment at {VENV_PYTHON}")
def test_a_small_run_writes_every_arm(tmp_path, monkeypatch):
    import randattn.models as models

    model = str(models.converted_embedded(models.DEFAULT_MODEL))
    out = tmp_path / "vllm.json"
    arms = ["vllm full", "vllm random", "vllm triattention", "vllm h2o", "hf random"]  # R-KV: as Random's plumbing
    proc = subprocess.run([str(VENV_PYTHON), "-m", "bench.vllm", "--requests", "2", "--new-tokens", "64", "--budget",
                           "104", "--buffer", "8", "--hf-batches", "2", "--threads", "1", "--model", model, "--out",
                           str(out), "--arms", *arms], cwd=ROOT, env=vllm_env(), capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    data = json.loads(out.read_text())
    assert [r["arm"] for r in data["rows"]] == arms
    by = {r["arm"]: r for r in data["rows"]}
    for arm in ("vllm random", "vllm triattention", "vllm h2o"):  # every evicting arm ran rounds, timed by phase
        t = by[arm]["round_s"]
        assert t["rounds"] > 0 and t["score"] > 0 and t["select"] > 0 and t["read"] > 0, (arm, t)
        assert by[arm]["x_vllm_random"] > 0 and by[arm]["evicting"]
    assert by["vllm h2o"]["round_s"]["accumulate"] > 0 == by["vllm random"]["round_s"]["accumulate"]
    assert by["vllm random"]["x_vllm_random"] == 1.0
    for r in data["rows"]:
        assert ARM_KEYS <= set(r) and r["requests_finished"] == r["batch"] == 2, r
        assert r["generated_tokens"] == 2 * 64 and r["wall_s"] > 0
    for r in data["rows"][:4]:
        assert VLLM_KEYS <= set(r), r
    assert data["rows"][1]["evicting"] and not data["rows"][0]["evicting"]
    # the prompts reach T + r = 112 and beyond, so the plugin capped blocks at ceil(112 / 32) = 4 per request
    assert data["rows"][1]["max_request_blocks"] == 4 < data["rows"][0]["max_request_blocks"]
    assert data["meta"]["vllm"] == "0.32.0" and data["rows"][0]["x_vllm_full"] == 1.0
    text = _rendered(tmp_path / "docs", monkeypatch, data)
    assert "HF engine (EvictingCache Random), batch 2" in text


def test_repeats_rotate_the_order_and_pair_ratios_within_a_repeat():
    """``--repeats`` (issue 39): every arm runs in every position once over len(arms) repeats, an arm's times are the
    medians of its repeats, and Random's ratio to an arm is the median of the ratios within each repeat (the two ran
    at neighbouring times), not a ratio of medians from different moments."""
    from bench.vllm import paired_ratios, rotated, summarize_runs

    arms = ["vllm full", "vllm random", "vllm triattention"]
    orders = [rotated(arms, k) for k in range(3)]
    assert orders[0] == arms and {tuple(o) for o in orders} == {tuple(arms[k:] + arms[:k]) for k in range(3)}
    assert all(sorted(o.index(a) for o in orders) == [0, 1, 2] for a in arms)  # every arm in every position once

    def run(arm, wall, cpu, tokens=((1, 2),)):
        return {"arm": arm, "wall_s": wall, "cpu_s": cpu, "tokens": [list(t) for t in tokens],
                "round_s": {"score": wall / 10, "select": 1.0}}

    rnd = [run("vllm random", w, 2 * w) for w in (100.0, 130.0, 90.0)]
    tri = [run("vllm triattention", w, 2 * w) for w in (110.0, 120.0, 99.0)]
    s = summarize_runs(tri)
    assert s["wall_s"] == 110.0 and s["wall_s_runs"] == [110.0, 120.0, 99.0] and s["cpu_s"] == 220.0
    assert s["repeats"] == 3 and s["round_s"] == {"score": 11.0, "select": 1.0}
    ratios = paired_ratios(rnd, tri)
    assert ratios == pytest.approx([1.1, 120 / 130, 1.1])  # the ratio of medians (110/100) would hide the middle one
    assert summarize_runs(rnd[:1]) == rnd[0]  # one repeat: the row as it was
    with pytest.raises(RuntimeError, match="different tokens"):
        summarize_runs([run("vllm random", 1.0, 1.0), run("vllm random", 1.0, 1.0, tokens=((1, 3),))])


def test_the_table_shows_the_range_of_repeated_ratios(tmp_path, monkeypatch):
    counters = dict(peak_blocks_used=8, running_steps=30, steps=10, preemptions=2, tokens_computed=1234)
    rows = [_row("vllm random", 4, 4.0, **counters), _row("vllm triattention", 4, 4.4, **counters)]
    for r in rows:
        r["x_vllm_full"] = None
    rows[0]["x_vllm_random"], rows[1]["x_vllm_random"], rows[1]["x_vllm_random_range"] = 1.0, 1.1, [0.92, 1.1]
    meta = {"requests": 4, "new_tokens": 100, "budget": 64, "buffer": 16, "block_size": 32, "blocks": 8,
            "hf_batches": [1], "torch_threads": 2, "prompt_lengths": [5, 13], "full_blocks_per_request": 4,
            "capped_blocks_per_request": 2, "vllm": "0.32.0", "torch": "2.13.0+cpu", "git": "abc1234",
            "engine": "paper", "date": "2026-12-02", "repeats": 3, "arms": ["vllm random", "vllm triattention"]}
    text = _rendered(tmp_path, monkeypatch, {"meta": meta, "rows": rows})
    assert "1.10× (0.92–1.10)" in text and "--repeats 3" in text and "ran 3 times" in text
