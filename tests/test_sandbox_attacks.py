"""Issue 29's attack table: candidate programs that try to get out of the code grader's sandbox, to outlive or
outgrow grading, or to game the verdict. Each attempt runs to its end inside (the operating system refuses it, not
the program's own interpreter) and the host is checked from outside: its files, its processes, its listeners, the
harness's memory and the wall clock (the limit holds within a second)."""

import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from probes import sandbox
from probes.code_grader import run_test

STDIN = {"input": "3 4\n", "output": "7\n", "testtype": "stdin"}
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def sandboxed():
    if sandbox.shutil.which("bwrap") is None:
        pytest.skip(f"bubblewrap is not installed ({sandbox.INSTALL})")
    assert sandbox.unavailable() is None, sandbox.unavailable()


def processes_with(token: str) -> list[int]:
    """Host processes whose command line holds ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            pass
    return found


def programs_left() -> list[int]:
    """Host processes of this process's sandboxed programs: as root, by the uids its runs get (other test workers'
    runs have uids of their own); otherwise by the program's path."""
    if os.geteuid() != 0:
        return processes_with("/sandbox/solution.py")
    first = sandbox.UID_BASE + os.getpid() * sandbox.UID_SLOTS
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = int(Path(f"/proc/{entry}/status").read_text().split("\nUid:")[1].split()[0])
        except (OSError, IndexError):
            continue
        if first <= uid < first + sandbox.UID_SLOTS:
            found.append(int(entry))
    return found


def run_inside(program: str, timeout: float = 5, stdin: bytes = b"", **limits) -> sandbox.Outcome:
    return sandbox.run_python({"solution.py": program}, "solution.py", [], stdin,
                              sandbox.Limits(seconds=timeout, **limits))


def test_writing_and_deleting_outside_through_directory_descriptors_reaches_nothing(tmp_path):
    (tmp_path / "victim.txt").write_text("mine")
    stdlib = Path(os.__file__).parent
    program = f"""
import os
for folder in ("/", {str(tmp_path)!r}, {str(stdlib)!r}, "/usr/bin", "/sandbox"):
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        continue
    for attempt in (lambda: os.unlink("victim.txt", dir_fd=fd),
                    lambda: os.close(os.open("planted.txt", os.O_CREAT | os.O_WRONLY, dir_fd=fd)),
                    lambda: os.mkdir("made", dir_fd=fd), lambda: os.rename("solution.py", "x.py", src_dir_fd=fd)):
        try:
            attempt()
            print("escaped", folder)
        except OSError:
            pass
print(7)
"""
    r = run_test(program, STDIN)
    assert r.verdict == "pass", r  # every attempt failed, and the program went on to the end
    assert sorted(os.listdir(tmp_path)) == ["victim.txt"] and (tmp_path / "victim.txt").read_text() == "mine"
    for folder in (Path("/"), stdlib, Path("/usr/bin")):
        assert not (folder / "planted.txt").exists() and not (folder / "made").exists()


def test_a_child_started_with_fork_and_exec_does_not_outlive_grading():
    token = f"{os.getpid() % 1000 + 100}.{time.time_ns() % 10**6:06d}"
    program = f"""
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "{token}"])  # a new session, holding standard output open
    os._exit(0)
pid = os.posix_spawn("/bin/sleep", ["sleep", "{token}"], {{}})
print(7)
"""
    r = run_test(program, STDIN, timeout=4)
    assert r.verdict == "pass" and r.seconds < 2, r  # the answer came at once: nobody waited for the sleepers
    assert processes_with(token) == [], "a child outlived grading"


def test_the_wall_clock_kills_the_tree_within_a_second_even_with_stdout_held_open():
    token = f"{os.getpid() % 1000 + 100}.{time.time_ns() % 10**6:06d}"
    program = f"""
import os, subprocess
subprocess.Popen(["sleep", "{token}"], start_new_session=True)
while True:
    pass
"""
    t0 = time.monotonic()
    r = run_test(program, STDIN, timeout=2)
    assert r.verdict == "timeout" and time.monotonic() - t0 < 3, r
    assert processes_with(token) == []


def test_the_network_is_unreachable_loopback_and_abstract_sockets_of_the_host_included():
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    unix = socket.socket(socket.AF_UNIX)
    name = f"\0randattn-attack-{os.getpid()}"
    unix.bind(name)
    unix.listen()
    program = f"""
import socket
escaped = []
for family, address in ((socket.AF_INET, ("127.0.0.1", {tcp.getsockname()[1]})), (socket.AF_INET, ("1.1.1.1", 80)),
                        (socket.AF_INET, ("10.0.0.1", 80)), (socket.AF_UNIX, {name!r})):
    s = socket.socket(family)
    s.settimeout(1)
    try:
        s.connect(address)
        escaped.append(address)
    except OSError:
        pass
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("8.8.8.8", 53))
    escaped.append("udp")
except OSError:
    pass
try:
    socket.getaddrinfo("example.com", 80)
    escaped.append("dns")
except OSError:
    pass
print(escaped or 7)
"""
    try:
        r = run_test(program, STDIN, timeout=8)
        assert r.verdict == "pass", r
        for listener in (tcp, unix):
            listener.setblocking(False)
            with pytest.raises(BlockingIOError):
                listener.accept()
    finally:
        tcp.close()
        unix.close()


def test_the_limits_cannot_be_switched_off_from_inside():
    program = """
import ctypes, os, resource, subprocess
escaped = []
for limit in (resource.RLIMIT_NPROC, resource.RLIMIT_AS, resource.RLIMIT_FSIZE, resource.RLIMIT_CPU):
    try:
        resource.setrlimit(limit, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        escaped.append(limit)
    except (ValueError, OSError):
        pass
for attempt in (lambda: os.setuid(0), lambda: os.setgid(0), lambda: os.chroot("/tmp")):
    try:
        attempt()
        escaped.append("privileged")
    except OSError:
        pass
# a user namespace of its own would make it root there, free to mount a tmpfs without a size limit
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000) == 0:  # CLONE_NEWUSER
    escaped.append("unshare")
if subprocess.run(["unshare", "-U", "-r", "true"], capture_output=True).returncode == 0:
    escaped.append("unshare -U")
if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0:
    escaped.append("unshare -m")
print(escaped or 7)
"""
    r = run_test(program, STDIN, timeout=8)
    assert r.verdict == "pass", r


def test_a_fork_bomb_meets_the_process_limit_and_the_harness_finishes_on_time():
    # first, safely: how many processes can it start? (each sleeps, so nothing multiplies)
    counter = """
import os, time
n = 0
for _ in range(200):
    try:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
    except OSError:
        break
    n += 1
print(n)
"""
    o = run_inside(counter, processes=8)
    assert o.status == 0 and 0 < int(o.stdout) < 8, o
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t0 = time.monotonic()
    r = run_test(bomb, STDIN, timeout=2, processes=8)
    assert r.verdict == "timeout" and time.monotonic() - t0 < 3, r
    assert programs_left() == []
    assert run_test("print(7)\n", STDIN).verdict == "pass"  # and the next program runs as usual


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_gigabyte_of_output_stops_at_the_limit_and_the_harness_does_not_grow(stream):
    program = f"import sys\nchunk = '7' * 2**20\nfor _ in range(1024):\n    sys.{stream}.write(chunk)\n"
    # the peak resident memory of a fresh harness process (VmHWM: of this process alone, unlike ru_maxrss)
    script = ("import json, re\nfrom probes.code_grader import run_test\n"
              f"r = run_test({program!r}, {STDIN!r}, timeout=20)\n"
              "peak = int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
              "print(json.dumps([r.verdict, r.detail, peak]))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    verdict, detail, peak_kib = json.loads(done.stdout.strip().splitlines()[-1])
    assert verdict == "error" and "output limit: more than 16 MiB" in detail, detail
    assert peak_kib < 100 * 1024, f"the harness grew to {peak_kib / 1024:.0f} MiB"


def test_memory_file_size_and_the_working_folder_are_limited():
    big = run_test("x = bytearray(600 * 2**20)\nprint(7)\n", STDIN, memory_mb=256)
    assert big.verdict == "error" and "MemoryError" in big.detail, big
    one_file = run_test("open('f', 'wb').write(bytes(20 * 2**20))\nprint(7)\n", STDIN)
    assert one_file.verdict == "error" and "File too large" in one_file.detail, one_file
    many = run_test("for i in range(40):\n    open(f'f{i}', 'wb').write(bytes(2**20))\nprint(7)\n", STDIN)
    assert many.verdict == "error" and "No space left" in many.detail, many  # the folder holds 16 MiB in all


def test_the_expected_output_never_enters_the_sandbox(monkeypatch):
    secret = str(10**11 + time.time_ns() % (9 * 10**11))  # 12 digits, no leading zero (the functional output is JSON)
    seen = []
    real = sandbox.run_python

    def recording(files, main, args, stdin, limits, **kw):
        seen.append(json.dumps([dict(files), main, list(args), stdin.decode()]))
        return real(files, main, args, stdin, limits, **kw)

    monkeypatch.setattr("probes.code_grader.run_python", recording)
    # the attack of issue 29: read the expected outputs from a test file in its folder, or anywhere it can see
    thief = r"""
import glob, json, os, re, sys
found = []
names = []
for top, dirs, files in os.walk("/"):  # every file it can see, but the system's and Python's own
    dirs[:] = [d for d in dirs if not os.path.join(top, d).startswith(("/proc", "/sys", "/dev", "/usr", sys.prefix))]
    names += [os.path.join(top, f) for f in files]
for path in names + glob.glob("/proc/*/cmdline") + glob.glob("/proc/*/environ"):
    try:
        text = open(path, errors="replace").read(1 << 20)
    except OSError:
        continue
    found += re.findall(r'"output"\s*:\s*"?([0-9]+)', text)
found += re.findall(r"[0-9]{12}", json.dumps(dict(os.environ)) + " ".join(sys.argv) + sys.stdin.read())
print(found[-1] if found else "nothing")
"""
    stdin_test = {"input": "3 4\n", "output": secret, "testtype": "stdin"}
    r = run_test(thief, stdin_test, timeout=10)
    assert r.verdict == "wrong_answer", r
    functional = {"input": "[1, 2]", "output": secret, "testtype": "functional"}
    f = run_test("class Solution:\n    def f(self, xs):\n" + "".join("        " + line + "\n" for line in
                 thief.strip().splitlines()).replace("print(found[-1] if found else \"nothing\")",
                                                      "return found[-1] if found else 0"),
                 functional, fn_name="f", timeout=10)
    assert f.verdict == "wrong_answer", f
    assert len(seen) == 2 and not any(secret in s for s in seen)


@pytest.mark.parametrize("name,program", [
    ("an object equal to everything", "class Solution:\n    def f(self, xs):\n        class Any(int):\n"
                                      "            def __eq__(self, other):\n                return True\n"
                                      "        return Any(0)\n"),
    ("json.dumps patched to print the expected", "import json\njson.dumps = lambda *a, **k: '99'\n"
                                                 "class Solution:\n    def f(self, xs):\n        return 0\n"),
    ("a forged result marker, then exit", "import os\nprint('<<<result>>>98')\nos._exit(0)\n"),
    ("exits before the runner", "import sys\nsys.exit(0)\n"),
    # these raised out of run_test before (RecursionError, ValueError): the harness, not the program, failed
    ("a forged result nested too deep", "import os, sys\nsys.stdout.write('<<<result>>>' + '[' * 10**5 + ']' * 10**5)\n"
                                        "sys.stdout.flush()\nos._exit(0)\n"),
    ("a forged int past the digit limit", "import os, sys\nsys.stdout.write('<<<result>>>' + '1' * 5000)\n"
                                          "sys.stdout.flush()\nos._exit(0)\n"),
])
def test_the_functional_verdict_is_not_gamed(name, program):
    r = run_test(program, {"input": "[1, 2]", "output": "3", "testtype": "functional"}, fn_name="f")
    assert r.verdict in ("wrong_answer", "error"), (name, r)


def test_the_program_gets_a_minimal_environment(monkeypatch):
    monkeypatch.setenv("RANDATTN_ATTACK_SECRET", "hunter2")
    o = run_inside("import os, json\nprint(json.dumps(dict(os.environ)))\n")
    env = json.loads(o.stdout)
    assert sorted(env) == sorted(sandbox.ENV) and "hunter2" not in o.stdout.decode(), env


def test_killing_the_parent_or_everything_it_can_leaves_the_harness_running():
    program = "import os, signal\nfor pid in (os.getppid(), 1, -1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n" \
              "    except OSError:\n        pass\nprint(7)\n"
    r = run_test(program, STDIN)
    assert r.verdict in ("pass", "error"), r  # kill(-1) may take the program itself; the harness goes on
    assert run_test("print(7)\n", STDIN).verdict == "pass"


# -- issue 38 ---------------------------------------------------------------------------------------------------
MEMORY_OUTSIDE_THE_CAP = r"""
import ctypes, json, os
MiB, GOAL = 2**20, {goal}
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype, libc.shmat.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
chunk = b"x" * MiB
reached, errors, fds = {{"memfd": 0, "sysv_shm": 0, "sysv_msg": 0}}, {{}}, []
try:  # memfd files written, never mapped: the file-size limit caps each one, not how many
    while reached["memfd"] < GOAL:
        fds.append(os.memfd_create("m"))
        for _ in range(8):
            os.write(fds[-1], chunk)
            reached["memfd"] += 1
except OSError as e:
    errors["memfd"] = e.strerror
while reached["sysv_shm"] < GOAL:  # segments touched through a mapping, then unmapped: out of the address space
    sid = libc.shmget(0, 16 * MiB, 0o1600)  # IPC_PRIVATE, IPC_CREAT
    addr = libc.shmat(sid, None, 0) if sid >= 0 else None
    if addr in (None, 2**64 - 1):
        errors["sysv_shm"] = os.strerror(ctypes.get_errno())
        break
    ctypes.memset(addr, 1, 16 * MiB)
    libc.shmdt(ctypes.c_void_p(addr))
    reached["sysv_shm"] += 16
msg = ctypes.create_string_buffer(8 + 8192)
ctypes.memmove(msg, ctypes.byref(ctypes.c_long(1)), 8)
sent = 0
while sent < GOAL * MiB:  # message queues filled up (16 KiB each by default)
    qid = libc.msgget(0, 0o1600)
    if qid < 0:
        errors["sysv_msg"] = os.strerror(ctypes.get_errno())
        break
    while sent < GOAL * MiB and libc.msgsnd(qid, msg, 8192, 0o4000) == 0:  # IPC_NOWAIT
        sent += 8192
reached["sysv_msg"] = sent // MiB
print(json.dumps([reached, errors]))
"""


def test_memory_the_address_space_limit_does_not_count_is_refused():
    """memfd files and SysV shared memory and message queues hold memory outside RLIMIT_AS (before: 1536 MiB of each
    of memfd and shm and 500 MiB of queues under a 1 GiB cap, in 18 s). The seccomp filter refuses them (EPERM)."""
    cap = 256
    o = run_inside(MEMORY_OUTSIDE_THE_CAP.format(goal=2 * cap), timeout=20, memory_mb=cap)
    assert o.status == 0, o
    reached, errors = json.loads(o.stdout)
    print(f"reached under a {cap} MiB cap (MiB): {reached}; {errors}")
    assert reached == {"memfd": 0, "sysv_shm": 0, "sysv_msg": 0}, (reached, errors)
    assert set(errors.values()) == {"Operation not permitted"}, errors


def test_the_kernel_keyring_is_not_shared_between_runs():
    """A key one program stored in its uid's keyring was readable by the next run, after the verdict. add_key,
    request_key and keyctl are refused (EPERM)."""
    numbers = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl (the kernel's unistd tables)
    if platform.machine() not in numbers:
        pytest.skip(f"no syscall numbers for {platform.machine()}")
    add_key, keyctl = numbers[platform.machine()]
    name = f"randattn-attack-{os.getpid()}-{time.time_ns()}"
    head = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
            "KEY_SPEC_USER_KEYRING = -4\n")
    store = head + (f"k = libc.syscall({add_key}, b'user', {name.encode()!r}, b'hunter2', 7, KEY_SPEC_USER_KEYRING)\n"
                    "print(k, ctypes.get_errno())\n")
    find = head + (f"k = libc.syscall({keyctl}, 10, KEY_SPEC_USER_KEYRING, b'user', {name.encode()!r}, 0)  # SEARCH\n"
                   "print(k, ctypes.get_errno())\n")
    stored, found = run_inside(store), run_inside(find)
    assert stored.stdout.split() == [b"-1", b"1"], stored  # EPERM
    assert found.stdout.split() == [b"-1", b"1"], found


def test_two_gradings_at_once_each_have_their_own_process_limit():
    """Threads grading at once shared one uid, so a fork bomb in one took the other's process limit (an innocent
    program got `error`). Each run now has a uid of its own."""
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    innocent = "import subprocess\nsubprocess.run(['true'], check=True)\nprint(7)\n"
    results = {}
    thread = threading.Thread(target=lambda: results.update(bomb=run_test(bomb, STDIN, timeout=4)))
    thread.start()
    time.sleep(1)  # the bomb is at its limit by now
    results["innocent"] = run_test(innocent, STDIN)
    thread.join()
    assert results["innocent"].verdict == "pass", results
    assert results["bomb"].verdict == "timeout", results
    assert programs_left() == []
    if os.geteuid() == 0:
        with ThreadPoolExecutor(3) as pool:
            uids = list(pool.map(lambda _: run_inside("import os, time\ntime.sleep(1)\nprint(os.getuid())\n").stdout,
                                 range(3)))
        assert len(set(uids)) == 3 and os.getuid() not in map(int, uids), uids


def test_a_python_installation_under_tmp_runs_in_the_sandbox(tmp_path):
    """A venv under /tmp was hidden by the private /tmp mounted over it, and the sandbox refused, saying bubblewrap
    did not work. The Python installation is now bound after the private /tmp."""
    venv = tmp_path / "venv"
    assert str(venv).startswith("/tmp/"), venv
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    script = ("import json, sys\nfrom probes import sandbox\nfrom probes.code_grader import run_test\n"
              f"stdin = run_test(\"open('f', 'w').write('7')\\nprint(open('f').read())\\n\", {STDIN!r})\n"
              "functional = run_test('class Solution:\\n    def f(self, x):\\n        return x + 1\\n', "
              "{'input': '6', 'output': '7', 'testtype': 'functional'}, fn_name='f')\n"
              "print(json.dumps([sys.prefix, sandbox.unavailable(), stdin.verdict, functional.verdict]))")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    prefix, why, stdin, functional = json.loads(done.stdout.strip().splitlines()[-1])
    assert prefix == str(venv) and why is None and (stdin, functional) == ("pass", "pass"), done.stdout


def test_millions_of_short_output_lines_do_not_blow_up_the_harness():
    """14 MiB of short lines grew the harness to 1.3 GiB (2.5 GiB compared against an equal expected output, 26 s):
    a list of token lists. The comparison now goes a block of lines at a time; the peak is measured in a fresh
    harness process, as for the gigabyte of output above."""
    lines = 7 * 2**20
    script = ("import json, re, time\nfrom probes.code_grader import run_test\n"
              f"n = {lines}\nt0 = time.monotonic()\n"
              "r = run_test(f\"import sys\\nsys.stdout.write('1\\\\n' * {n})\\n\", "
              "{'input': '', 'output': '1\\n' * n, 'testtype': 'stdin'}, timeout=30)\n"
              "peak = int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
              "print(json.dumps([r.verdict, r.detail, peak, time.monotonic() - t0]))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    verdict, detail, peak_kib, seconds = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{lines} lines: harness peak {peak_kib / 1024:.0f} MiB, {seconds:.1f} s")
    assert verdict == "pass", detail
    assert peak_kib < 160 * 1024, f"the harness grew to {peak_kib / 1024:.0f} MiB"
