"""rollwise: RL post-training of language models with verifiable rewards, built around the
rollout. See README.md for the tour and docs/architecture.md for the map.

Heavy parts (torch, transformers) load on first use, so `import rollwise.observe` or
`import rollwise.tasks` stays light.
"""

from __future__ import annotations

import logging
import os
from typing import Any

# MKL's float32 products split their sums differently at 1 and at 2 threads for a few
# shapes (5 to 11 rows against SmolLM2's 1536-wide down projection, measured on an AVX2
# EPYC), so a run's rollouts depended on run.threads. MKL's strict reproducibility mode
# makes every product independent of the thread count, at no measured cost
# (docs/precision.md). MKL reads this at its first product, so it holds when rollwise is
# imported before any; a value set by the user wins. Builds without MKL ignore it.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

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
