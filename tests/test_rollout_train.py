"""Training through the rollout strategies: partial+context with TIS still learns and
reports its off-policy figures; an interrupted run resumes its partial pool exactly; configs
that cannot work are refused with a clear message."""

from __future__ import annotations

import json

import pytest
import torch

from rollwise.compose.config import ConfigError
from rollwise.pipeline.build import build
from rollwise.pipeline.loop import train
from rollwise.replay import TrajectoryStore
from rollwise.run.rundir import Run
from test_train import params, run_dir, small

PARTIAL = ["schedule.strategy='partial+context'", "schedule.chunk_tokens=4",
           "algorithm.correction='tis'"]


def records(cfg) -> list[dict]:
    lines = (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.mark.slow  # `make test` stays within 8 minutes on 2 cores
def test_partial_context_training_raises_reward_and_reports_staleness(tmp_path):
    cfg = small(tmp_path, "run.num_steps=50", "rollout.prompts_per_step=16", *PARTIAL)
    stages = build(cfg)
    summary = train(stages, Run(run_dir(cfg), resume=False, echo=lambda s: None), 50)
    got = records(cfg)
    rewards = [r["reward_mean"] for r in got]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.05, f"mean reward did not rise: {first:.3f} -> {last:.3f}"
    assert summary["eval_after"]["accuracy"] > summary["eval_before"]["accuracy"] + 0.05
    assert all(r["groups"] == 16 for r in got), "each step trains the target number of groups"
    assert max(r["offpolicy_token_frac"] for r in got) > 0, "no partial was ever resumed"
    assert all(r["staleness_max"] <= cfg.schedule.max_staleness for r in got)
    assert all("correction_ess" in r and 0 < r["correction_ess"] <= 1 for r in got)
    assert got[0]["pool_groups"] > 0  # over-provisioned groups wait for the next step


def test_interrupted_partial_run_resumes_its_pool_exactly(tmp_path):
    straight = small(tmp_path, "run.name='straight'", *PARTIAL)
    stages = build(straight)
    train(stages, Run(run_dir(straight), resume=False, echo=lambda s: None), 4,
          eval_before=False)
    expected = params(stages.model)

    cut = small(tmp_path, "run.name='cut'", *PARTIAL)
    first = build(cut)
    train(first, Run(run_dir(cut), resume=False, echo=lambda s: None), 2, eval_before=False)
    assert first.rollout_stage.scheduler.pool, "the cut should leave unfinished groups in the pool"
    second = build(cut)  # a fresh process
    train(second, Run(run_dir(cut), resume=True, echo=lambda s: None), 4, eval_before=False)
    got = params(second.model)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=0, atol=1e-6, msg=n)
    assert [r["reward_mean"] for r in records(cut)] == \
        [r["reward_mean"] for r in records(straight)]
    store = TrajectoryStore(run_dir(cut) / "trajectories.sqlite")
    assert store.steps() == [1, 2, 3, 4] and store.count() == 4 * 4 * 8
    ids = [t.sample.id for s in (1, 2, 3, 4) for t in store.load_step(s)[::8]]
    assert len(ids) == len(set(ids)), "a group was trained twice"


@pytest.mark.parametrize(("extra", "message"), [
    (["engine.name='hf'", "schedule.strategy='partial'"], "needs the native engine"),
    (["engine.name='hf'", "speculation.group=true"], "speculation.group needs"),
])
def test_configs_that_cannot_work_are_refused(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        build(small(tmp_path, *extra))


@pytest.mark.parametrize("allocator", ["dynamic", "pilot_commit"])
def test_partial_rollouts_take_their_extra_prompts_from_the_controller(tmp_path, allocator):
    """Over-provisioned groups come from the controller (not the sampler behind its back),
    and pooled groups of earlier steps reach the allocator like any other: partial rollouts
    work with every allocator, not only the uniform one."""
    stages = build(small(tmp_path, "schedule.strategy='partial'",
                         f"control.allocator='{allocator}'"))
    asked: list[int] = []
    extra = stages.control.extra
    stages.rollout_stage.fetch = lambda k: (asked.append(k), extra(k))[1]
    for _ in range(2):  # the driver's rounds (loop.train_step)
        requests = stages.select()
        while requests:
            groups = stages.rollout(requests)
            stages.score(groups)
            requests = stages.observe(groups)
        rolled, train = stages.allocation()
        assert len(train) <= 4 and len(rolled) >= max(len(train), 1)
    assert asked and asked[0] >= 4  # 2x over-provisioning of the (at least 4-prompt) plan
    assert stages.rollout_stage.scheduler.pool, "unfinished groups wait in the pool"
