"""Algorithm mathematics as pure tensor functions, registered by name.

    rollwise.algos.advantage_estimators["grpo"](rewards, group_ids) -> advantages
    rollwise.algos.policy_losses["ppo"](logprobs, old_logprobs, advantages, mask, ...) -> (loss, metrics)
    rollwise.algos.kl_estimators["k3"](logprobs, ref_logprobs) -> per-token KL

The learner and driver call these only through the registries; a new estimator is one
function plus one `@register` line.
"""

from rollwise.algos import advantages, kl, losses  # noqa: F401  (registers the functions)
from rollwise.algos.losses import aggregate
from rollwise.algos.registry import (
    advantage_estimators,
    kl_estimators,
    lookup,
    policy_losses,
    register,
)

__all__ = [
    "advantage_estimators",
    "aggregate",
    "kl_estimators",
    "lookup",
    "policy_losses",
    "register",
]
