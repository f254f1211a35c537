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
top-level tuple into a list).

Execution, LiveCodeBench's own too (its ``grade_stdio``/``grade_call_based``), done by a runner inside the sandbox
(the harness never parses the program):

- Every program runs after :data:`PRELUDE`, LiveCodeBench's ``import_string``: ``from M import *`` for string, re,
  datetime, collections, heapq, bisect, copy, math, random, statistics, itertools, functools, operator, io, sys,
  json, then builtins and typing, then ``import M`` for the first sixteen, then ``sys.setrecursionlimit(50000)``.
  So ``List[int]``, ``defaultdict``, ``heappush``, ``lru_cache``, ``inf`` need no import, ``datetime`` is the
  module, and a ``from __future__`` import is a ``SyntaxError`` (it no longer comes first). Its evaluator also
  raises Python's int-string limit to 50,000 digits (``sys.set_int_max_str_digits``, 4,300 by default), for the
  program and for the JSON of functional results: more digits are an error.
- ``stdin``: a last top-level statement ``if __name__ == '__main__':`` is replaced by its body; the top-level
  imports stay at the top level, after the prelude, and every other statement becomes the body of a function,
  ``wrapped_function()``, which is called once; ``SystemExit`` ends it like a return (what was printed counts,
  whatever the status). The program's top-level variables are therefore locals of that function, as in
  LiveCodeBench: a nested function's ``global x`` no longer reaches them (``NameError``, where the program run
  as a script passes), a top-level ``return`` is allowed, and an ``if __name__ == "__main__":`` block that is not
  the last statement is skipped (``__name__`` is ``"solution"``). A program of imports alone is an error (an
  empty function does not compile).
- ``functional``: the prelude, then the program, in one namespace; where the text holds ``class Solution`` (its
  test, on the text) the method is looked up on ``Solution()``, else the program's own top-level function of
  that name.

Deliberate differences in running (LiveCodeBench runs programs in process; here each test is a fresh process in
the sandbox): standard input and output are the process's real streams, where LiveCodeBench swaps in a
``StringIO`` for ``sys.stdin`` and one capturing ``sys.stdout`` (in the version read, ``sys.stdin.buffer``,
``sys.stdout.buffer``, ``open(0)``, ``os.read(0)``/``os.write(1)``, and ``stdout.write`` through the name the
prelude's ``from sys import *`` binds, fail or are not captured there, and work here); nothing of its
``reliability_guard`` is copied (it sets ``os.fork``, ``subprocess.Popen``, ``os.remove``, ``quit``, ``help``
and more to None and hides ``resource``: the sandbox is the guard here, and the attacks it must stop stay
real); every test starts fresh (a ``Solution`` instance, module globals, the random generator are not carried
from one test to the next, as they are there); and the limits are the sandbox's (LiveCodeBench sets no memory
limit). The stack is 8 MiB (:class:`probes.sandbox.Limits`), the usual Linux default, which LiveCodeBench
inherits: under the 50,000 recursion limit, Python recursion that goes through C (``functools.cache``, a key
function) can overflow it and crash the interpreter, reported as ``killed by signal 11 (SIGSEGV)``; how deep
that is depends on the Python version, here as there.
"""

from __future__ import annotations

import json
import re
import signal
import sys
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


# What LiveCodeBench puts before every program (its ``import_string``): every public name of these modules, then
# builtins' (the names the modules shadowed, ``pow`` or ``copyright``, back) and typing's, then the modules themselves
# (so ``datetime`` is the module, not the class), and the recursion limit.
PRELUDE_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                   "statistics", "itertools", "functools", "operator", "io", "sys", "json")
RECURSION_LIMIT = 50_000
INT_DIGITS = 50_000  # LiveCodeBench's evaluator sets sys.set_int_max_str_digits(50000) for the whole process
PRELUDE = ("".join(f"from {m} import *\n" for m in (*PRELUDE_MODULES, "builtins", "typing"))
           + "".join(f"import {m}\n" for m in PRELUDE_MODULES) + f"sys.setrecursionlimit({RECURSION_LIMIT})\n")

# The runner, in the sandbox beside solution.py: ``runner.py <solution.py> stdin`` or ``... functional <name>``
# (a functional test's arguments come on standard input). It runs the program as LiveCodeBench does (the module
# docstring), inside the sandbox: the program's text is parsed there, not in the harness.
_RUNNER = f"PRELUDE = {PRELUDE!r}\nINT_DIGITS = {INT_DIGITS}\n" + r"""
import ast, json, sys, types
dumps, out = json.dumps, sys.__stdout__  # the program cannot swap these under the runner

def is_main_block(stmt):
    # LiveCodeBench's test: the statement, written back by ast.unparse, is `if __name__ == '__main__':`
    test = getattr(stmt, "test", None)
    return (isinstance(stmt, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.comparators[0], ast.Constant) and type(test.comparators[0].value) is str
            and test.comparators[0].value == "__main__" and test.comparators[0].kind is None)

def as_function(body):
    # the imports stay at the top level, the other statements become the body of wrapped_function()
    imports = [s for s in body if isinstance(s, (ast.Import, ast.ImportFrom))]
    rest = [s for s in body if not isinstance(s, (ast.Import, ast.ImportFrom))]
    if not rest:
        raise SyntaxError("the program has no statement but imports: LiveCodeBench wraps the others in a function, "
                          "and a function without statements does not compile")
    fields = dict(name="wrapped_function", args=ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[],
                  kw_defaults=[], kwarg=None, defaults=[]), body=rest, decorator_list=[], returns=None,
                  type_comment=None, type_params=[])
    where = dict(lineno=min(s.lineno for s in rest), col_offset=0, end_lineno=max(s.end_lineno for s in rest),
                 end_col_offset=0)
    return imports + [ast.FunctionDef(**{k: v for k, v in fields.items() if k in ast.FunctionDef._fields}, **where)]

path, kind, fn_name = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None
with open(path, encoding="utf-8") as f:
    source = f.read()
if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(INT_DIGITS)
body = ast.parse(source, "solution.py").body
if kind == "stdin":
    if body and is_main_block(body[-1]):
        body = body[:-1] + body[-1].body
    body = as_function(body)
module = types.ModuleType("solution")  # __name__ is not "__main__", as in LiveCodeBench
sys.argv = [path]
tree = ast.fix_missing_locations(ast.Module(body=ast.parse(PRELUDE).body + body, type_ignores=[]))
exec(compile(tree, "solution.py", "exec"), module.__dict__)
if kind == "stdin":
    run = module.__dict__["wrapped_function"]
    try:
        run()
    except SystemExit:  # LiveCodeBench compares what was printed before exit(), whatever its status
        pass
else:
    if "class Solution" in source:  # LiveCodeBench's own test, on the text
        if "Solution" not in module.__dict__:
            raise NameError("no class Solution defined")
        owner = module.Solution()
    else:
        owner = module  # no class Solution: a function of the program's own
    fn = getattr(owner, fn_name, None)
    if fn is None:
        raise AttributeError(f"{'Solution' if owner is not module else 'the program'} has no {fn_name!r}")
    args = [json.loads(line) for line in sys.stdin.read().split("\n") if line.strip()]
    out.write("\n<<<result>>>" + dumps(fn(*args)) + "\n")
"""


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
    o = run_python({"solution.py": program, "runner.py": _RUNNER}, "runner.py",
                   [kind] + ([fn_name] if kind == "functional" else []), stdin, limits, file_args=["solution.py"],
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
    output = test.get("output")
    expected = _json(output) if isinstance(output, str) else output
    got_text = out_text[marker + len(RESULT_MARK):].strip()
    try:
        got = _json(got_text)
        ok = got == expected  # LiveCodeBench's rule: Python's equality
    except (ValueError, RecursionError):  # not JSON, an int past LiveCodeBench's digit limit, nested too deep
        return TestResult("error", "the function's result is not readable JSON", o.seconds)
    return TestResult("pass" if ok else "wrong_answer",
                      "" if ok else f"returned {_show(got, got_text)}, expected {_show(expected, output)}", o.seconds)


def _int(text: str) -> int:
    """A JSON integer, up to LiveCodeBench's ``INT_DIGITS`` digits whatever this process's int-string limit (its
    evaluator raises it to 50,000; a longer one is a ValueError there too), read in pieces the limit never checks."""
    digits = text.lstrip("-")
    if len(digits) > INT_DIGITS:
        raise ValueError(f"an int of {len(digits)} digits: more than {INT_DIGITS}")
    step = getattr(sys.int_info, "str_digits_check_threshold", 640)
    value = 0
    for i in range(0, len(digits), step):
        piece = digits[i:i + step]
        value = value * 10 ** len(piece) + int(piece)
    return -value if text.startswith("-") else value


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:  # not JSON, or an int past this process's int-string limit: read again with _int for ints
        return json.loads(text, parse_int=_int)


def _show(value, text) -> str:
    """``repr(value)``, shortened; its JSON text where repr fails (an int past this process's int-string limit)."""
    try:
        return _short(repr(value))
    except ValueError:
        return _short(text) if isinstance(text, str) else "(a value holding an int too long to print)"


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
        why = ""
        if sig == signal.SIGSEGV:
            why = (f": the interpreter crashed (a recursion deeper than the {limits.stack_mb} MiB stack holds, under "
                   f"LiveCodeBench's recursion limit of {RECURSION_LIMIT:,}, ends this way)")
        return TestResult("error", f"killed by signal {sig}{name} after {o.seconds:.1f} s, {cpu}{why}", o.seconds)
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
