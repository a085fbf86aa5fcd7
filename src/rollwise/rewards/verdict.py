"""The limits of one sandboxed execution (`SandboxLimits`), its verdict (`ExecResult`), and the
trainer's side of the started sandbox: feed it the program and the code, then the tests once
the runner is ready; read the runner's result lines (fd 1) and the code's output (fd 2) under
the limits; kill the process group; decide the verdict from what the runner reported.

Imports the standard library only; `rollwise.rewards.sandbox` starts the process and calls
`communicate`.
"""

from __future__ import annotations

import marshal
import os
import selectors
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any


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


def communicate(proc: subprocess.Popen, stdin: tuple[bytes, bytes], limits: SandboxLimits,
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


def frame(kind: str, message: dict) -> bytes:
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


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
