"""The accuracy harness's tasks: problems, prompts, default budgets and graders.

``TASKS`` maps a name to a :class:`Task`:

============  ======  ====  =====  ==========================================================
name          kind    K     max    data
============  ======  ====  =====  ==========================================================
math500       math    1024  32768  HF ``HuggingFaceH4/MATH-500`` (test) or ``--data``
aime          math    4096  32768  HF ``MathArena/aime_2025`` + ``aime_2026`` (pooled) or ``--data``
hmmt          math    4096  32768  HF ``MathArena/hmmt_feb_2025`` + ``hmmt_nov_2025`` or ``--data``
gpqa_diamond  choice  2048  32768  HF ``Idavidrein/gpqa``, ``gpqa_diamond`` (gated) or ``--data``
livecodebench code    3072  32768  HF ``livecodebench/code_generation_lite`` v6 (medium) or ``--data``
copy          copy    256   192    written here (no download): the embedded model's task
repeat        repeat  320   1664   written here: the embedded model's task in the paper's regime
============  ======  ====  =====  ==========================================================

K is the paper's per-task budget (MATH500 1024, GPQA-Diamond 2048, AIME/HMMT 4096, LiveCodeBench
3072; buffer r = 64) and 32k its maximum generation.

Graders:

- **math** (MATH500, AIME, HMMT): the answer is the content of the *last* ``\\boxed{...}`` (or
  ``\\fbox{...}``) in the output, braces matched so nested ``\\frac{1}{2}`` survive; it is compared
  with the reference by ``math-verify`` (symbolic and numeric equivalence: ``\\frac{1}{2}`` = ``0.5``,
  ``2\\sqrt{3}`` = ``\\sqrt{12}``). No box, no credit.
- **choice** (GPQA-Diamond): the four options are shuffled deterministically per problem id
  (``random.Random("gpqa:" + id)``), presented as ``A) .. D)``; the graded letter is the last
  ``Answer: X``, ``\\boxed{X}`` or ``answer is (X)`` in the output.
- **code** (LiveCodeBench): the last fenced program of the output is run against every test in an operating-system
  sandbox (:mod:`probes.code_grader`, bubblewrap: read-only system, a private empty ``/tmp``, no network, limits on
  time, memory, processes and output; the expected outputs stay outside); 1 when every test passes, with the
  per-test verdicts in the row.
- **repeat**: two endpoints of the generated text, each one behaviour (no threshold): ``copies``, the complete
  numbered lines written (the prompt's own ``1. <line>`` not counted), capped at 64 (generation behaviour: when the
  model stopped), and ``fidelity``, the mean fraction of the line's numbers in place over the copies written (content
  kept; None when none). The row's ``grade`` is the fidelity (0.0 when no copy was written).
- **copy**: the fraction of the ``n`` reference numbers the output reproduces in order (the first
  ``n`` four-digit numbers found; anything after is ignored, since the model keeps writing).

``--data FILE.jsonl`` fields (one JSON object per line): math tasks ``problem`` (or ``question``)
and ``answer`` (LaTeX, without ``\\boxed``); GPQA ``question``, ``correct`` and ``incorrect`` (a
list of three), or the HF names ``Question``, ``Correct Answer``, ``Incorrect Answer 1..3``;
LiveCodeBench the HF dataset's names: ``question_content`` (or ``question``), ``public_test_cases`` and/or
``private_test_cases`` (a JSON list of ``{"input", "output", "testtype"}``, or the dataset's compressed
string), optional ``starter_code`` (functional problems), ``metadata`` with ``func_name`` and ``difficulty``
(rows other than ``medium`` are skipped; missing counts as medium), id ``question_id``.
Optional ``id`` (else ``unique_id``, ``problem_idx``, ``Record ID`` or the line number).

The copy task ("Here is a list of numbers: 7311, 7890, ... Repeat the list, separated by commas.",
28 random four-digit numbers per problem, drawn from ``random.Random("copy:<i>")``) is one the
135M embedded model can do on CPU and whose answer lives only in the prompt: every number must be
read back from the question, so evicting the prompt costs accuracy directly. With the SmolLM2
tokenizer the prompt is 213 tokens and the answer about 175 ("Here is the list of numbers: " and
6 tokens a number), so at K = 256, r = 16 the first round fires 59 tokens into the answer and
about seven more follow while the rest is written (192 new tokens at most; the model usually
stops by itself). The protected
prompt leaves only K - 213 = 43 selectable slots, so H2O's recent window (``recent_fraction`` of K,
0.5 by default, which alone would exceed the budget) is set to 0.08 here: 20 recent slots, the other
23 for heavy hitters, H2O's half-and-half split of what the prompt leaves. SnapKV's 32-slot
observation window fits but leaves it 11 slots to choose.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from analysis.repeat import LINES as REPEAT_LINES
from analysis.repeat import copies, endpoints

__all__ = ["Problem", "Grade", "Task", "TASKS", "TaskDataError", "get_task", "load_problems", "last_boxed",
           "math_equal", "grade_math", "choice_letter", "grade_choice", "shuffle_choices", "copy_numbers",
           "grade_copy", "copy_problem", "repeat_problem", "grade_repeat", "chat_ids", "problem_ids",
           "has_thinking_mode"]

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CHOICE_INSTRUCTION = ("Answer the following multiple choice question. Think step by step, then end your response "
                      "with a line of the form 'Answer: X' where X is one of A, B, C or D.")
COPY_N = 28
COPY_TEMPLATE = "Here is a list of numbers: {numbers}\nRepeat the list, separated by commas."
LETTERS = "ABCD"


class TaskDataError(ValueError):
    """No problems could be loaded (the message says which options exist)."""


@dataclass(frozen=True)
class Problem:
    """One problem: ``prompt`` is the user message (the chat template is applied later)."""

    id: str
    prompt: str
    answer: str
    kind: str
    prefix: str = ""  # the start of the assistant's answer, part of the prompt (the repeat task's first line)
    system: Optional[str] = None  # a system message ("" for none where the template would add its own)
    data: Optional[dict] = field(default=None, compare=False, repr=False)  # what a grader needs beyond the answer


@dataclass(frozen=True)
class Grade:
    """A graded output: ``score`` in [0, 1] and what the grader read from the output."""

    score: float
    extracted: Optional[str]
    details: Optional[list] = None  # per-item verdicts (the code grader's per-test results), written into the row
    endpoints: Optional[dict] = None  # further row fields the grader measures (the repeat task's copies, fidelity)


@dataclass(frozen=True)
class HFSource:
    """Where a task's problems live on the HF hub, and which fields hold what."""

    path: str
    split: str
    name: Optional[str] = None
    tag: Optional[str] = None  # prefixed to problem ids when a task pools several sources ("2025", "feb")


@dataclass(frozen=True)
class Task:
    """A task: how to get its problems, its paper defaults, and its grader."""

    name: str
    kind: str  # "math", "choice", "copy" or "repeat"
    budget: int  # default K
    max_new_tokens: int
    grade: Callable[[str, Problem], Grade]
    buffer: int = 64  # default r
    hf: "HFSource | tuple[HFSource, ...] | None" = None
    description: str = ""
    policy_options: dict = field(default_factory=dict)  # {policy: {option: value}} this task's geometry needs
    problems: Optional[int] = None  # how many problems by default (None: all)
    paper_runs: Optional[int] = None  # the paper's runs per problem (scripts/run_cell.sh), for --protocol grid
    select: Optional[Callable[[dict], bool]] = None  # which source rows belong to the task (LiveCodeBench: medium)


# -- math ---------------------------------------------------------------------------------------
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (nested braces matched), or the
    token after ``\\boxed `` in the brace-less form; ``None`` when there is no complete box."""
    for m in reversed(list(_BOX.finditer(text))):
        rest = text[m.end():]
        if not rest.startswith("{"):
            word = re.match(r"([^\s$]+)", rest)
            if word:
                return word.group(1)
            continue
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if depth == 0:
                return rest[1:i].strip()
        # an unclosed box (generation cut off inside it): look further back
    return None


def math_equal(pred: str, gold: str) -> bool:
    """``pred`` and ``gold`` (LaTeX, no ``$``) are the same answer according to ``math-verify``."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("grading math answers needs math-verify: pip install 'math-verify>=0.7'") from None
    gold_parsed = parse(f"${gold}$")
    pred_parsed = parse(f"${pred}$")
    if not gold_parsed or not pred_parsed:
        return pred.strip() == gold.strip()
    return bool(verify(gold_parsed, pred_parsed))


def grade_math(text: str, problem: Problem) -> Grade:
    """1 when the last boxed answer equals the reference (math-verify), else 0."""
    pred = last_boxed(text)
    if pred is None:
        return Grade(0.0, None)
    return Grade(float(math_equal(pred, problem.answer)), pred)


def math_prompt(problem: str) -> str:
    return f"{problem.strip()}\n\n{MATH_INSTRUCTION}"


# -- multiple choice ------------------------------------------------------------------------------
_LETTER_PATTERNS = [
    re.compile(r"[Aa]nswer(?: is)?\s*:?\s*\**\s*\(?([ABCD])\)?(?![A-Za-z])"),
    re.compile(r"\\boxed\{\s*(?:\\text\{)?\s*\(?([ABCD])\)?\s*\}?\s*\}"),
]


def choice_letter(text: str) -> Optional[str]:
    """The last answer letter stated in ``text`` (``Answer: C``, ``\\boxed{B}``, ``the answer is (D)``)."""
    hits = [(m.start(), m.group(1).upper()) for pat in _LETTER_PATTERNS for m in pat.finditer(text)]
    return max(hits)[1] if hits else None


def grade_choice(text: str, problem: Problem) -> Grade:
    """1 when the extracted letter is the correct option's letter."""
    letter = choice_letter(text)
    return Grade(float(letter == problem.answer), letter)


def shuffle_choices(problem_id: str, correct: str, incorrect: list[str]) -> tuple[list[str], str]:
    """The four options in a fixed per-problem order, and the letter of the correct one."""
    options = [correct, *incorrect]
    if len(options) != 4:
        raise TaskDataError(f"problem {problem_id}: GPQA needs one correct and three incorrect answers, "
                            f"got {len(options)} options")
    order = list(range(4))
    random.Random(f"gpqa:{problem_id}").shuffle(order)
    return [options[i].strip() for i in order], LETTERS[order.index(0)]


def choice_prompt(question: str, options: list[str]) -> str:
    lines = "\n".join(f"{LETTERS[i]}) {o}" for i, o in enumerate(options))
    return f"{CHOICE_INSTRUCTION}\n\n{question.strip()}\n\n{lines}"


# -- copy (the embedded model's task) -----------------------------------------------------------
_FOUR_DIGITS = re.compile(r"(?<!\d)\d{4}(?!\d)")


def copy_problem(i: int, n: int = COPY_N) -> Problem:
    """Problem ``i`` of the copy task: ``n`` random four-digit numbers, fixed by ``i`` alone."""
    rng = random.Random(f"copy:{i}")
    numbers = [str(rng.randrange(1000, 10000)) for _ in range(n)]
    return Problem(f"copy-{i}", COPY_TEMPLATE.format(numbers=", ".join(numbers)), ", ".join(numbers), "copy")


def copy_numbers(text: str, n: int) -> list[str]:
    """The first ``n`` four-digit numbers in ``text``."""
    return _FOUR_DIGITS.findall(text)[:n]


def grade_copy(text: str, problem: Problem) -> Grade:
    """Fraction of reference numbers reproduced at their position (first n four-digit numbers found)."""
    ref = problem.answer.split(", ")
    got = copy_numbers(text, len(ref))
    return Grade(sum(a == b for a, b in zip(got, ref)) / len(ref), ", ".join(got))


# -- code (LiveCodeBench) --------------------------------------------------------------------------------
CODE_INSTRUCTION = ("Write a correct Python 3 program for the problem below; it will be run against hidden tests. "
                    "Give the complete program in one fenced block: ```python ... ```.")
CODE_STDIN = "The program reads the input from standard input and prints the answer to standard output."
CODE_FUNCTIONAL = "Complete this starter code (a class Solution whose method is called with the test's arguments):"


def _decode_tests(value) -> list[dict]:
    """LiveCodeBench test lists: a list, a JSON string, or (private tests) base64 of zlib of a pickled JSON string."""
    if value is None or value == "":
        return []
    if isinstance(value, list):
        return value
    text = str(value)
    if text.lstrip().startswith("["):
        return json.loads(text)
    import base64
    import pickle
    import zlib

    return json.loads(pickle.loads(zlib.decompress(base64.b64decode(text.encode()))))


def code_problem(row: dict, index: int) -> Problem:
    """A LiveCodeBench row (``question_content``, ``starter_code``, ``public_test_cases``, ``private_test_cases``,
    ``metadata`` with ``func_name``) as a problem: the prompt, and the tests for the grader."""
    pid = str(_first(row, "question_id", "id") or index)
    text = _first(row, "question_content", "question", "problem")
    tests = _decode_tests(row.get("public_test_cases")) + _decode_tests(row.get("private_test_cases"))
    if text is None or not tests:
        raise TaskDataError(f"livecodebench row {index}: needs 'question_content' and test cases "
                            f"('public_test_cases' / 'private_test_cases'), got {sorted(row)}")
    meta = row.get("metadata") or {}
    meta = json.loads(meta) if isinstance(meta, str) and meta.strip() else (meta if isinstance(meta, dict) else {})
    starter = (row.get("starter_code") or "").strip()
    how = f"{CODE_FUNCTIONAL}\n```python\n{starter}\n```" if starter else CODE_STDIN
    prompt = f"{CODE_INSTRUCTION}\n\n{str(text).strip()}\n\n{how}"
    return Problem(pid, prompt, f"{len(tests)} tests", "code", data={"tests": tests, "fn_name": meta.get("func_name")})


def grade_code(text: str, problem: Problem, *, unsafe: bool = False) -> Grade:
    """1 when the last fenced program in the output passes every test (pass@1), else 0; the per-test verdicts
    (``pass``, ``wrong_answer``, ``error``, ``timeout``) up to the first failure go into the row. The programs run
    in the sandbox (``unsafe``: without it, see :mod:`probes.code_grader`)."""
    from .code_grader import extract_program, run_tests

    program = extract_program(text)
    if program is None:
        return Grade(0.0, None, [])
    results = run_tests(program, problem.data["tests"], fn_name=problem.data.get("fn_name"), unsafe=unsafe)
    passed = all(r.verdict == "pass" for r in results) and len(results) == len(problem.data["tests"])
    summary = f"{sum(r.verdict == 'pass' for r in results)}/{len(problem.data['tests'])} pass" + (
        "" if passed else f"; test {len(results)}: {results[-1].verdict} {results[-1].detail}")
    return Grade(float(passed), summary[:300], [r.as_dict() for r in results])


# -- repeat (the embedded model's task in the paper's regime) ----------------------------------------
REPEAT_N = 4  # numbers per line
REPEAT_TEMPLATE = "Copy this line {lines} times: {line}"


def repeat_problem(i: int, n: int = REPEAT_N) -> Problem:
    """Problem ``i`` of the repeat task: a line of ``n`` random four-digit numbers to copy line after line; the
    answer's first line is part of the prompt, and no system message (a short prompt, as the paper's tasks)."""
    rng = random.Random(f"repeat:{i}")
    line = " ".join(str(rng.randrange(1000, 10000)) for _ in range(n))
    return Problem(f"repeat-{i}", REPEAT_TEMPLATE.format(lines=REPEAT_LINES, line=line), line, "repeat",
                   prefix=f"1. {line}\n2.", system="")


def grade_repeat(text: str, problem: Problem) -> Grade:
    """Two endpoints of the generated text, each measuring one thing (:func:`analysis.repeat.endpoints`), in the row
    as ``copies`` and ``fidelity``:

    - ``copies``: the complete numbered lines the generation wrote (``k. ...`` followed by a newline; a generation cut
      off at the length limit is cut inside its last line, which does not count; text after the list is not a copy),
      capped at :data:`REPEAT_LINES`. The prompt's own ``1. <line>`` is not counted: the answer's first line
      completes the prompt's ``2.``, so a model that stops after line 64 wrote 63, and one that goes on past line 64
      counts 64. Generation behaviour: when the model stopped (or broke down), not what it kept.
    - ``fidelity``: the mean over every complete copy written (past line 64 too) of the fraction of the line's
      numbers in place; None when no copy was written. Content kept, whatever the number of copies.

    ``score`` (the row's ``grade``) is the fidelity, and 0.0 when no copy was written (a grade must be a number; the
    ``fidelity`` field stays None, and the leaderboard leaves such runs out of its fidelity comparison). No threshold
    on the number of copies: early stopping is the ``copies`` endpoint, never a lost-content zero. ``extracted`` is
    the last complete copy."""
    written = copies(text)
    n, fid = endpoints(text, problem.answer, REPEAT_LINES)
    return Grade(0.0 if fid is None else fid, written[-1].group(0).strip() if written else None,
                 endpoints={"copies": n, "fidelity": fid})


# -- the registry ---------------------------------------------------------------------------------
TASKS: dict[str, Task] = {
    "math500": Task("math500", "math", 1024, 32768, grade_math, hf=HFSource("HuggingFaceH4/MATH-500", "test"),
                    description="MATH500 (500 competition problems), boxed answer graded by math-verify", paper_runs=2),
    "aime": Task("aime", "math", 4096, 32768, grade_math,
                 hf=(HFSource("MathArena/aime_2025", "train", tag="2025"), HFSource("MathArena/aime_2026", "train",
                                                                                     tag="2026")),
                 description="AIME 2025 + 2026 pooled, as the paper reports them (60 problems, integer answers; "
                             "ids per year, so runs cluster per problem), boxed answer graded by math-verify",
                 paper_runs=16),
    "hmmt": Task("hmmt", "math", 4096, 32768, grade_math,
                 hf=(HFSource("MathArena/hmmt_feb_2025", "train", tag="feb2025"),
                     HFSource("MathArena/hmmt_nov_2025", "train", tag="nov2025")),
                 description="HMMT February + November 2025 pooled, as the paper reports them, boxed answer graded by "
                             "math-verify", paper_runs=16),
    "gpqa_diamond": Task("gpqa_diamond", "choice", 2048, 32768, grade_choice,
                         hf=HFSource("Idavidrein/gpqa", "train", "gpqa_diamond"),
                         description="GPQA-Diamond (198 questions), options shuffled per problem, letter graded",
                         paper_runs=4),
    "livecodebench": Task("livecodebench", "code", 3072, 32768, grade_code,
                          hf=HFSource("livecodebench/code_generation_lite", "test", "release_v6"),
                          description="LiveCodeBench v6, medium problems, programs run against the tests in a "
                                      "bubblewrap sandbox (probes/code_grader.py), pass@1", paper_runs=4,
                          select=lambda row: str(row.get("difficulty", "medium")).lower() == "medium"),
    "copy": Task("copy", "copy", 256, 6 * COPY_N + 24, grade_copy, buffer=16,
                 description=f"repeat a list of {COPY_N} random four-digit numbers from the prompt (embedded model)",
                 policy_options={"h2o": {"recent_fraction": 0.08}}, problems=32),
    "repeat": Task("repeat", "repeat", 320, 1664, grade_repeat, buffer=8,
                   description=f"copy a line of {REPEAT_N} four-digit numbers line after line (embedded model): a "
                               "short prompt and a long answer that restates what it needs, the paper's regime",
                   problems=8),
}


def get_task(name: str) -> Task:
    """The task called ``name``; an unknown name is an error listing the known ones."""
    if name not in TASKS:
        raise KeyError(f"--task {name!r} unknown; choose from {', '.join(TASKS)}")
    return TASKS[name]


# -- loading ----------------------------------------------------------------------------------
def _first(row: dict, *names):
    for n in names:
        if row.get(n) is not None:
            return row[n]
    return None


def problem_from_row(task: Task, row: dict, index: int) -> Problem:
    """Build a :class:`Problem` from one record (``--data`` JSONL or an HF dataset row)."""
    if task.kind == "code":
        return code_problem(row, index)
    pid = str(_first(row, "id", "unique_id", "problem_idx", "Record ID") or index)
    if task.kind == "math":
        text, answer = _first(row, "problem", "question", "Problem"), _first(row, "answer", "Answer")
        if text is None or answer is None:
            raise TaskDataError(f"{task.name} row {index}: needs 'problem' (or 'question') and 'answer' fields, "
                                f"got {sorted(row)}")
        return Problem(pid, math_prompt(str(text)), str(answer), "math")
    question = _first(row, "question", "Question")
    correct = _first(row, "correct", "Correct Answer")
    incorrect = row.get("incorrect") or [row.get(f"Incorrect Answer {i}") for i in (1, 2, 3)]
    if question is None or correct is None or any(x is None for x in incorrect):
        raise TaskDataError(f"{task.name} row {index}: needs 'question', 'correct' and 'incorrect' (three) fields, "
                            f"or the HF names 'Question', 'Correct Answer', 'Incorrect Answer 1..3'; got {sorted(row)}")
    options, letter = shuffle_choices(pid, str(correct), [str(x) for x in incorrect])
    return Problem(pid, choice_prompt(str(question), options), letter, "choice")


#: The ``--data`` fields each kind of task reads (the rest are optional; see the module docstring).
DATA_FIELDS = {"math": "'problem' and 'answer'", "choice": "'question', 'correct', 'incorrect' (three)",
               "code": "'question_content' and 'public_test_cases' / 'private_test_cases' (optional 'starter_code', "
                       "'metadata' with 'func_name', 'difficulty')"}


def _hf_where(task: Task) -> str:
    sources = task.hf if isinstance(task.hf, tuple) else (task.hf,)
    return " + ".join(s.path + (f" ({s.name})" if s.name else "") for s in sources)


def _read_jsonl(path: Path, task: Optional[Task] = None) -> list[dict]:
    if not path.exists():
        other = f"; or drop --data to load HF {_hf_where(task)}" if task is not None and task.hf else ""
        raise TaskDataError(f"--data {path}: no such file; give a JSONL file (fields: "
                            f"{DATA_FIELDS.get(task.kind, 'see probes/tasks.py') if task else 'see probes/tasks.py'})"
                            f"{other}")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise TaskDataError(f"--data {path}: line {n} is not JSON") from None
    if not rows:
        raise TaskDataError(f"--data {path}: no rows")
    return rows


def _hf_rows(task: Task) -> list[dict]:
    """The task's rows from the HF hub (every source of a pooled task, ids tagged by source); any failure becomes a
    :class:`TaskDataError` naming ``--data``."""
    sources = task.hf if isinstance(task.hf, tuple) else (task.hf,)
    rows = []
    for src in sources:
        for i, r in enumerate(_hf_source_rows(task, src)):
            if src.tag is not None:
                r = {**r, "id": f"{src.tag}/{_first(r, 'id', 'unique_id', 'problem_idx', 'Record ID') or i}"}
            rows.append(r)
    return rows


def _hf_source_rows(task: Task, src: HFSource) -> list[dict]:
    where = f"HF dataset {src.path}" + (f" ({src.name})" if src.name else "") + f", split {src.split}"
    alternative = (f"pass --data FILE.jsonl instead (one JSON object per line; fields: {DATA_FIELDS[task.kind]}; "
                   "see probes/tasks.py)")
    try:
        import datasets
    except ImportError:
        raise TaskDataError(f"--task {task.name}: loading {where} needs the `datasets` package (pip install "
                            f"'randattn[tasks]'), or {alternative}") from None
    try:
        ds = datasets.load_dataset(src.path, src.name, split=src.split)
    except Exception as exc:  # offline, gated, renamed: all mean "not here"
        raise TaskDataError(f"--task {task.name}: could not load {where} ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200]}); {alternative}") from None
    return [dict(r) for r in ds]


def load_problems(task: Task, data: "str | Path | None" = None, limit: Optional[int] = None) -> list[Problem]:
    """The task's problems (the first ``limit``): generated for ``copy``, from ``data`` (JSONL) when given,
    else from the HF hub. Errors name both data options."""
    if task.kind in ("copy", "repeat"):
        if data is not None:
            raise TaskDataError(f"--task {task.name} generates its own problems; drop --data")
        make = copy_problem if task.kind == "copy" else repeat_problem
        return [make(i) for i in range(limit or task.problems)]
    rows = _read_jsonl(Path(data), task) if data is not None else _hf_rows(task)
    if task.select is not None:
        rows = [r for r in rows if task.select(r)]
        if not rows:
            raise TaskDataError(f"--task {task.name}: no rows of the task's kind (e.g. LiveCodeBench 'difficulty': "
                                "'medium') in the data")
    problems = [problem_from_row(task, r, i) for i, r in enumerate(rows)]
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise TaskDataError(f"--task {task.name}: problem ids are not unique; give each row a distinct 'id'")
    return problems[:limit] if limit else problems


# -- chat template ----------------------------------------------------------------------------
def has_thinking_mode(tok) -> bool:
    """The tokenizer's chat template has a thinking switch (Qwen3's ``enable_thinking``)."""
    return "enable_thinking" in str(getattr(tok, "chat_template", "") or "")


def chat_ids(tok, text: str, *, prefix: str = "", system: Optional[str] = None) -> list[int]:
    """Token ids of ``text`` as one user turn under the model's chat template, generation prompt added,
    thinking mode on where the template has one; ``system`` as the system message when given, and ``prefix``
    (the start of the answer) appended."""
    extra = {"enable_thinking": True} if has_thinking_mode(tok) else {}
    tail = list(tok(prefix, add_special_tokens=False)["input_ids"]) if prefix else []
    if not getattr(tok, "chat_template", None):
        return list(tok(text)["input_ids"]) + tail
    msgs = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]
    out = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True, **extra)
    return list(out["input_ids"]) + tail


def problem_ids(tok, problem: Problem) -> list[int]:
    """The prompt token ids of ``problem`` (its user message, system message and answer prefix)."""
    return chat_ids(tok, problem.prompt, prefix=problem.prefix, system=problem.system)
