"""The uniform prompt stream: epoch by epoch, each epoch in a seeded order."""

from __future__ import annotations

import random
from typing import Generic, TypeVar

T = TypeVar("T")


class UniformSampler(Generic[T]):
    """Draws `per_step` items per step without replacement within an epoch; reshuffles each
    epoch with seed (seed, epoch). Its whole state is the cursor, so resuming is exact."""

    def __init__(self, items: list[T], per_step: int, seed: int | str = 0):
        if not items:
            raise ValueError("no prompts to train on (all skipped or the task is empty)")
        self.items, self.per_step, self.seed = items, per_step, seed
        self.cursor = 0  # items drawn so far, over all epochs
        self._cached: tuple[int, list[int]] = (-1, [])

    def _order(self, epoch: int) -> list[int]:
        if self._cached[0] != epoch:
            order = list(range(len(self.items)))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._cached = (epoch, order)
        return self._cached[1]

    def take(self, k: int) -> list[T]:
        """The next `k` items of the stream."""
        out = []
        for _ in range(k):
            epoch, pos = divmod(self.cursor, len(self.items))
            out.append(self.items[self._order(epoch)[pos]])
            self.cursor += 1
        return out

    def next(self) -> list[T]:
        return self.take(self.per_step)

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])
