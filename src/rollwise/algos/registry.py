"""Name registries for the algorithm functions. One signature per kind (see each module)."""

from __future__ import annotations

from collections.abc import Callable

advantage_estimators: dict[str, Callable] = {}
policy_losses: dict[str, Callable] = {}
kl_estimators: dict[str, Callable] = {}
corrections: dict[str, Callable] = {}


def register(registry: dict[str, Callable], name: str) -> Callable[[Callable], Callable]:
    """Decorator: `@register(policy_losses, "ppo")` adds a function under a name."""

    def add(fn: Callable) -> Callable:
        if name in registry:
            raise ValueError(f"'{name}' is already registered")
        registry[name] = fn
        return fn

    return add


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


def lookup(registry: dict[str, Callable], name: str, kind: str) -> Callable:
    """The function registered as `name`, or an error listing what is registered."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} '{name}'; registered: {', '.join(sorted(registry))}") from None
