"""A code grader for LiveCodeBench-style problems: run a candidate program against each test in a sandbox.

Every test runs in a fresh operating-system sandbox (:mod:`probes.sandbox`, bubblewrap): a read-only view of the
system and the Python installation alone, a private empty ``/tmp`` as the only writable place and working folder,
no network, its own PID namespace, an unprivileged user, and hard limits on wall-clock and CPU time, memory,
file size, processes and output bytes; the whole process tree is killed at the wall clock. Only the program and
the test's input go in: the expected output stays here and is compared here. Where the sandbox does not work,
grading refuses (:class:`SandboxUnavailable`, with the install command ``apt-get install bubblewrap``) unless
``unsafe=True`` (``--unsafe-code-grading``): then programs run as plain limited subprocesses, without isolation.

Verdicts per test: ``pass``, ``wrong_answer``, ``error`` (an exception, a refused operation, the memory or output
limit, a kill by a signal) and ``timeout`` (the wall-clock or CPU limit), each with a one-line detail naming what
happened (the wall clock, SIGXCPU, signal N, the OOM killer, MemoryError).

Test kinds (LiveCodeBench's ``testtype``) and their comparison, LiveCodeBench's own (``lcb_runner/evaluation/
testing_util.py``): ``stdin`` feeds ``input`` on standard input; standard output and ``output`` are each stripped
and split at ``"\\n"``, each line stripped; the line counts must agree, and each line must be the same text or
else the same numbers: every whitespace-separated token a ``decimal.Decimal``, compared exactly (``7.0`` is ``7``;
``1000001`` is not ``1000000``; no tolerance, for floats either). ``functional`` calls
``Solution().<fn_name>(*args)`` with the arguments given one JSON value per line of ``input`` (fed on standard
input to a small runner in the sandbox); its result comes back as JSON and must be ``==`` to the JSON ``output``
(Python's equality: ``7.0 == 7``, ``True == 1``). A deliberate difference: the result crosses the sandbox as JSON,
so tuples nested inside it count as lists and dict keys as strings (LiveCodeBench, in process, turns only a
top-level tuple into a list), and an int of more than 4,300 digits is an error (Python's int-string limit).
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from itertools import chain, starmap, zip_longest
from operator import eq
from typing import Optional, Sequence

from .sandbox import INSTALL, Limits, SandboxUnavailable, run_python, unavailable

__all__ = ["TestResult", "run_tests", "run_test", "extract_program", "outputs_match", "output_difference",
           "network_isolation",
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


def _blocks(text: str, size: int = 1 << 18):
    """``text`` in pieces of about ``size`` characters, each cut after a ``"\\n"`` (and the last one)."""
    start = 0
    while (end := text.find("\n", start + size)) >= 0:
        yield text[start:end]
        start = end + 1
    yield text[start:]


def _lines(text: str):
    """LiveCodeBench's lines of ``text`` (stripped, split at "\\n", each stripped), a block's list at a time: a long
    output of short lines costs no list of them all (each str is about 50 bytes more than its text)."""
    return chain.from_iterable(map(str.strip, block.split("\n")) for block in _blocks(text.strip()))


def _tokens(line: str):
    return line.split() if len(line) < 1 << 16 else (m.group() for m in re.finditer(r"\S+", line))  # str.split's \s


def _same_numbers(a: str, b: str) -> bool:
    """Every token of both lines a number (``decimal.Decimal``) and the numbers equal, one by one."""
    try:
        return all(starmap(eq, zip_longest(map(Decimal, _tokens(a)), map(Decimal, _tokens(b)))))
    except InvalidOperation:  # not a number, or a signalling NaN compared (LiveCodeBench's comparison raises too)
        return False


def _short(text: str) -> str:
    return text if len(text) <= 80 else text[:80] + "..."


def output_difference(got: str, expected: str) -> Optional[str]:
    """None when standard output matches the expected (the module docstring's rule), else the first difference."""
    n, m = got.strip().count("\n") + 1, expected.strip().count("\n") + 1
    if n != m:
        return f"printed {n} line(s), expected {m}"
    for i, (a, b) in enumerate(zip(_lines(got), _lines(expected)), 1):
        if a != b and not _same_numbers(a, b):
            return f"line {i}: printed {_short(a)!r}, expected {_short(b)!r}"
    return None


def outputs_match(got: str, expected: str) -> bool:
    """Standard output against the expected: LiveCodeBench's rule (the module docstring)."""
    return output_difference(got, expected) is None


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
    if o.status != 0:
        return _failure(o, limits)
    out_text = o.stdout.decode("utf-8", errors="replace")
    if kind == "stdin":
        why = output_difference(out_text, str(test.get("output", "")))
        return TestResult("wrong_answer" if why else "pass", why or "", o.seconds)
    marker = out_text.rfind(RESULT_MARK)
    if marker < 0:
        return TestResult("error", "the function returned nothing readable", o.seconds)
    expected = json.loads(test["output"]) if isinstance(test.get("output"), str) else test.get("output")
    try:
        got = json.loads(out_text[marker + len(RESULT_MARK):].strip())
        ok = got == expected  # LiveCodeBench's rule: Python's equality
    except (ValueError, RecursionError):  # not JSON, an int past Python's digit limit, nested too deep
        return TestResult("error", "the function's result is not readable JSON", o.seconds)
    return TestResult("pass" if ok else "wrong_answer",
                      "" if ok else f"returned {_short(repr(got))}, expected {_short(repr(expected))}", o.seconds)


def _failure(o, limits: Limits) -> TestResult:
    """A run that ended with a non-zero status, labelled by what ended it."""
    sig = o.status - 128 if o.status > 128 else 0  # bwrap and the unsafe supervisor report signal N as 128 + N
    cpu = f"{o.cpu_seconds:.1f} s of CPU time"
    if sig == signal.SIGXCPU:
        return TestResult("timeout", f"CPU-time limit ({limits.cpu_seconds} s): SIGXCPU after {cpu}", o.seconds)
    if sig == signal.SIGKILL and o.cpu_seconds >= limits.cpu_seconds:  # the limit's hard stop, SIGXCPU ignored
        return TestResult("timeout", f"CPU-time limit ({limits.cpu_seconds} s): SIGKILL after {cpu}", o.seconds)
    if sig == signal.SIGKILL and o.oom_kills:
        return TestResult("error", "killed by the kernel's OOM killer (SIGKILL): the machine ran out of memory",
                          o.seconds)
    err_text = o.stderr.decode("utf-8", errors="replace")
    if "MemoryError" in err_text:
        return TestResult("error", f"MemoryError: the memory limit of {limits.memory_mb} MiB was reached", o.seconds)
    if sig:
        try:
            name = f" ({signal.Signals(sig).name})"
        except ValueError:
            name = ""
        return TestResult("error", f"killed by signal {sig}{name} after {o.seconds:.1f} s, {cpu}", o.seconds)
    return TestResult("error", _last_line(err_text) or f"exit status {o.status}", o.seconds)


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
