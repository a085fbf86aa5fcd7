"""Two Ray nodes on this machine (ray.cluster_utils.Cluster, 1 CPU each): the learner on
one, the rollout worker on the other, a few tiny steps trained across them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster

from rollwise.compose.config import load_config, to_toml
from rollwise.distributed.cluster import worker_env
from rollwise.pipeline.build import build, run_steps
from rollwise.pipeline.loop import train
from rollwise.run.rundir import Run

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"


@pytest.fixture(scope="module")
def two_nodes():
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    # a shared machine's memory use is not the tests': Ray's own OOM killer stays off
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="ERROR", runtime_env=worker_env())
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_training_across_two_nodes(tmp_path, two_nodes):
    cfg = load_config(CONFIG, [f"run.output_dir='{tmp_path}'", "run.num_steps=2",
                               "run.threads=1", "rollout.prompts_per_step=4",
                               "task.num_eval=16", "eval.every=0", "run.backend='ray'",
                               "schedule.mode='async'", "schedule.max_staleness=1"])
    stages = build(cfg)
    try:
        learner = ray.get(stages.learner.actor.node.remote())
        worker = ray.get(stages.rollout_stage.workers[0].node.remote())
        assert learner != worker, "learner and rollout worker should sit on different nodes"
        assert len({n["NodeID"] for n in ray.nodes() if n["Alive"]}) == 2
        run = Run(tmp_path / cfg.run.name, resume=False, config_toml=to_toml(cfg),
                  echo=lambda s: None)
        summary = train(stages, run, 2, eval_before=False, steps=run_steps(cfg))
    finally:
        stages.close()
    assert summary["steps"] == 2
    trains = [json.loads(x) for x in (tmp_path / cfg.run.name / "metrics.jsonl")
              .read_text().splitlines() if '"train"' in x]
    assert [r["step"] for r in trains] == [1, 2]
    assert all(r["weights_bytes"] > 0 and r["traj_trained"] + r["traj_filtered"] == 32
               for r in trains)
    # the second step's rollouts ran on weights the learner published across nodes
    assert trains[1]["rollout_started_version"] in (0, 1)
