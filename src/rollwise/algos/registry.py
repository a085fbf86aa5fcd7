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


def lookup(registry: dict[str, Callable], name: str, kind: str) -> Callable:
    """The function registered as `name`, or an error listing what is registered."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} '{name}'; registered: {', '.join(sorted(registry))}") from None
