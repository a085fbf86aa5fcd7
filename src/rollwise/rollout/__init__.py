"""The rollout stage: prompts in, groups of trajectories out.

`RolloutStage` (stage.py) is the one object the driver calls: it owns both paths and the
scoring overlap. `RolloutScheduler` (scheduler.py) runs the seed papers' strategies on the
native engine: sync, continuous, partial (APRIL), context (Seer), with grouped speculative
decoding (Seer) and speculative reuse (SPEC-RL); docs/rollout.md. `generate_groups` is the
plain path for engines without the request-level API (HF `generate`).

May import: types, system, replay, engine, rewards, envs.
"""

from __future__ import annotations

from rollwise.rollout.figures import RolloutFigures
from rollwise.rollout.scheduler import RolloutScheduler, StepReport
from rollwise.rollout.stage import RolloutStage, generate_groups
from rollwise.rollout.strategy import STRATEGIES, Strategy, strategy

__all__ = ["STRATEGIES", "RolloutFigures", "RolloutScheduler", "RolloutStage", "StepReport",
           "Strategy", "generate_groups", "strategy"]
