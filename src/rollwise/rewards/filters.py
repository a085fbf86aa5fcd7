"""Group filters applied after scoring and before advantages."""

from __future__ import annotations

from rollwise.types import Group


def drop_zero_variance(groups: list[Group]) -> list[Group]:
    """Keep groups whose rewards differ (DAPO dynamic sampling without the refill): a group
    with equal rewards has zero GRPO advantage everywhere and only dilutes the update."""
    return [g for g in groups if not g.zero_variance]
