"""The weight-publication protocol (pipeline/ports.py) on every placement: the rollout port
in this process (the tiny model's native engine, keeping its own copy as an asynchronous
run builds it), over inference servers (a fake SGLang server, tests/test_remote_dialects.py)
and on a local Ray cluster (marked slow). The trainer publishes a version, the rollout
side stages it (tokens keep the active version) and activates it at a step boundary;
versions only move forward, and a stage that fails keeps the active version with an error
naming the placement and the phase."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rollwise.compose.config import load_config
from rollwise.pipeline.build import build
from rollwise.pipeline.stages import Stages
from rollwise.types import Published, PublishError
from test_remote_dialects import Fake, sglang_routes

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"


@dataclass
class Placement:
    stages: Stages
    name: str  # how its errors name it
    broken: Any  # version -> a Published whose stage fails, on this placement
    after: list = field(default_factory=list)  # closed after the stages (fakes, clusters)
    loads: Any = None  # () -> weight loads the servers saw (servers only)

    def close(self) -> None:
        try:
            self.stages.close()
        finally:
            for close in self.after:
                close()

    @property
    def rollout(self):
        return self.stages.rollout_stage

    def versions(self) -> set[int]:
        """The versions of the tokens of one group sampled now."""
        prompt = self.stages.sampler.items[0]
        groups = self.rollout.run([prompt], [2])
        self.rollout.score(groups)
        self.rollout.metrics()
        return {v for g in groups for t in g.trajectories for v in t.versions}


def config(tmp_path: Path, *extra: str):
    return load_config(CONFIG, [f"run.output_dir='{tmp_path}'", "run.threads=1",
                                "rollout.prompts_per_step=2", "rollout.group_size=2",
                                "rollout.max_tokens=6", "task.num_eval=2", "eval.every=0",
                                *extra])


class _Unwritable:
    """A publication handle whose folders cannot be written (a full disk)."""

    def folder(self, dtype):
        raise OSError(28, "No space left on device")


def in_process(tmp_path: Path, monkeypatch) -> Placement:
    stages = build(config(tmp_path, "schedule.mode='async'", "schedule.max_staleness=1"))
    engine = stages.rollout_stage.engine

    def broken(version: int) -> Published:
        take = engine.take

        def fails():  # once: the next stage takes as before
            monkeypatch.setattr(engine, "take", take)
            raise RuntimeError("CUDA out of memory")

        monkeypatch.setattr(engine, "take", fails)
        return Published(version)

    return Placement(stages, "in-process rollout", broken)


def servers(tmp_path: Path, monkeypatch) -> Placement:
    fake = Fake({})
    fake.routes = sglang_routes(fake)
    try:
        stages = build(config(tmp_path, "engine.name='remote'",
                              f"engine.remote_urls=['{fake.url}']",
                              "engine.remote_kind='sglang'", "engine.remote_timeout_s=30"))
    except BaseException:
        fake.close()
        raise
    return Placement(stages, "remote servers", lambda v: Published(v, _Unwritable(), 1),
                     [fake.close], lambda: fake.routes_called().count("/update_weights_from_disk"))


def on_ray(tmp_path: Path, monkeypatch) -> Placement:
    ray = pytest.importorskip("ray")
    from rollwise.distributed.cluster import worker_env

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    after = []
    if not ray.is_initialized():  # a cluster of this module's own, shut down after it
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
                 runtime_env=worker_env(), _temp_dir="/tmp/rwray")
        after.append(ray.shutdown)
    stages = build(config(tmp_path, "run.backend='ray'", "ray.num_workers=1",
                          "ray.worker_cpus=0.5"))
    return Placement(stages, "Ray rollout workers", lambda v: Published(v), after)


# a local Ray cluster and its three actors take 15-40 s to start on two shared cores: slow
@pytest.fixture(scope="module", params=[
    in_process, servers, pytest.param(on_ray, marks=[pytest.mark.ray, pytest.mark.slow])],
    ids=["in-process", "servers", "ray"])
def placement(request, tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        made = request.param(tmp_path_factory.mktemp(request.param.__name__), monkeypatch)
        try:
            yield made
        finally:
            made.close()


def publish(placement: Placement, version: int) -> Published:
    return placement.stages.learner.publish(version)


def test_a_staged_version_is_sampled_only_once_activated(placement):
    rollout = placement.rollout
    v = rollout.version
    loads = placement.loads() if placement.loads else 0
    rollout.stage(publish(placement, v + 1))
    assert rollout.version == v and placement.versions() == {v}  # staged: not sampled
    assert (placement.loads() if placement.loads else 0) == loads  # no server loaded it
    rollout.activate(v + 1)
    assert rollout.version == v + 1 and placement.versions() == {v + 1}
    assert (placement.loads() if placement.loads else 1) == loads + 1


def test_versions_only_move_forward(placement):
    rollout = placement.rollout
    v = rollout.version + 1
    rollout.publish(publish(placement, v))
    with pytest.raises(PublishError, match=f"{placement.name}: activate of weights version "
                       f"{v - 1} failed: older than the active version {v}"):
        rollout.activate(v - 1)
    with pytest.raises(PublishError, match=f"{placement.name}: stage of weights version "
                       f"{v - 1} failed: older"):
        rollout.stage(Published(v - 1))
    with pytest.raises(PublishError, match="not the version staged"):
        rollout.activate(v + 1)  # published, never staged
    assert rollout.version == v and placement.versions() == {v}


def test_a_failed_stage_keeps_the_active_version_and_names_placement_and_phase(placement):
    rollout = placement.rollout
    v = rollout.version
    rollout.stage(publish(placement, v + 1))
    with pytest.raises(PublishError) as e:
        rollout.stage(placement.broken(v + 2))
    assert (e.value.placement, e.value.phase, e.value.version) == (placement.name, "stage", v + 2)
    assert str(e.value).startswith(f"{placement.name}: stage of weights version {v + 2} failed")
    with pytest.raises(PublishError, match="not the version staged"):
        rollout.activate(v + 2)
    assert rollout.version == v and placement.versions() == {v}
    rollout.activate(v + 1)  # what was staged before the failure still activates
    assert rollout.version == v + 1
