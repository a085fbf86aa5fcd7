r"""The code sandbox: runs model-written Python against unit tests in a separate, limited process,
and decides the verdict where the code cannot reach it.

What one execution does (docs/rewards.md says what this stops and what it does not):

1. A fresh private directory (``rollwise-sbx-*``, mode 0700) is the code's working directory,
   $HOME and $TMPDIR, and the only place it may write.
2. The sandbox starts in a new session (its own process group) with a scrubbed environment
   (PATH, LANG, HOME, TMPDIR only) and resource limits set before it executes anything.
3. Isolation, the strongest that works here, detected once per process by running a real
   execution (the real interpreter, a real lazy standard-library import) under each:
   ``bwrap`` (bubblewrap namespaces, read-only file system), ``unshare`` (util-linux
   namespaces, with a private read-only view of the file system set up by the runner),
   ``landlock`` (no namespaces: Landlock and seccomp confine the code), else ``rlimits``
   (limits, plus seccomp where the kernel has it; NOT a security boundary: a one-time warning
   says so). Landlock and seccomp are added under bwrap and unshare too where the kernel has
   them.
4. The runner (`rollwise.rewards.runner`, trusted, standard library only) forks a candidate
   process that drops its privileges and loads the code; the tests run in the runner and call
   the code through canonical values only. Results reach this process on the runner's fd 1,
   which the candidate never holds; the candidate's own output comes on fd 2, capped.
5. The wall-time limit, the output cap or the end kills the whole process group and every
   descendant; the directory is removed. Score = tests passed / tests, counted here from the
   runner's results: bounded by the number of tests, whatever the code prints.

Infrastructure failures (the sandbox could not start: an OSError, a wrapper that failed, a
runner that timed out before it was ready) are not the model's fault: `execute` retries once
and then raises `InfraError`, which the reward pool counts apart and masks.
"""

from __future__ import annotations

import atexit
import marshal
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from rollwise.rewards.pool import InfraError

ISOLATION_LEVELS = ("bwrap", "unshare", "landlock", "rlimits")
SECURITY_BOUNDARY = ("bwrap", "unshare", "landlock")
REQUIRE = ("any", "isolated")  # task option sandbox_require
NOBODY = 65534
# The runner imports the standard-library modules the code and tests name before the code's
# process drops root (where the interpreter may be unreadable afterwards); never these:
NO_PREIMPORT = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo",
                          "webbrowser", "pydoc", "ensurepip", "venv", "lib2to3"})
PREIMPORT = frozenset(sys.stdlib_module_names) - NO_PREIMPORT
RLIMITS_WARNING = ("rollwise sandbox: model-written code runs with resource limits only (no "
                   "bubblewrap, unshare or Landlock isolation). Limits are NOT a "
                   "security boundary: the code can read and write what this user can "
                   "(shared temporary directories included) and, where seccomp is missing, "
                   "open network connections. Install bubblewrap (Debian/Ubuntu: apt-get "
                   "install bubblewrap) for isolation.")
# The detection probe: the real interpreter, lazy standard-library imports (the ones that
# fail when the code's user cannot read the interpreter), a file in its own directory.
PROBE_CODE = ("import importlib\n"
              "def f(x):\n"
              "    import datetime\n"
              "    datetime.datetime.strptime('2024-01-02', '%Y-%m-%d')\n"
              "    importlib.import_module('fractions').Fraction(1, 3)\n"
              "    importlib.import_module('xml.etree.ElementTree').fromstring('<a/>')\n"
              "    open('probe.txt', 'w').write('ok')\n"
              "    return x + 1\n")
PROBE_TESTS = "def check(candidate):\n    assert candidate(1) == 2\n"


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one execution."""

    cpu_s: int = 2  # CPU seconds per process (RLIMIT_CPU)
    wall_s: float = 4.0  # wall time of the whole execution, then the group is killed
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    file_mb: int = 8  # largest file it may write (RLIMIT_FSIZE)
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 16  # RLIMIT_NPROC (counted per uid; the code's process sets it)
    output_kb: int = 256  # stdout + stderr kept; more kills the execution

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"sandbox limit {name}={value!r}: expected a number > 0")


@dataclass
class ExecResult:
    """What one execution did."""

    passed: int = 0  # tests passed (never more than total)
    total: int = 0  # tests in the test function
    status: str = "ok"  # ok | failed | load_error | timeout | cpu_limit | output_limit |
    #                     crashed | infra
    reason: str = ""  # why it did not pass everything, for reward_errors
    seconds: float = 0.0
    output: str = ""  # the code's own output (capped), for debugging
    isolation: str = ""
    details: list[str] = field(default_factory=list)  # "fail: why" per failed test

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def infra(self) -> bool:
        return self.status == "infra"


# ---------------------------------------------------------------------------------------------
# Where things are: the interpreter the code needs, the directories it must not see


@lru_cache(maxsize=1)
def interpreter_paths() -> tuple[str, ...]:
    """The directories the runner's interpreter needs (prefixes, standard library, the real
    executable's directory), real paths, none beneath another."""
    paths = {os.path.realpath(p) for p in (
        sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
        sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
        os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(sys.executable))}
    return tuple(sorted(p for p in paths
                        if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in paths)))


def hidden_dirs() -> list[str]:
    """Directories replaced by an empty tmpfs under bwrap and unshare: the shared temporary
    directories (writes there would outlive the execution and reach its siblings) and the
    home directory (keys, tokens, history)."""
    hide = [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d)]
    home = os.path.realpath(os.path.expanduser("~"))
    if home not in ("/", "") and os.path.isdir(home) and home not in hide:
        hide.append(home)
    return hide


def _beneath(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def readable_by_others(path: str) -> bool:
    """Whether a user that owns nothing can reach `path` (every directory on the way
    searchable by others): where the interpreter lives decides whether the dropped code's
    lazy imports work."""
    parts = Path(os.path.realpath(path)).parts
    for i in range(1, len(parts) + 1):
        try:
            mode = os.stat(os.path.join(*parts[:i])).st_mode
        except OSError:
            return False
        if not mode & 0o001:
            return False
    return True


@lru_cache(maxsize=1)
def _interpreter_readable_by_others() -> bool:
    return all(readable_by_others(p) for p in interpreter_paths())


LANDLOCK_READ = ("/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/localtime",
                 "/dev/urandom", "/dev/random", "/dev/zero")


# ---------------------------------------------------------------------------------------------
# Detection

_detected: dict[str, Any] = {}
_detect_lock = threading.Lock()
_warned = False


def _wrapper_argv(level: str, workdir: str) -> list[str]:
    """The command line that puts the runner inside `level`'s namespaces."""
    root = os.geteuid() == 0
    if level == "bwrap":
        argv = [shutil.which("bwrap") or "bwrap", "--unshare-ipc", "--unshare-pid",
                "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session", "--as-pid-1", "--ro-bind", "/", "/",
                "--dev", "/dev", "--proc", "/proc"]
        if not root:
            argv[1:1] = ["--unshare-user"]
        hide = hidden_dirs()
        for path in hide:
            argv += ["--tmpfs", path]
        for path in interpreter_paths():  # the interpreter may live beneath one of them
            if _beneath(path, hide):
                # bwrap makes missing parents 0700: the code's user (nobody) must pass them
                parents = [str(p) for p in reversed(Path(path).parents)
                           if _beneath(str(p), hide) and str(p) not in hide]
                for parent in parents:
                    argv += ["--perms", "0755", "--dir", parent]
                argv += ["--ro-bind", path, path]
        argv += ["--bind", workdir, workdir, "--chdir", workdir]
        if root:  # the code's process drops to nobody itself, which needs these two
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        return argv
    if level == "unshare":
        argv = [shutil.which("unshare") or "unshare"]
        if not root:
            argv += ["--user", "--map-root-user"]
        return argv + ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
                       "--mount-proc"]
    return []


def _layers_here() -> dict[str, Any]:
    """What the kernel offers the code's process: {"landlock": ABI or 0, "seccomp": bool}."""
    from rollwise.rewards import confine

    try:
        confine.seccomp_filter()
        seccomp = True
    except OSError:
        seccomp = False
    return {"landlock": confine.landlock_abi(), "seccomp": seccomp}


def _probe(level: str) -> bool:
    """A real execution under `level`: the probe function passes its test."""
    try:
        result = run_tests(PROBE_CODE, PROBE_TESTS, "f", SandboxLimits(wall_s=10.0),
                           isolation=level, _probing=True)
    except (OSError, ValueError, RuntimeError):
        return False
    return result.status == "ok" and result.passed == 1


def detect_isolation(force: str | None = None) -> str:
    """The strongest isolation that works here: "bwrap", "unshare", "landlock" or "rlimits".

    `force` (or the environment variable ROLLWISE_SANDBOX) picks one; forcing one that does
    not work is an error. Probed once per process: each level runs a real execution (the real
    interpreter, a lazy standard-library import, a write in its own directory).
    """
    force = force or os.environ.get("ROLLWISE_SANDBOX") or None
    if force is not None and force not in (*ISOLATION_LEVELS, "auto"):
        raise ValueError(f"sandbox isolation {force!r}: expected auto, "
                         f"{', '.join(ISOLATION_LEVELS)}")
    with _detect_lock:
        if "works" not in _detected:
            # each kernel layer counts only where a real execution passes with it: seccomp
            # first (every level uses it), then Landlock (the landlock level needs both)
            _detected["layers"] = layers = {**_layers_here()}
            if layers["seccomp"] and not _probe("rlimits"):
                layers["seccomp"] = False
            works = {"rlimits": True, "landlock": False}
            if layers["landlock"] and layers["seccomp"]:
                works["landlock"] = _probe("landlock")
            if not works["landlock"]:
                layers["landlock"] = 0
            for level in ("bwrap", "unshare"):
                works[level] = bool(shutil.which(level)) and _probe(level)
            _detected["works"] = {lvl: works[lvl] for lvl in ISOLATION_LEVELS}
        works = _detected["works"]
    if force not in (None, "auto"):
        if not works[force]:
            raise RuntimeError(f"sandbox isolation {force!r} was asked for but does not work "
                               f"on this machine (working: "
                               f"{', '.join(k for k, v in works.items() if v)})")
        return force
    return next(level for level in ISOLATION_LEVELS if works[level])


def _layers(level: str) -> dict[str, Any]:
    """What an execution under `level` uses (detection decided what the kernel offers)."""
    found = _detected.get("layers") or {"landlock": 0, "seccomp": False}
    return {"landlock": found["landlock"] if level != "rlimits" else 0,
            "seccomp": found["seccomp"],  # every level, limits alone included
            "mounts": level == "unshare",
            "drop_uid": NOBODY if os.geteuid() == 0 else 0}


def layer_names(level: str) -> list[str]:
    """The active layers of `level`, in words, for the start-up line and summary.json."""
    use = _layers(level)
    names = {"bwrap": ["network, PID, IPC, UTS namespaces", "read-only file system",
                       "private /tmp", "home hidden"],
             "unshare": ["network, PID, IPC, UTS, mount namespaces", "read-only file system",
                         "private /tmp", "home hidden"]}.get(level, [])
    if use["landlock"]:
        names.append(f"Landlock ABI {use['landlock']}")
    if use["seccomp"]:
        names.append("seccomp")
    if use["drop_uid"]:
        names.append("code runs as nobody")
    names.append("verdict outside the code's process")
    return names


def isolation_info(level: str | None = None) -> dict[str, Any]:
    """What the sandbox uses here, for the run header and summary.json."""
    level = level or detect_isolation()
    return {"isolation": level, "layers": layer_names(level),
            "drops_root": os.geteuid() == 0,
            "available": dict(_detected.get("works", {})),
            "security_boundary": level in SECURITY_BOUNDARY}


def check_required(level: str, require: str) -> None:
    """Refuse to run code rewards without isolation when the task asks for it
    (``sandbox_require = "isolated"``)."""
    if require not in REQUIRE:
        raise ValueError(f"option sandbox_require={require!r}: expected {' or '.join(REQUIRE)}")
    if require == "isolated" and level not in SECURITY_BOUNDARY:
        raise RuntimeError(
            f"sandbox_require = \"isolated\" but the sandbox here is {level!r} (limits only): "
            f"install bubblewrap (apt-get install bubblewrap), allow user namespaces, or run on "
            f"a kernel with Landlock and seccomp (available: {isolation_info(level)['available']})")


def warn_if_unisolated(level: str) -> None:
    """Say once per process that limits alone are not a security boundary."""
    global _warned
    if level == "rlimits" and not _warned:
        _warned = True
        warnings.warn(RLIMITS_WARNING, RuntimeWarning, stacklevel=2)
        print(f"warning: {RLIMITS_WARNING}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# The program the sandbox runs: `confine` and `runner`, compiled here once and sent on stdin

BOOTSTRAP = ("import marshal,sys,types\n"
             "b=sys.stdin.buffer\n"
             "m={}\n"
             "for n,c in marshal.loads(b.read(int(b.readline()))):\n"
             "    m[n]=types.ModuleType(n);exec(c,m[n].__dict__)\n"
             "m['runner'].main(m['confine'])\n")


@lru_cache(maxsize=1)
def _program() -> bytes:
    here = Path(__file__).parent
    blob = marshal.dumps([(name, compile((here / f"{name}.py").read_text(),
                                         f"<sandbox {name}>", "exec"))
                          for name in ("confine", "runner")])
    return f"{len(blob)}\n".encode() + blob


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


def run_tests(code: str, tests: str, entry_point: str, limits: SandboxLimits | None = None,
              isolation: str | None = None, helpers: str = "", _probing: bool = False
              ) -> ExecResult:
    """One execution of `code` against `tests` (source holding ``def check(candidate)``);
    `helpers` is trusted source the tests may use (a problem's own prompt code, e.g.
    HumanEval's helper functions), run beside the tests, never taken from the completion.
    Never raises for anything the code does. See the module docstring."""
    limits = limits or SandboxLimits()
    if not _probing:  # a level given by name still needs the layers detection found
        level = detect_isolation(isolation)
        warn_if_unisolated(level)
    else:
        level = isolation
    start = time.perf_counter()
    result = ExecResult(isolation=level)
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="rollwise-sbx-"))
    use = _layers(level)
    try:
        if use["drop_uid"]:
            os.chown(workdir, NOBODY, NOBODY)
        setup, body, is_test = split_tests(tests)
        result.total = sum(is_test)
        preimport = _wanted_imports(code, tests + "\n" + helpers)
        payload = {
            "code": code, "entry_point": entry_point, "preimport": preimport,
            "drop_uid": use["drop_uid"], "nproc": int(limits.processes), "cpu_s": limits.cpu_s,
            # as a user outside a user namespace the process-count limit counts all of the
            # user's tasks (the trainer's threads too): the code gets `processes` more
            "nproc_counts_user": os.geteuid() != 0 and level in ("landlock", "rlimits"),
            # nobody cannot pass the directories above the interpreter and no mount namespace
            # re-mounts it: the code's process imports through descriptors opened before
            "imports_via_fds": bool(use["drop_uid"]) and level in ("landlock", "rlimits")
            and not _interpreter_readable_by_others(),
            # the runner stops the code a little before this process kills everything
            "deadline": time.monotonic() + limits.wall_s - min(0.2, limits.wall_s / 4),
            "landlock": {"read": [*interpreter_paths(), *LANDLOCK_READ],
                         "write": [workdir, "/dev/null"]} if use["landlock"] else None,
            "seccomp": use["seccomp"],
            "mounts": {"hide": hidden_dirs(), "keep": list(interpreter_paths()),
                       "writable": workdir} if use["mounts"] else None}
        # sent only once the code's process exists, so it never holds them
        secret = {"helpers": helpers, "setup": setup, "body": body, "is_test": is_test,
                  "entry_point": entry_point}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir,
               "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        argv = [*_wrapper_argv(level, workdir), sys.executable, "-I", "-S", "-B", "-c",
                BOOTSTRAP]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=workdir, env=env,
                                    start_new_session=True, close_fds=True,
                                    # only setrlimit and signal between fork and exec; the
                                    # reward workers that call this are single-threaded
                                    preexec_fn=_set_limits(limits))  # noqa: PLW1509
        except OSError as err:
            result.status, result.reason = "infra", f"cannot start the sandbox: {err}"
            return result
        _communicate(proc, (_program() + _frame("payload", payload),
                            _frame("tests", secret)), limits, start, result, is_test)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        result.seconds = time.perf_counter() - start
    return result


def _communicate(proc: subprocess.Popen, stdin: tuple[bytes, bytes], limits: SandboxLimits,
                 start: float, result: ExecResult, is_test: list[bool]) -> None:
    """Feed the program and the code, then the tests once the runner is ready; read the
    runner's results (fd 1) and the code's output (fd 2) until the runner is done, a limit
    is passed, or the deadline."""
    cap = int(limits.output_kb) * 1024
    deadline = start + limits.wall_s
    _feed(proc, stdin[0], close=False)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "results")
    sel.register(proc.stderr, selectors.EVENT_READ, "output")
    lines, output, seen = b"", [], 0
    state: dict[str, Any] = {"passed": set()}
    killed = None
    try:
        while sel.get_map() and "done" not in state:
            left = deadline - time.perf_counter()
            if left <= 0:
                killed = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data == "results":
                    lines += chunk
                    *complete, lines = lines.split(b"\n")
                    for line in complete:
                        _take(line, state, is_test)
                    if "ready" in state and proc.stdin and not proc.stdin.closed:
                        _feed(proc, stdin[1], close=True)
                    if len(lines) > 1 << 20:  # the runner writes short lines
                        lines = b""
                else:
                    seen += len(chunk)
                    if seen > cap:
                        killed = "output_limit"
                        break
                    output.append(chunk)
            if killed:
                break
    finally:
        sel.close()
        if "done" in state:  # the runner reaped everything and exits: let its wrapper reap
            try:            # it, or a killed runner becomes a zombie of init's (a container's
                proc.wait(timeout=1.0)  # init may never reap it)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc)
    result.output = b"".join(output).decode("utf-8", "replace")[:cap]
    _verdict(result, state, killed, proc.returncode, limits)


def _frame(kind: str, message: dict) -> bytes:
    """One length-prefixed marshal message for the runner (trusted data, plain types)."""
    data = marshal.dumps(message)
    return f"{kind} {len(data)}\n".encode() + data


def _feed(proc: subprocess.Popen, data: bytes, close: bool) -> None:
    try:
        proc.stdin.write(data)
        proc.stdin.flush()
        if close:
            proc.stdin.close()
    except OSError:
        pass  # the runner died before reading; its exit says why


def _take(line: bytes, state: dict[str, Any], is_test: list[bool]) -> None:
    """One result line of the runner (fd 1: only the runner writes there):
    ``<kind> <fields>``, e.g. ``passed 3`` or ``ended cpu_limit CPU time limit 2s``."""
    kind, _, rest = line.decode("utf-8", "replace").partition(" ")
    if kind == "passed":
        if rest.isascii() and rest.isdigit() and int(rest) < len(is_test) and is_test[int(rest)]:
            state["passed"].add(int(rest))  # a set: one pass per test at most
    elif kind == "fail":
        state.setdefault("fails", []).append(rest.partition(" ")[2])
    elif kind == "abort":
        state["abort"] = rest.partition(" ")[2]
    elif kind == "ended":
        state["ended"] = rest.partition(" ")[::2]  # (kind, why)
    elif kind in ("ready", "done", "load_error", "infra"):
        state[kind] = rest


def _verdict(result: ExecResult, state: dict[str, Any], killed: str | None, rc: int | None,
             limits: SandboxLimits) -> None:
    result.passed = min(len(state["passed"]), result.total)
    fails = state.get("fails", [])
    result.details = [f"fail: {why}" for why in fails]
    if fails:
        result.reason = f"test failed: {fails[0]}"
    ready = "ready" in state
    if killed == "output_limit":
        result.status, result.reason = "output_limit", f"output over {limits.output_kb} KiB"
    elif "infra" in state:
        result.status, result.reason = "infra", state["infra"]
    elif "load_error" in state:
        result.status = "load_error"
        result.reason = f"the code does not load: {state['load_error']}"
    elif "ended" in state:
        kind, why = state["ended"]
        result.status = kind if kind in ("timeout", "cpu_limit") else "crashed"
        result.reason = f"wall time limit {limits.wall_s:g}s" if kind == "timeout" else why
    elif "abort" in state:
        result.status, result.reason = "failed", f"test setup failed: {state['abort']}"
    elif "done" in state:
        result.status = "ok" if result.passed == result.total and result.total else "failed"
        if not result.total:
            result.reason = "the tests hold no assert"
    elif not ready:
        result.status = "infra"
        result.reason = (f"the sandbox did not start within {limits.wall_s:g}s" if killed
                         else f"sandbox exited with {rc} before its runner started: "
                              f"{result.output[-300:]!r}")
    elif killed == "timeout":
        result.status, result.reason = "timeout", f"wall time limit {limits.wall_s:g}s"
    else:
        result.status, result.reason = "crashed", f"the runner ended early (exit {rc})"


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



def execute(code: str, tests: str, entry_point: str, limits: SandboxLimits | None = None,
            isolation: str | None = None, retries: int = 1, helpers: str = "") -> ExecResult:
    """`run_tests`, retried `retries` times on an infrastructure failure; then InfraError."""
    for attempt in range(retries + 1):
        with _concurrency((limits or SandboxLimits()).wall_s):
            result = run_tests(code, tests, entry_point, limits, isolation, helpers)
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
_SLOTS_PREFIX = "rollwise-sbx-slots-"


def set_max_concurrent(n: int) -> None:
    """Allow at most `n` executions at once across this process and the workers it forks
    afterwards (the first call in a process decides). The slot files live in a folder named
    after this process, removed when it exits (and by a later run when it was killed)."""
    global _SLOT_FILES
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"sandbox max_concurrent={n!r}: expected an integer >= 1")
    if _SLOT_FILES:
        return
    _sweep_stale_slots()
    folder = tempfile.mkdtemp(prefix=f"{_SLOTS_PREFIX}{os.getpid()}-")
    paths = [os.path.join(folder, f"slot{i}") for i in range(n)]
    for path in paths:
        open(path, "w").close()
    _SLOT_FILES = paths
    atexit.register(_remove_slots, folder, os.getpid())


def _remove_slots(folder: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked worker that happens to run atexit hooks
        shutil.rmtree(folder, ignore_errors=True)


def _sweep_stale_slots() -> None:
    """Remove slot folders whose process is gone (a run that was killed)."""
    for path in Path(tempfile.gettempdir()).glob(f"{_SLOTS_PREFIX}*"):
        owner = path.name[len(_SLOTS_PREFIX):].partition("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(path, ignore_errors=True)


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
