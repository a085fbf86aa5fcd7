"""Rollout workers, the reward pool and the learner as Ray actors (run.backend = "ray").

The driver stays one process running the same drivers over the same `Stages`; its two
ports (rollout, trainer) are placed on actors here (`place_on_ray`); docs/scaling.md.

May import: types, registry, system, algos, models, replay, engine, rewards, control, envs,
tasks, learner, rollout, compose.
"""

from rollwise.distributed.cluster import connect, import_ray
from rollwise.distributed.ports import LearnerDied, RayRollout, RayTrainer, place_on_ray

__all__ = ["LearnerDied", "RayRollout", "RayTrainer", "connect", "import_ray", "place_on_ray"]
