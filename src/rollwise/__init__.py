"""rollwise: RL post-training of language models with verifiable rewards, built around the
rollout. See README.md for the tour and ARCHITECTURE.md for the map."""

from rollwise.models import Policy, load_policy
from rollwise.types import Batch, Group, Sample, Trajectory

__version__ = "0.1.0"

__all__ = ["Batch", "Group", "Policy", "Sample", "Trajectory", "__version__", "load_policy"]
