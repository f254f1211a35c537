"""The planted-fact probes end to end on a tiny model with the real tokenizer: results, resume, figures,
and clear errors for bad flags."""

import json

import pytest


SMALL = ["--budget", "64", "--buffer", "12", "--distance", "90", "--batch", "2", "--parity", "1"]


def _rows(path):
    """The rows of a results file, or of the one results file (``*.jsonl``) in a folder (``--out`` is a folder)."""
    if path.is_dir():
        (path,) = [p for p in path.glob("*.jsonl") if not p.name.startswith("nll-")]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_head_pooling_writes_rows_resumes_and_draws(tiny_dir, tmp_path, capsys):
    from probes import head_pooling

    out = tmp_path / "hp"
    args = ["--model", tiny_dir, "--out", str(out), "--figure-dir", str(tmp_path), *SMALL]
    assert head_pooling.main(args + ["--instances", "2"]) == 0
    first = _rows(out)
    assert len(first) == 2 * 10  # 8 head subsets, the fact left to the policy, the full cache
    assert {r["condition"] for r in first} >= {"deleted", "all", "h0", "h1+2", "policy"}
    assert all(r["config"]["budget"] == 64 and (r["rounds_after_fact"] >= 6) != (r["condition"] == "full") for r in first)
    text = capsys.readouterr().out
    assert "replay parity" in text and "audit" in text and "endpoints" in text
    assert (tmp_path / "head_pooling.png").exists() and (tmp_path / "head_pooling.pdf").exists()
    assert head_pooling.main(args + ["--instances", "3"]) == 0  # resume: only instance 2 is new
    rows = _rows(out)
    assert rows[: len(first)] == first and len(rows) == 3 * 10
    assert len({(r["instance"], r["condition"]) for r in rows}) == len(rows)
    # other settings go to another file (named by them); settings the name does not carry cannot be mixed in
    assert head_pooling.main(args + ["--instances", "2", "--budget", "80", "--no-figure", "--parity", "0"]) == 0
    assert len(list(out.glob("*.jsonl"))) == 2
    with pytest.raises(SystemExit):
        head_pooling.main(args + ["--instances", "2", "--box-width", "10"])
    assert "--out:" in (err := capsys.readouterr().err) and "box_width" in err and "--restart" in err


@pytest.mark.parametrize("probe,n_conds", [("scatter", 9), ("two_facts", 15)])
def test_scatter_and_two_facts_run(tiny_dir, tmp_path, probe, n_conds):
    import importlib

    mod = importlib.import_module(f"probes.{probe}")
    out = tmp_path / probe
    assert mod.main(["--model", tiny_dir, "--out", str(out), "--figure-dir", str(tmp_path), "--instances", "2",
                     *SMALL]) == 0
    rows = _rows(out)
    facts = 2 if probe == "two_facts" else 1
    assert len(rows) == 2 * n_conds * facts
    assert (tmp_path / f"{probe}.png").exists()
    (summary,) = out.glob("*-score-only.summary.csv")  # one spelling of protection in file names


def test_blocks_runs_both_parts(tiny_dir, tmp_path):
    from probes import blocks

    assert blocks.main(["--model", tiny_dir, "--out", str(tmp_path), "--figure-dir", str(tmp_path), "--instances", "2",
                        "--blocks", "1", "32", "--sequences", "2", "--length", "160", *SMALL]) == 0
    nll = _rows(next(tmp_path.glob("nll-*.jsonl")))
    assert {r["arm"] for r in nll} == {"full", "block1", "block32"} and len(nll) == 6
    assert all(r["rounds"] > 0 for r in nll if r["arm"] != "full")
    assert all(r["rounds"] == 0 for r in nll if r["arm"] == "full")
    assert len(_rows(next(tmp_path.glob("*-block32-*score-only.jsonl")))) == 2 * 3
    assert (tmp_path / "blocks.png").exists()


@pytest.mark.parametrize("flags,message", [
    (["--policy", "nope"], "--policy"),
    (["--box-width", "16"], "--box-width"),
    (["--traces", "/nonexistent.jsonl"], "probes.traces"),
    (["--instances", "0"], "--instances: must be a positive integer, got 0"),
    (["--parity", "-1"], "--parity: must be a non-negative integer, got -1"),
    (["--budget", "abc"], "expected an integer, got 'abc'"),
    (["--buffer", "64"], "--budget: T=64 must exceed the recent window r=64"),
    (["--seed", "-1"], "--seed: must be an integer in [0, 2**64), got -1"),
])
def test_bad_flags_name_the_flag(tiny_dir, tmp_path, capsys, flags, message):
    from probes import head_pooling

    with pytest.raises(SystemExit):
        head_pooling.main(["--model", tiny_dir, "--out", str(tmp_path / "x"), *SMALL, *flags])
    assert message in capsys.readouterr().err


def test_passcode_counts_the_rounds_from_the_event_counter(tiny_dir, tmp_path, capsys):
    from probes import passcode

    assert passcode.main(["--model", tiny_dir, "--out", str(tmp_path), "--figure-dir", str(tmp_path), "--instances",
                          "2", "--batch", "2", "--parity", "0", "--budget", "96", "--buffer", "16", "--rounds", "5",
                          "--policies", "random", "recency", "h2o"]) == 0
    for policy in ("random", "recency", "h2o"):
        (path,) = tmp_path.glob(f"*-{policy}-K96-*-protected.jsonl")
        rows = [r for r in _rows(path) if r["condition"] == "policy"]
        assert len(rows) == 2 and all(r["rounds_after_fact"] == 5 for r in rows)
        assert all(r["config"]["protect_prompt"] for r in rows)
    refs = [r for r in _rows(next(tmp_path.glob("*-random-K96-*.jsonl"))) if r["condition"] != "policy"]
    assert {r["condition"] for r in refs} == {"kept", "full"}
    assert all(r["rounds"] == 0 for r in refs if r["condition"] == "full")
    out = capsys.readouterr().out
    assert "asked after 5 rounds" in out
    assert (tmp_path / "passcode.png").exists()


def test_prompt_protection_pairs_every_policy_with_and_without_protection(tiny_dir, tmp_path):
    from probes import prompt_protection

    out = tmp_path / "pp"
    assert prompt_protection.main(["--model", tiny_dir, "--out", str(out), "--figure-dir", str(tmp_path),
                                   "--instances", "3", "--batch", "2", "--budget", "128", "--buffer", "8", "--body",
                                   "120", "--policies", "random", "snapkv"]) == 0
    rows = _rows(out)
    assert len(rows) == 3 * 5  # full + 2 policies x {score only, protected}
    assert all(r["rounds"] >= 10 for r in rows if r["policy"] != "full")
    assert all(r["rounds"] == 0 for r in rows if r["policy"] == "full")
    assert (tmp_path / "prompt_protection.png").exists()


def test_shared_draw_runs_all_three_parts(tiny_dir, tmp_path, monkeypatch, capsys):
    from probes import shared_draw

    monkeypatch.chdir(tmp_path)  # nothing may be written outside --out and --figure-dir
    assert shared_draw.main(["--model", tiny_dir, "--out", str(tmp_path / "sd"), "--instances", "2",
                             "--sequences", "2", "--length", "160", "--rounds", "4", "--passcode-instances", "2",
                             "--budget", "64", "--buffer", "12", "--distance", "90", "--batch", "2",
                             "--parity", "0", "--figure-dir", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "shared_draw.png").exists()  # never the shipped figures/shared_draw.png
    out = capsys.readouterr().out
    assert "shared - per-head" in out and "passcode stated once" in out
    nll = _rows(next((tmp_path / "sd").glob("nll-*.jsonl")))
    assert {r["arm"] for r in nll} == {"full", "random", "random-shared"}
    assert len(list((tmp_path / "sd" / "passcode").glob("*.jsonl"))) == 2  # the passcode part under --out too
    assert not (tmp_path / "data").exists()
