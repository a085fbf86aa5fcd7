"""Resuming an asynchronous run keeps the rollouts collected ahead: a checkpoint of step k
holds the batches already collected for the later steps (groups, trajectories, figures)
and the stages' state as of the last of them; the resumed learner trains those batches
first, exactly as they were, and the producer goes on after them. The plain-data round
trip of a real batch is exact (log-probs bit for bit), and S = 0 checkpoints hold what
the synchronous driver's hold."""

from __future__ import annotations

import json
import time
from dataclasses import fields, replace
from pathlib import Path

import pytest

from rollwise.compose.config import load_config
from rollwise.control import UniformSampler
from rollwise.pipeline.build import build, run_steps
from rollwise.pipeline.collect import Collected, collect
from rollwise.pipeline.loop import train
from rollwise.replay import TrajectoryStore
from rollwise.run.rundir import Run, StepTimer
from rollwise.types import Group, RewardIssue, Trajectory

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
ASYNC = ("schedule.mode='async'", "schedule.max_staleness=1")


def small(tmp_path: Path, *extra: str):
    return load_config(CONFIG, [f"run.output_dir='{tmp_path}'", "run.threads=1",
                                "rollout.prompts_per_step=4", "rollout.group_size=4",
                                "task.num_eval=8", "eval.every=0", "eval.before=false",
                                *extra])


def state_json(root: Path, step: int) -> dict:
    text = (root / "checkpoints" / f"step_{step}" / "state.json").read_text()
    assert "\n" not in text  # compact: kept batches make an indented file 2.8x larger
    return json.loads(text)


def tokens(t: Trajectory) -> tuple:
    return t.sample.id, t.prompt_ids, t.response_ids, t.logprobs, t.versions, t.finish_reason


def assert_same_groups(a: list[Group], b: list[Group]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.sample is y.sample or x.sample == y.sample
        assert len(x.trajectories) == len(y.trajectories)
        for s, t in zip(x.trajectories, y.trajectories):
            for f in fields(Trajectory):
                assert getattr(s, f.name) == getattr(t, f.name), f.name


def test_a_real_batch_round_trips_field_by_field(tmp_path):
    stages = build(small(tmp_path))
    try:
        batch = collect(stages, StepTimer())
    finally:
        stages.close()
    first = batch.groups[0].trajectories[0]
    assert all(type(x) is float for x in first.logprobs)  # JSON keeps Python floats exactly
    # what a real batch may carry besides: a reward issue, turns, a kept group of its own
    first.reward_errors = [RewardIssue("note", "correct", "2 of 5"),
                           RewardIssue("infra", "format", "sandbox: down")]
    first.turns, first.turn_rewards, first.turn_states = [(0, 2), (3, 5)], [0.5, 1.0], ["a", "b"]
    first.loss_mask = [1] * first.num_tokens
    extra = replace(batch.groups[1], trajectories=list(batch.groups[1].trajectories))
    batch = replace(batch, kept=batch.kept + [extra], phases={"rollout": 0.25},
                    stale_dropped=3)

    plain = json.loads(json.dumps(batch.to_plain()))  # as a checkpoint writes and reads it
    back = Collected.from_plain(plain, stages.samples_by_id())

    assert_same_groups(back.groups, batch.groups)
    assert_same_groups(back.kept, batch.kept)
    assert back.groups[0].trajectories[0].turns == [(0, 2), (3, 5)]
    # a kept group that is one of the step's groups is that very object again
    for k, original in zip(back.kept, batch.kept):
        assert any(k is g for g in back.groups) == any(original is g for g in batch.groups)
    assert back.reward_stats == batch.reward_stats and back.control == batch.control
    assert (back.requested, back.phases, back.stale_dropped) == \
        (batch.requested, batch.phases, batch.stale_dropped)
    with pytest.raises(ValueError, match="not among the task's prompts"):
        Collected.from_plain(plain, {})


def _wait_for_ahead(stages, num_steps: int) -> None:
    """Each snapshot of a trained step waits until the next step's batch is collected, so
    that the checkpoint holds one (without it, whether it does depends on timing)."""
    source = stages.stage_state

    def waiting() -> dict:
        for _ in range(6000):
            state = source()
            if "ahead" in state or not 0 < state["version"] < num_steps:
                return state
            time.sleep(0.01)
        raise AssertionError("the producer never finished the next batch")

    stages.stage_state = waiting


@pytest.mark.parametrize("resumed", ["async", "sync"])
def test_resume_trains_the_buffered_batch_as_it_was_and_nothing_twice(tmp_path, resumed):
    """Resumed in either mode (the synchronous driver trains the kept batches first too)."""
    cfg = small(tmp_path, *ASYNC, "run.num_steps=4", "run.name='cut'")
    root = tmp_path / "cut"
    first = build(cfg)
    update, calls = first.update, []

    def interrupting_update(batch):  # Ctrl-C in step 3's update: the checkpoint is step 2's
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return update(batch)

    first.update = interrupting_update
    run = Run(root, resume=False, echo=lambda s: None)
    _wait_for_ahead(first, 4)
    with pytest.raises(KeyboardInterrupt):
        train(first, run, 4, eval_before=False, steps=run_steps(cfg))
    first.close()
    saved = state_json(root, 2)
    assert saved["step"] == 2 and len(saved["stages"]["ahead"]) == 1
    ahead = saved["stages"]["ahead"][0]

    if resumed == "sync":
        cfg = small(tmp_path, "run.num_steps=4", "run.name='cut'")
    second = build(cfg)  # a fresh process
    select, selected = second.select, []
    second.select = lambda: selected.append(1) or select()
    try:
        summary = train(second, Run(root, resume=True, echo=lambda s: None), 4,
                        eval_before=False, steps=run_steps(cfg))
    finally:
        second.close()
    assert summary["steps"] == 4 and len(selected) == 1  # step 3 kept, only step 4 rolled out

    store = TrajectoryStore(root / "trajectories.sqlite")
    try:
        trained = store.load_groups(3)
        by_step = {s: [t.sample.id for t in store.load_step(s)] for s in (1, 2, 3, 4)}
        assert store.steps() == [1, 2, 3, 4] and store.count() == 4 * 4 * 4
    finally:
        store.close()
    kept = Collected.from_plain(ahead, second.samples_by_id())
    assert [tokens(t) for g in trained for t in g.trajectories] == \
        [tokens(t) for g in kept.groups for t in g.trajectories]
    assert [t.reward for g in trained for t in g.trajectories] == \
        [t.reward for g in kept.groups for t in g.trajectories]
    step3 = [r for r in map(json.loads, (root / "metrics.jsonl").read_text().splitlines())
             if r.get("step") == 3 and r["kind"] == "train"]
    assert step3[0]["rollout_started_version"] == ahead["control"]["rollout_started_version"]
    # the prompts of each step in the sampler's order: none trained twice, none skipped
    fresh = UniformSampler(second.sampler.items, 4, second.sampler.seed)
    expected = [sorted({p.sample.id for p in fresh.next()}) for _ in range(4)]
    assert [sorted(set(by_step[s])) for s in (1, 2, 3, 4)] == expected
    assert all(len(ids) == 4 * 4 for ids in by_step.values())


def test_staleness_zero_checkpoints_hold_what_the_synchronous_driver_holds(tmp_path):
    """S = 0: every snapshot is the stages' state after the step it records (no batch is
    ever ahead at a snapshot), as in the synchronous driver."""
    states = {}
    for name, extra in (("sync", ()), ("s0", ("schedule.mode='async'",
                                             "schedule.max_staleness=0"))):
        cfg = small(tmp_path, *extra, "run.num_steps=2", f"run.name='{name}'")
        stages = build(cfg)
        try:
            train(stages, Run(tmp_path / name, resume=False, echo=lambda s: None), 2,
                  eval_before=False, checkpoint_every=1, steps=run_steps(cfg))
        finally:
            stages.close()
        states[name] = [state_json(tmp_path / name, s)["stages"] for s in (1, 2)]
    assert states["s0"] == states["sync"]
    assert all("ahead" not in s for s in states["s0"])
    assert [s["version"] for s in states["s0"]] == [1, 2]


def test_a_checkpoint_of_the_format_before_the_controller_saved_its_sampler_loads(tmp_path):
    """Before, the stages saved the controller's sampler beside its state ("sampler" at the
    top): such a checkpoint restores the sampler's cursor as the new format does."""
    stages = build(small(tmp_path))
    try:
        state = json.loads(json.dumps(stages.stage_state()))
        old = dict(state, control=dict(state["control"]))
        old["sampler"] = old["control"].pop("sampler")
        drawn = [p.sample.id for p in stages.control.sampler.next()]
        for checkpoint in (old, state):
            stages.control.sampler.next()  # moved on since the checkpoint
            stages.load_state_dict(stages.learner.state_dict(), checkpoint)
            assert [p.sample.id for p in stages.control.sampler.next()] == drawn
            assert stages.stage_state()["control"]["sampler"] == \
                stages.control.sampler.state_dict()
    finally:
        stages.close()
