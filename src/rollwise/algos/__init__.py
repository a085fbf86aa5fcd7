"""Algorithm mathematics as pure tensor functions, registered by name.

    rollwise.algos.advantage_estimators["grpo"](rewards, group_ids) -> advantages
        (token-level ones also take the `AdvantageInputs` fields they declare with `uses`)
    rollwise.algos.policy_losses["ppo"](logprobs, old_logprobs, advantages, mask, ...)
        -> (loss, metrics)
    rollwise.algos.kl_estimators["k3"](logprobs, ref_logprobs) -> per-token KL
    rollwise.algos.corrections["tis"](old_logprobs, behaviour_logprobs, mask, cap=2)
        -> (weights, metrics)

The learner and driver call these only through the registries; a new estimator is one
function plus one `@register` line. docs/algorithms.md lists every name.

May import: registry.
"""

from rollwise.algos import (  # noqa: F401  (registers)
    advantages,
    importance,
    kl,
    losses,
    reweighting,
)
from rollwise.algos.advantages import call_estimator
from rollwise.algos.inputs import AdvantageInputs, inputs_of, uses
from rollwise.algos.losses import aggregate
from rollwise.algos.registry import (
    advantage_estimators,
    corrections,
    is_zero_at_zero_advantage,
    kl_estimators,
    lookup,
    policy_losses,
    register,
    zero_at_zero_advantage,
)

__all__ = [
    "AdvantageInputs",
    "advantage_estimators",
    "aggregate",
    "call_estimator",
    "corrections",
    "inputs_of",
    "is_zero_at_zero_advantage",
    "kl_estimators",
    "lookup",
    "policy_losses",
    "register",
    "uses",
    "zero_at_zero_advantage",
]
