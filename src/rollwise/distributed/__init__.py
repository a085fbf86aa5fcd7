"""Rollout workers, the reward pool and the learner as Ray actors (run.backend = "ray").

The driver stays one process running `loop.py` (or `asyncloop.py`) over `RayStages`, the
same stages with their work placed on actors; docs/scaling.md.
"""

from rollwise.distributed.cluster import connect, import_ray
from rollwise.distributed.stages import LearnerDied, RayStages, build_distributed

__all__ = ["LearnerDied", "RayStages", "build_distributed", "connect", "import_ray"]
