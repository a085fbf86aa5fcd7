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

This module holds the detection, one execution and `execute`; `wrappers.py` builds the
namespace command lines; `verdict.py` holds the limits and the result, talks to the started
process and decides the verdict. It imports those two and `rewards.pool` (`InfraError`).
"""

from __future__ import annotations

import atexit
import marshal
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any

from rollwise.rewards.pool import InfraError
from rollwise.rewards.verdict import ExecResult, SandboxLimits, communicate, frame
from rollwise.rewards.wrappers import (
    LANDLOCK_READ,
    hidden_dirs,
    interpreter_paths,
    interpreter_readable_by_others,
    wrapper_argv,
)

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


# ---------------------------------------------------------------------------------------------
# Detection

_detected: dict[str, Any] = {}
_detect_lock = threading.Lock()
_warned = False


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
# The program the sandbox runs: `confine`, `canonical` and `runner`, compiled here once and
# sent on stdin; each becomes a module under its own name (the runner imports `canonical`)

BOOTSTRAP = ("import marshal,sys,types\n"
             "b=sys.stdin.buffer\n"
             "m=sys.modules\n"
             "for n,c in marshal.loads(b.read(int(b.readline()))):\n"
             "    m[n]=types.ModuleType(n);exec(c,m[n].__dict__)\n"
             "m['rollwise.rewards.runner'].main(m['rollwise.rewards.confine'])\n")


@lru_cache(maxsize=1)
def _program() -> bytes:
    here = Path(__file__).parent
    blob = marshal.dumps([(f"rollwise.rewards.{name}",
                           compile((here / f"{name}.py").read_text(), f"<sandbox {name}>", "exec"))
                          for name in ("confine", "canonical", "runner")])
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
        payload = _payload(code, tests + "\n" + helpers, entry_point, limits, level, use, workdir)
        # sent only once the code's process exists, so it never holds them
        secret = {"helpers": helpers, "setup": setup, "body": body, "is_test": is_test,
                  "entry_point": entry_point}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir,
               "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        argv = [*wrapper_argv(level, workdir), sys.executable, "-I", "-S", "-B", "-c",
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
        communicate(proc, (_program() + frame("payload", payload), frame("tests", secret)),
                    limits, start, result, is_test)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        result.seconds = time.perf_counter() - start
    return result


def _payload(code: str, tests: str, entry_point: str, limits: SandboxLimits, level: str,
             use: dict[str, Any], workdir: str) -> dict[str, Any]:
    """What the runner gets first: the code and how to confine the code's process (`tests`
    with the helpers only say which modules to import beforehand)."""
    return {
        "code": code, "entry_point": entry_point, "preimport": _wanted_imports(code, tests),
        "drop_uid": use["drop_uid"], "nproc": int(limits.processes), "cpu_s": limits.cpu_s,
        # as a user outside a user namespace the process-count limit counts all of the
        # user's tasks (the trainer's threads too): the code gets `processes` more
        "nproc_counts_user": os.geteuid() != 0 and level in ("landlock", "rlimits"),
        # nobody cannot pass the directories above the interpreter and no mount namespace
        # re-mounts it: the code's process imports through descriptors opened before
        "imports_via_fds": bool(use["drop_uid"]) and level in ("landlock", "rlimits")
        and not interpreter_readable_by_others(),
        # the runner stops the code a little before this process kills everything
        "deadline": time.monotonic() + limits.wall_s - min(0.2, limits.wall_s / 4),
        "landlock": {"read": [*interpreter_paths(), *LANDLOCK_READ],
                     "write": [workdir, "/dev/null"]} if use["landlock"] else None,
        "seccomp": use["seccomp"],
        "mounts": {"hide": hidden_dirs(), "keep": list(interpreter_paths()),
                   "writable": workdir} if use["mounts"] else None}


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
