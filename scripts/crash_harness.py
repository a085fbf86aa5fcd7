"""Kill a tiny rollwise run at many random instants and check every resumed run.

    python scripts/crash_harness.py --kills 300 [--seed 0] [--config configs/tiny_arith.toml]
        [--set key=value ...] [--workdir /tmp/rollwise-crash] [--user-code]
        [--mode sync|async|both]

    python scripts/crash_harness.py --pair --kills 120 [--mode sync|async|both]
        [--sync-delay 0.3] [--timeout 20] [--server rollwise|vllm]

    python scripts/crash_harness.py --ranks 2 --kills 20 [--timeout 60]

--user-code: the run also scores with a verifier and a group term (with an option) named
by import path, as a user's own code is (tests/crashtest.py's USER_CODE).

--mode: the run synchronous (the default without --pair), asynchronous in one process
(max_staleness 1: compared in what timing cannot change, and every batch a checkpoint
kept must be trained as kept), or the kills split between the two.

--pair: a trainer and a `rollwise serve` process, either killed (tests/
crashpair.py); prints the kills per victim and phase. The servers are forked by this
script (`serve-zygote DELAY ...`: the libraries imported once), which makes each weight
load take DELAY seconds more so that kills can land inside one (the tiny model's takes
about 10 ms). --mode both splits
the kills between a synchronous run and an asynchronous one (max_staleness 1).
--server vllm: the server is the real vLLM (`make vllm`; engine.remote_kind = "vllm"),
started eager on the tiny model (about 35 s a start, inside the harness's waits); a SIGKILL
takes its whole process group.

--ranks N: the learner sharded over N local ranks (learner.shards = N); at random
instants one rank is SIGKILLed, or the driver (SIGKILL or SIGINT) (tests/crashranks.py):
a dead rank must stop the trainer within --timeout (learner.shard_timeout_s) with an
error naming it, and a dead driver's ranks must exit; prints the kills per victim and
phase.

Exits 0 when every finished run equals the uninterrupted reference (metrics, stored
trajectories, summary counters), 1 otherwise. See tests/crashtest.py for what it does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from rollwise.compose.config import load_config

# the harness is test tooling: it lives beside the tests that run it briefly
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from crashpair import SERVER, pair_test  # noqa: E402
from crashranks import rank_test  # noqa: E402
from crashtest import USER_CODE, crash_test  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ["run.num_steps=6", "run.threads=1", "run.checkpoint_every=2",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "task.num_eval=8", "eval.every=3"]
MODES = {"sync": [], "async": ["schedule.mode='async'", "schedule.max_staleness=1"]}


def server_launcher(delay_s: float) -> list[str]:
    """The harness's server command: this script's `serve-zygote` (crashpair.Server's
    `zygote`), its servers `rollwise serve` with `delay_s` added to each weight load."""
    return [sys.executable, __file__, "serve-zygote", str(delay_s), *SERVER[3:]]


def serve_zygote(delay_s: float, argv: list[str]) -> None:
    """Import the server's libraries once, then fork a `rollwise <argv>` for each line on
    stdin, writing its process id; each weight load takes `delay_s` more (on the engine's
    thread, where the load itself runs), so that kills can land inside one."""
    from rollwise.cli import main as cli_main
    from rollwise.models import load_policy
    from rollwise.serve import make_server  # noqa: F401 - imported before the forks
    from rollwise.serve.weights import WeightStore

    apply = WeightStore.apply

    def slow_apply(self, *args, **kwargs):
        time.sleep(delay_s)
        return apply(self, *args, **kwargs)

    WeightStore.apply = slow_apply
    load_policy("tiny")  # the model's libraries too
    # each server's death is reaped at once, so the harness sees its id gone
    signal.signal(signal.SIGCHLD, lambda *_: _reap())
    for _ in sys.stdin:
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.dup2(2, 1)  # its output to the log, not to the harness's pipe
            sys.argv = ["rollwise", *argv]
            try:
                cli_main()
            finally:
                os._exit(0)
        print(pid, flush=True)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def pair_config(workdir: Path, port: int, mode: str, timeout_s: float, config: str,
                overrides: list[str]):
    """The tiny run against one server on `port`, in `mode` (MODES)."""
    return load_config(config, [
        f"run.output_dir='{workdir}'", *TINY, "engine.name='remote'",
        f"engine.remote_urls=['http://127.0.0.1:{port}']", f"engine.remote_timeout_s={timeout_s}",
        *MODES[mode], *overrides])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(args, workdir: Path) -> int:
    """--pair: the kills split over the modes; a table per mode; 0 when all is well."""
    modes = ["sync", "async"] if args.mode == "both" else [args.mode]
    ok = True
    for i, mode in enumerate(modes):
        kills = args.kills // len(modes) + (i < args.kills % len(modes))
        port = free_port()
        vllm = None
        overrides = list(args.overrides)
        if args.server == "vllm":  # the real vLLM (`make vllm`), eager, on the tiny model
            from rollwise.serve.vllm import VLLMServer, prepare_folder

            folder = prepare_folder("tiny", workdir / "served-tiny")
            vllm = VLLMServer(folder, port, eager=True)
            overrides.append("engine.remote_kind='vllm'")
        cfg = pair_config(workdir / mode, port, mode, args.timeout, args.config, overrides)
        start = time.perf_counter()
        report = pair_test(cfg, kills=kills, seed=args.seed + i, workdir=workdir / mode,
                           server_command=server_launcher(args.sync_delay), zygote=True,
                           log=print, vllm=vllm)
        ok = ok and report.ok
        longest = max(report.errors, default=(0.0, ""), key=lambda e: e[0])
        print(f"\n{mode}: {report.total} kills ({dict(report.signals)}), {report.rounds} runs "
              f"compared, {report.resumes} trainer resumes, {report.server_restarts} server "
              f"restarts, {len(report.errors)} trainer errors from a dead server (longest "
              f"{longest[0]:.1f}s of engine.remote_timeout_s={args.timeout:g}), "
              f"{report.outlived} trainers finished without it, {report.forced} servers "
              f"SIGKILLed after ignoring SIGTERM/SIGINT, {report.kept} kept batches "
              f"trained as checkpointed, reference run "
              f"{report.reference_seconds:.1f}s, total {time.perf_counter() - start:.0f}s: "
              + ("all equal to the uninterrupted run" if report.ok else "FAILED"))
        print(report.table())
        if longest[1]:
            print(f"longest: {longest[1][:400]}")
        for failure in report.failures:
            print("  " + failure)
    return 0 if ok else 1


def main() -> int:
    if sys.argv[1:2] == ["serve-zygote"]:
        serve_zygote(float(sys.argv[2]), sys.argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default=str(ROOT / "configs/tiny_arith.toml"))
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--sigint-share", type=float, default=0.3)
    parser.add_argument("--user-code", action="store_true",
                        help="also score with a verifier and a group term by import path")
    parser.add_argument("--pair", action="store_true",
                        help="kill a trainer and an inference server in turn")
    parser.add_argument("--ranks", type=int, default=0,
                        help="shard the learner over this many local ranks; kill one")
    parser.add_argument("--mode", choices=["sync", "async", "both"], default=None,
                        help="default: both with --pair, else sync")
    parser.add_argument("--sync-delay", type=float, default=0.3,
                        help="--pair: seconds added to each weight load on the server")
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="--pair: engine.remote_timeout_s")
    parser.add_argument("--server", choices=["rollwise", "vllm"], default="rollwise",
                        help="--pair: the server killed beside the trainer: `rollwise serve` "
                        "(forked, seconds to restart) or the real vLLM (`make vllm`; ~35 s)")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rollwise-crash-"))
    if args.pair:
        args.mode = args.mode or "both"
        return run_pair(args, workdir)
    if args.ranks:
        return run_ranks(args, workdir)
    return run_local(args, workdir)


def run_ranks(args, workdir: Path) -> int:
    """--ranks: the sharded learner's harness; 0 when all is well."""
    cfg = load_config(args.config, [f"run.output_dir='{workdir}'", *TINY,
                                    f"learner.shards={args.ranks}",
                                    f"learner.shard_timeout_s={args.timeout}", *args.overrides])
    start = time.perf_counter()
    report = rank_test(cfg, kills=args.kills, seed=args.seed, workdir=workdir,
                       sigint_share=args.sigint_share, log=print)
    longest = max(report.errors, default=(0.0, ""), key=lambda e: e[0])
    print(f"\n{report.total} kills ({dict(report.signals)}), {report.rounds} runs compared, "
          f"{report.resumes} resumes, {len(report.errors)} errors naming the killed rank "
          f"(longest {longest[0]:.1f}s of learner.shard_timeout_s={args.timeout:g}), "
          f"{report.finished} trainers finished without it, orphaned ranks gone in at most "
          f"{max(report.orphans_s, default=0.0):.1f}s, {report.kept} kept batches trained as "
          f"checkpointed, reference run {report.reference_seconds:.1f}s, total "
          f"{time.perf_counter() - start:.0f}s: "
          + ("all equal to the uninterrupted run" if report.ok else "FAILED"))
    print(report.table())
    if longest[1]:
        print(f"longest: {longest[1][:400]}")
    for failure in report.failures:
        print("  " + failure)
    return 0 if report.ok else 1


def run_local(args, workdir: Path) -> int:
    """The harness in one process: the kills split over the modes; 0 when all is well."""
    modes = ["sync", "async"] if args.mode == "both" else [args.mode or "sync"]
    ok = True
    for i, mode in enumerate(modes):
        kills = args.kills // len(modes) + (i < args.kills % len(modes))
        user = USER_CODE if args.user_code else []
        cfg = load_config(args.config, [f"run.output_dir='{workdir / mode}'", *TINY, *user,
                                        *MODES[mode], *args.overrides])
        start = time.perf_counter()
        report = crash_test(cfg, kills=kills, seed=args.seed + i, workdir=workdir / mode,
                            sigint_share=args.sigint_share, log=print)
        ok = ok and report.ok
        print(f"{mode}: {report.kills} kills ({report.sigkills} SIGKILL, {report.sigints} "
              f"SIGINT), {report.resumes} resumes, {report.rounds} runs compared, "
              f"{report.kept} kept batches trained as checkpointed, reference run "
              f"{report.reference_seconds:.1f}s, total {time.perf_counter() - start:.0f}s: "
              + ("all equal to the uninterrupted run" if report.ok else "FAILED"))
        for failure in report.failures:
            print("  " + failure)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
