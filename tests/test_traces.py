"""The trace-corpus generator's problems and the traces loader."""

import json
import random
import re

import pytest

from probes.traces import load_traces, make_problem


def test_problems_are_deterministic_per_seed_and_varied():
    a = [make_problem(random.Random(i)) for i in range(200)]
    b = [make_problem(random.Random(i)) for i in range(200)]
    assert a == b
    assert len({p["question"] for p in a}) == 200
    openings = {" ".join(p["question"].split()[1:3]) for p in a}
    assert len(openings) >= 8, openings  # several templates, not one
    assert all(isinstance(p["answer"], (int, float)) and p["answer"] >= 0 for p in a)


def test_answers_agree_with_an_independent_reading_of_the_question():
    checked = 0
    for i in range(400):
        p = make_problem(random.Random(i))
        q = p["question"]
        m = re.search(r"has (\d+) \w+\. \w+ has (\d+) times as many \w+ as \w+, then gives away (\d+)\.", q)
        if m:
            x, y, z = map(int, m.groups())
            assert p["answer"] == x * y - z
            checked += 1
        m = re.search(r"travels at (\d+) km per hour for (\d+) hours, then another (\d+) km", q)
        if m:
            s, h, e = map(int, m.groups())
            assert p["answer"] == s * h + e
            checked += 1
        m = re.search(r"is (\d+) m long and (\d+) m wide\. A path 1 m wide", q)
        if m:
            w, h = map(int, m.groups())
            assert p["answer"] == 2 * (w + h) + 4
            checked += 1
    assert checked >= 100


def test_load_traces_reads_text_and_names_bad_input(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text(json.dumps({"text": "first"}) + "\n\n" + json.dumps({"text": "second", "id": 2}) + "\n")
    assert load_traces(good) == ["first", "second"]
    with pytest.raises(FileNotFoundError, match="--traces .*no such file; make one with `python -m probes.traces"):
        load_traces(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        load_traces(bad)
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"solution": "x"}\n')
    with pytest.raises(ValueError, match='line 1 has no string "text" field'):
        load_traces(nofield)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no traces"):
        load_traces(empty)


@pytest.mark.slow
def test_shipped_corpus_is_large_enough_and_written_by_the_embedded_model(embedded):
    """The probes draw fillers of several thousand tokens without reuse: ~100k tokens of trace."""
    from pathlib import Path

    _, tok = embedded
    path = Path(__file__).resolve().parents[1] / "data" / "traces" / "smollm2-135m.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert sum(r["tokens"] for r in rows) >= 100_000
    assert len({r["id"] for r in rows}) == len(rows)
    assert all(r["settings"]["model"] == "smollm2-135m" and r["text"].strip() for r in rows)
    # The recorded lengths are the model's own token counts (re-tokenising decoded text is close, not exact).
    sample = rows[:: max(1, len(rows) // 50)]
    recount = sum(len(tok(r["text"], add_special_tokens=False)["input_ids"]) for r in sample)
    recorded = sum(r["tokens"] for r in sample)
    assert abs(recount - recorded) <= 0.05 * recorded
