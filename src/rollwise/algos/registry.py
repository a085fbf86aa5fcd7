"""Name registries for the algorithm functions. One signature per kind (see each module);
`takes` is what the learner passes positionally, checked for users' own functions."""

from __future__ import annotations

from collections.abc import Callable

from rollwise.registry import Registry

advantage_estimators: Registry[Callable] = Registry(
    "advantage estimator", takes=("rewards", "group_ids"), options=True)
policy_losses: Registry[Callable] = Registry(
    "policy loss", takes=("logprobs", "old_logprobs", "advantages", "mask"))
kl_estimators: Registry[Callable] = Registry("KL estimator", takes=("logprobs", "ref_logprobs"))
corrections: Registry[Callable] = Registry(
    "correction", takes=("old_logprobs", "behaviour_logprobs", "mask"))


def register(registry: Registry, name: str) -> Callable[[Callable], Callable]:
    """Decorator: `@register(policy_losses, "ppo")` adds a function under a name."""
    return registry.register(name)


def zero_at_zero_advantage(fn: Callable) -> Callable:
    """Declare of a policy loss that each token's loss is 0, with 0 gradient, wherever that
    token's advantage is 0 (true of losses whose per-token term is a clipped ratio times the
    advantage): zero-advantage rows then contribute nothing, and the learner may skip their
    forward and backward passes and get the same update. tests/test_algos_losses.py checks the
    declaration against autograd for every registered loss that makes it."""
    fn.zero_at_zero_advantage = True
    return fn


def is_zero_at_zero_advantage(fn: Callable) -> bool:
    """Whether `fn` declared `zero_at_zero_advantage` (see there)."""
    return bool(getattr(fn, "zero_at_zero_advantage", False))


def lookup(registry: Registry, name: str, kind: str = "") -> Callable:
    """The function registered as `name` (or at "package.module:function"); an error with
    the closest registered name otherwise. `kind` is the registry's own (kept for callers)."""
    return registry.get(name)
