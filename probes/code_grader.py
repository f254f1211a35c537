"""A code grader for LiveCodeBench-style problems: run a candidate program against each test in a subprocess.

Every test runs in a fresh ``python -I`` subprocess in an empty temporary folder, with

- a wall-clock limit (the process group is killed when it passes; verdict ``timeout``) and a CPU-time limit,
- an address-space limit (``RLIMIT_AS``; allocating past it raises ``MemoryError``: verdict ``error``),
- a file-size limit, and an audit hook (PEP 578, installed before the program runs and impossible to remove)
  that refuses writing, deleting or renaming anything outside the temporary folder, opening sockets,
  starting processes and importing ``ctypes``,
- no network: where ``unshare -rn`` works (Linux user namespaces) the process has a network namespace of its
  own with nothing in it; elsewhere the audit hook's socket refusal is all there is.

Verdicts per test: ``pass``, ``wrong_answer``, ``error`` (an exception, a refused operation, the memory limit)
and ``timeout``, each with a one-line detail. This guards against programs that misbehave by accident (loops,
runaway allocation, stray files); it is not a security boundary against hostile code: run untrusted models'
programs in a container or VM for that.

Test kinds (LiveCodeBench's ``testtype``): ``stdin`` feeds ``input`` on standard input and compares standard
output with ``output`` line by line, whitespace-separated tokens, numbers within 1e-6; ``functional`` calls
``Solution().<fn_name>(*args)`` with the arguments given one JSON value per line of ``input`` and compares the
result with the JSON ``output``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["TestResult", "run_tests", "extract_program", "outputs_match", "network_isolation"]

VERDICTS = ("pass", "wrong_answer", "error", "timeout")


@dataclass(frozen=True)
class TestResult:
    verdict: str
    detail: str
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


# What the child runs before the program: resource limits are set by the parent; this adds the audit hook.
_RUNNER = r'''
import builtins, io, json, os, sys
ROOT = os.path.realpath(os.getcwd())
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_DENY = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "subprocess.Popen", "os.system",
         "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn"}
_PATHS = {"os.remove", "os.rename", "os.replace", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink",
          "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}

def _inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path)) if not isinstance(path, int) else None
    except Exception:
        return False
    return p is None or p == ROOT or p.startswith(ROOT + os.sep) or p == "/dev/null"

def _hook(event, args):
    if event == "open":
        path, mode, flags = (list(args) + [None, None, None])[:3]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writes and not _inside(path):
            raise PermissionError(f"sandbox: writing outside the working folder is refused ({path})")
    elif event in _PATHS:
        for a in args:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a):
                raise PermissionError(f"sandbox: {event} outside the working folder is refused ({a})")
    elif event in _DENY:
        raise PermissionError(f"sandbox: {event} is refused")
    elif event == "import" and args and str(args[0]).split(".")[0] in ("ctypes", "_ctypes"):
        raise PermissionError("sandbox: importing ctypes is refused")

def _close(a, b):
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)
    except (TypeError, ValueError):
        return False

import math
mode, fn_name = sys.argv[1], sys.argv[2]
source = open("solution.py").read()
test = json.load(open("test.json"))
sys.addaudithook(_hook)
if mode == "stdin":
    sys.stdin = io.StringIO(test["input"])
    glb = {"__name__": "__main__"}
    exec(compile(source, "solution.py", "exec"), glb)
else:
    glb = {"__name__": "solution"}
    exec(compile(source, "solution.py", "exec"), glb)
    args = [json.loads(line) for line in test["input"].split("\n") if line.strip()]
    if "Solution" not in glb:
        raise NameError("no class Solution defined")
    result = getattr(glb["Solution"](), fn_name)(*args)
    sys.__stdout__.write("\n<<<result>>>" + json.dumps(result) + "\n")
'''


@functools.lru_cache(maxsize=1)
def network_isolation() -> str:
    """``"namespace"`` when ``unshare -rn`` gives programs a network namespace of their own here, else ``"hook"``."""
    try:
        ok = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return "namespace" if ok else "hook"


def _limits(memory_mb: int, cpu_seconds: int, file_mb: int):
    def apply():
        import resource

        os.setsid()
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * 2**20, file_mb * 2**20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


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
             memory_mb: int = 1024, file_mb: int = 16) -> TestResult:
    """One test in a fresh sandboxed subprocess (see the module docstring)."""
    kind = test.get("testtype", "stdin")
    if kind not in ("stdin", "functional"):
        raise ValueError(f"unknown test type {kind!r}: expected 'stdin' or 'functional'")
    if kind == "functional" and not fn_name:
        raise ValueError("a functional test needs the function name (the problem's metadata 'func_name')")
    with tempfile.TemporaryDirectory(prefix="randattn-code-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        (work / "solution.py").write_text(program)
        (work / "test.json").write_text(json.dumps(test))
        (Path(tmp) / "runner.py").write_text(_RUNNER)
        cmd = [sys.executable, "-I", "-B", str(Path(tmp) / "runner.py"), kind, fn_name or "-"]
        if network_isolation() == "namespace":
            cmd = ["unshare", "-rn", *cmd]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, preexec_fn=_limits(memory_mb, int(math.ceil(timeout)) + 1,
                                                                            file_mb))
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            return TestResult("timeout", f"no answer within {timeout:g} s wall-clock", time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
    out_text = out.decode("utf-8", errors="replace")
    err_text = err.decode("utf-8", errors="replace")
    if proc.returncode != 0:
        if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            return TestResult("timeout", f"CPU-time limit ({int(math.ceil(timeout)) + 1} s)", seconds)
        detail = _last_line(err_text) or f"exit status {proc.returncode}"
        if "MemoryError" in err_text:
            detail = f"MemoryError: the memory limit of {memory_mb} MiB was reached"
        return TestResult("error", detail, seconds)
    if kind == "stdin":
        ok = outputs_match(out_text, str(test.get("output", "")))
        return TestResult("pass" if ok else "wrong_answer",
                          "" if ok else f"printed {_last_line(out_text)!r}, expected {_last_line(str(test['output']))!r}",
                          seconds)
    marker = out_text.rfind("<<<result>>>")
    if marker < 0:
        return TestResult("error", "the function returned nothing readable", seconds)
    try:
        got = json.loads(out_text[marker + len("<<<result>>>"):].strip())
    except json.JSONDecodeError:
        return TestResult("error", "the function's result is not JSON-serialisable", seconds)
    expected = json.loads(test["output"]) if isinstance(test.get("output"), str) else test.get("output")
    ok = _same_value(got, expected)
    return TestResult("pass" if ok else "wrong_answer", "" if ok else f"returned {got!r}, expected {expected!r}",
                      seconds)


def run_tests(program: str, tests: Sequence[dict], *, fn_name: Optional[str] = None, timeout: float = 6.0,
              memory_mb: int = 1024, stop_at_first_failure: bool = True) -> list[TestResult]:
    """Every test of one program (by default stopping at the first that does not pass, as pass@1 needs no more)."""
    results = []
    for test in tests:
        results.append(run_test(program, test, fn_name=fn_name, timeout=timeout, memory_mb=memory_mb))
        if stop_at_first_failure and results[-1].verdict != "pass":
            break
    return results


_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(text: str) -> Optional[str]:
    """The last fenced code block of a model's answer (```python ... ```), or None."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else None
