"""The planted-fact instrument: layouts, keep-mask conditions (checked from keep-logs), result files,
and, on the embedded model, that the instrument can tell a kept fact from a deleted one."""

import json

import numpy as np
import pytest
import torch

import randattn
from probes.planted import Condition, InstanceBuilder, audit_keep_log, fact_metrics, run_batch, subsets
from probes.results import DEFAULT_TRACES
from analysis.planted import endpoint_check, summarize
from probes.results import ResultsFile
from randattn.testing import tiny_model
from randattn.traces import load_traces


@pytest.fixture(scope="module")
def smol_tok(embedded):
    return embedded[1]


@pytest.fixture(scope="module")
def texts():
    return load_traces(DEFAULT_TRACES)[:60]


@pytest.mark.parametrize("budget,buffer,distance,n_facts", [(256, 16, 384, 1), (64, 10, 100, 1), (40, 12, 90, 2),
                                                            (1024, 64, 1536, 1)])
def test_layout_puts_each_answer_exactly_distance_after_its_fact(smol_tok, texts, budget, buffer, distance, n_facts):
    b = InstanceBuilder(smol_tok, texts, budget=budget, buffer=buffer, distance=distance, box_width=min(12, buffer),
                        n_facts=n_facts, seed=1)
    lengths = set()
    for i in range(6):
        inst = b.build(i)
        lengths.add(len(inst.ids))
        filler = smol_tok.decode(inst.ids[inst.prompt_len : inst.facts[0].box_start])
        for f in inst.facts:
            assert f.answer_start - f.box_start == distance
            assert smol_tok.decode(inst.ids[f.answer_start : f.answer_end]).strip() == f.value
            box_text = smol_tok.decode(inst.ids[f.box_start : f.box_end])
            assert f"Let {f.name} = {f.value}." in box_text
            assert f"{f.name} =" in smol_tok.decode(inst.ids[f.answer_start - 8 : f.answer_start])
            assert f.value not in filler
        # the first box ends exactly where a round fires: at K + r, then every r tokens
        first = inst.facts[0]
        assert first.box_end >= budget + buffer and (first.box_end - budget - buffer) % buffer == 0
        if n_facts == 2:
            assert inst.facts[1].box_start >= inst.facts[0].box_end
            assert inst.facts[0].name != inst.facts[1].name
        assert inst.ids[: inst.prompt_len] == b.stub
    assert lengths == {b.length}
    assert b.build(3).ids == b.build(3).ids  # instance i depends only on (seed, i)
    assert b.build(3).ids != b.build(4).ids


def test_bad_geometry_is_refused_with_the_flag_to_change(smol_tok, texts):
    with pytest.raises(ValueError, match="--box-width"):
        InstanceBuilder(smol_tok, texts, budget=64, buffer=8, distance=100, box_width=12)
    with pytest.raises(ValueError, match="--box-width"):
        InstanceBuilder(smol_tok, texts, budget=64, buffer=8, distance=100, box_width=4)
    with pytest.raises(ValueError, match="--distance"):
        InstanceBuilder(smol_tok, texts, budget=64, buffer=16, distance=20, box_width=12)


@pytest.fixture(scope="module")
def small(smol_tok, texts):
    """A tiny 3-KV-head model over the real tokenizer, and a small geometry."""
    model = tiny_model("llama", vocab_size=len(smol_tok), num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
                       num_hidden_layers=3, head_dim=16)
    builder = InstanceBuilder(smol_tok, texts, budget=64, buffer=12, distance=90, box_width=12, n_facts=2, seed=0)
    return model, builder


def _make_cache(keep_log=False):
    return randattn.EvictingCache("random", budget=64, buffer=12, protect_prompt=False, seed=7, keep_log=keep_log)


def _conditions(width):
    scatter = tuple(frozenset({t % 3, (t + 1) % 3}) for t in range(width))
    return [
        *(Condition.heads(f"s{h}", h, width, n_facts=2) for h in subsets(3)),
        Condition("scatter", (scatter, scatter)),
        Condition("x-in-0-y-in-2", (Condition.heads("", [0], width).keep[0], Condition.heads("", [2], width).keep[0])),
        Condition.heads("h1-layer-2", [1], width, n_facts=2, layers=(2,)),
        Condition.policy(n_facts=2),
    ]


def test_keep_masks_hold_each_fact_in_exactly_the_requested_heads(small):
    model, builder = small
    instances = [builder.build(i) for i in range(3)]
    conds = _conditions(builder.box_width)
    checked = {}
    for cond, result, cache, rounds in run_batch(model, instances, conds, _make_cache, audit=True):
        checked[cond.name] = audit_keep_log(cache, cond, instances[0].facts, 3)
        # the box ends where a round fires, then one round every r tokens until the answer
        assert rounds == 1 + (builder.distance - builder.box_width - 1) // builder.buffer
        assert not torch.isnan(result.logprobs[:, instances[0].facts[0].answer_start :]).any()
    assert all(n > 0 for name, n in checked.items() if name != "policy"), checked
    assert checked["policy"] == 0


def test_the_audit_catches_a_mask_that_is_not_where_it_claims(small):
    model, builder = small
    instances = [builder.build(0)]
    width = builder.box_width
    applied = Condition.heads("applied", [1], width, n_facts=2)
    claimed = Condition.heads("claimed", [0], width, n_facts=2)
    (cond, _, cache, _), = run_batch(model, instances, [applied], _make_cache, audit=True)
    assert audit_keep_log(cache, applied, instances[0].facts, 3) > 0
    with pytest.raises(AssertionError, match="audit failed"):
        audit_keep_log(cache, claimed, instances[0].facts, 3)


def test_conditions_share_the_prefix_and_differ_only_after_the_fact(small):
    model, builder = small
    instances = [builder.build(i) for i in range(2)]
    ids = torch.tensor([inst.ids for inst in instances])
    outs = {c.name: (r, cache) for c, r, cache, _ in run_batch(model, instances, _conditions(builder.box_width), _make_cache)}
    fact = instances[0].facts[0]
    lp_all, _ = fact_metrics(outs["s(0, 1, 2)"][0], ids, fact)
    lp_del, _ = fact_metrics(outs["s()"][0], ids, fact)
    assert not np.allclose(lp_all, lp_del), "keeping or deleting the fact changed nothing"
    # A fork with no mask and a fresh straight replay agree: the shared prefix is the real prefix.
    straight = randattn.replay(model, ids, _make_cache(), prompt_len=instances[0].prompt_len,
                               score_from=fact.answer_start)
    torch.testing.assert_close(outs["policy"][0].logprobs[:, fact.answer_start :],
                               straight.logprobs[:, fact.answer_start :], atol=1e-5, rtol=0)


def test_summaries_on_hand_made_rows():
    rows = []
    lps = {"deleted": [-20, -18, -22], "all": [-2, -4, -2], "half": [-11, -11, -12]}
    for cond, values in lps.items():
        for i, lp in enumerate(values):
            rows.append({"instance": i, "condition": cond, "fact": 0, "lp": lp, "retrieved": cond == "all" or i == 0})
    s = summarize(rows, ["deleted", "half", "all"])
    assert s["all"].recall.value == 1.0 and s["deleted"].recall.value == 0.0
    assert s["half"].recall.value == pytest.approx((9 + 7 + 10) / (18 + 14 + 20))
    assert s["all"].retrieval.value == 1.0 and s["deleted"].retrieval.value == pytest.approx(1 / 3)
    assert s["half"].recall_full is None  # no full-cache rows: no second denominator
    # With a full-cache condition, R against it too (the full cache a little better than kept-everywhere here)
    rows_full = rows + [{"instance": i, "condition": "full", "fact": 0, "lp": lp, "retrieved": True}
                        for i, lp in enumerate([-1, -3, -2])]
    s = summarize(rows_full, ["half", "all"])
    assert s["half"].recall_full.value == pytest.approx((9 + 7 + 10) / (19 + 15 + 20))
    assert s["half"].recall.value == pytest.approx((9 + 7 + 10) / (18 + 14 + 20))
    assert "recall_full" in s["half"].as_row()
    ok, text = endpoint_check(rows)
    assert ok and "endpoints" in text
    flat = [dict(r, lp=-5.0, retrieved=False) for r in rows]
    ok, text = endpoint_check(flat)
    assert not ok and "cannot measure" in text


def test_results_file_resumes_and_refuses_a_different_config(tmp_path):
    path = tmp_path / "r.jsonl"
    cfg = {"model": "m", "budget": 8, "revision": "abc"}
    rf = ResultsFile(path, cfg, ("instance", "condition"))
    rf.append([{"instance": 0, "condition": "a", "lp": -1.0}, {"instance": 1, "condition": "a", "lp": -2.0}])
    with open(path, "a") as f:
        f.write('{"instance": 2, "condit')  # a run killed mid-write
    again = ResultsFile(path, {**cfg, "revision": "def"}, ("instance", "condition"))
    assert again.done == {(0, "a"), (1, "a")}
    again.append([{"instance": 2, "condition": "a", "lp": -3.0}])
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["config"]["budget"] == 8 for line in lines)
    with pytest.raises(ValueError, match="budget.*--restart"):
        ResultsFile(path, {**cfg, "budget": 16}, ("instance", "condition"))
    fresh = ResultsFile(path, {**cfg, "budget": 16}, ("instance", "condition"), restart=True)
    assert fresh.done == set()


@pytest.mark.slow
def test_on_the_embedded_model_a_kept_fact_is_recalled_and_a_deleted_one_is_not(embedded, texts):
    model, tok = embedded
    builder = InstanceBuilder(tok, load_traces(DEFAULT_TRACES), budget=128, buffer=12, distance=192, box_width=12,
                              seed=5)
    instances = [builder.build(i) for i in range(8)]
    ids = torch.tensor([inst.ids for inst in instances])
    make = lambda keep_log=False: randattn.EvictingCache("random", budget=128, buffer=12, protect_prompt=False, seed=1)  # noqa: E731
    conds = [Condition.heads("deleted", [], 12), Condition.heads("all", [0, 1, 2], 12)]
    rows = []
    for cond, result, cache, _ in run_batch(model, instances, conds, make):
        lp, ok = fact_metrics(result, ids, instances[0].facts[0])
        rows += [{"instance": i, "condition": cond.name, "fact": 0, "lp": float(lp[i]), "retrieved": bool(ok[i])}
                 for i in range(len(instances))]
    s = summarize(rows, ["deleted", "all"])
    assert s["all"].retrieval.value - s["deleted"].retrieval.value >= 0.25, s
    ok, text = endpoint_check(rows)
    assert ok, text
