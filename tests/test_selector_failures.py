"""A selector that fails mid-run, from the command line (issue 29, section 2).

It returns NaN, +inf (more pins than a round keeps), -inf or a tensor on another device (``meta`` stands in for
the wrong GPU on a CPU machine), or raises, only after some work is done. The command then keeps the rows already
computed and exits with status 2 and one paragraph that names the selector and the step (layer, round; the part of
the challenge), never a traceback. The challenge writes no verdict (no ``verdict.csv``, ``verdict.json``,
``report.md``) until every part finished. Rerun after the fix, the same command resumes from the kept rows.
``--no-figure`` draws nothing anywhere.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

SELECTORS = textwrap.dedent('''
    import os

    import torch

    CALLS = {}


    def _broken(view, kind):
        """Broken until SEL_FIXED=1; only past SEL_PAST tokens, or after SEL_AFTER calls of this selector."""
        CALLS[kind] = CALLS.get(kind, 0) + 1
        if os.environ.get("SEL_FIXED") == "1":
            return False
        if int(view.positions.max()) < int(os.environ.get("SEL_PAST", "0")):
            return False
        return CALLS[kind] > int(os.environ.get("SEL_AFTER", "0"))


    def _random(view):
        return torch.rand(view.shape, generator=view.generator, device=view.keys.device, dtype=torch.float32)


    def nan(view):
        s = _random(view)
        return s.fill_(float("nan")) if _broken(view, "nan") else s


    def inf(view):
        s = _random(view)
        return s.fill_(float("inf")) if _broken(view, "inf") else s


    def neginf(view):
        s = _random(view)
        return s.fill_(float("-inf")) if _broken(view, "neginf") else s


    def raises(view):
        s = _random(view)
        if _broken(view, "raises"):
            raise KeyError("no such head statistics")
        return s


    def meta(view):
        s = _random(view)
        return torch.zeros(view.shape, device="meta") if _broken(view, "meta") else s
''')
KINDS = ("nan", "inf", "neginf", "raises", "meta")


@pytest.fixture()
def selectors(tmp_path, monkeypatch):
    (tmp_path / "failing_selectors.py").write_text(SELECTORS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import failing_selectors

    module = importlib.reload(failing_selectors)
    module.CALLS.clear()
    return module


def _exit(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


def _refusal(err: str) -> str:
    """The one paragraph of the refusal: the last line on stderr, the only one that says "error" (progress bars,
    which also go to stderr, come before it; no usage block)."""
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err[-3000:]
    return errors[0]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


HEAD_POOLING = ["--budget", "64", "--buffer", "12", "--distance", "90", "--batch", "1", "--parity", "0",
                "--instances", "2", "--no-figure"]


@pytest.mark.parametrize("kind", KINDS)
def test_head_pooling_keeps_its_rows_names_the_selector_and_step_and_resumes(selectors, kind, tiny_dir, tmp_path,
                                                                              capsys, monkeypatch):
    from probes import head_pooling

    out = tmp_path / "hp"
    argv = ["--model", tiny_dir, "--out", str(out), *HEAD_POOLING, "--policy", f"failing_selectors:{kind}"]
    # fail in the second instance's batch: the first batch's rows are on disk by then
    monkeypatch.setenv("SEL_AFTER", "40")
    status = _exit(head_pooling.main, argv)
    err = capsys.readouterr().err
    assert status == 2, err[-2000:]
    assert "Traceback" not in err
    text = _refusal(err)
    assert ": error: --policy: " in text, text
    assert f"policy 'failing_selectors:{kind}'" in text and "layer " in text and "round " in text, text
    assert "rerun the same command" in text, text
    rows_file = next(out.glob("*.jsonl"))
    kept = _lines(rows_file)
    assert kept, "the rows computed before the failure were lost"

    monkeypatch.setenv("SEL_FIXED", "1")  # the user fixes the selector and reruns the same command
    assert head_pooling.main(argv) == 0
    assert "already there" in capsys.readouterr().out
    after = _lines(rows_file)
    assert after[:len(kept)] == kept and len(after) > len(kept)  # resumed: kept rows as they were, the rest added
    assert len({(json.loads(r)["instance"], json.loads(r)["condition"]) for r in after}) == len(after)


CHALLENGE = ["--quick", "--problems", "2", "--runs", "1", "--instances", "2", "--no-figure"]


def test_challenge_failing_past_400_tokens_keeps_rows_writes_no_verdict_and_resumes(selectors, tiny_dir, tmp_path,
                                                                                    capsys, monkeypatch):
    """The issue's case: a selector that fails only past 400 tokens left a partial verdict.csv."""
    from probes import challenge

    out = tmp_path / "ch"
    argv = ["--policy", "failing_selectors:nan", "--model", tiny_dir, "--out", str(out), *CHALLENGE,
            "--only", "accuracy", "question", "planted"]
    monkeypatch.setenv("SEL_PAST", "400")
    status = _exit(challenge.main, argv)
    err = capsys.readouterr().err
    assert status == 2, err[-2000:]
    assert "Traceback" not in err
    text = _refusal(err)
    assert ": error: --policy: " in text and "policy 'failing_selectors:nan'" in text, text
    assert "layer " in text and "round " in text and "challenge part 'planted'" in text, text
    for name in ("verdict.csv", "verdict.json", "report.md"):
        assert not (out / name).exists(), f"a partial {name} was written"
    # the accuracy and question parts finished before planted failed: their leaderboard rows (copy/, question)
    finished = [p for p in out.rglob("*.jsonl") if "work" not in p.relative_to(out).parts]
    assert {p.relative_to(out).parts[0] for p in finished} == {"copy", "question.jsonl"}, finished
    kept = {p: p.read_bytes() for p in finished}
    assert all(kept.values()), "rows of a finished part were lost"

    monkeypatch.setenv("SEL_FIXED", "1")
    assert challenge.main(argv) == 0
    assert "already there" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in finished} == kept, "finished parts were recomputed instead of resumed"
    with open(out / "verdict.csv") as f:
        tests = {line.split(",")[0] for line in f.read().splitlines()[1:]}
    assert tests == {"copy", "question", "planted"}
    assert (out / "verdict.json").exists() and (out / "report.md").exists()


def test_challenge_no_figure_draws_nothing(selectors, tiny_dir, tmp_path, monkeypatch):
    from probes import challenge, cli

    drawn = []
    real = cli.draw
    monkeypatch.setattr(cli, "draw", lambda *a, **k: drawn.append(a[0]) or real(*a, **k))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SEL_FIXED", "1")
    out = tmp_path / "nofig"
    assert challenge.main(["--policy", "failing_selectors:nan", "--model", tiny_dir, "--out", str(out), *CHALLENGE,
                           "--passcode-instances", "2", "--rounds", "3", "--only", "accuracy", "passcode"]) == 0
    assert drawn == [], f"--no-figure drew {drawn}"
    assert not list(tmp_path.rglob("*.png")), list(tmp_path.rglob("*.png"))
    assert "![" not in (out / "report.md").read_text()
