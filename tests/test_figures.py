"""python -m figures draws every figure from the shipped results, and the figures' data come from them."""

import csv
import json

import pytest

import figures.style
from figures.__main__ import FIGURES, ON_REQUEST, default_input, draw, main


def test_every_figure_has_shipped_results_and_is_drawn(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/results/ here: every figure comes from the shipped results
    missing = [name for name in FIGURES if not default_input(name).exists()]
    assert not missing, f"shipped results missing for {missing}"
    assert main(["--out", str(tmp_path)]) == 0
    for name in set(FIGURES) - ON_REQUEST:
        for ext in ("png", "pdf"):
            f = tmp_path / f"{name}.{ext}"
            assert f.exists() and f.stat().st_size > 5_000, f


def test_the_accuracy_probe_names_its_shipped_figures_as_the_registry_does():
    from probes.accuracy import DEFAULT_RESULT_NAME, FIGURE_NAMES

    assert FIGURES["accuracy"][2] == f"accuracy/{DEFAULT_RESULT_NAME}" and len(FIGURE_NAMES) == 2
    assert all(FIGURES[figure][2] == f"accuracy/{result}" for result, figure in FIGURE_NAMES.items())


def test_a_missing_result_names_the_command(tmp_path, capsys):
    assert main(["--probe", "scatter", "--results", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)]) == 1
    assert "python -m probes.scatter" in capsys.readouterr().err


REAL_ERRORBAR = figures.style.errorbar


def _plotted(monkeypatch, name, results, tmp_path):
    points = []
    real = REAL_ERRORBAR
    monkeypatch.setattr(figures.style, "errorbar", lambda ax, x, est, **kw: (points.append(round(est.value, 6)),
                                                                             real(ax, x, est, **kw))[1])
    draw(name, results, tmp_path)
    return points


def test_head_pooling_figure_follows_its_rows(monkeypatch, tmp_path):
    src = default_input("head_pooling")
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    before = _plotted(monkeypatch, "head_pooling", src, tmp_path)
    lp_all = {r["instance"]: r["lp"] for r in rows if r["condition"] == "all"}
    for r in rows:  # head 0 now recalls exactly as well as all heads
        if r["condition"] == "h0":
            r["lp"], r["retrieved"] = lp_all[r["instance"]], True
    changed = tmp_path / "changed.jsonl"
    changed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    after = _plotted(monkeypatch, "head_pooling", changed, tmp_path)
    assert len(before) == len(after) and before != after
    assert 1.0 in after and after.count(1.0) > before.count(1.0)


def test_passcode_figure_follows_its_summary(monkeypatch, tmp_path):
    src = default_input("passcode")
    with open(src) as f:
        rows = list(csv.DictReader(f))
    before = _plotted(monkeypatch, "passcode", src, tmp_path)
    rows[0].update(retrieval="0.4321", retrieval_lo="0.3", retrieval_hi="0.5")
    changed = tmp_path / "changed.csv"
    with open(changed, "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    after = _plotted(monkeypatch, "passcode", changed, tmp_path)
    assert 0.4321 in after and 0.4321 not in before


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_each_figure_module_refuses_a_missing_file_clearly(name, tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m"):
        draw(name, tmp_path / "missing.jsonl", tmp_path)


def test_the_challenge_figure_is_drawn_on_request_from_its_shipped_verdict(tmp_path):
    assert main(["--probe", "challenge", "--out", str(tmp_path), "--name", "verdict"]) == 0
    assert (tmp_path / "verdict.png").stat().st_size > 5_000
