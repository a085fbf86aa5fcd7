# ruff: noqa: BLE001, S102, S110, TRY004 -- a sandbox runner catches whatever the model's code
# or the tests raise, and runs the trusted tests with exec
"""The sandbox runner: the program the sandbox starts (``python -I -S -B``), standard library
and `rollwise.rewards.canonical` only, loaded from its stdin with `confine` and `canonical`
(docs/rewards.md, "The verdict").

The runner itself never executes the model's code. It forks one **candidate process** that
loads the code and then answers calls: the runner sends the arguments, the candidate sends
back the return value as a canonical value (`canonical.py`: exact built-in types only,
rebuilt as genuine objects here by a strict parser). The tests run here, in the runner, on
those rebuilt values: an ``__eq__`` that always agrees, an int subclass or an object that
pretends to be a str never reach a comparison. The candidate gets no descriptor of the result
channel (fd 1 here) and cannot reach this process (it is not dumpable, the candidate drops
its privileges, and Landlock and seccomp stop ptrace, /proc and signals where the kernel has
them), and the tests are sent here only after it was forked, so whatever it prints, patches
or forges, it can only answer the calls made, which is what any honest function could do.

Wire formats, chosen for start-up time (no json, re, enum or typing: ~10 ms a start) and so
that nothing the candidate writes is parsed by anything but `decode`: the sandbox sends the
runner length-prefixed marshal data (trusted), the runner sends the candidate marshal data
(trusted), the candidate answers with length-prefixed canonical text, and the runner reports
to fd 1 in plain lines (``passed 3``, ``fail 2 AssertionError: ...``); the candidate's own
output goes to fd 2.
"""

from __future__ import annotations

import _signal
import builtins
import marshal
import os
import select
import sys
import time

from rollwise.rewards.canonical import decode, encode

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

REPLY_LIMIT = 16 << 20  # bytes of one reply from the candidate; more ends it


# ---------------------------------------------------------------------------------------------
# Framing: "<kind> <length>\n" then the payload


def _send(fd: int, kind: str, payload: bytes) -> None:
    data = f"{kind} {len(payload)}\n".encode() + payload
    while data:
        data = data[os.write(fd, data):]


def _read_frame(stream) -> tuple[str, bytes] | None:
    header = stream.readline(64)
    if not header:
        return None
    kind, _, size = header.decode().partition(" ")
    return kind, stream.read(int(size))


# ---------------------------------------------------------------------------------------------
# The candidate process


def _serve(data: dict, confine, requests: int, replies: int) -> None:
    """In the forked child: confine, load the code, answer calls until its input ends."""
    def send(kind: str, text: str) -> None:
        _send(replies, kind, text.encode("utf-8", "surrogatepass"))

    try:
        _confine(data, confine)
    except BaseException as err:  # detection promised these layers: an infrastructure failure
        send("infra", f"{type(err).__name__}: {err}")
        os._exit(3)
    ns = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(data["code"], "solution.py", "exec"), ns)
        function = ns.get(data["entry_point"])
        if not callable(function):
            raise NameError("no function named " + data["entry_point"])
    except BaseException as err:
        send("load_error", _describe(err))
        os._exit(0)
    send("loaded", "")
    reader = os.fdopen(requests, "rb")
    while True:
        frame = _read_frame(reader)
        if frame is None:
            os._exit(0)
        args, kwargs = marshal.loads(frame[1])
        try:
            send("value", encode(function(*args, **kwargs)))
        except BaseException as err:
            send("raised", encode((_name(err), _describe(err))))


def _name(err: BaseException) -> str:
    try:
        return str(type(err).__name__)
    except BaseException:
        return "Exception"


def _describe(err: BaseException) -> str:
    try:
        return f"{_name(err)}: {str(err)[:300]}"
    except BaseException:
        return _name(err)


def _confine(data: dict, confine) -> None:
    """Drop what the candidate must not have, in an order that keeps each step possible."""
    import resource

    ruleset = None
    if data["landlock"]:  # opened while the paths are still reachable
        ruleset, _ = confine.landlock_ruleset(data["landlock"]["read"],
                                              data["landlock"]["write"])
    n = data["nproc"]
    if data["nproc_counts_user"]:  # the limit counts every task of this user: add the others'
        n += _tasks_of(os.getuid())
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
    except (ValueError, OSError):
        pass
    if data["imports_via_fds"]:
        _imports_via_fds()
    if os.geteuid() == 0:
        if data["drop_uid"]:
            os.setgroups([])
            os.setgid(data["drop_uid"])
            os.setuid(data["drop_uid"])
        else:  # root of a user namespace: keep the uid, lose the powers
            confine.drop_capabilities()
    confine.prctl(confine.PR_SET_NO_NEW_PRIVS, 1)
    if ruleset is not None:
        confine.landlock_enforce(ruleset)
    if data["seccomp"]:
        confine.seccomp_enforce(confine.seccomp_filter())


def _tasks_of(uid: int) -> int:
    """How many tasks (threads) the user `uid` runs now: what RLIMIT_NPROC counts."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f.read().splitlines()
                          if line.startswith((b"Uid:", b"Threads:")))
            if int(fields[b"Uid"].split()[0]) == uid:
                count += int(fields[b"Threads"])
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return count


def _imports_via_fds() -> None:
    """Make the interpreter's directories importable after the drop to nobody when a
    directory above them is closed to others (the interpreter under root's 0700 home):
    directories opened now, while still root, are reached as /proc/self/fd/N, a path that
    does not pass the closed ancestors. Lazy standard-library imports keep working."""
    moved = {}
    for entry in sys.path:
        if entry and os.path.isdir(entry):
            moved[entry.rstrip("/")] = f"/proc/self/fd/{os.open(entry, os.O_RDONLY)}"

    def move(path: str) -> str:
        for old, new in moved.items():
            if path == old or path.startswith(old + "/"):
                return new + path[len(old):]
        return path

    sys.path[:] = [move(p) for p in sys.path]
    for module in list(sys.modules.values()):
        path = getattr(module, "__path__", None)
        if type(path) is list:
            path[:] = [move(p) for p in path]
    sys.path_importer_cache.clear()


def _fork_candidate(data: dict, confine) -> tuple[int, int, int]:
    """(pid, requests fd, replies fd) of a new candidate process."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(2, 1)  # its output goes where the runner's errors go, never to fd 1
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            keep = sorted({0, 1, 2, req_r, rep_w})
            for low, high in zip(keep, [*keep[1:], 65536]):
                os.closerange(low + 1, high)
            _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
            _serve(data, confine, req_r, rep_w)
        finally:
            os._exit(4)
    os.close(req_r)
    os.close(rep_w)
    return pid, req_w, rep_r


# ---------------------------------------------------------------------------------------------
# The runner


class Ended(BaseException):
    """The candidate process is gone (or was stopped): no more calls. A BaseException, so
    that a test's ``except Exception`` does not take it for an exception the code raised."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind = kind


class Link:
    """Calls into the candidate process, with the execution's deadline and CPU limit."""

    def __init__(self, data: dict, confine):
        self.confine, self.deadline = confine, data["deadline"]
        self.cpu_s = data["cpu_s"]
        self.pid, self.requests, self.replies = _fork_candidate(data, confine)
        try:
            self.exit_fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self.exit_fd = None
        self.buf, self.ended = b"", None

    def receive(self) -> tuple[str, str]:
        """The candidate's next reply (kind, text); Ended when it cannot come."""
        while True:
            frame = self._frame()
            if frame is not None:
                return frame
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.stop("timeout", "wall time limit")
            fds = [self.replies] + ([self.exit_fd] if self.exit_fd is not None else [])
            # without a pidfd, poll for the exit (a grandchild may hold the reply pipe open)
            wait = left if self.exit_fd is not None else min(left, 0.05)
            ready, _, _ = select.select(fds, [], [], wait)
            if self.replies in ready:
                chunk = os.read(self.replies, 1 << 16)
                if not chunk:  # it closed its end (or is exiting): nothing more can come
                    self._await_exit(min(self.deadline - time.monotonic(), 1.0))
                    self.stop("crashed", "the code closed its reply channel")
                self.buf += chunk
                if len(self.buf) > REPLY_LIMIT + 64:
                    self.stop("crashed", "a reply over the size limit")
            elif self.exit_fd in ready or not ready:
                self._check_exit(block=False)

    def _frame(self) -> tuple[str, str] | None:
        header, newline, rest = self.buf.partition(b"\n")
        if not newline:
            if len(header) > 64:
                self.stop("crashed", "a malformed reply")
            return None
        kind, _, size = header.partition(b" ")
        if kind not in (b"value", b"raised", b"loaded", b"load_error", b"infra") or \
                not size.isdigit() or len(size) > 9 or int(size) > REPLY_LIMIT:
            self.stop("crashed", "a malformed reply")
        if len(rest) < int(size):
            return None
        payload, self.buf = rest[:int(size)], rest[int(size):]
        try:
            return kind.decode(), payload.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            self.stop("crashed", "a malformed reply")
        raise AssertionError("unreachable")

    def _await_exit(self, seconds: float) -> None:
        """Give an exiting candidate `seconds` to become reapable (its pipes close first)."""
        end = time.monotonic() + max(seconds, 0.0)
        while True:
            self._check_exit(block=False)
            left = end - time.monotonic()
            if left <= 0:
                return
            if self.exit_fd is not None:
                select.select([self.exit_fd], [], [], left)
            else:
                time.sleep(min(left, 0.01))

    def _check_exit(self, block: bool) -> None:
        if self.ended:
            raise self.ended
        try:
            pid, status, usage = os.wait4(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:  # already reaped with the other descendants
            self.ended = Ended("crashed", "the code's process ended")
            raise self.ended from None
        if pid == 0:
            return
        cpu = usage.ru_utime + usage.ru_stime
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (9, _signal.SIGXCPU) \
                and cpu >= self.cpu_s - 0.1:
            self.ended = Ended("cpu_limit", f"CPU time limit {self.cpu_s}s")
        elif os.WIFSIGNALED(status):
            self.ended = Ended("crashed", f"the code's process was killed by signal "
                                          f"{os.WTERMSIG(status)}")
        else:
            self.ended = Ended("crashed", f"the code ended its process (exit "
                                          f"{os.WEXITSTATUS(status)})")
        raise self.ended

    def stop(self, kind: str, why: str) -> None:
        self.confine.kill_descendants(os.getpid())
        self.ended = Ended(kind, why)
        raise self.ended

    def call(self, args: tuple, kwargs: dict) -> Any:
        if self.ended:
            raise self.ended
        try:
            payload = marshal.dumps((args, kwargs))
        except ValueError:
            raise TypeError("the tests passed a value the sandbox cannot send") from None
        try:
            _send(self.requests, "call", payload)
        except BrokenPipeError:
            self._await_exit(min(self.deadline - time.monotonic(), 1.0))
            self.stop("crashed", "the code closed its call channel")
        kind, text = self.receive()
        try:
            value = decode(text)
        except (ValueError, TypeError, RecursionError, OverflowError):
            self.stop("crashed", "a malformed value")
        if kind == "value":
            return value
        if kind == "raised" and type(value) is tuple and len(value) == 2:
            raise _rebuilt(*value)
        self.stop("crashed", "a reply out of order")
        raise AssertionError("unreachable")


def _rebuilt(name: Any, message: Any) -> Exception:
    """The candidate's exception as a genuine built-in one (tests may expect a ValueError)."""
    kind = getattr(builtins, name, None) if type(name) is str else None
    text = message if type(message) is str else ""
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(text)
        except Exception:  # one that takes other arguments (UnicodeDecodeError)
            pass
    return RuntimeError(text or "the code raised")


class Candidate:
    """What the tests call ``candidate``: forwards to the candidate process."""

    def __init__(self, link: Link):
        self._link = link

    def __call__(self, *args, **kwargs):
        return self._link.call(args, kwargs)


def main(confine) -> None:
    """Two messages come on stdin: the code and how to confine it, then, only after the
    candidate process exists (``ready``), the tests: they never enter its memory, so it
    cannot read the expected values out of it."""
    out = os.fdopen(1, "w", buffering=1)

    def emit(kind: str, *fields: Any) -> None:
        text = " ".join(str(f) for f in fields).replace("\n", " ").replace("\r", " ")
        out.write(f"{kind} {text[:300]}\n")

    stdin = sys.stdin.buffer
    data = marshal.loads(_read_frame(stdin)[1])
    for sig in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"):
        _signal.signal(getattr(_signal, sig), _signal.SIG_IGN)  # no exceptions from signals
    confine.prctl(confine.PR_SET_DUMPABLE, 0)  # no ptrace, no /proc/<pid>/{fd,mem} for peers
    confine.prctl(confine.PR_SET_CHILD_SUBREAPER, 1)  # double-forked orphans stay ours
    try:
        if data["mounts"]:
            confine.private_view(**data["mounts"])
    except OSError as err:
        emit("infra", f"private mounts: {err}")
        return
    for name in data["preimport"]:  # before the candidate drops privileges
        try:
            __import__(name)
        except Exception:
            pass
    link = Link(data, confine)
    emit("ready")
    try:
        _run(marshal.loads(_read_frame(stdin)[1]), link, emit)
    finally:
        confine.kill_descendants(os.getpid())
    emit("done")
    out.flush()
    os._exit(0)  # everything is reaped: skip the interpreter's teardown (milliseconds)


def _run(tests: dict, link: Link, emit) -> None:
    """Run the test statements here, calling the candidate process for `candidate`."""
    try:
        kind, text = link.receive()
    except Ended as end:
        emit("ended", end.kind, end)
        return
    if kind in ("infra", "load_error"):
        emit(kind, text)
        return
    tns = {"__name__": "tests", "__builtins__": builtins}
    try:
        exec(compile(tests["helpers"], "prompt.py", "exec"), tns)
        exec(compile(tests["setup"], "tests.py", "exec"), tns)
    except BaseException as err:
        emit("abort", -1, _describe(err))
        return
    # the entry point's own name too: some tests call it (HumanEval/33 compares it with
    # candidate), and in the prompt code it is only a stub
    tns["candidate"] = tns[tests["entry_point"]] = Candidate(link)
    for i, (statement, test) in enumerate(zip(tests["body"], tests["is_test"])):
        try:
            exec(compile(statement, "tests.py", "exec"), tns)
        except Ended as end:
            emit("ended", end.kind, end)
            return
        except BaseException as err:
            if not test:
                emit("abort", i, _describe(err))
                return
            emit("fail", i, _describe(err))
            continue
        if test:
            emit("passed", i)
