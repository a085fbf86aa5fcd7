"""The verifiers adapter: a single-turn verifiers 0.4.0 (v1) taskset defined here trains in
rollwise, split disjointly, scored by the task's own weighted @vf.reward functions."""

from __future__ import annotations

from pathlib import Path

import pytest

vf = pytest.importorskip("verifiers.v1")

import rollwise
from rollwise.rewards.pool import RewardPool, RewardSpec
from rollwise.tasks import make_task
from rollwise.types import Trajectory

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace) -> float:
        return float(len(trace.last_reply) <= 3)


class SumTaskset(vf.Taskset[SumTask]):
    def __init__(self, config, size: int = 60):
        super().__init__(config)
        self.size = size

    def load(self):
        for a in range(self.size):
            yield SumTask(SumData(prompt=f"{a}+{a % 7}=", answer=str(a + a % 7)))


def load_env(size: int = 60):
    return SumTaskset(vf.TasksetConfig(), size=size)


def test_taskset_becomes_a_task_with_its_own_rewards() -> None:
    task = make_task("verifiers", seed=0, num_train=30, num_eval=4, env=f"{__name__}:load_env",
                     size=80)
    assert len(task.train) == 30 and len(task.eval) == 4
    assert not {s.prompt for s in task.train} & {s.prompt for s in task.eval}
    s = task.train[0]
    a, b = (int(x) for x in s.prompt.rstrip("=").split("+"))
    assert s.answer == str(a + b)
    assert task.verifier(s.answer, s) == 1.0 + 0.5 * (len(s.answer) <= 3)
    assert task.verifier("no idea", s) == 0.0
    trajs = [Trajectory(s, [], [], [], [], "stop", text=t) for t in (s.answer, "1234")]
    with RewardPool([RewardSpec("correct", task.verifier)], timeout_s=30, num_workers=1) as pool:
        pool.score(trajs)  # in a forked worker: the tasks travel with the fork
    assert trajs[0].reward == task.verifier(s.answer, s) and trajs[1].reward == 0.0
    assert any(e.kind == "note" and "verifiers rewards" in e.message
               for e in trajs[0].reward_errors)


def test_bad_env_is_clear() -> None:
    with pytest.raises(ValueError, match="expected \"package.module:function\""):
        make_task("verifiers", env="nope")
    with pytest.raises(ValueError, match="not a verifiers Taskset"):
        make_task("verifiers", env="builtins:dict")


def test_trains_on_a_verifiers_taskset(tmp_path) -> None:
    summary = rollwise.train(CONFIG, echo=None, overrides=[
        f"run.output_dir='{tmp_path}'", "task.name='verifiers'",
        f"task.options={{env = '{__name__}:load_env'}}", "task.num_train=20", "task.num_eval=4",
        "run.num_steps=1", "run.threads=1", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_tokens=4", "eval.every=0"])
    assert summary["steps"] == 1 and summary["verifiers"]["version"] == "0.4.0"
    assert summary["reward_errors"] == 0
