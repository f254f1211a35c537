"""The accuracy harness's tasks: problems, prompts, default budgets and graders.

``TASKS`` maps a name to a :class:`Task`:

============  ======  ====  =====  ==========================================================
name          kind    K     max    data
============  ======  ====  =====  ==========================================================
math500       math    1024  32768  HF ``HuggingFaceH4/MATH-500`` (test) or ``--data``
aime          math    4096  32768  HF ``MathArena/aime_2025`` (train) or ``--data``
hmmt          math    4096  32768  HF ``MathArena/hmmt_feb_2025`` (train) or ``--data``
gpqa_diamond  choice  2048  32768  HF ``Idavidrein/gpqa``, ``gpqa_diamond`` (gated) or ``--data``
copy          copy    256   192    written here (no download): the embedded model's task
============  ======  ====  =====  ==========================================================

K is the paper's per-task budget (MATH500 1024, GPQA-Diamond 2048, AIME/HMMT 4096; buffer
r = 64) and 32k its maximum generation. LiveCodeBench (the paper's code task, K = 3072) may come
later; it needs a sandboxed code runner, which this project does not have yet.

Graders:

- **math** (MATH500, AIME, HMMT): the answer is the content of the *last* ``\\boxed{...}`` (or
  ``\\fbox{...}``) in the output, braces matched so nested ``\\frac{1}{2}`` survive; it is compared
  with the reference by ``math-verify`` (symbolic and numeric equivalence: ``\\frac{1}{2}`` = ``0.5``,
  ``2\\sqrt{3}`` = ``\\sqrt{12}``). No box, no credit.
- **choice** (GPQA-Diamond): the four options are shuffled deterministically per problem id
  (``random.Random("gpqa:" + id)``), presented as ``A) .. D)``; the graded letter is the last
  ``Answer: X``, ``\\boxed{X}`` or ``answer is (X)`` in the output.
- **copy**: the fraction of the ``n`` reference numbers the output reproduces in order (the first
  ``n`` four-digit numbers found; anything after is ignored, since the model keeps writing).

``--data FILE.jsonl`` fields (one JSON object per line): math tasks ``problem`` (or ``question``)
and ``answer`` (LaTeX, without ``\\boxed``); GPQA ``question``, ``correct`` and ``incorrect`` (a
list of three), or the HF names ``Question``, ``Correct Answer``, ``Incorrect Answer 1..3``.
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

__all__ = ["Problem", "Grade", "Task", "TASKS", "TaskDataError", "get_task", "load_problems", "last_boxed",
           "math_equal", "grade_math", "choice_letter", "grade_choice", "shuffle_choices", "copy_numbers",
           "grade_copy", "copy_problem", "chat_ids", "has_thinking_mode"]

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


@dataclass(frozen=True)
class Grade:
    """A graded output: ``score`` in [0, 1] and what the grader read from the output."""

    score: float
    extracted: Optional[str]


@dataclass(frozen=True)
class HFSource:
    """Where a task's problems live on the HF hub, and which fields hold what."""

    path: str
    split: str
    name: Optional[str] = None


@dataclass(frozen=True)
class Task:
    """A task: how to get its problems, its paper defaults, and its grader."""

    name: str
    kind: str  # "math", "choice" or "copy"
    budget: int  # default K
    max_new_tokens: int
    grade: Callable[[str, Problem], Grade]
    buffer: int = 64  # default r
    hf: Optional[HFSource] = None
    description: str = ""
    policy_options: dict = field(default_factory=dict)  # {policy: {option: value}} this task's geometry needs
    problems: Optional[int] = None  # how many problems by default (None: all)


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


# -- the registry ---------------------------------------------------------------------------------
TASKS: dict[str, Task] = {
    "math500": Task("math500", "math", 1024, 32768, grade_math, hf=HFSource("HuggingFaceH4/MATH-500", "test"),
                    description="MATH500 (500 competition problems), boxed answer graded by math-verify"),
    "aime": Task("aime", "math", 4096, 32768, grade_math, hf=HFSource("MathArena/aime_2025", "train"),
                 description="AIME 2025 (30 problems, integer answers), boxed answer graded by math-verify"),
    "hmmt": Task("hmmt", "math", 4096, 32768, grade_math, hf=HFSource("MathArena/hmmt_feb_2025", "train"),
                 description="HMMT February 2025 (30 problems), boxed answer graded by math-verify"),
    "gpqa_diamond": Task("gpqa_diamond", "choice", 2048, 32768, grade_choice,
                         hf=HFSource("Idavidrein/gpqa", "train", "gpqa_diamond"),
                         description="GPQA-Diamond (198 questions), options shuffled per problem, letter graded"),
    "copy": Task("copy", "copy", 256, 6 * COPY_N + 24, grade_copy, buffer=16,
                 description=f"repeat a list of {COPY_N} random four-digit numbers from the prompt (embedded model)",
                 policy_options={"h2o": {"recent_fraction": 0.08}}, problems=32),
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


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise TaskDataError(f"--data {path}: no such file")
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
    """The task's rows from the HF hub; any failure becomes a :class:`TaskDataError` naming ``--data``."""
    src = task.hf
    where = f"HF dataset {src.path}" + (f" ({src.name})" if src.name else "") + f", split {src.split}"
    alternative = ("pass --data FILE.jsonl instead (one JSON object per line; fields: "
                   + ("'problem' and 'answer'" if task.kind == "math" else "'question', 'correct', 'incorrect'")
                   + "; see probes/tasks.py)")
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
    if task.kind == "copy":
        if data is not None:
            raise TaskDataError("--task copy generates its own problems; drop --data")
        return [copy_problem(i) for i in range(limit or task.problems)]
    rows = _read_jsonl(Path(data)) if data is not None else _hf_rows(task)
    problems = [problem_from_row(task, r, i) for i, r in enumerate(rows)]
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise TaskDataError(f"--task {task.name}: problem ids are not unique; give each row a distinct 'id'")
    return problems[:limit] if limit else problems


# -- chat template ----------------------------------------------------------------------------
def has_thinking_mode(tok) -> bool:
    """The tokenizer's chat template has a thinking switch (Qwen3's ``enable_thinking``)."""
    return "enable_thinking" in str(getattr(tok, "chat_template", "") or "")


def chat_ids(tok, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn under the model's chat template, generation prompt added,
    thinking mode on where the template has one."""
    extra = {"enable_thinking": True} if has_thinking_mode(tok) else {}
    if not getattr(tok, "chat_template", None):
        return list(tok(text)["input_ids"])
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                  return_dict=True, **extra)
    return list(out["input_ids"])
