"""The Ray backend on a local 2-CPU cluster (one per module): the same metrics as the
local driver, asynchronous training within its staleness bound, a rollout worker killed
mid-step, a dead learner and --resume, clear errors for a wrong address or no Ray."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rollwise.compose.config import ConfigError, load_config
from rollwise.distributed.cluster import connect, probe, worker_env
from rollwise.pipeline.build import build
from rollwise.replay import TrajectoryStore
from runs import records, run_config

pytestmark = pytest.mark.ray

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
TIMING = ("time", "seconds", "_per_s", "makespan", "tail_s",
          "publish", "eta", "peak_rss", "cuda_max_allocated")  # memory peaks: machine figures


@pytest.fixture(scope="module", autouse=True)
def cluster():
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    # a shared machine's memory use is not the tests': Ray's own OOM killer stays off
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env=worker_env(), _temp_dir="/tmp/rwray")
    yield
    ray.shutdown()


def small(tmp_path: Path, *extra: str):
    return load_config(CONFIG, [f"run.output_dir='{tmp_path}'", "run.num_steps=3",
                                "run.threads=1", "rollout.prompts_per_step=4",
                                "task.num_eval=24", "eval.every=2", *extra])


def assert_flow(trains: list[dict]) -> None:
    for r in trains:
        assert r["traj_requested"] == (r["traj_trained"] + r["traj_filtered"]
                                       + r["traj_stale_dropped"]), r["step"]


def test_ray_matches_local_and_async_zero_too(tmp_path):
    """backend ray (sync, and async S=0) trains exactly as the local driver: the same
    rewards, losses, lengths, evaluations at every step."""
    cfg = small(tmp_path)
    run_config(cfg, "local", stages=build(cfg))
    run_config(small(tmp_path, "run.backend='ray'", "schedule.mode='async'",
                     "schedule.max_staleness=0"), "ray")
    a, b = records(tmp_path / "local"), records(tmp_path / "ray")
    assert [r["kind"] for r in a] == [r["kind"] for r in b]
    for x, y in zip(a, b):
        keys = {k for k in set(x) & set(y) if not any(t in k for t in TIMING)}
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}, (x["kind"], x["step"])
    assert all(r["weights_bytes"] > 0 for r in records(tmp_path / "ray", "train"))


@pytest.mark.slow
def test_workers_rollout_state_is_checkpointed_and_resume_equals_the_uninterrupted_run(tmp_path):
    """The workers' own rollout state (here speculation.reuse's previous responses, over 8 prompts
    that come back every other step) is in the checkpoint: a run stopped by Ctrl-C during
    step 3 and resumed trains steps 3 and 4 exactly as the uninterrupted run, drafts
    included."""
    extra = ("run.backend='ray'", "ray.num_workers=2", "ray.worker_cpus=0.5",
             "speculation.reuse=true", "task.num_train=8", "run.num_steps=4",
             "run.checkpoint_every=2", "eval.every=0")
    run_config(small(tmp_path, *extra), "whole")
    cfg = small(tmp_path, *extra)
    cfg.run.name = "stopped"
    stages = build(cfg)
    original = stages.update

    def update_then_stop(batch):
        if stages.rollout_stage.version == 2:  # the update of step 3
            raise KeyboardInterrupt
        return original(batch)

    stages.update = update_then_stop
    with pytest.raises(KeyboardInterrupt):
        run_config(cfg, "stopped", stages=stages)
    state = json.loads(next((tmp_path / "stopped" / "checkpoints").glob("step_2"))
                       .joinpath("state.json").read_text())
    workers = state["stages"]["rollout"]["workers"]
    assert len(workers) == 2 and any(w["previous"] for w in workers)
    run_config(small(tmp_path, *extra), "stopped", resume=True)
    a, b = records(tmp_path / "whole", "train"), records(tmp_path / "stopped", "train")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        keys = {k for k in set(x) & set(y) if not any(t in k for t in TIMING)}
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}, x["step"]
    assert all("spec_accepted_len" in r for r in b[2:])  # steps 3, 4 drafted from step 1, 2


@pytest.mark.slow
def test_async_one_step_ahead_stays_within_the_bound(tmp_path):
    cfg = small(tmp_path, "run.backend='ray'", "schedule.mode='async'", "schedule.max_staleness=1",
                "ray.num_workers=2", "ray.worker_cpus=0.5", "run.num_steps=4",
                "eval.every=0")
    run_config(cfg, "async1")
    trains = records(tmp_path / "async1", "train")
    assert len(trains) == 4
    assert_flow(trains)
    assert all(r["staleness_hist_2"] == r["staleness_hist_3plus"] == 0 for r in trains)
    # step k's rollouts begin at version k-1 or later: never more than one update behind
    assert all(r["step"] - 1 - r["rollout_started_version"] <= 1 for r in trains)
    assert sum(r["step_rollouts"] for r in trains) == 4 * 4 * 8  # none lost, none twice


def test_killed_rollout_worker_is_restarted_and_its_requests_rerun(tmp_path):
    cfg = small(tmp_path, "run.backend='ray'", "run.num_steps=4", "eval.every=0")
    cfg.run.name = "fault"
    stages = build(cfg)
    pid = stages.rollout_stage.worker_pids()[0]
    killed = []

    def kill_mid_rollout():
        metrics = tmp_path / "fault" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # after step 1, while the worker decodes
            trained = metrics.exists() and '"train"' in metrics.read_text()
            if trained and ray.get(stages.rollout_stage.workers[0].is_busy.remote()):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_mid_rollout)
    killer.start()
    summary = run_config(cfg, "fault", stages=stages)
    killer.join()
    assert killed, "the worker was never caught mid-rollout"
    trains = records(tmp_path / "fault", "train")
    assert [r["step"] for r in trains] == [1, 2, 3, 4] and summary["steps"] == 4
    assert trains[-1]["rollout_worker_restarts"] >= 1
    assert stages.rollout_stage.worker_pids()[0] != pid
    assert_flow(trains)
    assert all(r["traj_requested"] == r["step_rollouts"] == 4 * 8 for r in trains)
    store = TrajectoryStore(tmp_path / "fault" / "trajectories.sqlite")
    try:  # every step's groups once: 4 prompts of 8 samples, no duplicate
        for step in range(1, 5):
            groups = store.load_groups(step)
            assert [len(g.trajectories) for g in groups] == [8] * 4
            assert len({g.sample.id for g in groups}) == 4
    finally:
        store.close()


@pytest.mark.slow
def test_dead_learner_ends_the_run_and_resume_continues(tmp_path):
    cfg = small(tmp_path, "run.backend='ray'", "run.num_steps=4", "eval.every=0",
                "run.checkpoint_every=2")
    cfg.run.name = "learner"
    stages = build(cfg)
    learner_pid = stages.learner.pid()
    original = stages.update

    def update_then_die(batch):
        if stages.rollout_stage.version == 2:  # the update of step 3: after the step-2 checkpoint
            os.kill(learner_pid, signal.SIGKILL)
        return original(batch)

    stages.update = update_then_die
    from rollwise.distributed import LearnerDied

    with pytest.raises(LearnerDied, match="--resume"):
        run_config(cfg, "learner", stages=stages)
    root = tmp_path / "learner"
    assert [r["step"] for r in records(root, "train")] == [1, 2]
    summary = run_config(cfg, "learner", resume=True)
    assert summary["steps"] == 4
    assert [r["step"] for r in records(root, "train")] == [1, 2, 3, 4]


def test_unreachable_address_fails_fast_and_missing_ray_names_the_install(monkeypatch):
    start = time.monotonic()
    with pytest.raises(ConfigError, match="no Ray cluster answers at 127.0.0.1:9"):
        probe("127.0.0.1:9", timeout_s=2)
    assert time.monotonic() - start < 5
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init reached"))
    monkeypatch.setenv("RAY_ADDRESS", "ray://127.0.0.1:9")  # the variable is read too
    start = time.monotonic()
    with pytest.raises(ConfigError, match="ray.address = 'ray://127.0.0.1:9'"):
        connect(None)
    assert time.monotonic() - start < 5
    monkeypatch.delenv("RAY_ADDRESS")
    import builtins

    real = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ConfigError, match=r"pip install 'rollwise\[ray\]'"):
        connect(None)


@pytest.mark.slow
def test_sharded_learner_on_ray_trains_as_the_local_ranks(tmp_path):
    """learner.shards = 2 as two Ray actors of a placement group: the same figures at every
    step as the two ranks the local backend starts, and a killed rank is named."""
    shards = ["learner.shards=2", "ray.learner_cpus=0.5"]
    cfg = small(tmp_path, *shards)
    run_config(cfg, "local", stages=build(cfg))
    run_config(small(tmp_path, "run.backend='ray'", *shards), "ray")
    a, b = records(tmp_path / "local"), records(tmp_path / "ray")
    assert [r["kind"] for r in a] == [r["kind"] for r in b]
    for x, y in zip(a, b):
        keys = {k for k in set(x) & set(y) if not any(t in k for t in TIMING)}
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}, (x["kind"], x["step"])
    assert all(r["learner_ranks"] == 2 for r in records(tmp_path / "ray", "train"))
    # a rank's actor killed: the next call to the ranks names it
    from rollwise.types import LearnerDied

    stages = build(small(tmp_path, "run.backend='ray'", *shards))
    try:
        ray.kill(stages.learner.ranks.actors[1])
        start = time.monotonic()
        with pytest.raises(LearnerDied, match=r"learner rank 1 of 2 failed during 'publish': "
                                              r"its actor died"):
            stages.learner.publish(1)
        assert time.monotonic() - start < 30
    finally:
        stages.close()
