"""The asynchronous driver in one process: S = 0 is the synchronous driver exactly, the
staleness bound drops or regenerates what is too old (and counts it), bad combinations
are refused before anything loads."""

from __future__ import annotations

import json
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from rollwise.compose.config import ConfigError, load_config, to_toml
from rollwise.compose.preflight import check_config
from rollwise.pipeline.asyncloop import AsyncSteps
from rollwise.pipeline.build import build, run_steps
from rollwise.pipeline.collect import Staleness, collect, split_stale, staleness_histogram
from rollwise.pipeline.loop import train
from rollwise.pipeline.stages import Stages
from rollwise.rewards import RewardStats
from rollwise.run.rundir import Run, StepTimer
from rollwise.types import Group, Sample

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
# wall-clock figures and the asynchronous driver's own fields differ by construction
TIMING = ("time", "seconds", "_per_s", "makespan", "tail_s",
          "publish", "eta", "peak_rss", "cuda_max_allocated")  # memory peaks: machine figures


def small(tmp_path: Path, *extra: str):
    return load_config(CONFIG, [f"run.output_dir='{tmp_path}'", "run.num_steps=3",
                                "run.threads=1", "rollout.prompts_per_step=4",
                                "task.num_eval=24", "eval.every=2", *extra])


def records(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]


def comparable(record: dict, keys: set[str]) -> dict:
    return {k: v for k, v in record.items() if k in keys and not any(t in k for t in TIMING)}


def assert_same_metrics(a: list[dict], b: list[dict]) -> None:
    assert [r["kind"] for r in a] == [r["kind"] for r in b]
    for x, y in zip(a, b):
        keys = set(x) & set(y)
        assert comparable(x, keys) == comparable(y, keys), (x["kind"], x["step"])


def _run(cfg, name: str, steps) -> list[dict]:
    cfg.run.name = name
    root = Path(cfg.run.output_dir) / name
    stages = build(cfg)
    run = Run(root, resume=False, config_toml=to_toml(cfg), echo=lambda s: None)
    train(stages, run, cfg.run.num_steps, eval_every=cfg.eval.every, steps=steps)
    return records(root)


def test_async_staleness_zero_is_the_synchronous_driver(tmp_path):
    cfg = small(tmp_path)
    sync = _run(cfg, "sync", run_steps(cfg))
    cfg_async = small(tmp_path, "schedule.mode='async'", "schedule.max_staleness=0")
    check_config(cfg_async)
    out = _run(cfg_async, "async", run_steps(cfg_async))
    assert_same_metrics(sync, out)
    trains = [r for r in out if r["kind"] == "train"]
    assert all(r["staleness_hist_0"] == r["traj_trained"] for r in trains)
    assert all(r["traj_requested"] == r["traj_trained"] + r["traj_filtered"]
               + r["traj_stale_dropped"] for r in trains)


def _group(version: int, n: int = 2) -> Group:
    from rollwise.types import Trajectory

    s = Sample(id="p", prompt="1+1=", answer="2")
    return Group(s, [Trajectory(s, [1, 5], [7, 8], [-1.0, -1.0], [version, version + 1], "stop")
                     for _ in range(n)])


class _FakeControl:
    """The controller's regeneration seam: asks for the stale prompts, sees the new groups."""

    def __init__(self):
        self.seen: list[Group] = []

    def regenerate(self, stale):
        from rollwise.control import Request
        from rollwise.types import EncodedPrompt

        return [Request(EncodedPrompt(g.sample, g.trajectories[0].prompt_ids),
                        len(g.trajectories)) for g in stale]

    def observe_regenerated(self, groups):
        self.seen += groups


class _FakeStages:
    """One round of a fresh and an old group (ages 1 and 4 at version 9), the allocator
    training both; rolls out fresh groups at version 9 (what 'regenerate' asks for);
    `regenerate` is the real stage method over these parts."""

    regenerate = Stages.regenerate

    def __init__(self, fresh, old):
        self.asked, self.groups = [], [fresh, old]
        self.control = _FakeControl()

    def select(self):
        from rollwise.control import Request
        from rollwise.types import EncodedPrompt

        return [Request(EncodedPrompt(g.sample, [1, 5]), len(g.trajectories))
                for g in self.groups]

    def rollout(self, requests):
        self.asked += requests
        return [_group(9, r.n) for r in requests]

    def score(self, groups):
        return RewardStats(sum(len(g.trajectories) for g in groups), 0, 0, 0.0)

    def observe(self, groups):
        return []

    def allocation(self):
        return list(self.groups), list(self.groups)

    def control_metrics(self):
        return {"allocator": 1.0}


def test_the_staleness_split_is_a_pure_function_of_groups_version_and_bound():
    fresh, old = _group(8), _group(5, n=3)  # at version 9: ages 1 and 4
    assert split_stale([fresh, old], 9, 2) == ([fresh], [old])
    assert split_stale([fresh, old], 9, 4) == ([fresh, old], [])
    assert split_stale([old, fresh], 12, 0) == ([], [old, fresh])
    assert staleness_histogram([fresh, old], 9) == {
        "staleness_hist_0": 0, "staleness_hist_1": 2, "staleness_hist_2": 0,
        "staleness_hist_3plus": 3}


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_staleness_bound_drops_or_regenerates_and_counts(policy):
    """The collector applies the bound and any regeneration itself: the record it returns
    is finished (and frozen), with the bound's figures."""
    fresh, old = _group(8), _group(5, n=3)
    stages = _FakeStages(fresh, old)
    batch = collect(stages, StepTimer(), bound=Staleness(2, policy), trains_at=9,
                    figures={"rollout_started_version": 7})
    with pytest.raises(FrozenInstanceError):
        batch.kept = []  # type: ignore[misc]
    assert [r.n for r in stages.asked[:2]] == [2, 3]  # the step's one round
    assert batch.control["stale_groups"] == 1 and batch.control["allocator"] == 1.0
    assert batch.control["rollout_started_version"] == 7
    assert batch.control["rolled_staleness_hist_3plus"] == 3
    flow = batch.flow()
    assert flow["traj_stale_dropped"] == 3 == batch.stale_dropped
    assert flow["traj_requested"] == (flow["traj_trained"] + flow["traj_filtered"]
                                      + flow["traj_stale_dropped"])
    assert "rollout" in batch.phases and "reward" in batch.phases
    if policy == "drop":
        assert batch.kept == [fresh] and flow["traj_trained"] == 2 and len(stages.asked) == 2
    else:
        again = stages.asked[2:]
        assert [r.n for r in again] == [3] and again[0].prompt.ids == [1, 5]
        assert flow["traj_trained"] == 5 and flow["traj_requested"] == 8
        assert batch.kept[0] is fresh and batch.kept[1].trajectories[0].versions == [9, 10]
        assert stages.control.seen == batch.kept[1:]  # the controller saw them scored


def test_bad_run_combinations_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="needs engine.name='native'"):
        check_config(small(tmp_path, "schedule.mode='async'", "schedule.max_staleness=1",
                           "engine.name='hf'"))
    with pytest.raises(ConfigError, match="num_workers"):
        check_config(small(tmp_path, "ray.num_workers=2"))
    with pytest.raises(ConfigError, match="schedule.mode"):
        small(tmp_path, "schedule.mode='later'")
    with pytest.raises(ValueError, match="stale_policy"):
        AsyncSteps(None, None, 0, 0, max_staleness=1, stale_policy="keep")
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        AsyncSteps(None, None, 0, 0, max_staleness=-1, stale_policy="drop")


def test_scaling_model_arithmetic():
    from rollwise.bench.overlap import scaling_table

    rows = scaling_table(8.0, 2.0, 1e9, workers=(1, 2, 4), bandwidth_bytes_s=1e10,
                         trajectories=32)
    one, two, four = rows
    assert one["sync_step_s"] == pytest.approx(8.0 + 0.1 + 2.0)
    assert one["async_step_s"] == pytest.approx(8.1)  # rollout-bound: the learner waits
    assert four["rollout_s"] == 2.0 and four["async_step_s"] == pytest.approx(2.4)
    assert two["async_learner_util"] == pytest.approx(2.0 / 4.2)
    assert four["async_traj_per_s"] == pytest.approx(32 / 2.4)


def test_bench_async_rejects_an_unknown_variant():
    from typer.testing import CliRunner

    from rollwise.cli import app

    out = CliRunner().invoke(app, ["bench", "async", str(CONFIG), "--variant", "ray-async-9"])
    assert out.exit_code != 0 and "unknown variant 'ray-async-9'" in out.output
