"""Rewards: verifiers `(completion, sample) -> float` and the pool that runs them with limits.

May import: types, registry, system.
"""

from rollwise.rewards.countdown import countdown_verifier
from rollwise.rewards.pool import (
    InfraError,
    RewardPool,
    RewardSpec,
    RewardStats,
    mask_infra_failures,
)
from rollwise.rewards.verifiers import (
    VERIFIERS,
    Verifier,
    final_number,
    format_reward,
    get_verifier,
    math_verify_match,
)

__all__ = [
    "VERIFIERS",
    "InfraError",
    "RewardPool",
    "RewardSpec",
    "RewardStats",
    "Verifier",
    "countdown_verifier",
    "final_number",
    "format_reward",
    "get_verifier",
    "mask_infra_failures",
    "math_verify_match",
]
