# ruff: noqa: BLE001, S102, S110, TRY004 -- a sandbox runner catches whatever the model's code
# or the tests raise, and runs the trusted tests with exec
"""The sandbox runner: the program the sandbox starts (``python -I -S -B``), standard library
only, loaded from its stdin with `confine` (docs/rewards.md, "The verdict").

The runner itself never executes the model's code. It forks one **candidate process** that
loads the code and then answers calls: the runner sends the arguments, the candidate sends
back the return value, both as canonical values (`encode` / `decode`: exact built-in types
only, rebuilt as genuine objects on the other side). The tests run here, in the runner, on
those rebuilt values: an ``__eq__`` that always agrees, an int subclass or an object that
pretends to be a str never reach a comparison. The candidate gets no descriptor of the result
channel (fd 1 here) and cannot reach this process (it is not dumpable, the candidate drops
its privileges, and Landlock and seccomp stop ptrace, /proc and signals where the kernel has
them), so whatever it prints, patches or forges, it can only give answers to the calls made,
which is what any honest function could do.

Results go to fd 1 as one JSON object per line; the candidate's own output goes to fd 2.
"""

from __future__ import annotations

import builtins
import json
import os
import select
import signal
import sys
import time
from typing import Any

REPLY_LIMIT = 16 << 20  # bytes of one reply from the candidate; more ends it
_DICT_LIKE = ("OrderedDict", "Counter", "defaultdict")  # compare equal to dicts in Python


# ---------------------------------------------------------------------------------------------
# Canonical values: a JSON tree with every number and container tagged


def encode(value: Any, depth: int = 0) -> Any:
    """`value` as a tagged JSON tree; TypeError for anything but exact built-in values.

    >>> encode([1, (2.5, "a"), {None: True}])
    ['l', [['i', '1'], ['t', [['f', '2.5'], 'a']], ['d', [[None, True]]]]]
    """
    if depth > 200:
        raise ValueError("value nested too deeply")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return ["i", str(value)]
    if kind is float:
        return ["f", repr(value)]
    if kind is complex:
        return ["c", repr(value.real), repr(value.imag)]
    if kind is bytes:
        return ["b", value.hex()]
    tag = {list: "l", tuple: "t", set: "s", frozenset: "fs"}.get(kind)
    if tag:
        return [tag, [encode(v, depth + 1) for v in value]]
    if kind is dict or (issubclass(kind, dict) and kind.__module__ == "collections"
                        and kind.__name__ in _DICT_LIKE):
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(value)]]
    raise TypeError(f"a {kind.__name__} is not a plain built-in value (int, float, str, "
                    f"bytes, bool, None, list, tuple, dict, set)")


def decode(tree: Any, depth: int = 0) -> Any:
    """The genuine value of a tagged tree from `encode`; ValueError for anything else.

    >>> decode(['l', [['i', '1'], ['t', [['f', 'nan'], 'a']]]])
    [1, (nan, 'a')]
    """
    if tree is None or type(tree) is bool or type(tree) is str:
        return tree
    if depth > 200 or type(tree) is not list or not tree or type(tree[0]) is not str:
        raise ValueError("not a canonical value")
    tag, rest = tree[0], tree[1:]
    if tag not in ("i", "f", "c", "b", *_CONTAINERS):
        raise ValueError(f"unknown canonical tag {tag[:20]!r}")
    if any(type(r) is not (list if tag in _CONTAINERS else str) for r in rest) or \
            len(rest) != (2 if tag == "c" else 1):
        raise ValueError(f"malformed canonical value {tag!r}")
    if tag == "i":
        return int(rest[0])
    if tag == "f":
        return float(rest[0])
    if tag == "c":
        return complex(float(rest[0]), float(rest[1]))
    if tag == "b":
        return bytes.fromhex(rest[0])
    if tag == "d":
        pairs = rest[0]
        if any(type(p) is not list or len(p) != 2 for p in pairs):
            raise ValueError("malformed dict")
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in pairs}
    items = [decode(v, depth + 1) for v in rest[0]]
    return _CONTAINERS[tag](items)


_CONTAINERS = {"l": list, "t": tuple, "s": set, "fs": frozenset, "d": dict}


# ---------------------------------------------------------------------------------------------
# The candidate process


def _serve(data: dict, confine, requests: int, replies: int) -> None:
    """In the forked child: confine, load the code, answer calls until stdin ends."""
    def send(obj: dict) -> None:
        line = (json.dumps(obj) + "\n").encode()
        while line:
            line = line[os.write(replies, line):]

    try:
        _confine(data, confine)
    except BaseException as err:  # the layers detection promised: an infrastructure failure
        send({"infra": f"{type(err).__name__}: {err}"})
        os._exit(3)
    ns = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(data["code"], "solution.py", "exec"), ns)
        function = ns.get(data["entry_point"])
        if not callable(function):
            raise NameError("no function named " + data["entry_point"])
    except BaseException as err:
        send({"load_error": _describe(err)})
        os._exit(0)
    send({"loaded": True})
    reader = os.fdopen(requests, "rb")
    for line in reader:
        call = json.loads(line)
        try:
            value = function(*decode(call["args"]), **decode(call["kwargs"]))
            reply = {"seq": call["seq"], "value": encode(value)}
        except BaseException as err:
            reply = {"seq": call["seq"], "raised": _name(err), "message": _describe(err)}
        send(reply)
    os._exit(0)


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
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
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
        self.buf, self.seq, self.ended = b"", 0, None

    def receive(self) -> dict:
        """The candidate's next reply (a JSON object); Ended when it cannot come."""
        while b"\n" not in self.buf:
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
                if len(self.buf) > REPLY_LIMIT:
                    self.stop("crashed", "a reply over the size limit")
            elif self.exit_fd in ready or not ready:
                self._check_exit(block=False)
        line, _, self.buf = self.buf.partition(b"\n")
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if type(reply) is not dict:
            self.stop("crashed", "a malformed reply")
        return reply

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
        pid, status, usage = os.wait4(self.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            return
        cpu = usage.ru_utime + usage.ru_stime
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGKILL, signal.SIGXCPU) \
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
        self.seq += 1
        line = json.dumps({"seq": self.seq, "args": encode(list(args)),
                           "kwargs": encode(kwargs)}).encode() + b"\n"
        try:
            while line:
                line = line[os.write(self.requests, line):]
        except BrokenPipeError:
            self._check_exit(block=True)
        reply = self.receive()
        if reply.get("seq") != self.seq:
            self.stop("crashed", "a reply out of order")
        if "value" in reply:
            try:
                return decode(reply["value"])
            except (ValueError, TypeError, RecursionError, OverflowError):
                self.stop("crashed", "a malformed value")
        raise _rebuilt(reply.get("raised"), reply.get("message"))


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

    def emit(**fields) -> None:
        out.write(json.dumps(fields) + "\n")

    data = json.loads(sys.stdin.buffer.readline())
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # a signal must not turn into an exception here
    confine.prctl(confine.PR_SET_DUMPABLE, 0)  # no ptrace, no /proc/<pid>/{fd,mem} for peers
    confine.prctl(confine.PR_SET_CHILD_SUBREAPER, 1)  # double-forked orphans stay ours
    try:
        if data["mounts"]:
            confine.private_view(**data["mounts"])
    except OSError as err:
        emit(infra=f"private mounts: {err}")
        return
    for name in data["preimport"]:  # before the candidate drops privileges
        try:
            __import__(name)
        except Exception:
            pass
    link = Link(data, confine)
    emit(ready=True)
    try:
        _run(json.loads(sys.stdin.buffer.readline()), link, emit)
    finally:
        confine.kill_descendants(os.getpid())
    emit(done=True)
    out.close()


def _run(tests: dict, link: Link, emit) -> None:
    """Run the test statements here, calling the candidate process for `candidate`."""
    try:
        first = link.receive()
    except Ended as end:
        emit(ended=end.kind, why=str(end))
        return
    for kind in ("infra", "load_error"):
        if kind in first:
            emit(**{kind: str(first[kind])[:300]})
            return
    tns = {"__name__": "tests", "__builtins__": builtins}
    try:
        exec(compile(tests["helpers"], "prompt.py", "exec"), tns)
        exec(compile(tests["setup"], "tests.py", "exec"), tns)
    except BaseException as err:
        emit(abort=-1, why=_describe(err))
        return
    # the entry point's own name too: some tests call it (HumanEval/33 compares it with
    # candidate), and in the prompt code it is only a stub
    tns["candidate"] = tns[tests["entry_point"]] = Candidate(link)
    for i, (statement, test) in enumerate(zip(tests["body"], tests["is_test"])):
        try:
            exec(compile(statement, "tests.py", "exec"), tns)
        except Ended as end:
            emit(ended=end.kind, why=str(end))
            return
        except BaseException as err:
            if not test:
                emit(abort=i, why=_describe(err))
                return
            emit(fail=i, why=_describe(err))
            continue
        if test:
            emit(passed=i)
