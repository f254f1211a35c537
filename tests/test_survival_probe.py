"""python -m probes.survival end to end on a tiny model (rows, resume, figure, flag errors), and on the
embedded model: Random's keep-log survival from a real decode against the analytic curve."""

import json
import math

import pytest

import randattn
from randattn import keepstats

SMALL = ["--budget", "128", "--buffer", "8", "--rounds", "6", "--sequences", "2", "--batch", "2"]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_survival_probe_writes_rows_resumes_and_draws(tiny_dir, tmp_path, capsys):
    from probes import survival

    folder = tmp_path / "sv"  # --out is a folder; the file is named after the configuration
    args = ["--model", tiny_dir, "--out", str(folder), "--figure-dir", str(tmp_path), *SMALL]
    assert survival.main(args + ["--policies", "random", "recency"]) == 0
    (out,) = folder.glob("*.jsonl")
    assert out.name.endswith("-K128-r8-n6-seq2-b2-s0.jsonl")
    first = _rows(out)
    assert len(first) == 2 * 2 * 2  # policies x modes x sequences
    assert {(r["policy"], r["mode"]) for r in first} == {(p, m) for p in ("random", "recency")
                                                         for m in ("protected", "score-only")}
    # every sequence went through exactly --rounds rounds in every layer (counted by the cache)
    assert all(r["rounds_min"] == r["rounds_max"] == 6 and r["length"] == 128 + 6 * 8 for r in first)
    assert all(r["config"]["budget"] == 128 and r["config"]["kv_heads"] == 3 for r in first)
    protected = [r for r in first if r["mode"] == "protected"]
    assert all(r["prompt_union"] == r["prompt_head"] == 1.0 for r in protected)
    recency = [r for r in first if r["policy"] == "recency" and r["mode"] == "score-only"]
    # score-only recency keeps the last K positions: the prompt's tail inside that window, every head alike
    assert all(r["prompt_head"] == pytest.approx(max(0, r["prompt_len"] - (r["length"] - 128)) / r["prompt_len"])
               and r["jaccard"] == 1.0 for r in recency)
    text = capsys.readouterr().out
    assert "keep-log metrics" in text and "Random (protected)" in text and "Random (score-only)" in text
    assert "slot coverage .999-1.000" in text  # the paper's numbers beside ours
    assert (tmp_path / "survival.png").exists() and (tmp_path / "survival.pdf").exists()

    # resume: an interrupted run (last row lost) and a new policy only add what is missing
    out.write_text("".join(line + "\n" for line in out.read_text().splitlines()[:-1]))
    assert survival.main(args + ["--policies", "random", "recency", "random-shared", "--no-figure"]) == 0
    rows = _rows(out)
    assert rows[: len(first) - 1] == first[:-1] and len(rows) == 3 * 2 * 2
    assert len({(r["policy"], r["mode"], r["sequence"]) for r in rows}) == len(rows)
    assert [r for r in rows if r["policy"] == "recency"][-1]["by_rounds"] == first[-1]["by_rounds"]  # same seed


@pytest.mark.parametrize("flags,message", [
    (["--policies", "random", "nope"], "--policies"),
    (["--policies", "triattention"], "--stats"),
    (["--policies", "random", "--modes", "neither"], "--modes"),
    (["--rounds", "0"], "--rounds: must be a positive integer"),
    (["--policies", "random", "--budget", "40"], "--budget"),
    (["--policies", "random", "--traces", "/nonexistent.jsonl"], "probes.traces"),
])
def test_bad_flags_name_the_flag(tiny_dir, tmp_path, capsys, flags, message):
    from probes import survival

    with pytest.raises(SystemExit):
        survival.main(["--model", tiny_dir, "--out", str(tmp_path / "x"), "--no-figure", *SMALL, *flags])
    assert message in capsys.readouterr().err


def test_changed_configuration_is_refused_not_mixed(tiny_dir, tmp_path, capsys):
    from probes import survival

    folder = tmp_path / "x"
    base = ["--model", tiny_dir, "--out", str(folder), "--no-figure", "--policies", "recency", "--modes", "protected"]
    assert survival.main(base + SMALL) == 0
    # another --rounds is another file (its name says the configuration); a setting the name does not carry
    # (the entropy bins) meets the old rows and is refused
    assert survival.main(base + SMALL + ["--rounds", "5"]) == 0
    assert len(list(folder.glob("*.jsonl"))) == 2
    with pytest.raises(SystemExit):
        survival.main(base + SMALL + ["--entropy-bins", "5"])
    assert "--restart" in capsys.readouterr().err
    assert survival.main(base + SMALL + ["--entropy-bins", "5", "--restart"]) == 0
    (out,) = folder.glob("*-n6-*.jsonl")
    assert {r["config"]["entropy_bins"] for r in _rows(out)} == {5}


@pytest.mark.slow
def test_random_keep_log_survival_from_a_real_decode_matches_the_analytic_curve(embedded):
    """Greedy decoding on the embedded model (30 layers x 3 KV heads), prompt = a trace's question,
    protected: per-head survival after n rounds within 4 binomial standard errors + 0.01 of
    ((K-lp)/(K+r-lp))^n and the union within the same of 1-(1-s)^3, for every n with >= 1,000
    observations. Recency decoded the same way fails the same check."""
    from probes.results import DEFAULT_TRACES
    from probes.survival import read_rows

    model, tok = embedded
    question = read_rows(DEFAULT_TRACES)[3]["question"]
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    lp, budget, buffer, rounds = ids.shape[1], 128, 8, 12
    assert lp < budget
    new_tokens = budget + rounds * buffer - lp + 1  # the last generated token is never fed through the model
    q = keepstats.random_round_survival(budget, buffer, lp, protected=True)
    misfits = {}
    for policy in ("random", "recency"):
        cache = randattn.EvictingCache(policy, budget=budget, buffer=buffer, seed=1, keep_log=True)
        randattn.generate(model, ids, cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        assert cache.events == [rounds] * 30
        curve = keepstats.survival_curve(cache.keep_log, lp)
        head, union = curve.analytic(q)
        bad, checked = [], 0
        for i in range(len(curve.total)):
            if curve.total[i] < 1000:
                continue
            checked += 1
            se_h = math.sqrt(head[i] * (1 - head[i]) / (3 * curve.total[i]))
            se_u = math.sqrt(union[i] * (1 - union[i]) / curve.total[i])
            if abs(curve.head[i] - head[i]) > 4 * se_h + 0.01 or abs(curve.union[i] - union[i]) > 4 * se_u + 0.01:
                bad.append((i + 1, round(curve.head[i], 4), round(head[i], 4), round(curve.union[i], 4)))
        assert checked >= 8
        misfits[policy] = bad
    assert misfits["random"] == [], misfits["random"]
    assert misfits["recency"], "recency matched Random's curve: the check cannot tell them apart"
