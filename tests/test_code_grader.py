"""The LiveCodeBench grader: known-good and known-bad programs, each with the verdict it must get, and nothing
written outside the sandbox's folder."""

import json

import pytest

from probes.code_grader import extract_program, network_isolation, outputs_match, run_test, run_tests
from probes.tasks import code_problem, grade_code

STDIN = {"input": "3 4\n", "output": "7\n", "testtype": "stdin"}
FUNCTIONAL = {"input": "[1, 2, 3]\n4", "output": "10", "testtype": "functional"}


@pytest.mark.parametrize("name,program,verdict,detail", [
    ("good", "a, b = map(int, input().split())\nprint(a + b)\n", "pass", ""),
    ("float output within 1e-6", "print(7.0000000001)\n", "pass", ""),
    ("wrong answer", "a, b = map(int, input().split())\nprint(a * b)\n", "wrong_answer", "printed '12', expected '7'"),
    ("exception", "raise ValueError('boom')\n", "error", "ValueError: boom"),
    ("syntax error", "def f(:\n", "error", "SyntaxError"),
    ("loops forever", "while True:\n    pass\n", "timeout", "no answer within 2 s"),
    ("sleeps forever", "import time\ntime.sleep(1000)\n", "timeout", "no answer within 2 s"),
    ("allocates without bound", "x = []\nwhile True:\n    x.append(bytearray(10**7))\n", "error", "MemoryError"),
    ("opens a socket", "import socket\nsocket.create_connection(('10.0.0.1', 80), timeout=1)\n", "error", "sandbox"),
    ("starts a process", "import subprocess\nsubprocess.run(['true'])\nprint(7)\n", "error", "sandbox"),
    ("imports ctypes", "import ctypes\nprint(7)\n", "error", "ctypes"),
    ("writes in its own folder", "open('s.txt', 'w').write('7')\nprint(open('s.txt').read())\n", "pass", ""),
])
def test_verdicts(name, program, verdict, detail):
    r = run_test(program, STDIN, timeout=2, memory_mb=512)
    assert r.verdict == verdict, (name, r)
    assert detail in r.detail, (name, r)


def test_a_program_that_writes_outside_its_folder_is_refused_and_writes_nothing(tmp_path):
    target = tmp_path / "outside.txt"
    for program in (f"open({str(target)!r}, 'w').write('x')\nprint(7)\n",
                    f"import os\nos.makedirs({str(tmp_path / 'made')!r})\nprint(7)\n",
                    f"import shutil\nshutil.rmtree({str(tmp_path)!r})\nprint(7)\n",
                    "open('../../escape.txt', 'w').write('x')\nprint(7)\n"):
        r = run_test(program, STDIN, timeout=5)
        assert r.verdict == "error" and "sandbox" in r.detail, r
    assert not target.exists() and not (tmp_path / "made").exists() and tmp_path.is_dir()


def test_the_network_is_cut_where_namespaces_exist():
    if network_isolation() != "namespace":
        pytest.skip("no user namespaces here: only the audit hook refuses sockets")
    # even before the audit hook could refuse it, the interface list of the namespace has loopback alone
    r = run_test("print([l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]])\n",
                 {**STDIN, "output": "['lo']"}, timeout=5)
    assert r.verdict == "pass", r


def test_functional_tests_call_the_solution_method():
    good = "class Solution:\n    def total(self, xs, y):\n        return sum(xs) + y\n"
    assert run_test(good, FUNCTIONAL, fn_name="total").verdict == "pass"
    bad = run_test(good.replace("sum(xs) + y", "0"), FUNCTIONAL, fn_name="total")
    assert bad.verdict == "wrong_answer" and "returned 0, expected 10" in bad.detail
    assert run_test("x = 1\n", FUNCTIONAL, fn_name="total").verdict == "error"
    with pytest.raises(ValueError, match="func_name"):
        run_test(good, FUNCTIONAL)


def test_run_tests_stops_at_the_first_failure():
    tests = [STDIN, {**STDIN, "output": "8"}, STDIN]
    res = run_tests("a, b = map(int, input().split())\nprint(a + b)\n", tests)
    assert [r.verdict for r in res] == ["pass", "wrong_answer"]
    assert len(run_tests("print(7)\n", tests, stop_at_first_failure=False)) == 3


def test_output_comparison_and_extraction():
    assert outputs_match("1 2\n3\n\n", "1  2\n3")
    assert not outputs_match("1 2", "1 2 3") and not outputs_match("abc", "abd")
    assert extract_program("x\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```") == "print(2)\n"
    assert extract_program("no code here") is None


def test_livecodebench_rows_become_problems_graded_by_their_tests():
    import base64
    import pickle
    import zlib

    private = base64.b64encode(zlib.compress(pickle.dumps(json.dumps([{**STDIN, "input": "10 5\n", "output": "15\n"}]))))
    row = {"question_id": "q1", "question_content": "Add two numbers.", "starter_code": "",
           "public_test_cases": json.dumps([STDIN]), "private_test_cases": private.decode(), "metadata": "{}"}
    prob = code_problem(row, 0)
    assert prob.answer == "2 tests" and "standard input" in prob.prompt
    right = grade_code("```python\na, b = map(int, input().split())\nprint(a + b)\n```", prob)
    assert right.score == 1.0 and [d["verdict"] for d in right.details] == ["pass", "pass"]
    wrong = grade_code("```python\nprint(7)\n```", prob)  # passes the public test, fails the private one
    assert wrong.score == 0.0 and "test 2: wrong_answer" in wrong.extracted
    assert grade_code("I cannot solve it.", prob).score == 0.0
