"""The stages of the driver in `loop.py`, as one object built by `build.py`.

Each method is one named stage; the work lives in the parts it holds (the controller, the
rollout stage, the reward terms, the learner, the evaluator). Nothing here reads the
config tree: `build.py` passes plain arguments.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollwise.control import Controller, Request, UniformSampler
from rollwise.pipeline.evaluate import Evaluator
from rollwise.learner import Learner, prepare_batch
from rollwise.models import Policy
from rollwise.rewards import RewardStats, mask_infra_failures
from rollwise.rewards.group import GroupTerm, apply_group_rewards
from rollwise.rollout import RolloutStage
from rollwise.tasks import Task
from rollwise.types import Batch, EncodedPrompt, Group, Sample


@dataclass
class Stages:
    """The built parts; each method is one named stage of the driver."""

    policy: Policy
    task: Task
    sampler: UniformSampler[EncodedPrompt]
    control: Controller  # the rollout allocator: which prompts, how many rollouts each
    rollout_stage: RolloutStage  # rollouts and their scoring (the reward pool's `score`)
    learner: Learner
    evaluator: Evaluator  # or EpisodeEvaluator (tasks with an environment)
    advantage_fn: Callable
    advantage_options: dict[str, Any] = field(default_factory=dict)
    group_rewards: list[GroupTerm] = field(default_factory=list)  # after the verifiers
    mask_truncated: bool = False
    kl_in_reward: float = 0.0  # KL coefficient of the KL-in-reward penalty (0: off)
    info: dict[str, Any] = field(default_factory=dict)  # figures of the build, for the summary

    @property
    def model(self):
        return self.policy.model

    @property
    def engine(self):
        return self.rollout_stage.engine

    def select(self) -> list[Request]:
        """The allocator's first round of the step: which prompts, how many rollouts each."""
        return self.control.plan()

    def rollout(self, requests: list[Request]) -> list[Group]:
        return self.rollout_stage.run([r.prompt for r in requests], [r.n for r in requests])

    def score(self, groups: list[Group]) -> RewardStats:
        stats = self.rollout_stage.score(groups)
        for g in groups:  # a verifier's infrastructure failed: zero advantage, not a 0 reward
            mask_infra_failures(g.trajectories)
        apply_group_rewards(groups, self.group_rewards)
        return stats

    def observe(self, groups: list[Group]) -> list[Request]:
        """Scored groups update the prompt posteriors; the allocator's next round, or []."""
        return self.control.observe(groups)

    def allocation(self) -> tuple[list[Group], list[Group]]:
        """(every group of the step merged per prompt, the groups the allocator trains on)."""
        return self.control.finish()

    def control_metrics(self) -> dict[str, float]:
        """The allocator's figures and the rollout scheduler's, for this step's record."""
        return dict(self.control.last) | self.rollout_stage.metrics()

    def advantages(self, groups: list[Group]) -> Batch:
        return prepare_batch(
            groups, self.advantage_fn, pad_id=self.policy.tokenizer.pad_token_id,
            options=self.advantage_options, mask_truncated=self.mask_truncated,
            reference_kl=self.learner.reference_kl, kl_coef=self.kl_in_reward)

    def update(self, batch: Batch) -> dict[str, float]:
        return self.learner.update(batch)

    def publish(self, version: int) -> dict[str, float]:
        """The engine reads the new weights (in process: in place, or converted when
        rollout.dtype differs from the model's); the time it took, for the step's record."""
        start = time.perf_counter()
        self.rollout_stage.publish(version)
        return {"publish_seconds": time.perf_counter() - start}

    def evaluate(self) -> dict[str, float]:
        return self.evaluator()

    def state_dict(self) -> tuple[dict, dict]:
        return self.learner.state_dict(), self.stage_state()

    def stage_state(self) -> dict:
        """What changes between steps besides the weights and the optimizer (plain data)."""
        state = {"sampler": self.sampler.state_dict(), "version": self.engine.version,
                 "control": self.control.state_dict()}
        rollout = self.rollout_stage.state_dict()
        if rollout is not None:  # the partial pool and the reuse cache
            state["rollout"] = rollout
        return state

    def load_state_dict(self, learner_state: dict, state: dict) -> None:
        self.learner.load_state_dict(learner_state)
        self.sampler.load_state_dict(state["sampler"])
        if "control" in state:  # checkpoints before adaptive allocation have none
            self.control.load_state_dict(state["control"])
        self.rollout_stage.load_state_dict(state.get("rollout"))
        self.rollout_stage.publish(state["version"])


def encode_prompts(policy: Policy, samples: list[Sample], max_prompt_tokens: int,
                   max_tokens: int) -> tuple[list[EncodedPrompt], int]:
    """Token ids of each prompt; prompts that don't fit the context are skipped and counted."""
    limit = min(max_prompt_tokens, policy.max_context - max_tokens)
    kept, skipped = [], 0
    for s in samples:
        ids = policy.encode(s.prompt)
        if len(ids) > limit:
            skipped += 1
        else:
            kept.append(EncodedPrompt(s, ids))
    return kept, skipped
