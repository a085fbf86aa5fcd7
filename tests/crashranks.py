"""The crash harness over a sharded learner: one rank, or the driver, killed at random.

    report = rank_test(cfg, kills=20, seed=0, workdir=Path("/tmp/ranks"))
                                              # cfg: learner.shards = N >= 2, local ranks

A trainer (forked from this process once the heavy modules are imported; it goes the way
of `rollwise train`: `launch.open_run`, then `train_run`, with `--resume` semantics after a
death) drives N learner ranks, processes it spawns. One trainer trains the reference run
uninterrupted. Then, round after round, at a random instant of a trainer's life (uniform
over 1.1 times the reference's span, scaled by the share of steps left to train), the
victim gets a signal: one rank picked at random (SIGKILL, about `rank_share` of the time),
or the driver (SIGKILL, or SIGINT `sigint_share` of those times). Where it landed is
recorded (`PHASES`): ranks still starting, a rank busy in a call (its CPU time moving:
an update, a reference pass, a publication, a checkpoint's shard), ranks idle (the driver
rolls out, scores or evaluates), or the run's last checkpoint written.

Checked, for each kill:

- a killed rank stops the trainer with `LearnerDied` naming that rank ("learner rank r of
  N failed during '<phase>'") within `learner.shard_timeout_s` of the kill (the driver
  notices a dead rank at its next call: at once when it is waiting on one); unless the
  trainer had no call left to make (then it finishes, code 0);
- no rank outlives its driver by more than `learner.shard_timeout_s` (a SIGKILLed driver
  leaves its ranks orphans: they must find the closed pipe and exit, not linger holding a
  copy of the model each);

and for each finished round, as every harness does (crashtest.compare, check_kept): every
step's metrics equal to the uninterrupted reference's, every completed trajectory stored
exactly once, summary counters adding up.

Imports the pair harness's rounds (`crashpair.Rounds`: the reference, the rounds, the
comparison) and its forked trainer.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from crashpair import Rounds, _left, _trainer
from crashtest import wait_exit
from rollwise.compose.config import Config

VICTIMS = ("rank", "driver")
# where a kill landed: ranks not all started, a rank inside a call, ranks waiting for the
# driver's next call, the run's last checkpoint written (the report, the exit)
PHASES = ("startup", "busy", "idle", "finish")


@dataclass
class RankReport:
    kills: Counter = field(default_factory=Counter)  # (victim, phase) -> kills
    signals: Counter = field(default_factory=Counter)  # signal name -> kills
    rounds: int = 0
    resumes: int = 0
    errors: list[tuple[float, str]] = field(default_factory=list)  # rank kills: (s, message)
    orphans_s: list[float] = field(default_factory=list)  # driver kills: its ranks' exit
    finished: int = 0  # rank kills after which the trainer finished without it
    reference_seconds: float = 0.0
    kept: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.kills.values())

    @property
    def ok(self) -> bool:
        return not self.failures

    def table(self) -> str:
        """Kills per victim (rows) and phase (columns), Markdown."""
        lines = ["| victim | " + " | ".join(PHASES) + " | all |",
                 "|---" * (len(PHASES) + 2) + "|"]
        for v in VICTIMS:
            row = [self.kills[(v, p)] for p in PHASES]
            lines.append(f"| {v} | " + " | ".join(map(str, row)) + f" | {sum(row)} |")
        return "\n".join(lines)


def rank_pids(parent: int) -> list[int]:
    """The learner ranks among `parent`'s children (spawned: multiprocessing's
    spawn_main), oldest first, which is rank order."""
    pids = []
    for task in Path(f"/proc/{parent}/task").glob("*"):
        try:
            pids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    out = []
    for pid in sorted(pids):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return out


def cpu_ticks(pid: int) -> int:
    """User plus system clock ticks `pid` has run (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def rank_test(cfg: Config, kills: int, seed: int, workdir: Path, rank_share: float = 0.7,
              sigint_share: float = 0.3, log=lambda s: None) -> RankReport:
    """Run the harness (the module docstring) until at least `kills` kills."""
    if cfg.learner.shards < 2 or cfg.run.backend != "local":
        raise ValueError("rank_test needs learner.shards >= 2 and run.backend='local'")
    import rollwise.pipeline.launch  # noqa: F401 - imported once, before the forks
    from rollwise.models import load_policy

    load_policy(cfg.model.name)
    workdir.mkdir(parents=True, exist_ok=True)
    cfg.run.output_dir = str(workdir)
    harness = _Harness(cfg, random.Random(seed), kills, rank_share, sigint_share)
    reference = harness.reference(workdir / "reference")
    while harness.report.total < kills:
        harness.report.rounds += 1
        root = workdir / f"round_{harness.report.rounds}"
        harness.round(root)
        failures = harness.check(root, reference)
        harness.report.failures += failures
        log(f"round {harness.report.rounds}: {harness.report.total} kills so far"
            + (f"; FAILED: {failures}" if failures else ""))
    return harness.report


class _Harness(Rounds):
    """The rounds of `rank_test` and what they found (`report`)."""

    def __init__(self, cfg: Config, rng: random.Random, kills: int, rank_share: float,
                 sigint_share: float):
        super().__init__(cfg, rng, kills, RankReport())
        self.rank_share, self.sigint_share = rank_share, sigint_share
        self.world, self.timeout_s = cfg.learner.shards, cfg.learner.shard_timeout_s

    def _life(self, cfg: Config, root: Path) -> int | None:
        """One trainer on `root` and perhaps one kill; its exit code, or None after a
        failure (recorded)."""
        pid = _trainer(cfg, root)
        born = time.monotonic()
        if self.report.total >= self.kills:
            return self._ended(root, wait_exit(pid))
        span = self.report.reference_seconds * max(_left(root, cfg.run.num_steps), 0.2)
        deadline = born + self.rng.uniform(0, 1.1 * span)
        ranks: list[int] = []
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return self._ended(root, os.waitstatus_to_exitcode(status))
            if len(ranks) < self.world:
                ranks = rank_pids(pid)
            time.sleep(min(0.02, max(deadline - time.monotonic(), 0)))
        ranks = rank_pids(pid)
        phase = self._phase(root, ranks)
        victim = "rank" if ranks and self.rng.random() < self.rank_share else "driver"
        sig = signal.SIGKILL
        if victim == "driver" and self.rng.random() < self.sigint_share:
            sig = signal.SIGINT
        self.report.kills[(victim, phase)] += 1
        self.report.signals[sig.name] += 1
        if victim == "driver":
            os.kill(pid, sig)
            code = wait_exit(pid)
            self._orphans(root, rank_pids(pid) or ranks)
            return self._ended(root, code)
        return self._rank_killed(pid, root, self.rng.randrange(len(ranks)), ranks)

    def _phase(self, root: Path, ranks: list[int]) -> str:
        if (root / "checkpoints" / f"step_{self.cfg.run.num_steps}").exists():
            return "finish"
        if len(ranks) < self.world:
            return "startup"
        before = [cpu_ticks(r) for r in ranks]
        time.sleep(0.03)  # a clock tick is 10 ms: a rank in a call moves in 30
        return "busy" if any(cpu_ticks(r) > b for r, b in zip(ranks, before)) else "idle"

    def _orphans(self, root: Path, ranks: list[int]) -> None:
        """After the driver's death: its ranks must exit within learner.shard_timeout_s."""
        start = time.monotonic()
        while any(alive(r) for r in ranks):
            if time.monotonic() > start + self.timeout_s:
                for r in ranks:
                    if alive(r):
                        os.kill(r, signal.SIGKILL)
                self.report.failures.append(
                    f"{root.name}: ranks outlived their killed driver by "
                    f"{self.timeout_s:g}s (learner.shard_timeout_s)")
                return
            time.sleep(0.02)
        self.report.orphans_s.append(time.monotonic() - start)

    def _rank_killed(self, pid: int, root: Path, rank: int, ranks: list[int]) -> int | None:
        """SIGKILL to rank `rank`: the trainer must finish, or stop within the time-out
        with LearnerDied naming that rank; its other ranks exit with it."""
        os.kill(ranks[rank], signal.SIGKILL)
        killed = time.monotonic()
        code = None
        while code is None and time.monotonic() < killed + 3 * self.timeout_s:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
            else:
                time.sleep(0.02)
        seconds = time.monotonic() - killed
        if code is None:
            os.kill(pid, signal.SIGKILL)
            wait_exit(pid)
            self._orphans(root, ranks)
            self.report.failures.append(f"{root.name}: the trainer outlived its dead rank "
                                        f"{rank} by {seconds:.0f}s (a hang)")
            return None
        self._orphans(root, ranks)
        if code == 0:
            self.report.finished += 1
            return 0
        message = self._error(root)
        self.report.errors.append((seconds, message))
        named = re.search(rf"learner rank {rank} of {self.world} failed during '\w+'", message)
        if code != 1 or "LearnerDied" not in message or not named:
            self.report.failures.append(f"{root.name}: exit {code} after rank {rank}'s death, "
                                        f"not an error naming it: {message[:300]}")
            return None
        if seconds > self.timeout_s:
            self.report.failures.append(f"{root.name}: the error took {seconds:.1f}s, over "
                                        f"learner.shard_timeout_s={self.timeout_s:g}")
        return code
