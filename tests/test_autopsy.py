"""The eviction autopsy: a planted cause is found by fork replay (and only it), nothing is reported when nothing
evicted matters, the necessity direction finds the needle on the full-attention run, forks equal straight runs,
bad flags are clear errors."""

import numpy as np
import pytest
import torch

import randattn
from conftest import random_ids
from probes import autopsy
from probes.autopsy import Autopsy, Case, Pool
from probes.tasks import chat_ids
from analysis.autopsy import held_map, location, summarize, windows

NEEDLE_POLICY = '''
import torch
NEEDLE = {needle}
def score(view):
    pos = view.positions.float()
    inside = (view.positions >= NEEDLE[0]) & (view.positions < NEEDLE[1])
    return torch.where(inside, torch.full_like(pos, -1e9), pos)  # the needle first, then the oldest
'''


def _needle_case(tok):
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = chat_ids(tok, "Remember this. The secret passcode is 4729.", system="")
    text = tok.decode(prompt)
    at = text.index("4729")
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    needle = [k for k, (a, b) in enumerate(offsets) if a < at + 4 and b > at]
    filler = enc(" The weather was mild and the market opened late. People walked along the river, talking about "
                 "the harvest and the new bridge.")
    cue = enc("\n\nQuestion: what is the secret passcode? Answer: The secret passcode is")
    return Case("needle", prompt + filler + cue, len(prompt), 5, None), (needle[0], needle[-1] + 1)


@pytest.fixture(scope="module")
def needle_row(embedded, tmp_path_factory):
    model, tok = embedded
    case, needle = _needle_case(tok)
    path = tmp_path_factory.mktemp("policy") / "needle_first.py"
    path.write_text(NEEDLE_POLICY.format(needle=list(needle)))
    a = Autopsy(model, tok, case, policy=f"{path}:score", budget=40, buffer=8, protect=False, seed=0, horizon=4,
                max_replays=12)
    return a.run(), needle


def test_a_planted_cause_is_found_and_nothing_else(needle_row):
    row, (a, b) = needle_row
    assert row["full_text"].strip().startswith("4729")
    assert row["status"] == "restored" and row["replay_parity"]
    assert "4729" not in row["evict_text"]
    [span] = row["spans"]
    assert a <= span["start"] < span["end"] <= b, (span, (a, b))  # inside the needle: no filler, no template
    assert span["location"] == "prompt" and span["empirical"] == 0.0  # gone from every head of every layer
    assert row["lp_restored"] > row["lp_evicted"] + 5
    assert row["candidates"] > (b - a) * 3  # much more than the needle was evicted


def test_the_necessity_direction_finds_the_needle_on_the_full_run(needle_row):
    row, (a, b) = needle_row
    [span] = row["necessary"]
    assert a <= span["start"] < span["end"] <= b, (span, (a, b))
    assert span["match_evicted"] < 1.0 and row["match_full"] == 1.0


def test_nothing_is_reported_when_nothing_evicted_matters(embedded):
    model, tok = embedded
    case, _ = _needle_case(tok)
    row = Autopsy(model, tok, case, policy="random", budget=40, buffer=8, protect=True, seed=0, horizon=4,
                  max_replays=4).run()
    assert row["rounds"] > 0  # eviction really ran
    assert row["status"] == "no divergence" and row["spans"] == [] and row["replays"] == 0
    assert row["evict_text"] == row["full_text"]
    assert summarize([{**row, "task": "t"}])[0]["diverged"] == 0


def test_a_pinned_fork_equals_a_straight_run_with_the_same_keep_masks(tiny):
    model = tiny("llama")
    ids = random_ids(1, 90, seed=5)
    mk = lambda: randattn.EvictingCache("random", budget=24, buffer=4, protect_prompt=False, seed=1,  # noqa: E731
                                        keep_log=True)
    pool = Pool(model, ids, mk(), prompt_len=6, until=70, score_from=0, step=4)
    hm = held_map(pool.base.cache.keep_log, 70, 2, 2)
    span = (30, 36)
    first = hm.first_round[span[0]:span[1]]
    at = int(first[first >= 0].min()) - 1  # the fork point: before the first round that evicted the span
    branch = pool.fork(at)
    assert branch.pos <= at
    branch.cache.pin(range(*span))
    forked = branch.run().result()
    straight_cache = mk()
    straight_cache.pin(range(*span))
    straight = randattn.Replay(model, ids, straight_cache, prompt_len=6).run().result()
    torch.testing.assert_close(forked.logprobs[:, 1:], straight.logprobs[:, 1:], atol=1e-5, rtol=0)
    for layer in range(2):
        assert torch.equal(branch.cache.positions(layer), straight_cache.positions(layer))
        assert torch.isin(torch.arange(*span), branch.cache.positions(layer)).all()
    plain = pool.base.fork().run().result()  # and the pin changed something: the check has teeth
    assert (plain.logprobs[:, 71:] - forked.logprobs[:, 71:]).abs().max() > 1e-3


def test_held_map_and_windows():
    log = randattn.KeepLog(recent=2)
    log.record(0, 0, 10, torch.tensor([[[0, 1, 2, 3, 4, 5, 8, 9], [0, 2, 3, 4, 5, 6, 8, 9]]]))
    hm = held_map(log, 14, 1, 2)
    assert hm.held.shape == (1, 2, 14)
    assert list(hm.evicted_anywhere) == [1, 6, 7]
    assert hm.first_round[7] == 10 and hm.first_round[0] == -1
    assert list(hm.rounds_competed([0, 7, 8])) == [1, 1, 0]
    assert held_map(log, 10, 1, 2).held.all()  # a round at seq_len 10 shapes the token after position 10 only
    assert windows(np.array([1, 2, 5, 9, 10, 30]), 5) == [(0, 3), (3, 5), (5, 6)]
    assert location(0, 4, prompt_len=10, until=100, window=20) == "prompt"
    assert location(85, 90, prompt_len=10, until=100, window=20) == "recent"
    assert location(20, 24, prompt_len=10, until=100, window=20) == "middle"


@pytest.mark.parametrize("argv, flag", [
    (["--budget", "16", "--buffer", "16"], "--budget"),
    (["--policy", "nope"], "--policy"),
    (["--policy", "random", "random"], "--policy"),
    (["--prompt", "hi", "--index", "2"], "--index"),
    (["--max-replays", "0"], "--max-replays"),
    (["--task", "math500"], "--task"),
    (["--index", "-1"], "--index"),
])
def test_bad_flags_are_clear_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        autopsy.main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_out_must_be_a_folder(tmp_path, capsys, tiny_dir):
    f = tmp_path / "file.jsonl"
    f.write_text("x")
    with pytest.raises(SystemExit):
        autopsy.main(["--out", str(f), "--model", tiny_dir, "--device", "cpu"])
    assert "--out" in capsys.readouterr().err
