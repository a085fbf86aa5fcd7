r"""The code sandbox: runs model-written Python against unit tests in a separate, limited process.

What one execution does (docs/rewards.md says what this stops and what it does not):

1. A fresh temporary directory (``rollwise-sbx-*``) is made; it is the child's working
   directory, $HOME and $TMPDIR, and the only place it may write.
2. The child starts in a new session (its own process group) with a scrubbed environment
   (PATH, LANG, HOME, TMPDIR only) and resource limits set before it executes anything:
   CPU seconds, address space, file size, open files, core dumps off; the process-count limit
   is set by the runner just before the model's code runs (the wrappers need to fork first).
3. Isolation, the strongest available, detected once per process and recorded:
   ``bwrap`` (bubblewrap: new network, PID, IPC and UTS namespaces, the whole file system
   read-only except the working directory, a private /tmp, the home directory hidden),
   else ``unshare`` (util-linux: new network and PID namespaces), else ``rlimits`` (limits
   only, which is NOT a security boundary: a one-time warning says so).
   When the parent runs as root, the runner drops to uid/gid 65534 (nobody) after importing
   the standard-library modules the tasks use, so the code cannot write root-owned files or
   read the root home directory, and the process-count limit applies (root is exempt).
4. Data goes in as JSON on stdin (never pickle): the code, the test source, the entry point.
   The runner (``python -I -S -B``: no site-packages, no user environment) executes the code,
   then, in the same namespace (tests may call the code's helpers, as in human-eval), each
   top-level statement of the test function ``check(candidate)`` in order; each
   statement that contains an ``assert`` is one test. Results come back as lines tagged with
   a random nonce on stdout; the child's own output shares the pipe and is capped.
5. The parent kills the whole process group on the wall-time limit or when the output cap is
   passed, and removes the directory. Score = tests passed / tests, counted up to the point
   where the child stopped (an infinite loop in test 3 of 5 keeps tests 1 and 2).

Infrastructure failures (the sandbox could not start: an OSError, a wrapper that failed, a
child that timed out before its runner was ready) are not the model's fault: `execute`
retries once and then raises `InfraError`, which the reward pool counts apart and masks.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from rollwise.rewards.pool import InfraError

ISOLATION_LEVELS = ("bwrap", "unshare", "rlimits")
NOBODY = 65534
# The runner imports the standard-library modules the code and tests name before it drops
# root (afterwards the interpreter's own directory may be unreadable); never these:
NO_PREIMPORT = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo",
                          "webbrowser", "pydoc", "ensurepip", "venv", "lib2to3"})
PREIMPORT = frozenset(sys.stdlib_module_names) - NO_PREIMPORT
RLIMITS_WARNING = ("rollwise sandbox: model-written code runs with resource limits only (no "
                   "bubblewrap or unshare isolation). Limits are NOT a "
                   "security boundary: the code can read files this user can read, open "
                   "network connections and leave processes behind. Install bubblewrap "
                   "(Debian/Ubuntu: apt-get install bubblewrap) for isolation.")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one execution."""

    cpu_s: int = 2  # CPU seconds per process (RLIMIT_CPU)
    wall_s: float = 4.0  # wall time of the whole execution, then the group is killed
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    file_mb: int = 8  # largest file it may write (RLIMIT_FSIZE)
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 16  # RLIMIT_NPROC (counted per uid; the runner sets it)
    output_kb: int = 256  # stdout + stderr kept; more kills the child

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"sandbox limit {name}={value!r}: expected a number > 0")


@dataclass
class ExecResult:
    """What one execution did."""

    passed: int = 0  # tests passed
    total: int = 0  # tests in the test function (0 when the runner never started)
    status: str = "ok"  # ok | failed | load_error | timeout | cpu_limit | output_limit |
    #                     crashed | infra
    reason: str = ""  # why it did not pass everything, for reward_errors
    seconds: float = 0.0
    output: str = ""  # the child's own output (capped), for debugging
    isolation: str = ""
    details: list[str] = field(default_factory=list)  # per-test "pass" / "fail: why"

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def infra(self) -> bool:
        return self.status == "infra"


# ---------------------------------------------------------------------------------------------
# Detection

_detected: dict[str, Any] = {}
_detect_lock = threading.Lock()
_warned = False


def _probe(argv: list[str]) -> bool:
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _wrapper_argv(level: str, workdir: str) -> list[str]:
    """The command line that puts the runner inside `level`'s isolation."""
    root = os.geteuid() == 0
    if level == "bwrap":
        argv = [shutil.which("bwrap") or "bwrap", "--unshare-ipc", "--unshare-pid",
                "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session", "--ro-bind", "/", "/",
                "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm"]
        if not root:
            argv[1:1] = ["--unshare-user"]
        home = os.path.expanduser("~")
        if home not in ("/", "") and os.path.isdir(home):
            argv += ["--tmpfs", home]  # hide the home directory (keys, tokens, history)
            for prefix in {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)}:
                if prefix.startswith(home.rstrip("/") + "/"):
                    argv += ["--ro-bind", prefix, prefix]  # the interpreter may live there
        argv += ["--bind", workdir, workdir, "--chdir", workdir]
        if root:  # the runner drops to nobody itself, which needs these two
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        return argv
    if level == "unshare":
        argv = [shutil.which("unshare") or "unshare"]
        if not root:
            argv += ["--user", "--map-root-user"]
        return argv + ["--net", "--pid", "--fork", "--kill-child"]
    return []


def detect_isolation(force: str | None = None) -> str:
    """The strongest isolation that works here: "bwrap", "unshare" or "rlimits".

    `force` (or the environment variable ROLLWISE_SANDBOX) picks one; forcing one that does
    not work is an error. Probed once per process (each probe runs ``true`` inside it).
    """
    force = force or os.environ.get("ROLLWISE_SANDBOX") or None
    if force is not None and force not in (*ISOLATION_LEVELS, "auto"):
        raise ValueError(f"sandbox isolation {force!r}: expected auto, "
                         f"{', '.join(ISOLATION_LEVELS)}")
    with _detect_lock:
        if "works" not in _detected:
            works = {"rlimits": True}
            tmp = tempfile.mkdtemp(prefix="rollwise-sbx-probe-")
            try:
                for level in ("bwrap", "unshare"):
                    works[level] = bool(shutil.which(level)) and _probe(
                        [*_wrapper_argv(level, tmp), "/bin/sh", "-c", "true"])
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            _detected["works"] = works
        works = _detected["works"]
    if force not in (None, "auto"):
        if not works[force]:
            raise RuntimeError(f"sandbox isolation {force!r} was asked for but does not work "
                               f"on this machine (working: "
                               f"{', '.join(k for k, v in works.items() if v)})")
        return force
    return next(level for level in ISOLATION_LEVELS if works[level])


def isolation_info(level: str | None = None) -> dict[str, Any]:
    """What the sandbox uses here, for the run header and summary.json."""
    level = level or detect_isolation()
    return {"isolation": level, "drops_root": os.geteuid() == 0,
            "available": dict(_detected.get("works", {})),
            "security_boundary": level != "rlimits"}


def warn_if_unisolated(level: str) -> None:
    """Say once per process that limits alone are not a security boundary."""
    global _warned
    if level == "rlimits" and not _warned:
        _warned = True
        warnings.warn(RLIMITS_WARNING, RuntimeWarning, stacklevel=2)
        print(f"warning: {RLIMITS_WARNING}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# The runner: the program the child runs (stdlib only, reads JSON from stdin)

RUNNER = r'''
import json, os, resource, sys
data = json.loads(sys.stdin.read())
sys.stdin.close()
_tag = data["nonce"]
_out = os.fdopen(os.dup(1), "w", buffering=1)
def _emit(*parts, _out=_out, _tag=_tag):
    _out.write(_tag + " " + " ".join(str(p).replace("\n", " ")[:200] for p in parts) + "\n")
    _out.flush()
for _name in data["preimport"]:
    try:
        __import__(_name)
    except Exception:
        pass
if data["drop_uid"] and os.geteuid() == 0:
    os.setgroups([])
    os.setgid(data["drop_uid"])
    os.setuid(data["drop_uid"])
_n = data["nproc"]
try:
    resource.setrlimit(resource.RLIMIT_NPROC, (_n, _n))
except (ValueError, OSError):
    pass
_setup, _body, _is_test = data["setup"], data["body"], data["is_test"]
_emit("ready", sum(_is_test))
_ns = {"__name__": "solution", "__builtins__": __builtins__}
try:
    exec(compile(data["code"], "solution.py", "exec"), _ns)
    if not callable(_ns.get(data["entry_point"])):
        raise NameError("no function named " + data["entry_point"])
    _candidate = _ns[data["entry_point"]]
except BaseException as _err:
    _emit("load_error", type(_err).__name__ + ": " + str(_err))
    _out.close()
    os._exit(0)
_tns = _ns  # one namespace, as human-eval runs them: tests may call the code's helpers
_tns["candidate"] = _candidate
try:
    exec(compile(_setup, "tests.py", "exec"), _tns)
except BaseException as _err:
    _emit("abort", -1, type(_err).__name__ + ": " + str(_err))
    os._exit(0)
for _i, (_stmt, _test) in enumerate(zip(_body, _is_test)):
    try:
        exec(compile(_stmt, "tests.py", "exec"), _tns)
        if _test:
            _emit("pass", _i)
    except BaseException as _err:
        if not _test:
            _emit("abort", _i, type(_err).__name__ + ": " + str(_err))
            break
        _emit("fail", _i, type(_err).__name__ + ": " + str(_err))
_emit("done")
_out.close()
os._exit(0)
'''


def split_tests(tests: str) -> tuple[str, list[str], list[bool]]:
    r"""(the test module without `check`, check's top-level statements as source, whether each
    holds an assert): parsed here so the runner need not import `ast` (~30 ms a start).

    >>> split_tests("import math\ndef check(candidate):\n    n = 2\n    assert candidate(n)\n")
    ('import math', ['n = 2', 'assert candidate(n)'], [False, True])
    """
    import ast

    try:
        tree = ast.parse(tests)
    except SyntaxError as err:
        raise ValueError(f"the tests do not parse: {err}") from None
    checks = [s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == "check"]
    setup = ast.unparse(ast.Module([s for s in tree.body if s not in checks], []))
    body = checks[0].body if checks else []
    return (setup, [ast.unparse(s) for s in body],
            [any(isinstance(n, ast.Assert) for n in ast.walk(s)) for s in body])


def _wanted_imports(code: str, tests: str) -> list[str]:
    r"""The PREIMPORT modules the code or tests name (importing all costs ~50 ms a run).

    >>> _wanted_imports("import math, os\nfrom collections import Counter", "import re")
    ['collections', 'math', 'os', 're']
    """
    import ast

    found = set()
    for source in (code, tests):
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue  # the runner reports it
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return sorted(found & PREIMPORT)


def _set_limits(limits: SandboxLimits):
    """preexec_fn: the child's rlimits (before the wrapper and the interpreter start)."""
    import resource

    def apply() -> None:
        mem = int(limits.memory_mb) * 2**20
        for which, value in ((resource.RLIMIT_CPU, int(limits.cpu_s)),
                             (resource.RLIMIT_AS, mem),
                             (resource.RLIMIT_FSIZE, int(limits.file_mb) * 2**20),
                             (resource.RLIMIT_NOFILE, int(limits.open_files)),
                             (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(which, (value, value))
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)

    return apply


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def run_tests(code: str, tests: str, entry_point: str, limits: SandboxLimits | None = None,
              isolation: str | None = None) -> ExecResult:
    """One execution of `code` against `tests` (source holding ``def check(candidate)``);
    never raises for anything the code does. See the module docstring."""
    limits = limits or SandboxLimits()
    level = isolation or detect_isolation()
    warn_if_unisolated(level)
    start = time.perf_counter()
    result = ExecResult(isolation=level)
    workdir = tempfile.mkdtemp(prefix="rollwise-sbx-")
    root = os.geteuid() == 0
    try:
        if root:
            os.chown(workdir, NOBODY, NOBODY)
        nonce = secrets.token_hex(16)
        setup, body, is_test = split_tests(tests)
        payload = json.dumps({"code": code, "setup": setup, "body": body, "is_test": is_test,
                              "entry_point": entry_point,
                              "nonce": nonce, "preimport": _wanted_imports(code, tests),
                              "drop_uid": NOBODY if root else 0,
                              "nproc": int(limits.processes)}).encode()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir,
               "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        argv = [*_wrapper_argv(level, workdir), sys.executable, "-I", "-S", "-B", "-c", RUNNER]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, cwd=workdir, env=env,
                                    start_new_session=True, close_fds=True,
                                    # only setrlimit and signal between fork and exec; the
                                    # reward workers that call this are single-threaded
                                    preexec_fn=_set_limits(limits))  # noqa: PLW1509
        except OSError as err:
            result.status, result.reason = "infra", f"cannot start the sandbox: {err}"
            return result
        _communicate(proc, payload, limits, start, nonce, result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        result.seconds = time.perf_counter() - start
    return result


def _communicate(proc: subprocess.Popen, payload: bytes, limits: SandboxLimits, start: float,
                 nonce: str, result: ExecResult) -> None:
    """Feed the payload, read tagged lines and output until exit, a limit, or the deadline."""
    cap = int(limits.output_kb) * 1024
    deadline = start + limits.wall_s
    try:
        proc.stdin.write(payload)
        proc.stdin.close()
    except OSError:
        pass  # the child died before reading; its exit says why
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf, seen, killed = b"", 0, None
    own: list[bytes] = []
    try:
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                killed = "timeout"
                break
            if not sel.select(timeout=min(left, 0.5)):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            seen += len(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                _take(line, nonce, result, own)
            if "done" in result.details or result.status == "load_error":
                break  # finished: whatever it left running is killed with the group below
            if seen > cap + 65536:  # allow the tagged lines some room beyond the cap
                killed = "output_limit"
                break
            if len(buf) > cap:
                own.append(buf[:1024])
                buf = b""
    finally:
        sel.close()
        _kill_group(proc)
    result.output = b"\n".join(own).decode("utf-8", "replace")[:cap]
    rc = proc.returncode
    if result.status == "load_error":
        return
    ready = result.total > 0 or "ready" in result.details
    if killed == "timeout":
        if not ready:
            result.status, result.reason = "infra", (
                f"the sandbox did not start within {limits.wall_s:g}s")
        else:
            result.status, result.reason = "timeout", f"wall time limit {limits.wall_s:g}s"
    elif killed == "output_limit":
        result.status, result.reason = "output_limit", f"output over {limits.output_kb} KiB"
    elif "done" in result.details:
        result.status = "ok" if result.passed == result.total else "failed"
    elif not ready:
        result.status = "infra"
        result.reason = f"sandbox exited with {rc} before its runner started: " \
                        f"{result.output[-300:]!r}"
    elif "abort" in result.details:
        result.status = "failed"
    elif rc != 0 and time.perf_counter() - start >= 0.9 * limits.cpu_s:
        # killed by RLIMIT_CPU (SIGKILL at the hard limit; the wrappers report it as a
        # signal, 128 + signal, or their own error); a crash this late reads the same
        result.status, result.reason = "cpu_limit", f"CPU time limit {limits.cpu_s}s (exit {rc})"
    else:
        result.status, result.reason = "crashed", f"the code ended the process (exit {rc})"
    result.details = [d for d in result.details if d not in ("ready", "done", "abort")]


def _take(line: bytes, nonce: str, result: ExecResult, own: list[bytes]) -> None:
    text = line.decode("utf-8", "replace")
    if not text.startswith(nonce + " "):
        if sum(map(len, own)) < 1 << 20:
            own.append(line[:4096])
        return
    kind, _, rest = text[len(nonce) + 1:].partition(" ")
    if kind == "ready":
        result.total = int(rest)
        result.details.append("ready")
    elif kind == "pass":
        result.passed += 1
    elif kind == "fail":
        result.details.append(f"fail: {rest.partition(' ')[2]}")
        result.reason = result.reason or f"test failed: {rest.partition(' ')[2]}"
    elif kind == "abort":
        result.details.append("abort")
        result.reason = f"test setup failed: {rest.partition(' ')[2]}"
    elif kind == "load_error":
        result.status, result.reason = "load_error", f"the code does not load: {rest}"
    elif kind == "done":
        result.details.append("done")


def execute(code: str, tests: str, entry_point: str, limits: SandboxLimits | None = None,
            isolation: str | None = None, retries: int = 1) -> ExecResult:
    """`run_tests`, retried `retries` times on an infrastructure failure; then InfraError."""
    for attempt in range(retries + 1):
        with _concurrency((limits or SandboxLimits()).wall_s):
            result = run_tests(code, tests, entry_point, limits, isolation)
        if not result.infra:
            return result
        if attempt == retries:
            raise InfraError(f"sandbox ({result.isolation}): {result.reason} "
                             f"(after {retries + 1} tries)")
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# Concurrency: slots shared by every reward worker forked after `set_max_concurrent`. A slot is
# an exclusive flock on one of N files: the kernel releases it when its holder dies, so a
# worker killed mid-execution (the pool's time limit) cannot leak a slot.

_SLOT_FILES: list[str] = []


def set_max_concurrent(n: int) -> None:
    """Allow at most `n` executions at once across this process and the workers it forks
    afterwards (the first call in a process decides)."""
    global _SLOT_FILES
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"sandbox max_concurrent={n!r}: expected an integer >= 1")
    if _SLOT_FILES:
        return
    folder = tempfile.mkdtemp(prefix="rollwise-sbx-slots-")
    paths = [os.path.join(folder, f"slot{i}") for i in range(n)]
    for path in paths:
        open(path, "w").close()
    _SLOT_FILES = paths


class _concurrency:
    """Hold one slot while an execution runs; InfraError when none frees up in `wait_s`."""

    def __init__(self, wait_s: float):
        self.wait_s, self.fd = wait_s, None

    def __enter__(self):
        import fcntl

        if not _SLOT_FILES:
            return self
        deadline = time.monotonic() + self.wait_s
        while True:
            for path in _SLOT_FILES:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                self.fd = fd
                return self
            if time.monotonic() >= deadline:
                raise InfraError(f"sandbox: no execution slot free within {self.wait_s:g}s "
                                 f"(max_concurrent={len(_SLOT_FILES)})")
            time.sleep(0.005)

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None
