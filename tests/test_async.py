"""The asynchronous driver in one process: S = 0 is the synchronous driver exactly, the
staleness bound drops or regenerates what is too old (and counts it), bad combinations
are refused before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollwise.compose.config import ConfigError, load_config, to_toml
from rollwise.compose.preflight import check_config
from rollwise.pipeline.asyncloop import AsyncSteps, bound_staleness, staleness_histogram
from rollwise.pipeline.build import build, run_steps
from rollwise.pipeline.loop import Collected, train
from rollwise.pipeline.stages import Stages
from rollwise.rewards import RewardStats
from rollwise.run.rundir import Run
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
    """Rolls out fresh groups at version 9 (what 'regenerate' asks for); `regenerate` is
    the real stage method over these parts."""

    regenerate = Stages.regenerate

    def __init__(self):
        self.asked = []
        self.control = _FakeControl()

    def rollout(self, requests):
        self.asked += requests
        return [_group(9, r.n) for r in requests]

    def score(self, groups):
        return RewardStats(sum(len(g.trajectories) for g in groups), 0, 0, 0.0)


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_staleness_bound_drops_or_regenerates_and_counts(policy):
    fresh, old = _group(8), _group(5, n=3)  # at version 9 with S=2: ages 1 and 4
    batch = Collected([fresh, old], [fresh, old], RewardStats(5, 0, 0, 0.0), {}, requested=5)
    stages = _FakeStages()
    assert staleness_histogram(batch.kept, 9) == {
        "staleness_hist_0": 0, "staleness_hist_1": 2, "staleness_hist_2": 0,
        "staleness_hist_3plus": 3}
    assert bound_staleness(stages, batch, 9, 2, policy) == 1
    flow = batch.flow()
    assert flow["traj_stale_dropped"] == 3
    assert flow["traj_requested"] == (flow["traj_trained"] + flow["traj_filtered"]
                                      + flow["traj_stale_dropped"])
    if policy == "drop":
        assert batch.kept == [fresh] and flow["traj_trained"] == 2 and not stages.asked
    else:
        assert [r.n for r in stages.asked] == [3] and stages.asked[0].prompt.ids == [1, 5]
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
        AsyncSteps(None, None, 0, 0, stale_policy="keep")


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
