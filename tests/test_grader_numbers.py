"""The grader's comparison against LiveCodeBench's own, case by case (issue 38).

Each row carries the verdict LiveCodeBench gives it, read off ``lcb_runner/evaluation/testing_util.py`` (repository
LiveCodeBench/LiveCodeBench, the version at commit 15808c76fbd4): for stdin tests ``grade_stdio`` strips the whole
output and the expected one, splits both at "\\n", strips each line, fails on a different line count, and then per
line passes "CASE 1: exact match" or else "CASE 2": every ``line.split()`` token through ``decimal.Decimal`` (a
failed conversion fails the test) and the two lists of Decimals ``==``. For functional tests ``grade_call_based``
``json.loads`` the expected output, turns a returned tuple into a list and tests ``prediction == gt_out``, in a
process whose int-string limit its ``compute_code_generation_metrics`` raised to 50,000 digits. The
comments say which step decides each row; rows marked DELIBERATE are where randattn decides otherwise, on purpose
(see probes/code_grader.py's module docstring).
"""

import shutil

import pytest

from probes import sandbox
from probes.code_grader import outputs_match, run_test

# (printed, expected, LiveCodeBench passes it); the reason is the step of grade_stdio that decides it
STDIN_CASES = [
    ("998243852", "998244352", False),  # CASE 2: Decimals differ (no tolerance; rel 1e-6 passed it before)
    ("1000001", "1000000", False),  # CASE 2: Decimals differ
    ("1000001007", "1000000007", False),  # CASE 2: Decimals differ
    ("12345678901234567890123", "12345678901234567890124", False),  # CASE 2: exact, no float rounding
    ("7.0000001", "7", False),  # CASE 2: Decimals differ
    ("0.30000000000000004", "0.3", False),  # CASE 2: exact for floats too (print(0.1 + 0.2) fails)
    ("inf", "1e309", False),  # CASE 2: Decimal('inf') is Infinity, Decimal('1e309') is finite
    ("7.0", "7", True),  # CASE 2: Decimal('7.0') == Decimal('7')
    ("1e2", "100", True),  # CASE 2: Decimal('1E+2') == Decimal('100')
    ("1.5e3", "1500", True),  # CASE 2
    ("+7", "7", True),  # CASE 2
    ("07", "7", True),  # CASE 2
    ("-0", "0", True),  # CASE 2: Decimal('-0') == Decimal('0')
    ("1_000", "1000", True),  # CASE 2: Decimal accepts underscores between digits
    ("Infinity", "inf", True),  # CASE 2: both Decimal('Infinity')
    ("７", "7", True),  # CASE 2: Decimal reads Unicode decimal digits (fullwidth): Decimal('７') == 7
    ("٧", "7", True),  # CASE 2: and Arabic-Indic ones
    ("0x10", "16", False),  # CASE 2: not a Decimal
    ("nan", "nan", True),  # CASE 1: the same text (as Decimals, NaN != NaN)
    ("NaN", "nan", False),  # CASE 2: Decimal NaN is not equal to itself
    ("sNaN", "1", False),  # CASE 2: comparing a signalling NaN raises; run_test turns that into a failure
    ("YES", "yes", False),  # CASE 1 fails, and CASE 2: not a Decimal
    ("1 2", "1  2", True),  # CASE 2: the same Decimals, the spacing aside
    ("1\t2", "1 2", True),  # CASE 2
    ("a  b", "a b", False),  # CASE 1 fails (the line is compared as text), CASE 2: 'a' is not a Decimal
    ("1 2 3", "1 2", False),  # CASE 2: lists of different lengths
    ("  7  \n\n", "7", True),  # the whole output stripped
    ("7\r\n8\r\n", "7\n8", True),  # each line stripped: the "\r" goes
    ("1\n\n2", "1\n2", False),  # an empty line inside counts: 3 lines against 2
    ("7\u20288", "7\n8", False),  # split at "\n" alone: U+2028 does not end a line (one line against two)
    ("", "", True),  # CASE 1: one empty line each
    ("True", "1", False),  # CASE 2: not a Decimal
]


@pytest.mark.parametrize("printed,expected,lcb", STDIN_CASES)
def test_stdin_comparison_follows_livecodebench(printed, expected, lcb):
    assert outputs_match(printed, expected) is lcb


# (what the function returns, as Python source; the expected JSON output; LiveCodeBench passes it)
FUNCTIONAL_CASES = [
    ("998243852", "998244352", False),  # prediction == gt_out: int equality
    ("7.0000001", "7", False),  # float equality, exact (math.isclose passed it before)
    ("7.0", "7", True),  # 7.0 == 7
    ("0.1 + 0.2", "0.3", False),  # 0.30000000000000004 != 0.3
    ("True", "1", True),  # True == 1 in Python (strict bools failed it before)
    ("1", "true", True),  # 1 == True
    ("'7'", "7", False),  # a str is not an int
    ("(1, 2)", "[1, 2]", True),  # a returned tuple is made a list first
    ("float('inf')", "1e309", True),  # json.loads('1e309') is float inf too
    ("10 ** 30", "1000000000000000000000000000000", True),  # exact ints
    ("10 ** 5000", "1" + "0" * 5000, True),  # past Python's default 4,300 digits, within the evaluator's 50,000
    ("None", "null", True),
    ("[[1, 2], [3]]", "[[1, 2], [3]]", True),
    # DELIBERATE: LiveCodeBench fails these ([(1, 2)] != [[1, 2]], {1: 2} != {"1": 2}); the result leaves the sandbox
    # as JSON, which has neither tuples nor int keys, so randattn passes them
    ("[(1, 2)]", "[[1, 2]]", False),
    ("{1: 2}", '{"1": 2}', False),
]
DELIBERATE = {"[(1, 2)]", "{1: 2}"}


@pytest.fixture
def sandboxed():
    if shutil.which("bwrap") is None:
        pytest.skip(f"bubblewrap is not installed ({sandbox.INSTALL})")
    assert sandbox.unavailable() is None, sandbox.unavailable()


def test_functional_comparison_follows_livecodebench(sandboxed):
    got = {}
    for value, expected, lcb in FUNCTIONAL_CASES:
        program = f"class Solution:\n    def f(self, x):\n        return {value}\n"
        r = run_test(program, {"input": "0", "output": expected, "testtype": "functional"}, fn_name="f")
        got[value] = r.verdict
    want = {value: "pass" if lcb or value in DELIBERATE else "wrong_answer" for value, _, lcb in FUNCTIONAL_CASES}
    assert got == want


def test_stdin_comparison_through_the_sandbox(sandboxed):
    """A few rows end to end: what the program prints is what gets compared (bytes decoded as UTF-8)."""
    for printed, expected, lcb in [("998243852", "998244352", False), ("７", "7", True), ("7.0", "7", True),
                                   ("inf", "1e309", False)]:
        r = run_test(f"print({printed!r})\n", {"input": "", "output": expected, "testtype": "stdin"})
        assert r.verdict == ("pass" if lcb else "wrong_answer"), (printed, r)


def test_ints_up_to_livecodebenchs_digit_limit(sandboxed):
    """A 5,000-digit result was an error (Python's int-string limit of 4,300 digits, in the sandbox's json.dumps and
    the harness's json.loads). LiveCodeBench's evaluator raises the limit to 50,000 for the whole process: 50,000
    digits compare; past that its own comparison fails too (str() of the prediction raises: Runtime Error)."""
    program = "class Solution:\n    def f(self, x):\n        return 10 ** x\n"
    for power, verdict in ((4999, "pass"), (49_999, "pass"), (50_000, "error")):
        expected = "1" + "0" * min(power, 49_999)
        r = run_test(program, {"input": str(power), "output": expected, "testtype": "functional"}, fn_name="f")
        assert r.verdict == verdict, (power, r)
    wrong = run_test(program.replace("10 ** x", "10 ** x + 1"),
                     {"input": "4999", "output": "1" + "0" * 4999, "testtype": "functional"}, fn_name="f")
    assert wrong.verdict == "wrong_answer" and wrong.detail.startswith("returned 1000"), wrong  # shown, not raised
