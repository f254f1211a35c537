"""A code grader for LiveCodeBench-style problems: run a candidate program against each test in a sandbox.

Every test runs in a fresh operating-system sandbox (:mod:`probes.sandbox`, bubblewrap): a read-only view of the
system and the Python installation alone, a private empty ``/tmp`` as the only writable place and working folder,
no network, its own PID namespace, an unprivileged user, and hard limits on wall-clock and CPU time, memory,
file size, processes and output bytes; the whole process tree is killed at the wall clock. Only the program and
the test's input go in: the expected output stays here and is compared here. Where the sandbox does not work,
grading refuses (:class:`SandboxUnavailable`, with the install command ``apt-get install bubblewrap``) unless
``unsafe=True`` (``--unsafe-code-grading``): then programs run as plain limited subprocesses, without isolation.

Verdicts per test: ``pass``, ``wrong_answer``, ``error`` (an exception, a refused operation, the memory or output
limit) and ``timeout`` (the wall-clock or CPU limit), each with a one-line detail.

Test kinds (LiveCodeBench's ``testtype``): ``stdin`` feeds ``input`` on standard input and compares standard
output with ``output`` line by line, whitespace-separated tokens, numbers within 1e-6; ``functional`` calls
``Solution().<fn_name>(*args)`` with the arguments given one JSON value per line of ``input`` (fed on standard
input to a small runner in the sandbox) and compares the JSON it prints with the JSON ``output``.
"""

from __future__ import annotations

import json
import math
import re
import signal
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from .sandbox import INSTALL, Limits, SandboxUnavailable, run_python, unavailable

__all__ = ["TestResult", "run_tests", "run_test", "extract_program", "outputs_match", "network_isolation",
           "SandboxUnavailable", "INSTALL"]

VERDICTS = ("pass", "wrong_answer", "error", "timeout")
RESULT_MARK = "<<<result>>>"


@dataclass(frozen=True)
class TestResult:
    verdict: str
    detail: str
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


# The functional runner, in the sandbox beside solution.py: the arguments come on standard input.
_RUNNER = r'''
import json, os, sys
source = open(os.path.join(os.path.dirname(__file__), "solution.py")).read()
args = [json.loads(line) for line in sys.stdin.read().split("\n") if line.strip()]
glb = {"__name__": "solution"}
exec(compile(source, "solution.py", "exec"), glb)
if "Solution" not in glb:
    raise NameError("no class Solution defined")
result = getattr(glb["Solution"](), sys.argv[1])(*args)
sys.__stdout__.write("\n<<<result>>>" + json.dumps(result) + "\n")
'''


def network_isolation() -> str:
    """``"namespace"`` when programs run in the sandbox here (a network namespace with loopback alone), else
    ``"none"`` (grading refuses, or with ``unsafe=True`` programs reach the network)."""
    return "none" if unavailable() else "namespace"


def _tokens(text: str) -> list[list[str]]:
    lines = [line.split() for line in text.strip().splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _same_value(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return a == b


def outputs_match(got: str, expected: str) -> bool:
    """Standard output against the expected: the same lines of whitespace-separated tokens, numbers within 1e-6."""
    a, b = _tokens(got), _tokens(expected)
    if a == b:
        return True
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return False
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            if s == t:
                continue
            try:
                if not math.isclose(float(s), float(t), rel_tol=1e-6, abs_tol=1e-6):
                    return False
            except ValueError:
                return False
    return True


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:300]


def run_test(program: str, test: dict, *, fn_name: Optional[str] = None, timeout: float = 6.0,
             memory_mb: int = 1024, file_mb: int = 16, processes: int = 16, output_mb: int = 16,
             unsafe: bool = False) -> TestResult:
    """One test in a fresh sandbox (see the module docstring); ``unsafe`` runs it without isolation."""
    kind = test.get("testtype", "stdin")
    if kind not in ("stdin", "functional"):
        raise ValueError(f"unknown test type {kind!r}: expected 'stdin' or 'functional'")
    if kind == "functional" and not fn_name:
        raise ValueError("a functional test needs the function name (the problem's metadata 'func_name')")
    limits = Limits(seconds=timeout, memory_mb=memory_mb, file_mb=file_mb, processes=processes, output_mb=output_mb)
    stdin = str(test.get("input", "")).encode()
    if kind == "stdin":
        o = run_python({"solution.py": program}, "solution.py", [], stdin, limits, unsafe=unsafe)
    else:
        o = run_python({"solution.py": program, "runner.py": _RUNNER}, "runner.py", [fn_name], stdin, limits,
                       unsafe=unsafe)
    return _verdict(o, test, kind, limits)


def _verdict(o, test: dict, kind: str, limits: Limits) -> TestResult:
    if o.stopped == "timeout":
        return TestResult("timeout", f"no answer within {limits.seconds:g} s wall-clock", o.seconds)
    if o.stopped == "output":
        return TestResult("error", f"output limit: more than {limits.output_mb} MiB printed", o.seconds)
    out_text = o.stdout.decode("utf-8", errors="replace")
    err_text = o.stderr.decode("utf-8", errors="replace")
    if o.status != 0:
        if o.status in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):
            return TestResult("timeout", f"CPU-time limit ({limits.cpu_seconds} s)", o.seconds)
        detail = _last_line(err_text) or f"exit status {o.status}"
        if "MemoryError" in err_text:
            detail = f"MemoryError: the memory limit of {limits.memory_mb} MiB was reached"
        return TestResult("error", detail, o.seconds)
    if kind == "stdin":
        ok = outputs_match(out_text, str(test.get("output", "")))
        return TestResult("pass" if ok else "wrong_answer",
                          "" if ok else f"printed {_last_line(out_text)!r}, expected {_last_line(str(test['output']))!r}",
                          o.seconds)
    marker = out_text.rfind(RESULT_MARK)
    if marker < 0:
        return TestResult("error", "the function returned nothing readable", o.seconds)
    try:
        got = json.loads(out_text[marker + len(RESULT_MARK):].strip())
    except json.JSONDecodeError:
        return TestResult("error", "the function's result is not JSON-serialisable", o.seconds)
    expected = json.loads(test["output"]) if isinstance(test.get("output"), str) else test.get("output")
    ok = _same_value(got, expected)
    return TestResult("pass" if ok else "wrong_answer", "" if ok else f"returned {got!r}, expected {expected!r}",
                      o.seconds)


def run_tests(program: str, tests: Sequence[dict], *, fn_name: Optional[str] = None, timeout: float = 6.0,
              memory_mb: int = 1024, stop_at_first_failure: bool = True, unsafe: bool = False) -> list[TestResult]:
    """Every test of one program (by default stopping at the first that does not pass, as pass@1 needs no more).
    Raises :class:`SandboxUnavailable` (with the install command) where the sandbox does not work, unless
    ``unsafe``."""
    results = []
    for test in tests:
        results.append(run_test(program, test, fn_name=fn_name, timeout=timeout, memory_mb=memory_mb, unsafe=unsafe))
        if stop_at_first_failure and results[-1].verdict != "pass":
            break
    return results


_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(text: str) -> Optional[str]:
    """The last fenced code block of a model's answer (```python ... ```), or None."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else None
