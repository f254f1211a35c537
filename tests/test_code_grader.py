"""The LiveCodeBench grader: known-good and known-bad programs, each with the verdict it must get, nothing written
outside the sandbox, and the refusal where the sandbox is missing (the attacks: tests/test_sandbox_attacks.py)."""

import json
import os
import shutil
import sys
import time

import pytest

from probes import sandbox
from probes.code_grader import (PRELUDE, SandboxUnavailable, _verdict, extract_program, network_isolation,
                                output_difference, outputs_match, run_test, run_tests)
from probes.tasks import code_problem, grade_code
from tests.test_sandbox_attacks import processes_with


@pytest.fixture
def sandboxed():
    """Skips where bwrap is not installed (CI installs it: .ci/run); fails where it is and does not work."""
    if shutil.which("bwrap") is None:
        pytest.skip(f"bubblewrap is not installed ({sandbox.INSTALL})")
    assert sandbox.unavailable() is None, sandbox.unavailable()


@pytest.fixture
def no_bwrap(monkeypatch):
    """bwrap looks missing: its check is redone without it, and redone again afterwards."""
    real = shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if name == "bwrap" else real(name))
    sandbox._probe.cache_clear()
    yield
    monkeypatch.undo()
    sandbox._probe.cache_clear()

STDIN = {"input": "3 4\n", "output": "7\n", "testtype": "stdin"}
FUNCTIONAL = {"input": "[1, 2, 3]\n4", "output": "10", "testtype": "functional"}


@pytest.mark.parametrize("name,program,verdict,detail", [
    ("good", "a, b = map(int, input().split())\nprint(a + b)\n", "pass", ""),
    ("the same number written otherwise", "print(7.0)\n", "pass", ""),
    # LiveCodeBench compares numbers exactly (tests/test_grader_numbers.py has its rule case by case)
    ("a float off by 1e-10", "print(7.0000000001)\n", "wrong_answer", "printed '7.0000000001', expected '7'"),
    ("wrong answer", "a, b = map(int, input().split())\nprint(a * b)\n", "wrong_answer", "printed '12', expected '7'"),
    ("exception", "raise ValueError('boom')\n", "error", "ValueError: boom"),
    ("syntax error", "def f(:\n", "error", "SyntaxError"),
    ("loops forever", "while True:\n    pass\n", "timeout", "no answer within 4 s"),
    ("sleeps forever", "import time\ntime.sleep(1000)\n", "timeout", "no answer within 4 s"),
    ("allocates without bound", "x = []\nwhile True:\n    x.append(bytearray(10**7))\n", "error", "MemoryError"),
    ("opens a socket", "import socket\nsocket.create_connection(('10.0.0.1', 80), timeout=1)\n", "error",
     "Network is unreachable"),
    # processes and ctypes are harmless inside the sandbox: allowed, up to the process limit
    ("starts a process", "import subprocess\nsubprocess.run(['true'], check=True)\nprint(7)\n", "pass", ""),
    ("imports ctypes", "import ctypes\nprint(7)\n", "pass", ""),
    ("writes in its own folder", "open('s.txt', 'w').write('7')\nprint(open('s.txt').read())\n", "pass", ""),
    ("prints past the output limit", "import sys\nwhile True:\n    sys.stdout.write('7' * 65536)\n", "error",
     "output limit: more than 1 MiB"),
    ("reads its input as bytes", "import sys\na, b = map(int, sys.stdin.buffer.read().split())\nprint(a + b)\n",
     "pass", ""),
])
def test_verdicts(name, program, verdict, detail, sandboxed):
    r = run_test(program, STDIN, timeout=4, memory_mb=256, output_mb=1)
    assert r.verdict == verdict, (name, r)
    assert detail in r.detail, (name, r)


def test_a_program_that_writes_outside_its_folder_fails_and_writes_nothing(tmp_path, sandboxed):
    target = tmp_path / "outside.txt"
    (tmp_path / "kept.txt").write_text("mine")
    for program in (f"open({str(target)!r}, 'w').write('x')\nprint(7)\n",
                    f"import os\nos.makedirs({str(tmp_path / 'made')!r})\nprint(7)\n",
                    f"import shutil\nshutil.rmtree({str(tmp_path)!r})\nprint(7)\n",
                    "open('../../escape.txt', 'w').write('x')\nprint(7)\n"):
        # the host's folders are not in the sandbox at all (a path under /tmp is one in its own private /tmp)
        assert run_test(program, STDIN, timeout=5).verdict in ("pass", "error")
    r = run_test("import sys\nopen(sys.executable + '.x', 'w')\n", STDIN, timeout=5)
    assert r.verdict == "error" and "Read-only file system" in r.detail, r  # the system and Python are read-only
    assert not target.exists() and not (tmp_path / "made").exists() and (tmp_path / "kept.txt").read_text() == "mine"
    assert not list(tmp_path.parents[-2].glob("escape.txt"))


def test_the_network_is_cut(sandboxed):
    assert network_isolation() == "namespace"
    # the network namespace has its loopback interface alone
    r = run_test("print([l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]])\n",
                 {**STDIN, "output": "['lo']"}, timeout=5)
    assert r.verdict == "pass", r


def test_without_bwrap_grading_is_refused_with_the_install_command_unless_unsafe(no_bwrap):
    assert network_isolation() == "none"
    with pytest.raises(SandboxUnavailable, match=r"`bwrap` is not on PATH; install it \(apt-get install bubblewrap\)$"):
        run_tests("print(7)\n", [STDIN])  # the safe fix alone: the refusal does not point to the unsafe mode
    # unsafe: a plain limited subprocess, the same verdicts for ordinary programs
    good, wrong = "a, b = map(int, input().split())\nprint(a + b)\n", "print(8)\n"
    assert [r.verdict for r in run_tests(good, [STDIN], unsafe=True)] == ["pass"]
    assert [r.verdict for r in run_tests(wrong, [STDIN], unsafe=True)] == ["wrong_answer"]
    slow = run_test("while True:\n    pass\n", STDIN, timeout=1, unsafe=True)
    assert slow.verdict == "timeout" and slow.seconds < 2, slow


def test_the_accuracy_harness_refuses_a_code_task_before_loading_a_model(no_bwrap, tmp_path, capsys):
    from probes import accuracy

    data = tmp_path / "lcb.jsonl"
    data.write_text(json.dumps({"question_id": "q", "question_content": "Add.", "public_test_cases": [STDIN]}) + "\n")
    argv = ["--task", "livecodebench", "--data", str(data), "--model", str(tmp_path / "no-model"), "--out",
            str(tmp_path / "out"), "--no-figure", "--policy", "random"]
    with pytest.raises(SystemExit) as exit_:
        accuracy.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert "--task: livecodebench runs the generated programs; grading code needs the bubblewrap sandbox" in err
    refusal = next(line for line in err.splitlines() if "--task:" in line)
    assert "apt-get install bubblewrap" in refusal and "unsafe" not in refusal, refusal
    assert not (tmp_path / "out").exists()


def test_a_fault_in_the_sandbox_set_up_is_named_as_such_not_blamed_on_bwrap(monkeypatch):
    """Issue 38: a venv under /tmp was hidden by the private /tmp, and the refusal said bubblewrap did not work and
    offered the unsafe mode. A set-up fault now says so (here: the interpreter's folders left out of the sandbox)."""
    if shutil.which("bwrap") is None:
        pytest.skip(f"bubblewrap is not installed ({sandbox.INSTALL})")
    monkeypatch.setattr(sandbox, "_python_dirs", lambda: [])
    sandbox._probe.cache_clear()
    try:
        why = sandbox.unavailable()
    finally:
        monkeypatch.undo()
        sandbox._probe.cache_clear()
    assert why.startswith("grading code needs the bubblewrap sandbox, and it cannot run here: bwrap works, but a "
                          "trivial program failed in the sandbox randattn builds for this Python"), why
    assert "No such file or directory" in why and "unsafe" not in why and "install it" not in why, why


def _sigkill(o_status=137, **kw):
    return sandbox.Outcome(o_status, b"", b"", 0.5, **kw)


def test_a_killed_program_is_labelled_by_what_killed_it(sandboxed):
    """Issue 38: any SIGKILL read as `timeout: CPU-time limit`. The label now follows what happened."""
    busy = "import os, time\nt = time.time()\nwhile time.time() - t < 0.3:\n    pass\n"
    killed = run_test(busy + "os.kill(os.getpid(), 9)\n", STDIN)
    assert killed.verdict == "error" and killed.detail.startswith("killed by signal 9 (SIGKILL) after 0."), killed
    term = run_test("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n", STDIN)
    assert term.verdict == "error" and "killed by signal 15 (SIGTERM)" in term.detail, term
    # the CPU limit for real: the program lowers its own (allowed), then spins past it
    spin = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (1, 2))\nwhile True:\n    pass\n"
    cpu = run_test(spin, STDIN)
    assert cpu.verdict == "timeout" and "SIGXCPU after 1." in cpu.detail and cpu.seconds < 6, cpu  # before the wall clock
    # what cannot be staged here: the limit's hard stop (SIGKILL once the CPU time is past it), the OOM killer
    limits = sandbox.Limits()
    hard = _verdict(_sigkill(cpu_seconds=limits.cpu_seconds + 1.0), STDIN, "stdin", limits)
    assert hard.verdict == "timeout" and hard.detail == "CPU-time limit (7 s): SIGKILL after 8.0 s of CPU time"
    oom = _verdict(_sigkill(cpu_seconds=0.2, oom_kills=1), STDIN, "stdin", limits)
    assert oom.verdict == "error" and oom.detail.startswith("killed by the kernel's OOM killer"), oom
    assert _verdict(_sigkill(cpu_seconds=0.2), STDIN, "stdin", limits).detail.startswith("killed by signal 9")


def test_the_unsafe_mode_kills_detached_descendants_too():
    """Issue 38: unsafe mode killed the program's session alone, so a child that called setsid() outlived the
    verdict. Its supervisor is now their subreaper, and they die at the program's end and at the wall clock."""
    token = f"{os.getpid() % 1000 + 100}.{time.time_ns() % 10**6:06d}"
    detach = (f"import os, subprocess\nsubprocess.Popen(['sleep', '{token}'], start_new_session=True, "
              "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
              f"if os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '{token}'])\n")
    try:
        done = run_test(detach + "print(7)\n", STDIN, unsafe=True)
        assert done.verdict == "pass" and done.seconds < 2, done
        assert processes_with(token) == [], "a detached child outlived grading"
        t0 = time.monotonic()
        spun = run_test(detach + "while True:\n    pass\n", STDIN, timeout=2, unsafe=True)
        assert spun.verdict == "timeout" and time.monotonic() - t0 < 3, spun
        assert processes_with(token) == [], "a detached child outlived the wall clock"
        killed = run_test("import os\nos.kill(os.getpid(), 9)\n", STDIN, unsafe=True)
        assert killed.verdict == "error" and "killed by signal 9 (SIGKILL)" in killed.detail, killed
    finally:
        for pid in processes_with(token):
            os.kill(pid, 9)


def test_functional_tests_call_the_solution_method(sandboxed):
    good = "class Solution:\n    def total(self, xs, y):\n        return sum(xs) + y\n"
    assert run_test(good, FUNCTIONAL, fn_name="total").verdict == "pass"
    bad = run_test(good.replace("sum(xs) + y", "0"), FUNCTIONAL, fn_name="total")
    assert bad.verdict == "wrong_answer" and "returned 0, expected 10" in bad.detail
    assert run_test("x = 1\n", FUNCTIONAL, fn_name="total").verdict == "error"
    with pytest.raises(ValueError, match="func_name"):
        run_test(good, FUNCTIONAL)


def test_run_tests_stops_at_the_first_failure(sandboxed):
    tests = [STDIN, {**STDIN, "output": "8"}, STDIN]
    res = run_tests("a, b = map(int, input().split())\nprint(a + b)\n", tests)
    assert [r.verdict for r in res] == ["pass", "wrong_answer"]
    assert len(run_tests("print(7)\n", tests, stop_at_first_failure=False)) == 3


def test_output_comparison_and_extraction():
    assert outputs_match("1 2\n3\n\n", "1  2\n3")
    assert not outputs_match("1 2", "1 2 3") and not outputs_match("abc", "abd")
    assert output_difference("1\n2\n3", "1\n2.0\n4") == "line 3: printed '3', expected '4'"
    assert output_difference("1\n2", "1") == "printed 2 line(s), expected 1"
    assert extract_program("x\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```") == "print(2)\n"
    assert extract_program("no code here") is None


def test_livecodebench_rows_become_problems_graded_by_their_tests(sandboxed):
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


# -- LiveCodeBench's execution (probes/code_grader.py's module docstring) ----------------------------------------
def _recursion(depth, decorator=""):
    return (f"{decorator}def down(k):\n    return 0 if k == 0 else 1 + down(k - 1)\n"
            f"print(down({depth}) - {depth - 7})\n")


# (name, program, expected output, verdict, detail). Before, programs ran as plain scripts and every row got another
# verdict or detail (NameError, RecursionError, exit status 1, ...) but those marked `as before`, which pin the rule
LCB_STDIN = [
    ("defaultdict, no import", "d = defaultdict(int)\nfor x in input().split():\n    d[0] += int(x)\nprint(d[0])\n",
     "7", "pass", ""),
    ("heappush, inf, reduce, no import", "h = []\nfor x in input().split():\n    heappush(h, int(x))\n"
                                         "print(reduce(add, h) if inf > 0 else 0)\n", "7", "pass", ""),
    ("datetime is the module", "print(datetime.date(2024, 1, 7).day)\n", "7", "pass", ""),
    ("recursion 20,000 deep", _recursion(20_000), "7", "pass", ""),
    ("recursion 49,000 deep", _recursion(49_000), "7", "pass", ""),
    ("recursion past the limit", _recursion(51_000), "7", "error", "RecursionError"),  # as before
    ("exit(1) after the answer", "print(7)\nimport sys\nsys.exit(1)\n", "7", "pass", ""),
    ("exit('message') after the answer", "print(7)\nexit('done')\n", "7", "pass", ""),
    ("a top-level return", "a, b = map(int, input().split())\nif a < b:\n    print(a + b)\n    return\nprint(0)\n",
     "7", "pass", ""),
    ("a 5,000-digit int printed", "print(10 ** 5000)\n", "1" + "0" * 5000, "pass", ""),
    # as before: the last statement `if __name__ == "__main__":` is replaced by its body
    ("a last __main__ block", "import sys\ndef main():\n    print(sum(map(int, sys.stdin.read().split())))\n"
                              'if __name__ == "__main__":\n    main()\n', "7", "pass", ""),
    # LiveCodeBench's rule where a script runs otherwise: the program is the body of a function
    ("a __main__ block not last", "def main():\n    print(7)\nif __name__ == '__main__':\n    main()\nx = 1\n", "7",
     "wrong_answer", "printed '', expected '7'"),
    ("global across the wrapper", "def add(x):\n    global total\n    total += x\ntotal = 0\n"
                                  "for x in map(int, input().split()):\n    add(x)\nprint(total)\n", "7", "error",
     "NameError: name 'total' is not defined"),
    ("__name__", "print(__name__)\n", "solution", "pass", ""),
    ("from __future__ after the prelude", "from __future__ import annotations\nprint(7)\n", "7", "error",
     "SyntaxError: from __future__ imports must occur at the beginning of the file"),
    ("imports alone", "import sys\n", "", "error", "SyntaxError: the program has no statement but imports"),
]


@pytest.mark.parametrize("name,program,expected,verdict,detail", LCB_STDIN, ids=[row[0] for row in LCB_STDIN])
def test_stdin_programs_run_as_in_livecodebench(name, program, expected, verdict, detail, sandboxed):
    r = run_test(program, {**STDIN, "output": expected})
    assert r.verdict == verdict and detail in r.detail, (name, r)


# (name, program, verdict, detail) against FUNCTIONAL; the last two as before (the other rows were errors)
LCB_FUNCTIONAL = [
    ("List[int], no import", "class Solution:\n    def f(self, xs: List[int], y: int) -> Optional[int]:\n"
                             "        return sum(xs) + y\n", "pass", ""),
    ("Counter and lru_cache, no import", "class Solution:\n    def f(self, xs, y):\n        @lru_cache(None)\n"
                                         "        def g(k):\n            return k + y\n"
                                         "        return g(sum(Counter(xs).elements()))\n", "pass", ""),
    ("recursion 20,000 deep", "class Solution:\n    def f(self, xs, y):\n        def down(k):\n"
                              "            return 0 if k == 0 else 1 + down(k - 1)\n"
                              "        return down(20000) - 19990\n", "pass", ""),
    ("a function of its own, no class", "def f(xs, y):\n    return sum(xs) + y\n", "pass", ""),
    ("`class Solution` in a comment alone", "# class Solution\ndef f(xs, y):\n    return sum(xs) + y\n", "error",
     "no class Solution defined"),
    ("from __future__ after the prelude", "from __future__ import annotations\nclass Solution:\n"
                                          "    def f(self, xs, y):\n        return sum(xs) + y\n", "error",
     "SyntaxError: from __future__ imports must occur at the beginning of the file"),
    ("exit() in the method", "class Solution:\n    def f(self, xs, y):\n        exit(0)\n", "error", ""),
]


@pytest.mark.parametrize("name,program,verdict,detail", LCB_FUNCTIONAL, ids=[row[0] for row in LCB_FUNCTIONAL])
def test_functional_programs_run_as_in_livecodebench(name, program, verdict, detail, sandboxed):
    r = run_test(program, FUNCTIONAL, fn_name="f")
    assert r.verdict == verdict and detail in r.detail, (name, r)


def test_the_prelude_is_livecodebenchs():
    modules = ["string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random", "statistics",
               "itertools", "functools", "operator", "io", "sys", "json"]
    assert PRELUDE.splitlines() == ([f"from {m} import *" for m in modules + ["builtins", "typing"]]
                                    + [f"import {m}" for m in modules] + ["sys.setrecursionlimit(50000)"])


STACK = "import resource\nprint(*resource.getrlimit(resource.RLIMIT_STACK))\n"


def test_the_stack_is_8_mib_whatever_the_harness_has(sandboxed):
    """The harness's own `ulimit -s` (here 8 MiB soft, unlimited hard) went through to the program, so how deep it
    could recurse depended on who ran the grader. Now 8 MiB, soft and hard, in the sandbox and in the unsafe mode."""
    for unsafe in (False, True):
        r = run_test(STACK, {**STDIN, "output": f"{8 * 2**20} {8 * 2**20}"}, unsafe=unsafe)
        assert r.verdict == "pass", (unsafe, r)


def test_recursion_through_c_that_overflows_the_stack_is_reported_as_a_crash(sandboxed):
    """Under the recursion limit of 50,000, recursion through functools.lru_cache uses the C stack: on Python 3.10
    and 3.11 20,000 levels overflow 8 MiB and the interpreter dies of SIGSEGV (LiveCodeBench's evaluator loses its
    process the same way); 3.12 and later stop it with RecursionError. Either way an error, named for what it is."""
    r = run_test(_recursion(20_000, "@lru_cache(None)\n"), STDIN)
    want = "killed by signal 11 (SIGSEGV)" if sys.version_info < (3, 12) else "RecursionError"
    assert r.verdict == "error" and want in r.detail, r
    if sys.version_info < (3, 12):
        assert "the interpreter crashed" in r.detail, r
    assert run_test(_recursion(12_000, "@lru_cache(None)\n"), STDIN).verdict == "pass"  # within the stack
    crash = _verdict(sandbox.Outcome(128 + 11, b"", b"", 0.5, cpu_seconds=0.4), STDIN, "stdin", sandbox.Limits())
    assert crash.detail.startswith("killed by signal 11 (SIGSEGV) after 0.5 s, 0.4 s of CPU time: the interpreter "
                                   "crashed"), crash


def test_the_unsafe_mode_runs_programs_as_livecodebench_too():
    prelude = "d = defaultdict(int)\nfor x in input().split():\n    d[0] += int(x)\nprint(d[0])\nexit(3)\n"
    assert run_test(prelude, STDIN, unsafe=True).verdict == "pass"
    typed = "class Solution:\n    def f(self, xs: List[int], y: int) -> int:\n        return sum(xs) + y\n"
    assert run_test(typed, FUNCTIONAL, fn_name="f", unsafe=True).verdict == "pass"
    assert run_test(_recursion(20_000), STDIN, unsafe=True).verdict == "pass"


def test_run_python_passes_files_as_their_paths_inside(sandboxed):
    o = sandbox.run_python({"a.py": "import sys\nprint(sys.argv[1:])\n", "b.txt": "x"}, "a.py", ["z"], b"",
                           file_args=["b.txt"])
    assert o.stdout == b"['/sandbox/b.txt', 'z']\n", o
    with pytest.raises(ValueError, match="not among the files"):
        sandbox.run_python({"a.py": ""}, "a.py", [], b"", file_args=["b.txt"])
