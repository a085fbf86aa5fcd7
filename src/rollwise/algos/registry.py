"""Name registries for the algorithm functions. One signature per kind (see each module);
`takes` is what the learner passes positionally, checked for users' own functions.
Imports `rollwise.registry` (the registry idiom, itself importing nothing of rollwise) and
algos/ only."""

from __future__ import annotations

import difflib
from collections.abc import Callable

from rollwise.algos.inputs import INPUT_NAMES, inputs_of
from rollwise.registry import Registry, options_of

ESTIMATOR_TAKES = ("rewards", "group_ids")


def estimator_misfit(fn: Callable) -> str | None:
    """Why an estimator's inputs do not fit, or None: a declared input (`uses`) that is no
    field of `AdvantageInputs` (with the closest field) or that its signature cannot take,
    or a keyword named like an input that it did not declare (it would be read as an
    option and never filled)."""
    declared = inputs_of(fn)
    for name in declared:
        if name not in INPUT_NAMES:
            close = difflib.get_close_matches(name, INPUT_NAMES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return (f"uses input {name!r}{hint}, which is no field of AdvantageInputs; "
                    f"inputs: {', '.join(INPUT_NAMES)}")
    spec = options_of(fn, passes=ESTIMATOR_TAKES)
    for name in declared:
        if not spec.takes(name):
            return f"uses input {name!r} but has no keyword parameter {name!r}"
    for name in spec.defaults:
        if name in INPUT_NAMES and name not in declared:
            return (f"keyword {name!r} is an input: declare it with "
                    f"@rollwise.algos.uses({name!r}) (else it is never filled)")
    return None


advantage_estimators: Registry[Callable] = Registry(
    "advantage estimator", takes=ESTIMATOR_TAKES, options=True, check=estimator_misfit)
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
