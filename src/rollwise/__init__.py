"""rollwise: RL post-training of language models with verifiable rewards, built around the
rollout. See README.md for the tour and docs/architecture.md for the map.

Heavy parts (torch, transformers) load on first use, so `import rollwise.observe` or
`import rollwise.tasks` stays light.
"""

from __future__ import annotations

import logging
from typing import Any

# transformers imports torchao (the `lowbit` extra: learner.optimizer's low-bit moments)
# whenever it is installed, at every model load; that import logs a warning for each
# GPU-only kernel it cannot load on a CPU, and torch one for each of torchao's enum
# registrations it deprecates: noise on every run, nothing this run can act on
for _quiet in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_quiet).setLevel(logging.ERROR)

__version__ = "0.1.0"

_LAZY = {
    "load_policy": "rollwise.models", "Policy": "rollwise.models.policy",
    "Sample": "rollwise.types", "Trajectory": "rollwise.types", "Group": "rollwise.types",
    "Batch": "rollwise.types", "train": "rollwise.api",
    "group_reward": "rollwise.rewards.group",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rollwise' has no attribute '{name}'")


__all__ = ["Batch", "Group", "Policy", "Sample", "Trajectory", "__version__", "group_reward",
           "load_policy", "train"]
