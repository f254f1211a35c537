"""Run a Python program inside an operating-system sandbox (bubblewrap), for the code grader.

Nothing here relies on the program's own interpreter: every protection is the kernel's.

- **Namespaces** (``bwrap``): a mount namespace whose root is an empty tmpfs holding, read-only, only the system
  folders (``/usr`` and its ``/bin``, ``/lib`` links), the Python installation and the program's files under
  ``/sandbox``; the only writable place is a private, empty ``/tmp`` of ``file_mb`` MiB (the working folder). The
  harness's files, the data sets, ``/home``, ``/root`` and the host's ``/tmp`` are not there at all. A network
  namespace with nothing but its own loopback (abstract Unix sockets included), and PID, IPC and UTS namespaces.
- **An unprivileged user**: as root, the program runs as a uid of its own (``setpriv``, no capabilities, no new
  privileges), so the per-user process limit applies to it; otherwise bwrap's user namespace maps it to the caller.
- **A seccomp filter** (x86-64 and arm64) refusing ``unshare``, ``clone`` with a new user namespace and ``clone3``,
  so the program cannot make itself a namespace root that could mount a tmpfs without a size limit.
- **Hard limits** (``prlimit``, set before the program starts; an unprivileged process cannot raise them): address
  space, CPU seconds, file size, no core files, and processes (threads included) of the sandbox's user.
- **The harness side**: the wall clock is kept here, and at the limit the namespace's first process is killed,
  which kills every process in it (a detached grandchild holding standard output open included); standard output
  is read up to ``output_mb`` MiB and the run stopped past it; only the last 64 KiB of standard error are kept;
  the program gets no environment but ``PATH``, ``LANG``, ``HOME=/tmp`` and ``PYTHONHASHSEED``.

Where ``bwrap`` (or ``setpriv``/``prlimit``) is missing or does not work, :func:`unavailable` says why, with the
install command, and :func:`run_python` refuses unless ``unsafe=True``: then the program is a plain subprocess
with the same limits (but processes), a fresh session killed at the wall clock and an empty working folder, and
it can read, write and reach the network as the user running the harness.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

__all__ = ["Limits", "Outcome", "SandboxUnavailable", "INSTALL", "unavailable", "require", "run_python"]

INSTALL = "apt-get install bubblewrap"
SANDBOX_DIR = "/sandbox"  # the program's files, read-only
WORK_DIR = "/tmp"  # the working folder, the only writable place
STDERR_TAIL = 1 << 16
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": WORK_DIR, "PYTHONHASHSEED": "0"}
# as root the program runs as a uid nobody else uses, one per harness process, so that the process limit (counted
# per uid) is this run's alone
UID_BASE = 0x7A000000


@dataclass(frozen=True)
class Limits:
    seconds: float = 6.0  # wall clock
    memory_mb: int = 1024  # address space, per process
    file_mb: int = 16  # each file, and the working folder in all
    processes: int = 16  # processes and threads of the program, all together
    output_mb: int = 16  # bytes of standard output (and of standard error) before the run is stopped

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


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here; the message says why and how to install it."""


# -- the seccomp filter ---------------------------------------------------------------------------------
_ARCH = {  # machine: (AUDIT_ARCH_*, unshare, clone, clone3)
    "x86_64": (0xC000003E, 272, 56, 435),
    "aarch64": (0xC00000B7, 97, 220, 435),
}
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
_ALLOW, _EPERM, _ENOSYS, _KILL = 0x7FFF0000, 0x00050001, 0x00050026, 0x80000000
CLONE_NEWUSER = 0x10000000


def seccomp_filter(machine: Optional[str] = None) -> Optional[bytes]:
    """The BPF program bwrap installs before the program starts, or None on an architecture not listed above."""
    if (machine or platform.machine()) not in _ARCH:
        return None
    arch, unshare, clone, clone3 = _ARCH[machine or platform.machine()]
    # (code, jump if true, jump if false, k); jumps count the instructions skipped
    prog = [
        (_LD, 0, 0, 4),  # the calling convention: any other (x86's 32-bit one) is killed, it has other numbers
        (_JEQ, 1, 0, arch),
        (_RET, 0, 0, _KILL),
        (_LD, 0, 0, 0),  # the syscall number
        (_JGE, 7, 0, 0x40000000),  # the x32 numbering: refused
        (_JEQ, 6, 0, unshare),
        (_JEQ, 3, 0, clone3),  # ENOSYS: the C library falls back to clone, whose flags are visible
        (_JEQ, 0, 3, clone),
        (_LD, 0, 0, 16),  # clone's flags (the low half of the first argument)
        (_JSET, 2, 1, CLONE_NEWUSER),
        (_RET, 0, 0, _ENOSYS),
        (_RET, 0, 0, _ALLOW),
        (_RET, 0, 0, _EPERM),
    ]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


# -- the sandbox command --------------------------------------------------------------------------------
def _python_dirs() -> list[str]:
    """The folders the interpreter needs besides /usr: its prefix (a venv's too) and its executable's folder."""
    dirs = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix)}
    dirs.add(os.path.dirname(os.path.realpath(sys.executable)))
    dirs = sorted(d for d in dirs if d != "/" and not d.startswith("/usr/") and d != "/usr")
    return [d for d in dirs if not any(d.startswith(o + "/") for o in dirs if o != d)]


def _bwrap_argv(limits: Limits, files: Mapping[str, int], seccomp_fd: Optional[int], root: bool) -> list[str]:
    argv = ["bwrap", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for name in ("/etc/ld.so.cache", "/etc/localtime"):
        if os.path.exists(name):
            argv += ["--ro-bind", name, name]
    made = set()
    for d in _python_dirs():
        for parent in list(reversed(Path(d).parents))[1:]:  # folders on the way, traversable by the program's uid
            if str(parent) not in made:
                made.add(str(parent))
                argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", d, d]
    argv += ["--perms", "0755", "--dir", SANDBOX_DIR]
    for name, fd in files.items():
        argv += ["--perms", "0444", "--ro-bind-data", str(fd), f"{SANDBOX_DIR}/{name}"]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "01777", "--size", str(limits.file_mb * 2**20), "--tmpfs", WORK_DIR,
             "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
             "--die-with-parent", "--new-session", "--clearenv", "--chdir", WORK_DIR]
    for k, v in ENV.items():
        argv += ["--setenv", k, v]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    if root:  # drop to a uid of its own: the process limit is per uid and does not apply to root
        uid = str(UID_BASE + os.getpid() % 2**20)
        argv += ["--cap-add", "CAP_SETUID,CAP_SETGID,CAP_SETPCAP", "--",
                 "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                 "--inh-caps=-all", "--bounding-set=-all"]
    else:
        argv += ["--unshare-user", "--"]
    mb = 2**20
    argv += ["prlimit", f"--as={limits.memory_mb * mb}", f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
             f"--fsize={limits.file_mb * mb}", "--core=0", f"--nproc={limits.processes}", "--"]
    return argv


# -- availability -------------------------------------------------------------------------------------------
def _missing_tool() -> Optional[str]:
    for tool in ("bwrap", "prlimit") + (("setpriv",) if os.geteuid() == 0 else ()):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH"
    return None


@functools.lru_cache(maxsize=1)
def _probe() -> Optional[str]:
    """None when a trivial program runs in the sandbox here, else why not (checked once per process)."""
    missing = _missing_tool()
    if missing:
        return missing
    try:
        o = run_python({"probe.py": "print(6 * 7)\n"}, "probe.py", [], b"", Limits(seconds=20), _checked=True)
    except OSError as exc:
        return f"bwrap could not start ({exc})"
    if o.stdout != b"42\n" or o.status != 0:
        why = o.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"a trivial program failed in it ({why[-1] if why else f'exit status {o.status}'})"
    return None


def unavailable() -> Optional[str]:
    """None when the sandbox works here; else a message saying why and how to install it."""
    why = _probe()
    if why is None:
        return None
    return (f"grading code needs the bubblewrap sandbox, and it does not work here: {why}; install it "
            f"({INSTALL}; as root, or in a container allowed to create namespaces), or run the programs without "
            "isolation (--unsafe-code-grading; unsafe=True in Python)")


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


def _unsafe_limits(limits: Limits):
    def apply():
        import resource

        mb = 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb,) * 2)
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_python(files: Mapping[str, str], main: str, args: Sequence[str], stdin: bytes, limits: Limits = Limits(),
               *, unsafe: bool = False, _checked: bool = False) -> Outcome:
    """``python -I -B <files dir>/<main> *args`` with ``stdin`` on standard input, in the sandbox (or, with
    ``unsafe``, as a plain limited subprocess); the working folder is an empty private one."""
    if not unsafe and not _checked:
        require()
    opened = [_data_file(text.encode()) for text in files.values()]
    stdin_file = _data_file(stdin)
    try:
        with tempfile.TemporaryDirectory(prefix="randattn-code-") as tmp:
            if unsafe:
                src, work = Path(tmp) / "src", Path(tmp) / "work"
                src.mkdir()
                work.mkdir()
                for name, text in files.items():
                    (src / name).write_text(text)
                argv = [sys.executable, "-I", "-B", str(src / main), *args]
                popen = dict(cwd=work, env={**ENV, "HOME": str(work)}, preexec_fn=_unsafe_limits(limits))
            else:
                seccomp = seccomp_filter()
                if seccomp is not None:
                    opened.append(_data_file(seccomp))
                fds = {name: f.fileno() for name, f in zip(files, opened)}
                argv = _bwrap_argv(limits, fds, opened[-1].fileno() if seccomp else None, os.geteuid() == 0)
                argv += [sys.executable, "-I", "-B", f"{SANDBOX_DIR}/{main}", *args]
                popen = dict(cwd=tmp, env=dict(ENV), pass_fds=[f.fileno() for f in opened])
            t0 = time.monotonic()
            proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, **popen)
            try:
                out, err, stopped = _collect(proc, limits, t0 + limits.seconds)
            finally:
                _kill_tree(proc, unsafe)
            seconds = time.monotonic() - t0
    finally:
        for f in opened + [stdin_file]:
            f.close()
    status = None if stopped else (128 - proc.returncode if proc.returncode < 0 else proc.returncode)
    return Outcome(status, bytes(out), bytes(err), seconds, stopped)


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
    if stopped is None:  # both pipes closed: the exit is due now, but a program can close them and keep running
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stopped = "timeout"
    return out[:cap], err, stopped


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _kill_tree(proc: subprocess.Popen, unsafe: bool) -> None:
    """Everything the run started is gone when this returns."""
    if proc.poll() is None:
        if unsafe:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the session; a child that made a session of its own escapes
            except ProcessLookupError:
                pass
        else:
            # bwrap's child is the PID namespace's first process: killing it kills every process in the namespace,
            # and bwrap reaps it only once they are all gone
            for pid in _children(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()  # bwrap itself stuck: --die-with-parent takes the namespace with it
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
