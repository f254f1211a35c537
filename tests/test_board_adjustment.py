"""The leaderboard's verdicts are adjusted across the board (Holm) and carry their MDE (probes.leaderboard.adjust_board):
a 7/0/1 sign test that was "better" alone is not once 45 comparisons share the family, a strong effect still is, and
n = 8 can detect nothing at the board's level."""

from __future__ import annotations

import math

import pytest

from probes.leaderboard import adjust_board, compared
from randattn.power import holm, mde_normal, mde_sign


def _row(policy, a, b, lp=None):
    row = compared("copy", "copy accuracy", "problems", policy, a, b, seed=0)
    if lp is not None:
        la, lb = lp
        c = compared("copy", "log-prob", "problems", policy, la, lb, seed=0)
        row.update({"lp_delta": c["delta"], "lp_delta_lo": c["delta_lo"], "lp_delta_hi": c["delta_hi"],
                    "lp_p": c["p"], "lp_sd_delta": c["sd_delta"]})
    return row


def _binary(wins, losses, ties):
    a = {i: [1.0] for i in range(wins)} | {wins + i: [0.0] for i in range(losses)} | \
        {wins + losses + i: [1.0] for i in range(ties)}
    b = {i: [0.0] for i in range(wins)} | {wins + i: [1.0] for i in range(losses)} | \
        {wins + losses + i: [1.0] for i in range(ties)}
    return a, b


def _fractional_board() -> list[dict]:
    """A fractional score with a log-prob (32 problems) beside a 0/1 score: two score comparisons and one log-prob."""
    a = {i: [0.5 + 0.01 * (i % 7)] for i in range(32)}
    b = {i: [0.5] for i in range(32)}
    la = {i: [-1.0 + 0.1 * (i % 5)] for i in range(32)}
    lb = {i: [-1.2] for i in range(32)}
    return [_row("frac", a, b, lp=(la, lb)), _row("other", *_binary(3, 3, 26))]


def test_a_lone_p_0016_is_not_better_across_a_45_comparison_board():
    alone = [_row("rkv", *_binary(7, 0, 1))]
    adjust_board(alone)
    assert alone[0]["verdict"] == "better" and alone[0]["p"] == pytest.approx(2 * 0.5 ** 7)
    board = [_row("rkv", *_binary(7, 0, 1))] + [_row(f"null{i}", *_binary(2, 2, 4)) for i in range(44)]
    adjust_board(board)
    assert board[0]["verdict"] == "no detectable difference"
    assert board[0]["family"] == 45 and board[0]["adjustment"] == "holm"
    assert board[0]["p_adjusted"] == pytest.approx(holm([r["p"] for r in board])[0])
    assert board[0]["mde"] == math.inf  # 8 units: even 8/0 gives p = 0.0078 > 0.05 / 45


def test_a_strong_effect_survives_the_adjustment_and_its_mde_is_the_sign_tests():
    board = [_row("strong", *_binary(40, 1, 23))] + [_row(f"null{i}", *_binary(5, 5, 54)) for i in range(44)]
    adjust_board(board)
    strong = board[0]
    assert strong["verdict"] == "better" and strong["p_adjusted"] < 0.05
    assert strong["mde_method"] == "exact sign"
    assert strong["mde"] == pytest.approx(mde_sign(64, noise=1 / 64, alpha=0.05 / 45))
    assert all(r["verdict"] == "no detectable difference" for r in board[1:])


def test_fractional_scores_get_the_normal_mde_and_log_probs_join_the_family():
    board = _fractional_board()
    adjust_board(board)
    frac = board[0]
    assert frac["family"] == 3 and frac["lp_family"] == 3  # two scores + one log-prob
    assert frac["mde_method"] == "normal"
    assert frac["mde"] == pytest.approx(mde_normal(frac["sd_delta"], 32, alpha=0.05 / 3))
    assert frac["lp_mde"] == pytest.approx(mde_normal(frac["lp_sd_delta"], 32, alpha=0.05 / 3))
    assert frac["lp_verdict"] == "better" and frac["lp_p_adjusted"] >= frac["lp_p"]


def test_the_target_mde_planner_gives_the_units_that_reach_the_power():
    from probes.leaderboard import planned_units
    from randattn.power import sign_test_power, units_for_mde

    board = [_row("a", *_binary(6, 2, 24)), _row("b", *_binary(1, 1, 30))]
    adjust_board(board)
    (plan,) = planned_units(board, 0.2)
    assert plan["n"] == 32 and plan["how"].startswith("exact sign, noise 0.062")
    assert plan["units"] == units_for_mde(0.2, noise=2 / 32, alpha=0.05 / 2)
    assert sign_test_power(plan["units"], 0.2, noise=2 / 32, alpha=0.05 / 2) >= 0.8


def test_a_target_mde_outside_0_1_is_refused_before_anything_loads():
    import subprocess
    import sys

    for bad in ("0", "1", "-0.2", "1.5"):
        out = subprocess.run([sys.executable, "-m", "probes.leaderboard", "--target-mde", bad], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2 and "--target-mde: must be strictly between 0 and 1" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_a_task_table_read_back_by_the_board_keeps_its_types_and_its_mde(tmp_path):
    """The board re-adjusts every task's leaderboard.csv as read back from disk: the read must give back the row the
    leaderboard wrote, so that a fractional task keeps its normal-approximation MDE (``signed_unit`` read as the
    text "False" made every fractional task's MDE the sign test's, 0.42-0.48 instead of 0.06-0.09 on the board's
    copy task)."""
    from probes.board import read_table
    from probes.planted_run import write_csv

    written = _fractional_board()
    adjust_board(written)
    back = read_table(write_csv(tmp_path / "leaderboard.csv", [dict(r) for r in written]))
    assert [r["signed_unit"] for r in back] == [False, True]
    assert back[0]["unit"] == "problems" and back[0]["lp_verdict"] == written[0]["lp_verdict"]
    adjust_board(back)
    assert back[0]["mde_method"] == "normal"
    for before, after in zip(written, back):
        for key in ("mde", "mde_method", "p_adjusted", "verdict", "lp_mde", "lp_p_adjusted", "lp_verdict"):
            if key in before:
                assert after[key] == pytest.approx(before[key]) if isinstance(before[key], float) \
                    else after[key] == before[key], key
