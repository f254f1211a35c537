"""probes.challenge: Random in disguise is indistinguishable, an oracle wins the passcode, a question evictor loses,
broken selectors stop before any work."""

import csv
import textwrap

import pytest

SELECTORS = textwrap.dedent('''
    import torch

    BOX = (0, 0)  # the passcode's positions, set by the test that knows the layout


    def random_again(view):
        """Random in disguise: the same draw as the registered policy, under another name."""
        return torch.rand(view.shape, generator=view.generator, device=view.keys.device, dtype=torch.float32)


    def pin_passcode(view):
        """An oracle: Random, except that the passcode is always kept."""
        inside = (view.positions >= BOX[0]) & (view.positions < BOX[1])
        return random_again(view) + 2.0 * inside


    def question_first(view):
        """Random, except that prompt pairs always go first."""
        return random_again(view) - 2.0 * (view.positions < view.prompt_len)


    def wrong_shape(view):
        return torch.zeros(view.shape[-1] + 1)


    def nan_scores(view):
        return torch.full(view.shape, float("nan"))
''')


@pytest.fixture()
def selectors(tmp_path, monkeypatch):
    (tmp_path / "challengers.py").write_text(SELECTORS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import challengers

    return importlib.reload(challengers)


def _verdict_rows(out, name="verdict.csv"):
    with open(out / name) as f:
        return list(csv.DictReader(f))


def _challenge(*flags):
    from probes import challenge

    return challenge.main(list(flags))


def test_random_in_disguise_is_indistinguishable_on_every_part(selectors, tiny_dir, tmp_path, capsys):
    out = tmp_path / "disguise"
    assert _challenge("--policy", "challengers:random_again", "--model", tiny_dir, "--quick", "--problems", "3",
                      "--instances", "4", "--passcode-instances", "4", "--rounds", "4", "--out", str(out)) == 0
    rows = _verdict_rows(out)  # the leaderboard's board rows of the selector: one per task
    # every scored part, its score and its answer's log-prob, each paired unit a tie: the pairing is exact
    assert [r["test"] for r in rows] == ["copy", "question", "planted", "passcode"]
    for r in rows:
        assert r["verdict"] == "no detectable difference" and float(r["delta"]) == 0.0, r
        assert r["wins"] == r["losses"] == "0" and int(r["ties"]) == int(r["n"]) > 0
        assert float(r["round_cost_ratio"]) > 0 and float(r["throughput_ratio"]) > 0
    for r in rows[1:]:
        assert r["lp_verdict"] == "no detectable difference" and float(r["lp_delta"]) == 0.0, r
    for r in rows[:2]:  # full attention, the ceiling, on the accuracy and question tasks
        assert 0 <= float(r["full_attention"]) <= 1
    planted = rows[2]
    assert planted["recall"] == planted["random_recall"] and planted["recall"] != ""  # R: the same draws
    extra = _verdict_rows(out, "descriptive.csv")
    overlap = {r["policy"]: float(r["value"]) for r in extra if r["metric"] == "keep-set overlap with Random"}
    assert overlap["challengers:random_again"] == 1.0 and overlap["random (another seed)"] < 0.9
    assert {r["metric"] for r in extra if r["test"] == "cost"} == {"ms per eviction round (one layer)",
                                                                    "decode tokens/s"}
    text = capsys.readouterr().out
    assert "indistinguishable from Random on every metric tested" in text
    report = (out / "report.md").read_text()
    assert "## Verdict" in report and "![challenge](challenge.png)" in report
    for name in ("challenge.png", "accuracy.png"):
        assert (out / name).stat().st_size > 5_000

    # rerun: finished rows are reused, not recomputed
    assert _challenge("--policy", "challengers:random_again", "--model", tiny_dir, "--quick", "--problems", "3",
                      "--instances", "4", "--passcode-instances", "4", "--rounds", "4", "--out", str(out),
                      "--only", "planted") == 0
    assert "already there" in capsys.readouterr().out


@pytest.mark.parametrize("name,message", [("wrong_shape", "returned scores shaped"), ("nan_scores", "NaN scores"),
                                          ("missing", "has no 'missing'")])
def test_a_broken_selector_stops_before_any_work_with_the_reason(selectors, tiny_dir, tmp_path, capsys, name,
                                                                  message):
    out = tmp_path / "broken"
    with pytest.raises(SystemExit):
        _challenge("--policy", f"challengers:{name}", "--model", tiny_dir, "--quick", "--out", str(out))
    err = capsys.readouterr().err
    assert message in err and f"challengers:{name}" in err
    assert not list(out.glob("**/*.jsonl"))


def test_flags_are_checked(selectors, tiny_dir, tmp_path, capsys):
    for flags, message in ((["--policy", "random"], "reference"), (["--policy", "challengers:random_again",
                                                                     "--baselines", "nope"], "--baselines: 'nope'"),
                           (["--policy", "challengers:random_again", "--task", "nope"], "--task: invalid choice: 'nope'")):
        with pytest.raises(SystemExit):
            _challenge(*flags, "--model", tiny_dir, "--out", str(tmp_path / "x"))
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_an_oracle_that_pins_the_passcode_wins_the_passcode_test(selectors, embedded, tmp_path, capsys):
    from probes.passcode import FACT, INSTRUCTION, QUERY, passcode_distance
    from probes.planted import InstanceBuilder
    from probes.results import DEFAULT_TRACES
    from randattn.traces import load_traces

    rounds = 24
    builder = InstanceBuilder(embedded[1], load_traces(DEFAULT_TRACES), budget=256, buffer=16,
                              distance=passcode_distance(rounds, 16, 20), box_width=20, n_facts=1, seed=0, fact=FACT,
                              query=QUERY, instruction=INSTRUCTION, deletable=False)
    fact = builder.build(0).facts[0]
    selectors.BOX = (fact.box_start, fact.box_end)
    out = tmp_path / "oracle"
    assert _challenge("--policy", "challengers:pin_passcode", "--quick", "--only", "passcode", "--rounds",
                      str(rounds), "--out", str(out)) == 0
    (hit,) = _verdict_rows(out)
    assert hit["metric"] == "passcode retrieval"
    assert hit["verdict"] == "better" and float(hit["delta_lo"]) > 0 and float(hit["p_sign"]) < 0.05
    assert hit["lp_verdict"] == "better"
    assert "beats Random" in capsys.readouterr().out


@pytest.mark.slow
def test_a_selector_that_evicts_the_question_loses_where_the_question_is_needed(selectors, embedded, tmp_path):
    out = tmp_path / "evictor"
    assert _challenge("--policy", "challengers:question_first", "--quick", "--only", "question",
                      "--instances", "16", "--no-protect-prompt", "--out", str(out)) == 0
    (digits,) = _verdict_rows(out)
    assert digits["metric"] == "question digits recalled"
    assert digits["verdict"] == "worse" and float(digits["delta_hi"]) < 0 and float(digits["p_sign"]) < 0.05


def test_stats_reach_the_planted_and_passcode_parts(selectors, tiny_dir, tmp_path):
    """--stats is passed to every part whose policies read it: TriAttention as a baseline on a model without shipped
    statistics runs the planted fact and the passcode instead of refusing the model."""
    import torch

    import randattn
    from randattn.calibrate import calibrate

    model, _ = randattn.load_model(tiny_dir, device="cpu")
    stats = tmp_path / "tiny.pt"
    calibrate(model, [torch.randint(3, 1000, (1, 48), generator=torch.Generator().manual_seed(0))],
              progress=False).save(stats)
    out = tmp_path / "with-stats"
    for part in ("planted", "passcode"):
        assert _challenge("--policy", "challengers:random_again", "--baselines", "triattention", "--stats", str(stats),
                          "--model", tiny_dir, "--quick", "--instances", "4", "--passcode-instances", "4",
                          "--rounds", "4", "--out", str(out), "--only", part) == 0
    assert {r["policy"] for r in _verdict_rows(out) if r["test"] in ("planted", "passcode")} >= {"triattention"}


def test_parts_without_cost_print_a_verdict(selectors, tiny_dir, tmp_path, capsys):
    """Without the cost part (--skip cost, --only keeplog) the verdict prints no cost line instead of reading a cost
    ratio from the keep-set rows, which share the descriptive list and have none."""
    out = tmp_path / "no-cost"
    assert _challenge("--policy", "challengers:random_again", "--model", tiny_dir, "--quick", "--out", str(out),
                      "--only", "keeplog") == 0
    text = capsys.readouterr().out
    assert "challengers:random_again vs random" in text and "cost relative to Random" not in text
    extra = _verdict_rows(out, "descriptive.csv")
    assert {r["test"] for r in extra} == {"keep-sets"}
