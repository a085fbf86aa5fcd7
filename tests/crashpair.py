"""The crash harness over a trainer and an inference server, two processes killed in turn.

    report = pair_test(cfg, kills=120, seed=0, workdir=Path("/tmp/pair"),
                       server_command=SERVER)   # cfg: engine.name = "remote", one URL

A `rollwise serve` process (started from `server_command`, its port taken from the
config's one URL) and a trainer train the tiny model. The trainer is a child forked from
this process once the heavy modules are imported and goes the way of `rollwise train`
(`launch.open_run`, then `train_run`; with `--resume` semantics after a death), so a
start costs the model's build, not the imports. One trainer trains the reference run
uninterrupted. Then, round after round, a victim (the trainer or the server, about half
each) gets SIGKILL (or, `soft_share` of the time, SIGINT or SIGTERM) at a random instant
of the trainer's life (uniform over 1.1 times the reference's span from its start to its
last checkpoint, scaled by the share of steps left to train: the report after it needs no
server, and takes seconds on a loaded machine), or (`sync_share` of the time) while the
server loads weights (`GET /v1/weights` says `updating`), or (`generate_share`) while it
generates (`GET /v1/stats`: sequences pending). A killed server is started again on the same port,
from the base model (the trainer's resume publishes its checkpoint's weights to it); a
trainer that died, or stopped with the server's error, is resumed. A round ends when a
trainer finishes its run.

Checked: every finished run equals the reference (`crashtest.compare`: metrics to float32
rounding, trajectories stored exactly once, summary counters; an asynchronous run only in
what timing cannot change, with `crashtest.async_checks`); every batch a checkpoint kept
(collected ahead) is trained as it was kept (`crashtest.check_kept`); every trainer stopped
by a dead server exits within `engine.remote_timeout_s` with an error naming the server
and the route (the phase: `/v1/generate` rollouts, `/v1/weights/update` the weight sync);
no trainer outlives a dead server by more than that.

The trainer does not wait for a restarted server: a server that comes back holds other
weights (its base model) and none of the requests in flight, so the trainer stops with
the error and `--resume` (here, the next trainer) publishes the checkpoint's weights to
it before rolling out again (docs/remote.md, "Crash harness").

Imports the config, the launcher and crashtest's comparison; httpx for the probes.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from crashtest import (
    async_checks,
    check_kept,
    child_exit,
    compare,
    kept_batches,
    read_run,
    timing_free,
    wait_exit,
)
from rollwise.compose.config import Config, load_config

SERVER = [sys.executable, "-m", "rollwise", "serve", "--model", "tiny", "--threads", "1",
          "--port", "{port}"]
VICTIMS = ("trainer", "server")
# where a kill landed, as the server saw it at that instant: the trainer's first weight
# update not yet done (build, resume), a weight update running, rollouts on the server,
# neither (the trainer scores, updates, evaluates or checkpoints on its own), or the run's
# last checkpoint written (the report, the summary, the exit)
PHASES = ("startup", "sync", "generate", "trainer", "finish")
# the routes an error after a server's death may name: `rollwise serve`'s, then vLLM's
ROUTES = ("/v1/generate", "/v1/weights/update", "/v1/completions", "/pause", "/collective_rpc",
          "/reset_prefix_cache", "/update_weight_version", "/resume", "/weight_info",
          "/v1/load_lora_adapter", "/health")
STOP_GRACE_S = 30.0  # a server's shutdown after SIGTERM or SIGINT, before it is SIGKILLed
# a trainer's exit after its request timed out (the error written, the run closed, the
# interpreter gone): a stop within remote_timeout_s + this is not a hang. A request sent
# just before the kill times out remote_timeout_s after it, so without it an error at
# 20.1 s of a 20 s time-out failed the harness
EXIT_GRACE_S = 5.0
REL = 1e-4  # metrics against the reference: float32 rounding of the server's log-probs


@dataclass
class PairReport:
    kills: Counter = field(default_factory=Counter)  # (victim, phase) -> kills
    signals: Counter = field(default_factory=Counter)  # signal name -> kills
    rounds: int = 0
    resumes: int = 0  # trainers started on a run that had one before
    server_restarts: int = 0
    errors: list[tuple[float, str]] = field(default_factory=list)  # (seconds, message)
    outlived: int = 0  # server kills the trainer finished without needing it again
    reference_seconds: float = 0.0  # the reference's start to its last checkpoint
    kept: int = 0  # batches collected ahead that resumed trainers trained as checkpointed
    forced: int = 0  # servers that outlived SIGTERM or SIGINT by STOP_GRACE_S: SIGKILLed
    failures: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.kills.values())

    @property
    def ok(self) -> bool:
        return not self.failures

    def longest_error_s(self) -> float:
        return max((s for s, _ in self.errors), default=0.0)

    def table(self) -> str:
        """Kills per victim (rows) and phase (columns), Markdown."""
        lines = ["| victim | " + " | ".join(PHASES) + " | all |",
                 "|---" * (len(PHASES) + 2) + "|"]
        for v in VICTIMS:
            row = [self.kills[(v, p)] for p in PHASES]
            lines.append(f"| {v} | " + " | ".join(map(str, row)) + f" | {sum(row)} |")
        cols = [sum(self.kills[(v, p)] for v in VICTIMS) for p in PHASES]
        lines.append("| both | " + " | ".join(map(str, cols)) + f" | {self.total} |")
        return "\n".join(lines)


class Server:
    """The server process: started from `command` ("{port}" filled in), probed, signalled.
    `zygote`: `command` is a launcher that imports the server once and, for each line
    "start" on its input, forks a server and writes its process id (a restart then costs
    no imports: scripts/crash_harness.py serve-zygote)."""

    def __init__(self, command: list[str], url: str, log: Path, zygote: bool = False):
        self.url, self.log, self.zygote = url.rstrip("/"), log, zygote
        port = url.rstrip("/").rsplit(":", 1)[1]
        self.command = [part.replace("{port}", port) for part in command]
        self.proc: subprocess.Popen | None = None  # the server, or the launcher
        self.pid = 0  # the server's

    def start(self, timeout_s: float = 300.0) -> None:
        if self.zygote:
            if self.proc is None:
                with self.log.open("ab") as out:
                    self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE,
                                                 stdout=subprocess.PIPE, stderr=out)
            self.proc.stdin.write(b"start\n")
            self.proc.stdin.flush()
            self.pid = int(self.proc.stdout.readline() or 0)
        else:
            with self.log.open("ab") as out:
                self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)
            self.pid = self.proc.pid
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"the server exited: {self.log.read_text()[-1500:]}")
            if self._get("/health") is not None:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the server did not answer /health within {timeout_s:g}s")

    def alive(self) -> bool:
        if not self.zygote:
            return self.proc is not None and self.proc.poll() is None
        try:  # the launcher reaps its children: a dead server's id is gone at once
            os.kill(self.pid, 0)
            return self.pid > 0
        except ProcessLookupError:
            return False

    def _get(self, route: str):
        try:
            r = httpx.get(self.url + route, timeout=5)
            return r if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    def updates(self) -> int:
        """Weight updates the server has finished (ok or not), from /metrics."""
        r = self._get("/metrics")
        lines = r.text.splitlines() if r is not None else []
        return int(sum(float(x.rsplit(" ", 1)[1]) for x in lines
                       if x.startswith("rollwise_weight_updates_total")))

    def phase(self, updates_at_start: int) -> str:
        """Where the pair stands now (PHASES); generating first, the briefest."""
        if self.pending():
            return "generate"
        if self.updating():
            return "sync"
        return "startup" if self.updates() <= updates_at_start else "trainer"

    def pending(self) -> int:
        """Sequences the server has queued or running."""
        r = self._get("/v1/stats")
        return int(r.json().get("pending", 0)) if r is not None else 0

    def updating(self) -> bool:
        r = self._get("/v1/weights")
        return r is not None and bool(r.json().get("updating"))

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, sig: int, timeout_s: float = 60.0) -> None:
        """Send `sig`, then wait for the exit (SIGKILL past `timeout_s`)."""
        self.signal(sig)
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() > deadline:
                self.signal(signal.SIGKILL)
                raise RuntimeError(f"the server ignored {signal.Signals(sig).name} for "
                                   f"{timeout_s:g}s")
            if not self.zygote:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(0.05)
            else:
                time.sleep(0.05)

    def close(self) -> None:
        """The server, and the launcher, gone."""
        self.stop(signal.SIGKILL)
        if self.zygote and self.proc is not None:
            self.proc.kill()
            self.proc.wait(30)


class VLLMPairServer(Server):
    """The real vLLM in the pair (serve/vllm.py's VLLMServer): its API server, engine core
    and worker in a session of their own. SIGKILL kills them all (a machine losing the
    server), SIGINT or SIGTERM goes to the API server (which shuts the rest down). Probed
    through vLLM's routes: the tag of the weights it holds (/weight_info), requests running
    or waiting (/metrics), a load under way (/is_paused)."""

    def __init__(self, vllm, log: Path):
        super().__init__([], vllm.url, log)
        self.vllm = vllm
        self.vllm.log = log

    def start(self, timeout_s: float = 300.0) -> None:
        self.vllm.start(timeout_s)
        self.proc = self.vllm.process
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                (os.killpg if sig == signal.SIGKILL else os.kill)(self.pid, sig)

    def stop(self, sig: int, timeout_s: float = 60.0) -> bool:
        """Send `sig`, then wait for the exit; True when it had to be SIGKILLed after
        `timeout_s` (vLLM 0.32's API server can hang in its shutdown when SIGTERM arrives
        inside a weight reload: its engine core force-killed, it never exits). A
        supervisor kills such a server, and so does this one; the harness counts it."""
        try:
            super().stop(sig, timeout_s)
            return False
        except RuntimeError:
            return True
        finally:  # what the API server left (its engine core, its worker)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def close(self) -> None:
        self.stop(signal.SIGKILL)

    def updates(self) -> int:
        r = self._get("/weight_info")
        tag = r.json().get("weight_version") if r is not None else None
        held = tag[10:] if isinstance(tag, str) and tag.startswith("rollwise-v") else ""
        return int(held) if held.isdigit() else -1

    def pending(self) -> int:
        r = self._get("/metrics")
        lines = r.text.splitlines() if r is not None else []
        return int(sum(float(x.rsplit(" ", 1)[1]) for x in lines
                       if x.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))))

    def updating(self) -> bool:
        r = self._get("/is_paused")
        return r is not None and bool(r.json().get("is_paused"))


def _trainer(cfg: Config, root: Path) -> int:
    """Fork a trainer on `root`: resumed when it holds a config.toml (checked to read back
    as `cfg`), else a new run (a directory left without one is emptied first)."""
    resume = (root / "config.toml").is_file()
    if root.exists() and not resume:
        shutil.rmtree(root)
    pid = os.fork()
    if pid:
        return pid
    log = os.open(root.parent / f"{root.name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)

    def work() -> None:
        from rollwise.pipeline.launch import RunFinished, open_run, train_run

        if resume and load_config(root / "config.toml") != cfg:
            raise ValueError("config.toml does not read back as the run's config")
        try:
            opened = open_run(cfg, resume=root if resume else None, echo=lambda s: None)
        except RunFinished:  # killed after the end: nothing left to do
            return
        train_run(opened)

    child_exit(work, root.parent / f"{root.name}.error")
    raise AssertionError("unreachable")


def pair_test(cfg: Config, kills: int, seed: int, workdir: Path,
              server_command: list[str] | None = None, zygote: bool = False,
              sync_share: float = 0.3, generate_share: float = 0.2,
              soft_share: float = 0.2, log=lambda s: None, vllm=None) -> PairReport:
    """Run the harness (the module docstring) until at least `kills` kills; against the
    real vLLM when `vllm` (a serve/vllm.py VLLMServer on the config's port) is given."""
    if cfg.engine.name != "remote" or len(cfg.engine.remote_urls) != 1:
        raise ValueError("pair_test needs engine.name='remote' and one engine.remote_urls")
    import rollwise.pipeline.launch  # noqa: F401 - imported once, before the forks
    from rollwise.models import load_policy

    load_policy(cfg.model.name)  # the model's libraries too: a trainer then builds in ~1 s
    workdir.mkdir(parents=True, exist_ok=True)
    cfg.run.output_dir = str(workdir)
    server = (VLLMPairServer(vllm, workdir / "server.log") if vllm is not None else
              Server(server_command or SERVER, cfg.engine.remote_urls[0], workdir / "server.log",
                     zygote=zygote))
    harness = _Harness(cfg, server, random.Random(seed), kills,
                       (sync_share, generate_share, soft_share))
    server.start()
    try:
        reference = harness.reference(workdir / "reference")
        while harness.report.total < kills:
            harness.report.rounds += 1
            root = workdir / f"round_{harness.report.rounds}"
            harness.round(root)
            failures = harness.check(root, reference)
            harness.report.failures += failures
            log(f"round {harness.report.rounds}: {harness.report.total} kills so far"
                + (f"; FAILED: {failures}" if failures else ""))
    finally:
        server.close()
    return harness.report


def _left(root: Path, num_steps: int) -> float:
    """The share of the run's steps after its last checkpoint (1 for a new run)."""
    steps = [int(p.name.split("_")[1]) for p in (root / "checkpoints").glob("step_*")]
    return 1 - max(steps, default=0) / num_steps


class Rounds:
    """The rounds every forked-trainer harness runs (this one, tests/crashranks.py): the
    reference run, then run directories killed and resumed until a trainer finishes each,
    and what a finished one must equal. A subclass's `_life` runs one trainer and perhaps
    one kill; `report` has reference_seconds, resumes, kept and failures."""

    def __init__(self, cfg: Config, rng: random.Random, kills: int, report):
        self.cfg, self.rng, self.kills, self.report = cfg, rng, kills, report
        self.kept: dict[int, list[tuple]] = {}  # this round's (crashtest.kept_batches)

    def _config(self, name: str) -> Config:
        cfg = self.cfg.model_copy(deep=True)
        cfg.run.name = name
        return cfg

    def reference(self, root: Path) -> tuple[list[dict], list[tuple], dict]:
        """Train `root` uninterrupted; its records (crashtest.read_run)."""
        start = time.monotonic()
        pid = _trainer(self._config(root.name), root)
        last = root / "checkpoints" / f"step_{self.cfg.run.num_steps}"
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if not self.report.reference_seconds and last.exists():
                self.report.reference_seconds = time.monotonic() - start
            time.sleep(0.02)
        if (root.parent / f"{root.name}.error").exists():
            raise RuntimeError(f"the reference run failed: {self._error(root)}")
        return read_run(root)

    def check(self, root: Path, reference: tuple, rel: float = 0.0) -> list[str]:
        """What is wrong with the finished run `root` ([] if nothing): as the reference
        (crashtest.compare, metrics to `rel`; an asynchronous run's version mix depends on
        timing, so there only what timing cannot change), and within the staleness bound."""
        if not (root / "summary.json").is_file():
            return [f"{root.name}: the run did not finish"]
        exact = timing_free(self.cfg)
        out = compare(root, reference, rel=rel, exact=exact) + check_kept(root, self.kept)
        self.report.kept += len(self.kept)
        if exact:
            return out
        return out + async_checks(root, self.cfg.schedule.max_staleness)

    def round(self, root: Path) -> None:
        """Kill and resume until a trainer finishes `root`."""
        cfg = self._config(root.name)
        self.kept = {}
        for life in range(4 * self.kills + 10):  # every life but the last is killed
            self.report.resumes += life > 0
            self.kept.update(kept_batches(root))  # what this trainer goes on from
            code = self._life(cfg, root)
            if code is None or code == 0:
                return
        self.report.failures.append(f"{root.name}: never finished")

    def _life(self, cfg: Config, root: Path) -> int | None:
        raise NotImplementedError

    def _error(self, root: Path) -> str:
        """The last trainer's error message (its file removed: the next one writes anew)."""
        path = root.parent / f"{root.name}.error"
        text = path.read_text() if path.is_file() else "(no message)"
        path.unlink(missing_ok=True)
        return text

    def _ended(self, root: Path, code: int) -> int | None:
        """A trainer's exit code; None, recorded as a failure, when it failed (code 1)."""
        if code == 1:
            self.report.failures.append(f"{root.name}: a trainer failed: "
                                        f"{self._error(root)[:300]}")
            return None
        return code


class _Harness(Rounds):
    """The rounds of `pair_test` and what they found (`report`)."""

    def __init__(self, cfg: Config, server: Server, rng: random.Random, kills: int,
                 shares: tuple[float, float, float]):
        super().__init__(cfg, rng, kills, PairReport())
        self.server = server
        self.sync_share, self.generate_share, self.soft_share = shares
        self.timeout_s = cfg.engine.remote_timeout_s

    def check(self, root: Path, reference: tuple, rel: float = REL) -> list[str]:
        return super().check(root, reference, rel)

    def _life(self, cfg: Config, root: Path) -> int | None:
        """One trainer on `root` and perhaps one kill; the trainer's exit code, or None
        after a failure (recorded)."""
        updates = self.server.updates()
        pid = _trainer(cfg, root)
        born = time.monotonic()
        code = None
        if self.report.total < self.kills:
            code = self._until_instant(pid, born, _left(root, cfg.run.num_steps))
        if code is not None:  # it finished (or failed) first
            return self._ended(root, code)
        if self.report.total >= self.kills:
            return self._ended(root, wait_exit(pid))
        last = root / "checkpoints" / f"step_{cfg.run.num_steps}"
        phase = "finish" if last.exists() else self.server.phase(updates)
        victim = self.rng.choice(VICTIMS)
        sig = signal.SIGKILL
        if self.rng.random() < self.soft_share:
            sig = self.rng.choice((signal.SIGINT, signal.SIGTERM))
        self.report.kills[(victim, phase)] += 1
        self.report.signals[sig.name] += 1
        if victim == "trainer":
            os.kill(pid, sig)
            return self._ended(root, wait_exit(pid))
        return self._server_killed(pid, root, sig)

    def _until_instant(self, pid: int, born: float, left: float) -> int | None:
        """Wait for the kill instant: a random one of the reference's span (times `left`,
        the share of its steps still to train), or (sync_share, generate_share of the
        time) the moment the server loads weights, or generates. The trainer's exit code
        if it ended first."""
        span = self.report.reference_seconds * max(left, 0.2)
        target = self.rng.choices(("any", "sync", "generate"), (
            1 - self.sync_share - self.generate_share, self.sync_share, self.generate_share))[0]
        deadline = born + (1.5 * span if target != "any" else self.rng.uniform(0, 1.1 * span))
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            if target == "sync" and self.server.updating():
                time.sleep(self.rng.uniform(0.0, 0.05))  # somewhere inside it
                return None
            if target == "generate" and self.server.pending():
                return None
            time.sleep(0.01 if target != "any" else min(0.05, max(deadline - time.monotonic(), 0)))
        return None

    def _server_killed(self, pid: int, root: Path, sig: signal.Signals) -> int | None:
        """After `sig` to the server: the trainer must finish, or stop within the time-out
        with an error naming the server and the route; then the server starts again."""
        killed = time.monotonic()
        self.server.signal(sig)
        code = None
        while code is None and time.monotonic() < killed + 3 * self.timeout_s:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
            else:
                time.sleep(0.02)
        seconds = time.monotonic() - killed
        if self.server.stop(signal.SIGKILL if sig == signal.SIGKILL else sig,
                            timeout_s=STOP_GRACE_S):
            self.report.forced += 1
        self.server.start()
        self.report.server_restarts += 1
        if code is None:
            os.kill(pid, signal.SIGKILL)
            wait_exit(pid)
            self.report.failures.append(f"{root.name}: the trainer outlived the dead server "
                                        f"by {seconds:.0f}s (a hang)")
            return None
        if code == 0:
            self.report.outlived += 1
            return 0
        message = self._error(root)
        self.report.errors.append((seconds, message))
        if code != 1 or self.server.url not in message or not any(r in message for r in ROUTES):
            self.report.failures.append(f"{root.name}: exit {code} after the server's death, "
                                        f"not a clear error: {message[:300]}")
            return None
        if seconds > self.timeout_s + EXIT_GRACE_S:
            self.report.failures.append(f"{root.name}: the error took {seconds:.1f}s, over "
                                        f"engine.remote_timeout_s={self.timeout_s:g} and "
                                        f"{EXIT_GRACE_S:g}s to exit")
        return code
