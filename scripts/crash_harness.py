"""Kill a tiny rollwise run at many random instants and check every resumed run.

    python scripts/crash_harness.py --kills 300 [--seed 0] [--config configs/tiny_arith.toml]
        [--set key=value ...] [--workdir /tmp/rollwise-crash] [--user-code]

--user-code: the run also scores with a verifier and a group term (with an option) named
by import path, as a user's own code is (rollwise.pipeline.crashtest.USER_CODE).

Exits 0 when every finished run equals the uninterrupted reference (metrics, stored
trajectories, summary counters), 1 otherwise. See rollwise/pipeline/crashtest.py for what it does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from rollwise.compose.config import load_config
from rollwise.pipeline.crashtest import USER_CODE, crash_test

ROOT = Path(__file__).resolve().parents[1]
TINY = ["run.num_steps=6", "run.threads=1", "run.checkpoint_every=2",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "task.num_eval=8", "eval.every=3"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default=str(ROOT / "configs/tiny_arith.toml"))
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--sigint-share", type=float, default=0.3)
    parser.add_argument("--user-code", action="store_true",
                        help="also score with a verifier and a group term by import path")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rollwise-crash-"))
    user = USER_CODE if args.user_code else []
    cfg = load_config(args.config, [f"run.output_dir='{workdir}'", *TINY, *user,
                                    *args.overrides])
    start = time.perf_counter()
    report = crash_test(cfg, kills=args.kills, seed=args.seed, workdir=workdir,
                        sigint_share=args.sigint_share, log=print)
    print(f"{report.kills} kills ({report.sigkills} SIGKILL, {report.sigints} SIGINT), "
          f"{report.resumes} resumes, {report.rounds} runs compared, reference run "
          f"{report.reference_seconds:.1f}s, total {time.perf_counter() - start:.0f}s: "
          + ("all equal to the uninterrupted run" if report.ok else "FAILED"))
    for failure in report.failures:
        print("  " + failure)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
