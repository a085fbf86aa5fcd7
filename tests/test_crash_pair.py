"""Crash safety of a trainer and an inference server in two processes
(tests/crashpair.py; `scripts/crash_harness.py --pair` runs it longer): a server
killed during a weight sync stops the trainer within the time-out with an error naming it
and the route, and the resumed run ends with every step once; a server back on its base
weights (restarted) behind the trainer's back is an error, not rollouts from another
policy; and (slow) the
harness's rounds, each victim killed at random instants, equal the uninterrupted run."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from crashpair import EXIT_GRACE_S, SERVER, Server, pair_test
from rollwise.compose.config import load_config
from rollwise.learner.files import write_weights
from rollwise.models import load_policy
from rollwise.pipeline.build import build
from rollwise.rollout.servers import RemoteError
from runs import records, run_config
from test_remote import free_port

ROOT = Path(__file__).parents[1]
TIMEOUT_S = 10


def launcher(delay_s: float) -> list[str]:
    """Forks `rollwise serve` whose weight loads take `delay_s` more, imported once
    (scripts/crash_harness.py serve-zygote)."""
    return [sys.executable, str(ROOT / "scripts" / "crash_harness.py"), "serve-zygote",
            str(delay_s), *SERVER[3:]]


def tiny(tmp_path: Path, url: str, *extra: str):
    return load_config(ROOT / "configs" / "tiny_arith.toml", [
        f"run.output_dir='{tmp_path}'", "run.num_steps=4", "run.threads=1",
        "run.checkpoint_every=2", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "task.num_eval=8", "eval.every=0", "engine.name='remote'",
        f"engine.remote_urls=['{url}']", f"engine.remote_timeout_s={TIMEOUT_S}", *extra])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = Server(launcher(1.0), f"http://127.0.0.1:{port}", log, zygote=True)
    proc.start()
    try:
        yield proc
    finally:
        proc.close()


def test_a_server_killed_mid_sync_is_a_clear_error_in_time_and_resume_finishes(
        tmp_path, server):
    """SIGKILL while the server loads version 3: the trainer's error names the server and
    /v1/weights/update within engine.remote_timeout_s; the server restarted, the run
    resumes from its step-2 checkpoint and ends with steps 1-4 once each."""
    cfg = tiny(tmp_path, server.url)
    cfg.run.name = "killed"
    stages = build(cfg)
    activate, killed = stages.rollout_stage.activate, []

    def kill_inside(version: int) -> None:
        if version == 3:
            def kill() -> None:
                while not server.updating():
                    time.sleep(0.01)
                server.signal(signal.SIGKILL)
                killed.append(time.monotonic())
            threading.Thread(target=kill, daemon=True).start()
        activate(version)  # the servers load the staged version

    stages.rollout_stage.activate = kill_inside
    with pytest.raises(RemoteError) as e:
        run_config(cfg, "killed", stages=stages)
    took = time.monotonic() - killed[0]
    assert took < TIMEOUT_S, (took, e.value)
    assert server.url in str(e.value) and "/v1/weights/update" in str(e.value), e.value
    root = tmp_path / "killed"
    assert [r["step"] for r in records(root, "train")] == [1, 2]
    server.stop(signal.SIGKILL)
    server.start()
    summary = run_config(cfg, "killed", resume=True)
    assert summary["steps"] == 4
    assert [r["step"] for r in records(root, "train")] == [1, 2, 3, 4]


def test_a_server_with_other_weights_behind_the_trainer_is_an_error(tmp_path, server):
    """Between steps 2 and 3 the server goes back to the base model as version 0, as a
    restarted server does: step 3's rollouts stop with an error saying so, instead of
    training on another policy's samples."""
    cfg = tiny(tmp_path, server.url)
    stages = build(cfg)
    select, reverted = stages.select, []
    write_weights(load_policy("tiny").model, tmp_path / "base")

    def revert_then_select():
        if stages.rollout_stage.version == 2 and not reverted:
            r = httpx.post(server.url + "/v1/weights/update", timeout=30, json={
                "path": str(tmp_path / "base"), "version": 0, "mode": "pause"})
            reverted.append(r.status_code)
        return select()

    stages.select = revert_then_select
    with pytest.raises(RemoteError, match="version 0, older than the 2 it loaded") as e:
        run_config(cfg, "reverted", stages=stages)
    assert reverted == [200] and server.url in str(e.value)
    assert [r["step"] for r in records(tmp_path / "reverted", "train")] == [1, 2]


def pair(tmp_path: Path, *extra: str):
    cfg = tiny(tmp_path, f"http://127.0.0.1:{free_port()}", "run.num_steps=6",
               "eval.every=3", *extra)
    return pair_test(cfg, kills=6, seed=3, workdir=tmp_path / "pair",
                     server_command=launcher(0.3), zygote=True)


def _check(report) -> None:
    assert report.ok, "\n".join(report.failures)
    assert report.total >= 6 and report.rounds >= 1 and report.resumes >= 3
    assert report.server_restarts >= 1 and len(report.errors) + report.outlived >= 1
    assert all(sum(report.kills[(v, p)] for p in ("startup", "sync", "generate", "trainer",
                                                  "finish")) for v in ("trainer", "server"))
    assert all(s <= TIMEOUT_S + EXIT_GRACE_S for s, _ in report.errors)


@pytest.mark.slow
def test_pair_harness_sync(tmp_path):
    _check(pair(tmp_path))


@pytest.mark.slow
def test_pair_harness_async(tmp_path):
    _check(pair(tmp_path, "schedule.mode='async'", "schedule.max_staleness=1"))
