"""The lm-evaluation-harness backend (probes.lm_eval_backend) and the paired comparison of its sample files
(probes.compare_samples): requests against randattn's own generate/replay, refusals, and one offline run end to end
on the embedded model (custom tasks in tests/data/lm_eval)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="the lm-eval extra is not installed (pip install -e \".[lm-eval]\")")

import randattn  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from probes import compare_samples  # noqa: E402
from probes.lm_eval_backend import ACCEPTED_ARGS, RandAttnLM, request_key  # noqa: E402
from randattn.stats import paired_comparison  # noqa: E402
from randattn.testing import tiny_model, tiny_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "lm_eval"
CONTEXTS = [" ".join(f"w{(7 * i + k) % 200 + 3}" for i in range(n)) for k, n in ((1, 30), (5, 24), (9, 36))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model("llama"), tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _lm(tiny, policy="random", **kw):
    model, tok = tiny
    return RandAttnLM(model, tokenizer=tok, policy=policy, **kw)


def _ll(lm, pairs):
    return lm.loglikelihood([Instance("loglikelihood", {}, (c, x), i) for i, (c, x) in enumerate(pairs)],
                            disable_tqdm=True)


PAIRS = [(c, " w11 w12 w13 w14") for c in CONTEXTS] + [(CONTEXTS[0], " w40")]


def test_without_eviction_loglikelihood_is_lm_evals_own(tiny):
    """A budget no request reaches gives lm-eval's HF numbers (its batched forward, policy=full) to fp32 rounding."""
    full, roomy = _lm(tiny, "full"), _lm(tiny, budget=4096, buffer=8)
    for (lp_f, greedy_f), (lp_r, greedy_r) in zip(_ll(full, PAIRS), _ll(roomy, PAIRS)):
        assert lp_r == pytest.approx(lp_f, abs=1e-4) and greedy_r == greedy_f
    assert roomy.requests_seen == len(PAIRS) and roomy.requests_evicted == 0


def test_loglikelihood_under_eviction_is_token_by_token_decoding(tiny):
    """Each request scores its continuation as decoding would see it: randattn.replay_tokenwise with the request's
    own row key, the context as the prompt; and eviction changed the numbers."""
    model, _ = tiny
    lm = _lm(tiny, budget=12, buffer=4, protect_prompt=False, seed=3)
    got, full = _ll(lm, PAIRS), _ll(_lm(tiny, "full"), PAIRS)
    for (ctx, cont), (lp, greedy) in zip(PAIRS, got):
        c, x = lm._encode_pair(ctx, cont)
        cache = randattn.EvictingCache("random", budget=12, buffer=4, protect_prompt=False, seed=3,
                                       row_keys=[request_key(c + x)])
        ref = randattn.replay_tokenwise(model, torch.tensor([c + x]), cache, prompt_len=len(c))
        assert lp == pytest.approx(float(ref.logprobs[0, len(c):].sum()), abs=1e-4)
        assert greedy == bool((ref.argmax[0, len(c):] == torch.tensor(x)).all())
    assert lm.requests_evicted == len(PAIRS)
    assert max(abs(a[0] - b[0]) for a, b in zip(got, full)) > 1e-2, "eviction changed nothing"


def test_a_request_draws_the_same_in_any_order(tiny):
    lm = _lm(tiny, budget=12, buffer=4, protect_prompt=False)
    assert _ll(lm, PAIRS) == _ll(lm, PAIRS[::-1])[::-1]


def test_rolling_loglikelihood(tiny):
    doc = " ".join(f"w{i % 150 + 3}" for i in range(60))
    req = [Instance("loglikelihood_rolling", {}, (doc,), 0)]
    full = _lm(tiny, "full").loglikelihood_rolling(req, disable_tqdm=True)
    roomy = _lm(tiny, budget=4096, buffer=8).loglikelihood_rolling(req, disable_tqdm=True)
    tight = _lm(tiny, budget=12, buffer=4).loglikelihood_rolling(req, disable_tqdm=True)  # a 1-token protected prompt
    assert roomy[0] == pytest.approx(full[0], abs=1e-3)
    assert abs(tight[0] - full[0]) > 1e-2


def test_generate_until_is_randattn_generate(tiny):
    """Generation through lm-eval's generate_until equals randattn.generate with the request's cache; no eviction
    equals lm-eval's own generation."""
    model, tok = tiny
    kwargs = {"until": ["never-appears"], "max_gen_toks": 24, "do_sample": False}
    reqs = [Instance("generate_until", {}, (c, dict(kwargs)), i) for i, c in enumerate(CONTEXTS)]
    full = _lm(tiny, "full").generate_until(reqs, disable_tqdm=True)
    assert _lm(tiny, budget=4096, buffer=8).generate_until(reqs, disable_tqdm=True) == full
    lm = _lm(tiny, budget=16, buffer=4, protect_prompt=False)
    got = lm.generate_until(reqs, disable_tqdm=True)
    for ctx, text in zip(CONTEXTS, got):
        ids = torch.tensor([lm.tok_encode(ctx)])
        cache = randattn.EvictingCache("random", budget=16, buffer=4, protect_prompt=False, seed=0,
                                       row_keys=[request_key(ids[0].tolist())])
        out = randattn.generate(model, ids, cache, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
        assert text == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert lm.requests_evicted == len(CONTEXTS) and got != full


@pytest.mark.parametrize("policy,protect", [("recency", False), ("random", False), ("random", True)])
def test_a_padded_batch_generates_what_one_request_at_a_time_does(tiny, policy, protect):
    """--batch_size 2: lm-eval left-pads prompts of 30, 24 and 36 tokens; every row gets its batch-1 output (row keys
    make Random's draws independent of the batch too), with rounds firing."""
    kwargs = {"until": ["never-appears"], "max_gen_toks": 24, "do_sample": False}
    reqs = [Instance("generate_until", {}, (c, dict(kwargs)), i) for i, c in enumerate(CONTEXTS)]
    settings = dict(budget=48 if protect else 16, buffer=4, protect_prompt=protect)
    one = _lm(tiny, policy, **settings).generate_until(reqs, disable_tqdm=True)
    two = _lm(tiny, policy, batch_size=2, **settings)
    assert two.generate_until(reqs, disable_tqdm=True) == one
    assert two.requests_seen == len(CONTEXTS) and two.requests_evicted > 0


# -- refusals ---------------------------------------------------------------------------------------------
def test_unknown_model_args_are_refused_by_name_with_the_accepted_list():
    with pytest.raises(TypeError) as err:  # refused before anything loads: the path need not exist
        RandAttnLM.create_from_arg_string("pretrained=/no/such/dir,policy=random,budegt=512,peft=x")
    msg = str(err.value)
    assert "budegt, peft" in msg and "accepted ones are " + ", ".join(ACCEPTED_ARGS) in msg
    with pytest.raises(TypeError, match="--model_args parallelize: not a randattn model argument"):  # the CLI's way
        RandAttnLM.create_from_arg_obj({"pretrained": "/no/such/dir", "parallelize": True},
                                       {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"})


@pytest.mark.parametrize("args,needle", [
    ("batch_size=auto", "batch_size='auto'"),
    ("batch_size=0", "batch_size=0"),
    ("policy=nope", "policy=nope"),
    ("budget=64,buffer=64", "budget"),
    ("seed=-1", "seed=-1"),
])
def test_bad_settings_are_refused_before_the_model_loads(args, needle):
    with pytest.raises((ValueError, TypeError)) as err:
        RandAttnLM.create_from_arg_string(f"pretrained=/no/such/dir,{args}")
    assert needle in str(err.value) and "/no/such/dir" not in str(err.value)


def test_a_protected_prompt_too_long_for_the_budget_names_the_fix(tiny):
    lm = _lm(tiny, budget=16, buffer=4, protect_prompt=True)
    with pytest.raises(ValueError, match=r"budget=16 cannot hold the protected context of \d+ tokens.*protect_prompt=False"):
        _ll(lm, PAIRS[:1])


def test_policy_full_ignores_eviction_settings_and_says_so(tiny, caplog):
    with caplog.at_level("WARNING", logger="probes.lm_eval_backend"):
        lm = _lm(tiny, "full", budget=64)
    assert "budget ignored" in caplog.text and lm.get_model_info()["randattn"]["policy"] == "full"


# -- the paired comparison ----------------------------------------------------------------------------------
def _samples(path: Path, scores: dict, metric="acc", filt="none", hashes=None) -> Path:
    with path.open("w") as f:
        for doc, value in scores.items():
            f.write(json.dumps({"doc_id": doc, "doc_hash": (hashes or {}).get(doc, f"h{doc}"), "filter": filt,
                                "metrics": [metric], metric: value}) + "\n")
    return path


def test_compare_pairs_by_document_and_clusters_runs(tmp_path, capsys):
    a1 = {d: float(d % 3 != 0) for d in range(12)}
    a2 = {d: float(d % 4 != 0) for d in range(12)}
    b = {d: float(d % 2 == 0) for d in range(12)}
    files = [_samples(tmp_path / f"samples_t_2026-01-0{i + 1}T00-00-00.0.jsonl", s) for i, s in enumerate((a1, a2))]
    fb = _samples(tmp_path / "samples_t_2026-01-03T00-00-00.0.jsonl", b)
    res = compare_samples.compare(files, [fb], seed=1)
    want = paired_comparison({d: [a1[d], a2[d]] for d in b}, {d: [b[d]] for d in b}, seed=1)
    assert res["comparison"] == want and res["problems"] == 12 and res["runs_a"] == 2
    assert res["comparison"].delta.value == pytest.approx(sum((a1[d] + a2[d]) / 2 - b[d] for d in b) / 12)
    scipy_stats = pytest.importorskip("scipy.stats")
    s = want.sign
    assert s.p == pytest.approx(scipy_stats.binomtest(s.wins, s.wins + s.losses).pvalue)
    assert compare_samples.main(["--a", *map(str, files), "--b", str(fb), "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert f"A - B: {want.delta.value:+.3f} [95% CI {want.delta.lo:+.3f}, {want.delta.hi:+.3f}]" in out
    assert f"A better on {s.wins}, worse on {s.losses}, tied on {s.ties}; p {s.p:.3f}" in out


@pytest.mark.parametrize("case,needle", [
    ("different-docs", "doc_id 1 (and 0 more) hold different documents"),
    ("no-such-metric", "--metric em: "),
    ("corpus-metric", "is not one number per sample"),
    ("two-metrics", "several metrics (acc, acc_norm); choose one with --metric"),
    ("results-file", "no doc_id/metrics fields"),
])
def test_compare_refuses_what_cannot_be_paired(tmp_path, capsys, case, needle):
    a = _samples(tmp_path / "a.jsonl", {0: 1.0, 1: 0.0})
    b = _samples(tmp_path / "b.jsonl", {0: 1.0, 1: 1.0}, hashes={1: "other"} if case == "different-docs" else None)
    extra = ["--metric", "em"] if case == "no-such-metric" else []
    if case == "corpus-metric":
        b = _samples(tmp_path / "b.jsonl", {0: [-3.2, 4], 1: [-1.0, 2]}, metric="acc")
    if case == "two-metrics":
        rows = [{"doc_id": 0, "doc_hash": "h0", "filter": "none", "metrics": ["acc", "acc_norm"], "acc": 1,
                 "acc_norm": 0}]
        a.write_text(json.dumps(rows[0]) + "\n")  # side A's file sets the metric both sides are read with
    if case == "results-file":
        b.write_text(json.dumps({"results": {"t": {"acc,none": 0.5}}}) + "\n")
    with pytest.raises(SystemExit) as err:
        compare_samples.main([str(a), str(b), *extra])
    assert err.value.code == 2 and needle in capsys.readouterr().err


# -- end to end, offline, on the embedded model --------------------------------------------------------------
def test_the_copy_data_are_the_copy_tasks_problems():
    from probes.tasks import copy_problem

    rows = [json.loads(line) for line in (TASKS / "copy.jsonl").read_text().splitlines()]
    want = [copy_problem(i, 4) for i in range(len(rows))]
    assert [(r["id"], r["question"], r["answer"]) for r in rows] == [(p.id, p.prompt, p.answer) for p in want]


def _one(folder: Path, task: str) -> Path:
    (path,) = folder.rglob(f"samples_{task}_*.jsonl")
    return path


@pytest.mark.slow
def test_end_to_end_with_and_without_eviction(tmp_path, embedded, capsys):
    """lm-eval's command line with the randattn model (Random, T=32, the prompt unprotected, so rounds fire) on the
    custom copy and math tasks; full attention in process on the same tasks; then the paired comparison of their
    sample files."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    tasks = ["randattn_copy", "randattn_math"]
    common = ["--include_path", str(TASKS), "--apply_chat_template", "--limit", "3", "--log_samples"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "probes.lm_eval_backend", "--model", "randattn", "--device", "cpu", "--model_args",
           "pretrained=smollm2-135m,policy=random,budget=32,buffer=8,protect_prompt=False,seed=0", "--tasks", *tasks,
           *common, "--output_path", str(tmp_path / "random")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = (tmp_path / "random").rglob("results_*.json")
    info = json.loads(results.read_text())["config"]["randattn"]
    assert info["policy"] == "random" and info["budget"] == 32 and info["protect_prompt"] is False
    assert info["requests_with_eviction_rounds"] == info["requests"] == 3 + 3 * 4  # 3 generations, 12 choices

    model, tok = embedded
    lm = RandAttnLM(model, tokenizer=tok, policy="full")
    tracker = EvaluationTracker(output_path=str(tmp_path / "full"))
    out = simple_evaluate(lm, tasks=tasks, limit=3, log_samples=True, apply_chat_template=True,
                          task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
                          evaluation_tracker=tracker)
    samples = out.pop("samples")  # saved as lm-eval's command line saves them
    tracker.save_results_aggregated(results=out, samples=samples)
    for task in tasks:
        tracker.save_results_samples(task_name=task, samples=samples[task])
    assert out["results"]["randattn_copy"]["copy_score,none"] > 0.5  # full attention copies the four numbers

    for task in tasks:
        a, b = _one(tmp_path / "random", task), _one(tmp_path / "full", task)
        assert compare_samples.main([str(a), str(b)]) == 0
        text = capsys.readouterr().out
        res = compare_samples.compare([a], [b])
        assert f"task {task} |" in text and "3 problems in both" in text and "exact sign test" in text
        assert res["b"].value == pytest.approx(
            out["results"][task][("copy_score" if task == "randattn_copy" else "acc") + ",none"])
    copy = compare_samples.compare([_one(tmp_path / "random", "randattn_copy")], [_one(tmp_path / "full",
                                                                                       "randattn_copy")])
    assert copy["comparison"].delta.value < 0 and math.isfinite(copy["comparison"].delta.lo)
