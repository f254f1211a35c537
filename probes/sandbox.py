"""Run a Python program inside an operating-system sandbox (bubblewrap), for the code grader.

Nothing here relies on the program's own interpreter: every protection is the kernel's.

- **Namespaces** (``bwrap``): a mount namespace whose root is an empty tmpfs holding, read-only, only the system
  folders (``/usr`` and its ``/bin``, ``/lib`` links), the Python installation and the program's files under
  ``/sandbox``; the only writable place is a private, empty ``/tmp`` of ``file_mb`` MiB (the working folder). The
  harness's files, the data sets, ``/home``, ``/root`` and the host's ``/tmp`` are not there at all (a Python
  installation under ``/tmp``, a venv, is bound read-only inside the private one). A network namespace with
  nothing but its own loopback (abstract Unix sockets included), and PID, IPC and UTS namespaces.
- **An unprivileged user**: as root, each run gets a uid of its own (``setpriv``, no capabilities, no new
  privileges), also when several run at once in one process, so the per-user process limit is that run's alone;
  otherwise bwrap's user namespace maps it to the caller.
- **A seccomp filter** (x86-64 and arm64) refusing ``unshare``, ``clone`` with a new user namespace and
  ``clone3`` (a namespace root could mount a tmpfs without a size limit); ``memfd_create`` and SysV shared memory,
  message queues and semaphores (memory the address-space limit does not count); and the kernel keyring
  (``add_key``, ``request_key``, ``keyctl``: keys are kept per uid and would outlive the run).
- **Hard limits** (``prlimit``, set before the program starts; an unprivileged process cannot raise them): address
  space, CPU seconds, file size, no core files, processes (threads included) of the sandbox's user, and the stack
  (8 MiB, soft and hard: the usual Linux default, which LiveCodeBench's evaluator inherits; fixed here so that how
  deep a program can recurse does not depend on the ``ulimit -s`` of whoever runs the harness).
- **The harness side**: the wall clock is kept here, and at the limit the namespace's first process is killed,
  which kills every process in it (a detached grandchild holding standard output open included); standard output
  is read up to ``output_mb`` MiB and the run stopped past it; only the last 64 KiB of standard error are kept;
  the program gets no environment but ``PATH``, ``LANG``, ``HOME=/tmp`` and ``PYTHONHASHSEED``. The outcome
  says how the run ended (exit status or signal, CPU time, peak resident memory, OOM kills during it).

Where ``bwrap`` (or ``setpriv``/``prlimit``) is missing or does not work, :func:`unavailable` names the cause and
its fix, and :func:`run_python` refuses unless ``unsafe=True``: then the program is a plain subprocess with the
same limits (but processes) and an empty working folder, under a small supervisor that is the subreaper of
everything it starts (``PR_SET_CHILD_SUBREAPER``), so its descendants, detached sessions included, are killed at
its end or at the wall clock; it can read, write and reach the network as the user running the harness (and a
program that kills its supervisor can leave processes behind).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import platform
import re
import resource
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

__all__ = ["Limits", "Outcome", "SandboxUnavailable", "INSTALL", "unavailable", "require", "run_python"]

INSTALL = "apt-get install bubblewrap"
SANDBOX_DIR = "/sandbox"  # the program's files, read-only
STATUS_DIR = "/.randattn"  # where the shell above the program writes its CPU time (as root: out of its reach)
# The program runs as this shell's child, so that the shell's `times` reports its CPU time: bwrap's own init
# reaps the namespace's processes, and their resource usage never reaches the harness's wait4. The shell's own
# messages ("Killed") go nowhere: the program's standard error is the program's alone.
_TIMES = f'exec 3>&2 2>/dev/null; (exec "$@" 2>&3 3>&-); s=$?; times > {STATUS_DIR}/times; exit $s'
WORK_DIR = "/tmp"  # the working folder, the only writable place
STDERR_TAIL = 1 << 16
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": WORK_DIR, "PYTHONHASHSEED": "0"}
# as root each run drops to UID_BASE + pid * UID_SLOTS + slot: the harness's pid keeps processes apart, the slot
# the runs going on at once in one process (threads), so the process limit, counted per uid, is one run's alone
UID_BASE = 0x40000000
UID_SLOTS = 64  # runs at once per harness process; more wait for a free slot (pids < 2**22: uids < 0x50000000)


@dataclass(frozen=True)
class Limits:
    seconds: float = 6.0  # wall clock
    memory_mb: int = 1024  # address space, per process
    file_mb: int = 16  # each file, and the working folder in all
    processes: int = 16  # processes and threads of the program, all together
    output_mb: int = 16  # bytes of standard output (and of standard error) before the run is stopped
    stack_mb: int = 8  # the main thread's stack (RLIMIT_STACK, soft and hard), at most the harness's own hard limit

    @property
    def cpu_seconds(self) -> int:
        return int(math.ceil(self.seconds)) + 1


@dataclass(frozen=True)
class Outcome:
    status: Optional[int]  # exit status, 128 + N when killed by signal N; None when the harness stopped the run
    stdout: bytes
    stderr: bytes  # its last 64 KiB
    seconds: float
    stopped: Optional[str] = None  # "timeout" (wall clock) or "output" (output limit) when the harness stopped it
    cpu_seconds: float = 0.0  # user + system time of the program's process and of the children it waited for
    oom_kills: int = 0  # kills by the kernel's OOM killer on this machine while it ran (/proc/vmstat)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here; the message says why and what fixes it."""


# -- the seccomp filter ---------------------------------------------------------------------------------
_ARCH = {  # machine: (AUDIT_ARCH_*, its syscall numbers)
    "x86_64": (0xC000003E, dict(unshare=272, clone=56, clone3=435, memfd_create=319, shmget=29, msgget=68,
                                semget=64, add_key=248, request_key=249, keyctl=250)),
    "aarch64": (0xC00000B7, dict(unshare=97, clone=220, clone3=435, memfd_create=279, shmget=194, msgget=186,
                                 semget=190, add_key=217, request_key=218, keyctl=219)),
}
# refused with EPERM: a namespace of its own; memory RLIMIT_AS does not count (a memfd is capped by the file-size
# limit, but not their number; SysV objects outlive their mappings); the keyring, which is kept per uid
REFUSED = ("unshare", "memfd_create", "shmget", "msgget", "semget", "add_key", "request_key", "keyctl")
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
_ALLOW, _EPERM, _ENOSYS, _KILL = 0x7FFF0000, 0x00050001, 0x00050026, 0x80000000
CLONE_NEWUSER = 0x10000000


def seccomp_filter(machine: Optional[str] = None) -> Optional[bytes]:
    """The BPF program bwrap installs before the program starts, or None on an architecture not listed above."""
    machine = machine or platform.machine()
    if machine not in _ARCH:
        return None
    arch, nr = _ARCH[machine]
    # (code, jump if true, jump if false, k); a jump is 0 (to the next instruction) or the name of a return below
    body = [
        (_LD, 0, 0, 4),  # the calling convention: any other (x86's 32-bit one) is killed, it has other numbers
        (_JEQ, 0, "kill", arch),
        (_LD, 0, 0, 0),  # the syscall number
        (_JGE, "eperm", 0, 0x40000000),  # the x32 numbering: refused
        *[(_JEQ, "eperm", 0, nr[name]) for name in REFUSED],
        (_JEQ, "enosys", 0, nr["clone3"]),  # ENOSYS: the C library falls back to clone, whose flags are visible
        (_JEQ, 0, "allow", nr["clone"]),
        (_LD, 0, 0, 16),  # clone's flags (the low half of the first argument)
        (_JSET, "eperm", "allow", CLONE_NEWUSER),
    ]
    returns = {"kill": _KILL, "enosys": _ENOSYS, "allow": _ALLOW, "eperm": _EPERM}
    at = {name: len(body) + i for i, name in enumerate(returns)}
    prog = [(code, *(at[j] - i - 1 if j else 0 for j in (jt, jf)), k) for i, (code, jt, jf, k) in enumerate(body)]
    prog += [(_RET, 0, 0, value) for value in returns.values()]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


# -- the sandbox command --------------------------------------------------------------------------------
def _python_dirs() -> list[str]:
    """The folders the interpreter needs besides /usr: its prefix (a venv's too) and its executable's folder."""
    dirs = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix)}
    dirs.add(os.path.dirname(os.path.realpath(sys.executable)))
    dirs = sorted(d for d in dirs if d != "/" and not d.startswith("/usr/") and d != "/usr")
    return [d for d in dirs if not any(d.startswith(o + "/") for o in dirs if o != d)]


def _bwrap_argv(limits: Limits, files: Mapping[str, int], seccomp_fd: Optional[int], uid: Optional[int],
                status_dir: str) -> list[str]:
    argv = ["bwrap", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for name in ("/etc/ld.so.cache", "/etc/localtime"):
        if os.path.exists(name):
            argv += ["--ro-bind", name, name]
    # the private /tmp before the Python installation: mounted after, it would hide a venv made under /tmp
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "01777", "--size", str(limits.file_mb * 2**20), "--tmpfs", WORK_DIR]
    made = {WORK_DIR}
    for d in _python_dirs():
        for parent in list(reversed(Path(d).parents))[1:]:  # folders on the way, traversable by the program's uid
            if str(parent) not in made:
                made.add(str(parent))
                argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", d, d]
    argv += ["--bind", status_dir, STATUS_DIR, "--perms", "0755", "--dir", SANDBOX_DIR]
    for name, fd in files.items():
        argv += ["--perms", "0444", "--ro-bind-data", str(fd), f"{SANDBOX_DIR}/{name}"]
    argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
             "--die-with-parent", "--new-session", "--clearenv", "--chdir", WORK_DIR]
    for k, v in ENV.items():
        argv += ["--setenv", k, v]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    shell = ["/bin/sh", "-c", _TIMES, "sh", "env", "-i", *(f"{k}={v}" for k, v in ENV.items())]  # ENV alone
    if uid is not None:  # as root: drop to a uid of its own, the process limit is per uid and does not apply to root
        argv += ["--cap-add", "CAP_SETUID,CAP_SETGID,CAP_SETPCAP", "--", *shell,
                 "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                 "--inh-caps=-all", "--bounding-set=-all"]
    else:
        argv += ["--unshare-user", "--", *shell]
    mb, stack = 2**20, _stack_bytes(limits)
    argv += ["prlimit", f"--as={limits.memory_mb * mb}", f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
             f"--fsize={limits.file_mb * mb}", "--core=0", f"--nproc={limits.processes}", f"--stack={stack}:{stack}",
             "--"]
    return argv


def _stack_bytes(limits: Limits) -> int:
    """The stack limit in bytes: ``stack_mb``, or the harness's own hard limit where that is lower (an unprivileged
    process cannot raise it)."""
    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    want = limits.stack_mb * 2**20
    return want if hard == resource.RLIM_INFINITY else min(want, hard)


_slots = threading.Condition()
_slots_taken: set[int] = set()


@contextlib.contextmanager
def _own_uid():
    """A uid no other run uses while this one lasts (see UID_BASE)."""
    with _slots:
        while len(_slots_taken) >= UID_SLOTS:
            _slots.wait()
        slot = min(set(range(UID_SLOTS)) - _slots_taken)
        _slots_taken.add(slot)
    try:
        yield UID_BASE + os.getpid() * UID_SLOTS + slot
    finally:
        with _slots:
            _slots_taken.discard(slot)
            _slots.notify()


# -- availability -------------------------------------------------------------------------------------------
def _missing_tool() -> Optional[str]:
    for tool in ("bwrap", "prlimit") + (("setpriv",) if os.geteuid() == 0 else ()):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH"
    return None


def _last_line(data: bytes) -> str:
    lines = data.decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else ""


@functools.lru_cache(maxsize=1)
def _probe() -> Optional[str]:
    """None when a trivial program runs in the sandbox here, else its cause and fix (checked once per process)."""
    missing = _missing_tool()
    if missing:
        return f"{missing}; install it ({INSTALL})"
    try:
        o = run_python({"probe.py": "print(6 * 7)\n"}, "probe.py", [], b"", Limits(seconds=20), _checked=True)
    except OSError as exc:
        return f"bwrap could not start ({exc}); reinstall it ({INSTALL})"
    if o.stdout == b"42\n" and o.status == 0:
        return None
    why = _last_line(o.stderr) or f"exit status {o.status}"
    # bwrap itself, with the namespaces alone: does it work here at all, or is the fault in the sandbox built here?
    bare = ["bwrap", "--ro-bind", "/", "/", "--unshare-pid", "--unshare-net", "--unshare-ipc"]
    bare += [] if os.geteuid() == 0 else ["--unshare-user"]
    done = subprocess.run(bare + ["--", "true"], capture_output=True, timeout=20)
    if done.returncode != 0:
        return (f"bwrap cannot create namespaces here ({_last_line(done.stderr) or why}); run as root, or allow "
                "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 also "
                "kernel.apparmor_restrict_unprivileged_userns=0), or use a container allowed to create them")
    return (f"bwrap works, but a trivial program failed in the sandbox randattn builds for this Python "
            f"({sys.executable}, prefix {sys.prefix}): {why}. This is a fault of probes/sandbox.py's set-up for this "
            "installation, not of bwrap; please report it with this message")


def unavailable() -> Optional[str]:
    """None when the sandbox works here; else a message naming the cause and its fix."""
    why = _probe()
    return None if why is None else f"grading code needs the bubblewrap sandbox, and it cannot run here: {why}"


def require() -> None:
    """Raise :class:`SandboxUnavailable` when the sandbox does not work here."""
    why = unavailable()
    if why:
        raise SandboxUnavailable(why)


# -- running ---------------------------------------------------------------------------------------------------
def _data_file(data: bytes):
    f = tempfile.TemporaryFile()
    f.write(data)
    f.flush()
    f.seek(0)
    return f


# The unsafe mode's supervisor: sets the limits, runs the program (argv[2:]) as its child, and, the subreaper of
# everything the program starts (orphans come to it, not to init), kills what is left when the program ends.
_SUPERVISOR = r"""
import ctypes, json, os, resource, signal, sys
for name, value in json.loads(sys.argv[1]).items():
    resource.setrlimit(getattr(resource, name), tuple(value))
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
program = os.fork()
if program == 0:
    try:
        os.execv(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
while True:
    pid, status = os.wait()
    if pid == program:
        break
def children():
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid()):
                yield int(entry)
        except (OSError, IndexError):
            pass
while True:  # each killed one's children come here in turn
    for pid in children():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.wait()
    except ChildProcessError:
        break
sys.exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""


def _rlimits(limits: Limits) -> dict:
    mb = 2**20
    return {"RLIMIT_AS": (limits.memory_mb * mb,) * 2, "RLIMIT_CPU": (limits.cpu_seconds, limits.cpu_seconds + 1),
            "RLIMIT_FSIZE": (limits.file_mb * mb,) * 2, "RLIMIT_CORE": (0, 0),
            "RLIMIT_STACK": (_stack_bytes(limits),) * 2}


def _oom_kills() -> int:
    try:
        with open("/proc/vmstat") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), 0)
    except OSError:
        return 0


def run_python(files: Mapping[str, str], main: str, args: Sequence[str], stdin: bytes, limits: Limits = Limits(),
               *, file_args: Sequence[str] = (), unsafe: bool = False, _checked: bool = False) -> Outcome:
    """``python -I -B <files dir>/<main> <files dir>/<each of file_args> *args`` with ``stdin`` on standard input,
    in the sandbox (or, with ``unsafe``, as a plain limited subprocess); the working folder is an empty private
    one. ``file_args`` are names of ``files``, passed as their paths where the program sees them."""
    missing = [name for name in (main, *file_args) if name not in files]
    if missing:
        raise ValueError(f"not among the files: {missing}")
    if not unsafe and not _checked:
        require()
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="randattn-code-"))
        stdin_file = stack.enter_context(_data_file(stdin))
        if unsafe:
            src, work = Path(tmp) / "src", Path(tmp) / "work"
            src.mkdir()
            work.mkdir()
            for name, text in files.items():
                (src / name).write_text(text, encoding="utf-8")
            argv = [sys.executable, "-I", "-B", "-c", _SUPERVISOR, json.dumps(_rlimits(limits)),
                    sys.executable, "-I", "-B", *(str(src / name) for name in (main, *file_args)), *args]
            popen = dict(cwd=work, env={**ENV, "HOME": str(work)})
        else:
            opened = [stack.enter_context(_data_file(text.encode())) for text in files.values()]
            seccomp = seccomp_filter()
            seccomp_file = stack.enter_context(_data_file(seccomp)) if seccomp else None
            uid = stack.enter_context(_own_uid()) if os.geteuid() == 0 else None
            fds = {name: f.fileno() for name, f in zip(files, opened)}
            status_dir = Path(tmp) / "status"
            status_dir.mkdir(mode=0o700)
            argv = _bwrap_argv(limits, fds, seccomp_file.fileno() if seccomp_file else None, uid, str(status_dir))
            argv += [sys.executable, "-I", "-B", *(f"{SANDBOX_DIR}/{name}" for name in (main, *file_args)), *args]
            popen = dict(cwd=tmp, env=dict(ENV), pass_fds=[f.fileno() for f in opened + [seccomp_file] if f])
        ooms = _oom_kills()
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, **popen)
        try:
            out, err, stopped = _collect(proc, limits, t0 + limits.seconds)
        finally:
            usage = _kill_tree(proc, unsafe)
        seconds = time.monotonic() - t0
        cpu = usage.ru_utime + usage.ru_stime if unsafe else _shell_times(Path(tmp) / "status" / "times")
    status = None if stopped else (128 - proc.returncode if proc.returncode < 0 else proc.returncode)
    return Outcome(status, bytes(out), bytes(err), seconds, stopped, cpu_seconds=cpu, oom_kills=_oom_kills() - ooms)


def _shell_times(path: Path) -> float:
    """The CPU seconds of the shell's children in its `times` report (POSIX: its second line); 0 without one."""
    try:
        values = re.findall(r"(\d+)m([\d.]+)s", path.read_text())
    except OSError:
        return 0.0
    return sum(int(m) * 60 + float(sec) for m, sec in values[2:4])


def _exited(pid: int) -> bool:
    """Whether the child ``pid`` has ended, leaving it unreaped (its pid and process group stay taken)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _collect(proc: subprocess.Popen, limits: Limits, deadline: float):
    """Standard output (up to the limit) and the tail of standard error, until both close or the deadline."""
    cap = limits.output_mb * 2**20
    out, err, err_bytes, stopped = bytearray(), bytearray(), 0, None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        sel.register(proc.stderr, selectors.EVENT_READ, "err")
        while sel.get_map() and stopped is None:
            left = deadline - time.monotonic()
            if left <= 0:
                stopped = "timeout"
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data == "out":
                    out += chunk
                    stopped = "output" if len(out) > cap else None
                else:
                    err_bytes += len(chunk)
                    err = (err + chunk)[-STDERR_TAIL:]
                    stopped = "output" if err_bytes > cap else None
                if stopped:
                    break
    # both pipes closed: the exit is due now, but a program can close them and keep running
    while stopped is None and not _exited(proc.pid):
        if time.monotonic() >= deadline:
            stopped = "timeout"
        time.sleep(0.002)
    del out[cap:]
    return out, err, stopped


def _processes() -> dict[int, int]:
    """Every live process's parent (zombies left out: they are dead already)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    return parents


def _descendants(pid: int) -> list[int]:
    parents, found, todo = _processes(), [], [pid]
    while todo:
        pid = todo.pop()
        kids = [p for p, parent in parents.items() if parent == pid]
        found += kids
        todo += kids
    return found


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill_tree(proc: subprocess.Popen, unsafe: bool):
    """Everything the run started is gone when this returns; its resource usage (``os.wait4``'s: the unsafe
    supervisor's, which reaps the program; bwrap's never includes the namespace's)."""
    if not _exited(proc.pid):
        if unsafe:
            # the supervisor is the subreaper of all the program started: they stay its descendants until killed
            for _ in range(1000):
                left = _descendants(proc.pid)
                if not left:
                    break
                _kill(left)
            _kill([proc.pid])
        else:
            # bwrap's child is the PID namespace's first process: killing it kills every process in the namespace,
            # and bwrap exits only once they are all gone
            _kill(p for p, parent in _processes().items() if parent == proc.pid)
        t_end = time.monotonic() + 5
        while not _exited(proc.pid) and time.monotonic() < t_end:
            time.sleep(0.002)
    if unsafe:  # what is left of its session (one that killed its supervisor), while the pgid is still taken
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    _kill([proc.pid])  # bwrap or the supervisor itself stuck: bwrap's --die-with-parent takes the namespace along
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
    proc.stderr.close()
    return usage
