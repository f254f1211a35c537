"""The accuracy harness: graders on hand cases, the task data paths, and ``probes.accuracy`` end to end on a tiny
model with the real tokenizer (rows, resume, the length guard both ways, the compression sweep, errors)."""

import json

import numpy as np

import pytest

from probes import tasks
from probes.tasks import Problem

# -- math grader --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("nested: \\boxed{\\left(\\frac{\\sqrt{3}}{2}, \\{1\\}\\right)} done", "\\left(\\frac{\\sqrt{3}}{2}, \\{1\\}\\right)"),
    ("first \\boxed{1}, then corrected: \\boxed{2}", "2"),
    ("\\boxed{7} and then cut off \\boxed{\\frac{1}{", "7"),  # an unclosed last box falls back to the one before
    ("the brace-less form \\boxed 5$", "5"),
    ("\\fbox{x+1}", "x+1"),
    ("no box at all: 42", None),
])
def test_last_boxed(text, expected):
    assert tasks.last_boxed(text) == expected


@pytest.mark.parametrize("pred,gold,same", [
    ("0.5", "\\frac{1}{2}", True),
    ("\\dfrac{3}{4}", "0.75", True),
    ("\\sqrt{12}", "2\\sqrt{3}", True),
    ("1+x^2", "x^2+1", True),
    ("10.0", "10", True),
    ("6", "5", False),
    ("\\frac{1}{3}", "0.33", False),
])
def test_math_equal_uses_math_verify(pred, gold, same):
    assert tasks.math_equal(pred, gold) is same


def test_grade_math_reads_the_last_box_only():
    prob = Problem("p", "q", "\\frac{1}{2}", "math")
    right = tasks.grade_math("Try \\boxed{3}? No. Half of one is \\boxed{0.5}.", prob)
    wrong = tasks.grade_math("It is \\boxed{0.5}... wait, \\boxed{3}.", prob)
    none = tasks.grade_math("It is one half.", prob)
    assert (right.score, right.extracted) == (1.0, "0.5")
    assert (wrong.score, wrong.extracted) == (0.0, "3")
    assert (none.score, none.extracted) == (0.0, None)


# -- multiple choice ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text,letter", [
    ("Reasoning...\nAnswer: C", "C"),
    ("so the correct answer is (B).", "B"),
    ("\\boxed{D}", "D"),
    ("\\boxed{\\text{A}}", "A"),
    ("Answer: **B**", "B"),
    ("Answer: A\nHmm, no. Answer: D", "D"),
    ("The answer is a bit subtle, and I cannot decide.", None),
    ("nothing here", None),
])
def test_choice_letter(text, letter):
    assert tasks.choice_letter(text) == letter


def test_choices_are_shuffled_deterministically_per_problem():
    orders = {}
    for pid in map(str, range(24)):
        options, letter = tasks.shuffle_choices(pid, "right", ["w1", "w2", "w3"])
        assert options[tasks.LETTERS.index(letter)] == "right"
        assert tasks.shuffle_choices(pid, "right", ["w1", "w2", "w3"]) == (options, letter)
        orders[pid] = letter
    assert len(set(orders.values())) == 4  # the correct option does not always sit in one place


def test_gpqa_rows_in_both_field_spellings_grade_the_letter():
    task = tasks.get_task("gpqa_diamond")
    hf = {"Record ID": "rec1", "Question": "Which?", "Correct Answer": "yes", "Incorrect Answer 1": "a",
          "Incorrect Answer 2": "b", "Incorrect Answer 3": "c"}
    plain = {"id": "rec1", "question": "Which?", "correct": "yes", "incorrect": ["a", "b", "c"]}
    p1, p2 = tasks.problem_from_row(task, hf, 0), tasks.problem_from_row(task, plain, 0)
    assert p1 == p2 and f"{p1.answer}) yes" in p1.prompt
    assert tasks.grade_choice(f"Answer: {p1.answer}", p1).score == 1.0
    wrong = next(x for x in "ABCD" if x != p1.answer)
    assert tasks.grade_choice(f"Answer: {wrong}", p1).score == 0.0
    with pytest.raises(tasks.TaskDataError, match="incorrect"):
        tasks.problem_from_row(task, {"question": "q", "correct": "c"}, 3)


# -- copy task ------------------------------------------------------------------------------------------


def test_copy_problems_are_fixed_and_the_grader_reads_the_first_n_numbers():
    prob = tasks.copy_problem(5)
    assert prob == tasks.copy_problem(5) and prob != tasks.copy_problem(6)
    nums = prob.answer.split(", ")
    assert len(nums) == tasks.COPY_N and all(len(x) == 4 for x in nums) and prob.answer in prob.prompt
    assert tasks.grade_copy(prob.answer + ", 1234, 5678 and more", prob).score == 1.0
    assert tasks.grade_copy("The list is " + prob.answer.replace(", ", "\n"), prob).score == 1.0
    one_wrong = [*nums[:3], "0000" if nums[3] != "0000" else "1111", *nums[4:]]
    assert tasks.grade_copy(", ".join(one_wrong), prob).score == pytest.approx((tasks.COPY_N - 1) / tasks.COPY_N)
    skipped = nums[:3] + nums[4:]  # a skipped number shifts everything after it
    assert tasks.grade_copy(", ".join(skipped), prob).score < 0.5
    assert tasks.grade_copy("12345, 99 " + prob.answer, prob).score == 1.0  # not four-digit: ignored
    assert tasks.grade_copy("", prob).score == 0.0


# -- data loading -------------------------------------------------------------------------------------


def test_math500_without_data_names_both_options(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(tasks.TaskDataError) as err:
        tasks.load_problems(tasks.get_task("math500"))
    assert "--data FILE.jsonl" in str(err.value) and "HuggingFaceH4/MATH-500" in str(err.value)


def test_data_file_is_read_and_checked(tmp_path):
    task = tasks.get_task("math500")
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"id": "a", "problem": "What is 1/2 + 0?", "answer": "\\frac{1}{2}"}) + "\n"
                    + json.dumps({"question": "2+2?", "answer": 4}) + "\n")
    probs = tasks.load_problems(task, path)
    assert [p.id for p in probs] == ["a", "1"] and probs[1].answer == "4"
    assert tasks.MATH_INSTRUCTION in probs[0].prompt
    path.write_text(json.dumps({"problem": "no answer"}) + "\n")
    with pytest.raises(tasks.TaskDataError, match="'answer'"):
        tasks.load_problems(task, path)
    with pytest.raises(tasks.TaskDataError, match="no such file"):
        tasks.load_problems(task, tmp_path / "missing.jsonl")


def test_thinking_mode_is_switched_on_where_the_template_has_it():
    class Tok:
        chat_template = "{% if enable_thinking %}<think>{% endif %}"

        def apply_chat_template(self, messages, **kw):
            self.kw = kw
            return {"input_ids": [1, 2]}

    tok = Tok()
    assert tasks.chat_ids(tok, "hi") == [1, 2] and tok.kw["enable_thinking"] is True
    tok.chat_template = "{{ messages }}"
    tasks.chat_ids(tok, "hi")
    assert "enable_thinking" not in tok.kw


# -- the harness end to end ---------------------------------------------------------------------------


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run(tiny_dir, tmp_path, *flags):
    """Run the harness into the folder ``tmp_path/acc``; returns ``(exit code, the results file written there)``."""
    from probes import accuracy

    folder = tmp_path / "acc"
    code = accuracy.main(["--model", tiny_dir, "--task", "copy", "--out", str(folder), "--figure-dir", str(tmp_path),
                          "--buffer", "8", "--max-new-tokens", "40", *flags])
    return code, _written(folder)


def _written(folder):
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    return files[0] if len(files) == 1 else folder / "missing.jsonl"


def test_harness_rows_resume_table_and_figure(tiny_dir, tmp_path, capsys):
    flags = ["--policy", "full", "random", "recency", "--budget", "224", "--runs", "2"]
    code, out = _run(tiny_dir, tmp_path, *flags, "--problems", "3")
    assert code == 0
    first = _rows(out)
    assert len(first) == 3 * (1 + 2 + 1)  # full and recency once (greedy runs would be identical), random twice
    assert {(r["policy"], r["run"]) for r in first} == {("full", 0), ("random", 0), ("random", 1), ("recency", 0)}
    for r in first:
        assert r["config"]["model"] == tiny_dir and r["config"]["buffer"] == 8 and r["prompt_len"] == 213
        assert r["gen_len"] <= 40 and isinstance(r["terminated"], bool) and 0.0 <= r["grade"] <= 1.0
        if r["policy"] == "full":
            assert r["events"] == 0 and r["budget"] is None
        else:
            # K + r = 232 is reached 19 tokens into the answer, then a round every 8 tokens
            assert r["budget"] == 224 and r["protect_prompt"] is True
            assert r["events"] == r["cache_events"] == len(range(232, 213 + r["gen_len"] - 1, 8)) > 0
            assert r["compressed"] is True
    assert len({r["seed"] for r in first if r["policy"] == "random"}) == 2  # runs differ by eviction seed
    text = capsys.readouterr().out
    assert "WARNING" not in text and "verdict" in text and "| method | copy K=224 |" in text
    for ext in (".summary.csv", ".table.csv", ".table.tex", ".table.md"):
        assert out.with_suffix(ext).exists()
    assert "\\begin{tabular}" in out.with_suffix(".table.tex").read_text()
    # not the default run: the figure is named after its results, beside the default one's name
    assert (tmp_path / f"{out.stem}.png").exists() and (tmp_path / f"{out.stem}.pdf").exists()

    assert _run(tiny_dir, tmp_path, *flags, "--problems", "4")[0] == 0  # resume: only problem 3 is new
    rows = _rows(out)
    assert rows[: len(first)] == first and len(rows) == 4 * 4
    assert {r["problem"] for r in rows[len(first):]} == {"copy-3"}

    assert _run(tiny_dir, tmp_path, "--policy", "random", "--budget", "224", "--runs", "2", "--problems", "4",
                "--no-protect-prompt")[0] == 0  # score-only arm joins the same file
    text = capsys.readouterr().out
    assert "random (score only)" in text and "prompt protection gain, random K=224" in text
    assert (out.with_suffix(".protection.csv")).exists()


def test_budget_sweep_puts_every_k_in_one_file(tiny_dir, tmp_path, capsys):
    code, out = _run(tiny_dir, tmp_path, "--policy", "random", "recency", "--budget", "224", "240", "--runs", "1",
                     "--problems", "2", "--no-figure")
    assert code == 0
    rows = _rows(out)
    assert {(r["policy"], r["budget"]) for r in rows} == {(p, k) for p in ("random", "recency") for k in (224, 240)}
    for r in rows:  # the first round fires at K + r, then every r tokens
        assert r["events"] == len(range(r["budget"] + 8, 213 + r["gen_len"] - 1, 8))
    assert "| method | copy K=224 | copy K=240 |" in capsys.readouterr().out


def test_rows_count_only_the_rounds_that_ran_while_they_generated():
    """A row that stopped early shares the cache with rows that go on: its events stop at its own end."""
    from probes import accuracy

    class Tok:
        eos_token_id, pad_token_id = 0, 0

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    class Layer:
        round_lengths, held = [20, 24, 28, 32], None

    class Cache:
        layers, events = [Layer()], [4]

    rows = accuracy.rows_of([[5, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # EOS at position 18
                             [5] * 18], prompt_lens=[16, 16], cache=Cache(), tok=Tok(), stop={0})
    # row 0's tokens end at position 18, so no round (the first at length 20) shaped it; row 1 ends at 33
    assert [(r["gen_len"], r["terminated"], r["events"]) for r in rows] == [(3, True, 0), (18, False, 4)]


def test_length_guard_flags_rows_that_never_evicted(tiny_dir, tmp_path, capsys):
    code, out = _run(tiny_dir, tmp_path, "--policy", "random", "--budget", "400", "--runs", "1", "--problems", "2",
                     "--no-figure")
    assert code == 0
    rows = _rows(out)
    assert rows and all(r["events"] == 0 and r["compressed"] is False for r in rows)
    text = capsys.readouterr().out
    assert "WARNING" in text and "FULL ATTENTION, not compression" in text and "random K=400: 2" in text


def test_compression_sweep_sets_k_from_full_attention_length(tiny_dir, tmp_path):
    code, out = _run(tiny_dir, tmp_path, "--policy", "random", "--compression", "2", "4", "--no-protect-prompt",
                     "--runs", "1", "--problems", "2", "--max-new-tokens", "48", "--buffer", "4", "--no-figure")
    assert code == 0
    rows = _rows(out)
    full = [r for r in rows if r["policy"] == "full"]
    assert len(full) == 2  # run first, because the sweep needs it
    mean = sum(r["gen_len"] for r in full) / len(full)
    sweep = {r["compression"]: r["budget"] for r in rows if r["policy"] == "random"}
    assert sweep == {2.0: round(mean / 2), 4.0: round(mean / 4)}
    assert all(r["events"] > 0 for r in rows if r["policy"] == "random")


@pytest.mark.parametrize("flags,message", [
    (["--policy", "nope"], "--policy"),
    (["--task", "nope"], "--task"),
    (["--budget", "300", "--compression", "2"], "--compression"),
    (["--policy", "random", "--budget", "100"], "--no-protect-prompt"),  # cannot hold the 213-token prompt
    (["--policy", "random", "--compression", "4"], "--compression: 4"),
    (["--policy-option", "h2o:nope=1"], "--policy-option"),
    (["--policy-option", "h2o-recent"], "POLICY:KEY=VALUE"),
    (["--policy", "triattention"], "--stats"),
    (["--task", "math500", "--policy", "random"], "--data FILE.jsonl"),
    (["--task", "copy", "--data", "x.jsonl"], "--data"),
    (["--runs", "0"], "--runs: must be a positive integer, got 0"),
    (["--temperature", "nan"], "--temperature: must be a non-negative number, got nan"),
    (["--compression", "nan"], "--compression: must be a positive number, got nan"),
    (["--protocol", "grid", "--no-protect-prompt"], "disagree"),
])
def test_bad_flags_name_the_flag_and_the_fix(tiny_dir, tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(SystemExit):
        _run(tiny_dir, tmp_path, "--problems", "2", "--runs", "1", *flags)
    assert message in capsys.readouterr().err


def test_math_task_from_a_data_file_runs_and_grades(tiny_dir, tmp_path):
    from probes import accuracy

    data = tmp_path / "m.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"m{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i)})
                              for i in range(3)) + "\n")
    out = tmp_path / "m"
    assert accuracy.main(["--model", tiny_dir, "--task", "math500", "--data", str(data), "--policy", "full", "random",
                          "--budget", "64", "--buffer", "4", "--runs", "1", "--max-new-tokens", "12", "--out",
                          str(out), "--no-figure"]) == 0
    rows = _rows(_written(out))
    assert {r["problem"] for r in rows} == {"m0", "m1", "m2"} and all(r["grade"] in (0.0, 1.0) for r in rows)
    assert all(r["config"]["data"] for r in rows) and all(r["answer"] == str(2 * int(r["problem"][1:])) for r in rows)


def test_summary_pairs_each_arm_with_random_by_problem():
    from probes.accuracy import summarize, table_results

    def row(policy, problem, run, grade, protect=True):
        return {"policy": policy, "budget": None if policy == "full" else 64, "protect_prompt": None if policy == "full"
                else protect, "problem": problem, "run": run, "grade": grade, "gen_len": 10, "terminated": True,
                "events": 0 if policy == "full" else 3, "compressed": policy != "full"}

    rows = [row("random", f"p{i}", j, 1.0 if i < 12 else 0.0) for i in range(20) for j in range(2)]
    rows += [row("snapkv", f"p{i}", j, 0.0) for i in range(20) for j in range(2)]
    rows += [row("full", f"p{i}", 0, 1.0) for i in range(20)]
    table = {t["method"]: t for t in summarize(rows, n_resamples=2000)}
    assert table["random"]["accuracy"] == pytest.approx(0.6) and "delta" not in table["random"]
    snap = table["snapkv"]
    assert snap["delta"] == pytest.approx(-0.6) and (snap["wins"], snap["losses"], snap["ties"]) == (0, 12, 8)
    assert snap["verdict"] == "worse" and snap["p_sign"] == pytest.approx(2 * 0.5 ** 12)
    assert table["full"]["verdict"] == "better" and table["full"]["delta"] == pytest.approx(0.4)
    results = table_results(rows, "copy")
    assert set(results) == {("full", "copy K=64"), ("random", "copy K=64"), ("snapkv", "copy K=64")}
    # score-only arms get their own column, compared with score-only Random
    rows += [row("random", f"p{i}", 0, 0.0, protect=False) for i in range(20)]
    rows += [row("snapkv", f"p{i}", 0, 1.0 if i < 15 else 0.0, protect=False) for i in range(20)]
    table = {t["method"]: t for t in summarize(rows, n_resamples=2000)}
    assert table["snapkv (score only)"]["vs"] == "random (score only)"
    assert table["snapkv (score only)"]["delta"] == pytest.approx(0.75)
    results = table_results(rows, "copy")
    assert set(results) == {(m, c) for m in ("full", "random", "snapkv") for c in ("copy K=64", "copy K=64 score only")}
    assert results[("snapkv", "copy K=64 score only")]["p0"] == [1.0]


@pytest.mark.slow
def test_full_attention_solves_the_embedded_copy_task(embedded):
    import torch

    import randattn

    model, tok = embedded
    task = tasks.get_task("copy")
    probs = tasks.load_problems(task, limit=2)
    ids = torch.tensor([tasks.chat_ids(tok, p.prompt) for p in probs])
    cache = randattn.EvictingCache("random", budget=ids.shape[1] + task.max_new_tokens + 1, buffer=1,
                                   protect_prompt=False)
    out = randattn.generate(model, ids, cache, max_new_tokens=task.max_new_tokens, do_sample=False,
                            pad_token_id=tok.eos_token_id)
    assert cache.total_events == 0  # really full attention
    grades = [task.grade(tok.decode(o[ids.shape[1]:], skip_special_tokens=True), p).score for o, p in zip(out, probs)]
    assert sum(grades) / len(grades) >= 0.9, grades


def test_accuracy_figure_plots_the_rows(monkeypatch, tmp_path):
    import figures.style
    from figures.accuracy import plot

    cfg = {"model": "m", "task": "copy", "buffer": 16}

    def rows(random_grade):
        out = [{"policy": "full", "budget": None, "protect_prompt": None, "problem": f"p{i}", "run": 0, "grade": 1.0,
                "task": "copy", "config": cfg} for i in range(6)]
        for pol, grade in (("random", random_grade), ("snapkv", 0.25)):
            for protect in (True, False):
                out += [{"policy": pol, "budget": 256, "protect_prompt": protect, "problem": f"p{i}", "run": j,
                         "grade": grade if protect else 0.0, "task": "copy", "config": cfg}
                        for i in range(6) for j in range(2)]
        return out

    def plotted(grade):
        points = []
        real = figures.style.errorbar
        monkeypatch.setattr(figures.style, "errorbar",
                            lambda ax, x, est, **kw: (points.append(round(est.value, 6)), real(ax, x, est, **kw))[1])
        files = plot(rows(grade), tmp_path, name=f"acc{grade}")
        assert all(f.exists() for f in files)
        return sorted(points)

    assert plotted(0.5) == [0.0, 0.0, 0.25, 0.5]
    assert plotted(0.75) == [0.0, 0.0, 0.25, 0.75]


def test_summary_compares_generation_length_with_random_too():
    """The paper's check that parity is not bought with longer reasoning: lengths paired by problem."""
    from probes.accuracy import summarize

    def row(policy, problem, length):
        return {"policy": policy, "budget": 64, "protect_prompt": True, "problem": problem, "run": 0, "grade": 1.0,
                "gen_len": length, "terminated": True, "events": 3, "compressed": True}

    rows = [row("random", f"p{i}", 100) for i in range(16)] + [row("vase", f"p{i}", 100 + 10 * (i % 3 + 1))
                                                                 for i in range(16)]
    vase = {t["method"]: t for t in summarize(rows, n_resamples=2000)}["vase"]
    assert vase["len_delta"] == pytest.approx(np.mean([10 * (i % 3 + 1) for i in range(16)]))
    assert vase["len_delta_lo"] > 0 and vase["len_verdict"] == "longer"


@pytest.mark.parametrize("protocol,expected", [
    ("protected", {("random", True), ("snapkv", True), ("triattention", True)}),
    ("score-only", {("random", False), ("snapkv", False), ("triattention", False)}),
    ("matched", {(p, m) for p in ("random", "snapkv", "triattention") for m in (True, False)}),
    # the paper's grid: SnapKV score only, TriAttention with the prefill pinned, against protected Random
    ("grid", {("random", True), ("snapkv", False), ("triattention", True)}),
])
def test_protocols_choose_the_arms(protocol, expected):
    from probes.accuracy import protocol_arms

    arms = protocol_arms(protocol, ["random", "snapkv", "triattention"], [256, 320])
    assert {(a.policy, a.protect) for a in arms} == expected and {a.budget for a in arms} == {256, 320}


def test_grid_protocol_end_to_end_records_the_protocol_and_engine(tiny_dir, tmp_path, capsys):
    code, out = _run(tiny_dir, tmp_path, "--protocol", "grid", "--policy", "random", "snapkv", "--problems", "2",
                     "--budget", "240", "--no-figure")
    assert code == 0
    rows = _rows(out)
    assert {(r["policy"], r["protect_prompt"]) for r in rows} == {("random", True), ("snapkv", False)}
    assert all(r["protocol"] == "grid" and r["config"]["engine"] == "paper" and r["config"]["recent"] == 8
               and r["versions"]["randattn"] for r in rows)
    assert "protocol grid: each baseline in its native mode" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        _run(tiny_dir, tmp_path, "--protocol", "matched", "--no-protect-prompt", "--problems", "2")
    assert "disagree" in capsys.readouterr().err


def test_repeat_task_grades_two_endpoints_and_sweeps_compression(tiny_dir, tmp_path):
    """The repeat grader's two endpoints, each a function of the text: copies written (capped at 64; the prompt's
    own first line not counted) and the mean fidelity of the copies written; no threshold joins them."""
    from probes.tasks import REPEAT_LINES, get_task, grade_repeat, load_problems, repeat_problem

    p = repeat_problem(3)
    assert p.prefix == f"1. {p.answer}\n2." and p.system == "" and len(p.answer.split()) == 4
    def copies(n, last=None):  # lines 2 .. n + 1 as the model writes them after the prompt's "1. ...\n2."
        lines = [f" {p.answer}"] + [f"{k}. {p.answer}" for k in range(3, n + 2)]
        if last is not None:
            lines[-1] = f"{n + 1}. {last}"
        return "\n".join(lines) + "\n"

    def endpoints(text):
        g = grade_repeat(text, p)
        return g.endpoints["copies"], g.endpoints["fidelity"], g.score

    half = " ".join(p.answer.split()[:2] + ["1111", "2222"])
    # early stop with exact copies: few copies (generation behaviour), full fidelity (content kept): no zero
    assert endpoints(copies(7) + "\nThe output should be the line.") == (7, 1.0, 1.0)
    assert endpoints(copies(1)) == (1, 1.0, 1.0)
    # a wrong line lowers the fidelity, by its share of the copies; the cut-off last line does not count
    n, fid, score = endpoints(copies(40, half) + f"42. {p.answer[:6]}")
    assert n == 40 and fid == pytest.approx((39 + 0.5) / 40) == score < 1.0
    assert endpoints(copies(40) + "42. 12") == (40, 1.0, 1.0)
    # a model that ends the list by itself and writes a sentence: 63 copies (lines 2 to 64), the sentence no copy
    stopped = grade_repeat(copies(63) + "\nThe number of times the number appears is 10.", p)
    assert (stopped.endpoints, stopped.score) == ({"copies": 63, "fidelity": 1.0}, 1.0)
    assert stopped.extracted.startswith("64. ")
    # more than 64 copies (a model cut off at the length limit past line 64) are capped at 64; all count for fidelity
    over = copies(70, half)
    assert endpoints(over) == (REPEAT_LINES, pytest.approx(69.5 / 70), pytest.approx(69.5 / 70))
    # no copy written: no fidelity (None), and a grade of 0.0, said so in the grader's docstring
    for text in ("", " 1234 5678", "I cannot do that."):
        g = grade_repeat(text, p)
        assert g.endpoints == {"copies": 0, "fidelity": None} and g.score == 0.0 and g.extracted is None
    assert "0.0 when no copy was written" in " ".join(grade_repeat.__doc__.split())
    assert [q.id for q in load_problems(get_task("repeat"))] == [f"repeat-{i}" for i in range(8)]
    from probes import accuracy

    out = tmp_path / "rep"
    assert accuracy.main(["--model", tiny_dir, "--task", "repeat", "--policy", "random", "--compression", "2",
                          "--problems", "2", "--runs", "1", "--max-new-tokens", "200", "--out", str(out),
                          "--no-figure"]) == 0
    rows = _rows(_written(out))
    assert {r["policy"] for r in rows} == {"full", "random"}
    assert all(r["prompt_len"] < 80 and r["events"] > 0 for r in rows if r["policy"] == "random")
    for r in rows:  # both endpoints in every row, the grade the fidelity (0.0 without a copy)
        assert 0 <= r["copies"] <= REPEAT_LINES and (r["fidelity"] is None) == (r["copies"] == 0)
        assert r["grade"] == (r["fidelity"] or 0.0)
    from analysis.accuracy import endpoint_summary, summarize

    table = summarize(rows)  # the harness's own summary still reads repeat rows, with both endpoints beside
    assert {t["policy"] for t in table} == {"full", "random"} and all("copies" in t for t in table)
    assert {t["policy"] for t in endpoint_summary(rows, "copies")} == {"full", "random"}


def test_pooled_tasks_tag_each_source(monkeypatch):
    """AIME 2025 + 2026 and HMMT Feb + Nov are pooled with ids per source, so problems cluster within a year."""
    import probes.tasks as tasks

    def fake(task, src):
        return [{"problem": f"{src.tag} question {i}", "answer": str(i), "id": i + 1} for i in range(2)]

    monkeypatch.setattr(tasks, "_hf_source_rows", fake)
    aime = tasks.load_problems(tasks.get_task("aime"))
    assert [p.id for p in aime] == ["2025/1", "2025/2", "2026/1", "2026/2"]
    assert [p.id for p in tasks.load_problems(tasks.get_task("hmmt"))][::2] == ["feb2025/1", "nov2025/1"]
    assert tasks.get_task("aime").paper_runs == 16 and tasks.get_task("livecodebench").paper_runs == 4


def test_pack_batches_problems_of_any_length_sorted_and_rows_do_not_depend_on_the_batch(tiny_dir, tmp_path):
    """--pack puts problems of different prompt lengths into one left-padded batch; each row draws by its own key
    (problem, run), so the rows at --batch 3 equal those at --batch 1, Random included (timing fields aside)."""
    from probes import accuracy

    prompts = [[1] * 5, [1] * 3, [1] * 9, [1] * 4]
    from probes.tasks import Problem

    work = accuracy.pending_batches([accuracy.Arm("random", 64, True)], [Problem(str(i), "", "", "copy") for i in
                                    range(4)], prompts, lambda arm: 1, set(), 3, pack=True)
    assert [idx for _, _, idx in work] == [[1, 3, 0], [2]]  # sorted by length, lengths mixed in one batch
    data = tmp_path / "math.jsonl"  # the embedded tasks' prompts all have one length; these differ
    data.write_text("".join(json.dumps({"id": f"m{i}", "problem": q, "answer": a}) + "\n" for i, (q, a) in enumerate([
        ("What is 2 + 3?", "5"), ("Compute 12 times 11, then subtract the square of 4 from it.", "116"),
        ("What is 7 - 2?", "5"), ("A train leaves at noon at 60 km/h; how far has it gone by 3 pm?", "180")])))
    flags = ["--problems", "4", "--runs", "2", "--policy", "full", "random", "recency", "--budget", "84", "--pack",
             "--data", str(data)]
    runs = {}
    for batch in (1, 3):
        folder = tmp_path / f"b{batch}"
        code = accuracy.main(["--model", tiny_dir, "--task", "math500", "--out", str(folder / "acc"), "--buffer", "8",
                              "--max-new-tokens", "64", *flags, "--batch", str(batch), "--no-figure"])
        path = _written(folder / "acc")
        assert code == 0 and path.name.endswith("-packed-s0.jsonl")
        runs[batch] = {(r["problem"], r["run"], r["policy"]): r for r in _rows(path)}
    assert runs[1].keys() == runs[3].keys() and len(runs[1]) == 4 * (1 + 2 + 1)
    lengths = {r["prompt_len"] for r in runs[3].values()}
    assert len(lengths) > 1  # the copy problems' prompts differ in length, so batch 3 was padded
    assert any(r["events"] > 0 for r in runs[3].values() if r["policy"] == "random"), lengths
    # the config names the batch, and cache_events counts the rounds of the batch (it runs until its last row ends)
    drop = {"seconds", "versions", "revision", "date", "run_record", "config", "cache_events"}
    for key, row in runs[1].items():
        a = {k: v for k, v in row.items() if k not in drop}
        b = {k: v for k, v in runs[3][key].items() if k not in drop}
        assert a == b, key
