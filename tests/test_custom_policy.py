"""Selectors defined outside the package: ``module:callable`` specs, score functions that ask for queries, errors."""

import textwrap

import pytest
import torch

import randattn
from randattn.testing import tiny_model

SELECTOR = textwrap.dedent('''
    import torch
    import randattn

    @randattn.score_function(needs=("queries",), window=4)
    def query_norm(view):
        seen.append(view.queries.shape)
        return view.keys.norm(dim=-1)

    def newest(view):
        return view.positions.float()

    class Oldest(randattn.Policy):
        def __init__(self, sign=-1.0):
            self.sign = sign
        def score(self, view):
            return self.sign * view.positions.float()

    seen = []
    not_callable = 3
''')


@pytest.fixture()
def selector_file(tmp_path, monkeypatch):
    path = tmp_path / "my_selector.py"
    path.write_text(SELECTOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


def _generate(policy, **kw):
    model = tiny_model("llama")
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = randattn.EvictingCache(policy, budget=20, buffer=4, seed=0, **kw)
    randattn.generate(model, ids, cache, max_new_tokens=20, do_sample=False, pad_token_id=0)
    return cache


def test_module_and_file_specs_load_functions_and_classes(selector_file):
    newest = randattn.make_policy("my_selector:newest")
    assert newest.name == "my_selector:newest"
    by_path = randattn.make_policy(f"{selector_file}:newest")
    assert by_path.name == f"{selector_file}:newest"
    oldest = randattn.make_policy("my_selector:Oldest", sign=-2.0)
    assert oldest.sign == -2.0

    # the core does protection and top-K: a custom recency selector keeps the prompt and the newest pairs
    cache = _generate("my_selector:newest")
    assert cache.total_events > 0
    pos = cache.positions(0)[0, 0]
    end = cache.get_seq_length()
    assert pos[:12].tolist() == list(range(12)) and pos[12:].tolist() == list(range(end - len(pos) + 12, end))
    assert torch.equal(cache.positions(0), _generate("recency").positions(0))


def test_a_score_function_can_ask_for_recent_queries(selector_file):
    import my_selector

    my_selector.seen.clear()
    cache = _generate("my_selector:query_norm")
    assert cache.needs_queries and my_selector.seen
    assert all(s[2] == 4 for s in my_selector.seen)  # [B, H_q, window, D]


@pytest.mark.parametrize("spec,message", [
    ("no_such_module_xyz:score", "cannot import 'no_such_module_xyz'"),
    ("my_selector:missing", "has no 'missing'; callables there: Oldest"),
    ("my_selector:not_callable", "not a score function or Policy"),
    ("missing_dir/sel.py:score", "no file missing_dir/sel.py"),
    ("nonsense", "known policies"),
])
def test_bad_specs_name_what_is_wrong(selector_file, spec, message):
    with pytest.raises(ValueError, match=message):
        randattn.make_policy(spec)


def test_options_need_a_policy_class_and_queries_need_a_window(selector_file):
    with pytest.raises(ValueError, match="need a Policy subclass"):
        randattn.make_policy("my_selector:newest", sign=1)

    @randattn.score_function(needs=("queries",))
    def no_window(view):
        return view.positions.float()

    with pytest.raises(ValueError, match="window=0"):
        randattn.make_policy(no_window)
    with pytest.raises(ValueError, match="unknown"):
        randattn.make_policy(randattn.score_function(needs=("gradients",))(no_window))


def test_probes_take_a_selector_spec_and_name_files_after_it(selector_file, tiny_dir, tmp_path, capsys):
    import json

    from probes import passcode
    from probes.common import policy_slug

    assert policy_slug("my_selector:newest") == "my_selector.newest" and policy_slug("a/b/sel.py:f") == "sel.f"
    assert passcode.main(["--model", tiny_dir, "--out", str(tmp_path), "--no-figure", "--instances", "2",
                          "--batch", "2", "--parity", "0", "--budget", "96", "--buffer", "16", "--rounds", "3",
                          "--policies", "random", "my_selector:newest"]) == 0
    (path,) = tmp_path.glob("*-my_selector.newest-K96-*.jsonl")  # the file name carries the spec's slug
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 2 and all(r["config"]["policy"] == "my_selector:newest" for r in rows)
    assert "my_selector:newest" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        passcode.main(["--model", tiny_dir, "--out", str(tmp_path), "--policies", "my_selector:missing"])
    assert "--policies: policy 'my_selector:missing'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        passcode.main(["--model", tiny_dir, "--out", str(tmp_path), "--policies", "randomm"])
    assert "MODULE:CALLABLE" in capsys.readouterr().err
