"""What rollwise computes for advantage estimators besides rewards and group ids: one
frozen record, `AdvantageInputs`, and `uses`, the decorator by which an estimator says
which of its fields it takes by keyword. Imports torch only (types).

    @register(advantage_estimators, "drpo")
    @uses("lengths")
    def drpo(rewards, group_ids, *, lengths, lam=1.0): ...

Every other keyword of an estimator is an option (`algorithm.advantage_options`). The
registry refuses, at registration or import, an estimator that declares a name that is not
a field here, or names a field in its signature without declaring it
(`algos.registry.estimator_misfit`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class AdvantageInputs:
    """The inputs of one batch (N rows, T = the batch's padded length, K = its most
    turns); a field is None where the batch has no such input (token_rewards without the
    KL in the reward, ref_values when no sample has one) or no estimator asked for it (the
    multi-turn ones)."""

    mask: torch.Tensor | None = None  # [N, T] 1 on response tokens (the loss mask)
    lengths: torch.Tensor | None = None  # [N] response lengths in sampled tokens
    token_rewards: torch.Tensor | None = None  # [N, T] per-token rewards, e.g. -beta KL_t
    turns: torch.Tensor | None = None  # [N, T] long, the policy turn of each sampled
    # token (-1 elsewhere)
    step_rewards: torch.Tensor | None = None  # [N, K] the environment's reward after each
    # turn (0 past a row's turns)
    anchors: torch.Tensor | None = None  # [N, K] long, id of the state each turn acted in
    # (equal ids: the same state; -1 past a row's turns)
    trees: torch.Tensor | None = None  # [N] long, Tree-GRPO: the tree of its group a row
    # is a leaf of
    logprobs: torch.Tensor | None = None  # [N, T] behaviour log-prob of each sampled token
    # (0 off the response)
    input_ids: torch.Tensor | None = None  # [N, T] long, the row's tokens (prompt, response,
    # padding; `mask` picks the response)
    ref_values: torch.Tensor | None = None  # [N] the prompt's value under a reference policy
    # (`Sample.meta["ref_value"]`, PVPO's anchor); NaN where its sample has none

    def pick(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The keywords for an estimator that uses `names`: those of them this batch has."""
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


INPUT_NAMES = tuple(f.name for f in fields(AdvantageInputs))


def uses(*names: str) -> Callable[[F], F]:
    """Decorator: the estimator takes these `AdvantageInputs` fields by keyword."""
    def declare(fn: F) -> F:
        fn.advantage_inputs = names
        return fn

    return declare


def inputs_of(fn: Callable) -> tuple[str, ...]:
    """The input names `fn` declared with `uses` (none by default)."""
    return tuple(getattr(fn, "advantage_inputs", ()))
