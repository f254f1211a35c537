"""The accuracy harness's teacher-forced endpoint (``--reference-lp``): full attention's output replayed through every
arm's cache. Checked against independent computations (a plain HF forward without any cache for full attention;
``randattn.replay`` on a fresh cache of the same spec and seed for an evicting arm), end to end on the tiny model
(the reference is full attention's run 0 under greedy decoding, its run k when sampling, so a deterministic selector
gets variance within a problem), and through an interrupted last stage and a grid, which give the same rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import randattn
from test_kill_resume import _measured

FLAGS = ["--task", "copy", "--buffer", "8", "--max-new-tokens", "24", "--budget", "224", "--problems", "2",
         "--no-figure"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _files(folder: Path) -> tuple[Path, Path]:
    (ref,) = folder.glob("*.reference_lp*.jsonl")
    (gen,) = [p for p in folder.glob("*.jsonl") if p != ref]
    return gen, ref


def _run(tiny_dir, folder: Path, *flags) -> tuple[Path, Path]:
    from probes import accuracy

    assert accuracy.main(["--model", tiny_dir, "--out", str(folder), *FLAGS, *flags]) == 0
    return _files(folder)


def test_full_attentions_reference_lp_is_a_plain_forward_without_any_cache(tiny):
    """For full attention the replay through its never-evicting cache is the model's own log-prob of the reference:
    one forward of prompt + reference with no cache at all gives the same mean, to float tolerance."""
    from probes.accuracy import Arm, reference_lp

    model = tiny("llama")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 200, (40,), generator=g).tolist()
    reference = torch.randint(3, 200, (37,), generator=g).tolist()
    out = reference_lp(model, prompt, reference, Arm("full", None, None), seed=0, buffer=8, stats=None, options={})
    ids = torch.tensor([prompt + reference])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits.double()
    lp = torch.log_softmax(logits[0, len(prompt) - 1:-1], -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
    assert out["ref_tokens"] == 37 and out["events"] == 0
    assert out["ref_lp_sum"] == pytest.approx(float(lp.sum()), abs=1e-3)
    assert out["ref_lp"] == pytest.approx(float(lp.mean()), abs=1e-4)


@pytest.mark.parametrize("policy,row_key", [("random", None), ("random", "p3/run1"), ("snapkv", None)])
def test_an_evicting_arms_reference_lp_is_replay_on_a_fresh_cache_of_its_spec_and_seed(tiny, policy, row_key):
    from probes.accuracy import Arm, reference_lp

    model = tiny("llama")
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 200, (20,), generator=g).tolist()
    reference = torch.randint(3, 200, (60,), generator=g).tolist()
    arm = Arm(policy, 36, True)
    out = reference_lp(model, prompt, reference, arm, seed=11, buffer=4, stats=None, options={}, row_key=row_key)
    spec = randattn.EvictionSpec(policy, 36, 4, protect_prompt=True, seed=11)
    cache = spec.make_cache(row_keys=None if row_key is None else [row_key])
    res = randattn.replay(model, torch.tensor([prompt + reference]), cache, prompt_len=len(prompt))
    lps = res.logprobs[0, len(prompt):].double()
    assert out["ref_lp_sum"] == pytest.approx(float(lps.sum()), abs=1e-4)
    assert out["ref_lp"] == pytest.approx(float(lps.mean()), abs=1e-6)
    assert out["events"] > 0 and out["cache_events"] == cache.events[0]
    # a different seed (or no eviction) gives another log-prob: the arm's own draw is what was scored
    other = reference_lp(model, prompt, reference, arm, seed=12, buffer=4, stats=None, options={}, row_key=row_key)
    full = reference_lp(model, prompt, reference, Arm("full", None, None), seed=0, buffer=4, stats=None, options={})
    assert full["ref_lp"] != out["ref_lp"]
    if policy == "random":
        assert other["ref_lp"] != out["ref_lp"]


def test_greedy_reference_is_full_attentions_one_run_and_each_arm_replays_with_its_generation_seed(tiny_dir, tmp_path,
                                                                                                  capsys):
    gen, ref = _run(tiny_dir, tmp_path / "acc", "--policy", "random", "recency", "--runs", "2", "--reference-lp")
    assert ref.name == gen.name.replace(".jsonl", ".reference_lp.jsonl")
    gens, refs = _rows(gen), _rows(ref)
    assert {r["policy"] for r in gens} == {"full", "random", "recency"}  # full attention added: the reference
    keys = lambda rows: sorted((r["problem"], r["run"], r["policy"]) for r in rows)  # noqa: E731
    assert keys(refs) == keys(gens)  # every arm's (problem, run), full attention's too (the ceiling)
    tok = randattn.load_model(tiny_dir, device="cpu")[1]
    full = {r["problem"]: r["output"] for r in gens if r["policy"] == "full"}
    seeds = {(r["problem"], r["run"], r["policy"]): r["seed"] for r in gens}
    for r in refs:
        assert r["reference_run"] == 0  # greedy: full attention ran once
        assert r["ref_tokens"] == len(tok(full[r["problem"]], add_special_tokens=False)["input_ids"])
        assert r["seed"] == seeds[(r["problem"], r["run"], r["policy"])]
        assert r["ref_lp"] == pytest.approx(r["ref_lp_sum"] / r["ref_tokens"])
        assert (r["events"] > 0) == (r["policy"] != "full") and r["config"]["endpoint"] == "reference_lp"
    # Random's two runs replay the same reference with their own eviction seeds
    by = {(r["problem"], r["run"], r["policy"]): r["ref_lp"] for r in refs}
    assert any(by[(p, 0, "random")] != by[(p, 1, "random")] for p in full)
    printed = capsys.readouterr().out
    assert "reference log-prob: mean per token" in printed and "reference log-prob rows:" in printed


def test_sampling_gives_a_deterministic_selector_variance_within_a_problem(tiny_dir, tmp_path):
    """With --temperature > 0 every policy runs --runs times and run k's reference is full attention's sample k, so
    recency (which draws nothing) has different reference log-probs across the runs of one problem."""
    gen, ref = _run(tiny_dir, tmp_path / "acc", "--policy", "recency", "--runs", "2", "--temperature", "1.0",
                    "--reference-lp", "--reference-tokens", "12")
    assert ref.name.endswith(".reference_lp-t12.jsonl")
    gens, refs = _rows(gen), _rows(ref)
    full = {(r["problem"], r["run"]): r["output"] for r in gens if r["policy"] == "full"}
    assert len(full) == 4 and full[("copy-0", 0)] != full[("copy-0", 1)]  # full attention sampled per run
    recency = {(r["problem"], r["run"]): r for r in refs if r["policy"] == "recency"}
    assert len(recency) == 4 and all(r["reference_run"] == r["run"] and r["ref_tokens"] <= 12
                                     for r in recency.values())
    for problem in ("copy-0", "copy-1"):
        assert recency[(problem, 0)]["ref_lp"] != recency[(problem, 1)]["ref_lp"]
    from analysis.accuracy import endpoint_summary

    (line,) = [t for t in endpoint_summary(refs, "ref_lp") if t["policy"] == "recency"]
    assert line["runs"] == 2 and line["problems"] == 2


def test_an_interrupted_reference_stage_resumes_to_the_same_rows(tiny_dir, tmp_path, capsys):
    """Kill anywhere in the last stage (simulated: its file cut after a batch, with a torn line) and the rerun computes
    only the missing replays, ending with the rows of an uninterrupted run; the generations are not rerun."""
    flags = ("--policy", "random", "recency", "--runs", "2", "--reference-lp", "--batch", "1")
    gen, ref = _run(tiny_dir, tmp_path / "whole", *flags)
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copy(gen, cut / gen.name)
    lines = ref.read_text().splitlines(keepends=True)
    (cut / ref.name).write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    before = (cut / gen.name).read_bytes()
    capsys.readouterr()
    gen2, ref2 = _run(tiny_dir, cut, *flags)
    assert gen2.read_bytes() == before  # nothing regenerated
    printed = capsys.readouterr()
    assert "3 of 8 batch results already there" in printed.out + printed.err  # 2 full, 4 random, 2 recency
    assert _measured(_rows(ref2)) == _measured(_rows(ref))
    (cut / ref.name).unlink()  # the whole stage lost: recomputed the same
    assert _measured(_rows(_run(tiny_dir, cut, *flags)[1])) == _measured(_rows(ref))


def test_the_reference_stage_follows_the_compression_sweep_and_a_grid_writes_the_command_lines_rows(tiny_dir,
                                                                                                    tmp_path):
    from probes import accuracy, grid

    spec = tmp_path / "ref.toml"
    spec.write_text(f'''probe = "accuracy"
models = ["{tiny_dir}"]
task = "copy"
policies = ["random"]
compression = [2.0]
buffer = 8
max_new_tokens = 24
problems = 2
runs = 1
protect_prompt = false
reference_lp = true
''')
    assert grid.main([str(spec), "--out", str(tmp_path / "grid"), "--no-figure", "--cpus-per-worker", "1"]) == 0
    assert accuracy.main(["--model", tiny_dir, "--out", str(tmp_path / "cli"), "--task", "copy", "--policy", "random",
                          "--compression", "2", "--buffer", "8", "--max-new-tokens", "24", "--problems", "2",
                          "--runs", "1", "--no-protect-prompt", "--reference-lp", "--no-figure"]) == 0
    cli_gen, cli_ref = _files(tmp_path / "cli")
    (grid_ref,) = (tmp_path / "grid").rglob(cli_ref.name)
    (grid_gen,) = (tmp_path / "grid").rglob(cli_gen.name)
    assert _measured(_rows(grid_ref)) == _measured(_rows(cli_ref))
    assert _measured(_rows(grid_gen)) == _measured(_rows(cli_gen))
    refs = _rows(cli_ref)
    assert {(r["policy"], r["compression"]) for r in refs} == {("full", None), ("random", 2.0)}
