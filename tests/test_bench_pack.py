"""``bench.pack``: the three harness arms end to end on the tiny model, rows compared, a result file the docs'
table renders from."""

import json

from bench import pack


def test_three_arms_run_and_packed_rows_equal_one_at_a_time(tiny_dir, tmp_path):
    out = tmp_path / "pack.json"
    assert pack.main(["--model", tiny_dir, "--problems", "4", "--batch", "3", "--max-new-tokens", "40",
                      "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["arm"] for r in data["rows"]] == list(pack.ARMS)
    assert all(r["generations"] == 8 and r["wall_s"] > 0 for r in data["rows"])  # 4 problems x (full, random)
    assert data["rows"][0]["prompt_lengths"][2] > 1  # the word problems' prompts differ in length
    assert data["meta"]["rows_compared"] == 8 and data["meta"]["rows_equal"] == 8, data["meta"]["unequal"]
    assert data["rows"][0]["x_one_at_a_time"] == 1.0
