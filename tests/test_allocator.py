"""run.allocator = "jemalloc": the rollwise command runs itself again with jemalloc preloaded
(the C allocator is chosen when a process starts), the processes it starts do not inherit
it, a process that is not the command's own is never run again, and the memory a run frees
goes back to the system."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollwise.system import preload, runtime

sys.path.insert(0, str(Path(__file__).parent))
from test_memory import FRAGMENT

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or preload.jemalloc_library() is None,
    reason="jemalloc is preloaded on Linux, from the ray extra or $ROLLWISE_JEMALLOC")

RERUN = """
import os, subprocess, sys
from rollwise.system import preload
print("start", os.getpid(), flush=True)
preload.allow_rerun()
preload.preload_allocator("jemalloc")
child = subprocess.run([sys.executable, "-c",
                        "print('jemalloc' in open('/proc/self/maps').read())"],
                       capture_output=True, text=True, check=True).stdout.strip()
print("after", os.getpid(), preload.jemalloc_loaded(), os.environ.get("LD_PRELOAD", "-"),
      child)
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}


def test_the_command_runs_again_with_jemalloc_and_its_children_do_not() -> None:
    out = subprocess.run([sys.executable, "-c", RERUN], capture_output=True, text=True,
                         check=True, env=_clean_env()).stdout.split("\n")
    starts = [x for x in out if x.startswith("start")]
    after = next(x for x in out if x.startswith("after")).split()
    assert len(starts) == 2 and starts[0] == starts[1]  # the same process, run twice
    assert after[1] == starts[0].split()[1]
    assert after[2:] == ["True", "-", "False"]  # loaded here; LD_PRELOAD put back; child: not


def test_a_process_that_is_not_the_command_is_never_run_again() -> None:
    assert not preload._entry["may_rerun"]  # pytest is not `rollwise`
    preload.preload_allocator("jemalloc")  # returns: no exec, no error
    assert not preload.jemalloc_loaded()
    assert runtime.tune_allocator("jemalloc") in ("reuse", "system")  # glibc's, as it can


def test_jemalloc_returns_what_a_run_frees() -> None:
    """test_memory's fragmenting pattern under jemalloc, then the heap trimmed (jemalloc's
    arenas purged) as `learner.release_memory` does after each update."""
    env = _clean_env() | {"LD_PRELOAD": preload.jemalloc_library()}
    out = subprocess.run([sys.executable, "-c", FRAGMENT, "jemalloc", "trim"],
                         capture_output=True, text=True, check=True, env=env).stdout.split()
    assert out[0] == "jemalloc" and int(out[-1]) < 50  # of 384 MiB freed


@pytest.mark.slow  # `make test` stays within 8 minutes on 2 cores
def test_a_run_says_which_allocator_it_used(tmp_path) -> None:
    env = _clean_env() | {"ROLLWISE_NO_PROGRESS": "1", "COLUMNS": "200"}
    out = subprocess.run(
        [sys.executable, "-m", "rollwise", "train", str(ROOT / "configs/tiny_arith.toml"),
         "--set", "run.num_steps=1", "--set", "run.threads=1", "--set", "eval.before=false",
         "--set", f"run.output_dir='{tmp_path}'", "--set", "run.allocator='jemalloc'"],
        capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| allocator jemalloc" in out.stdout
    summary = json.loads((tmp_path / "tiny_arith" / "summary.json").read_text())
    assert summary["allocator"] == "jemalloc" and summary["peak_rss_mb"] > 0
