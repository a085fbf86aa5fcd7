"""Guess the number: a multi-turn game with a state, and step rewards for good moves.

The environment holds a secret in [1, high]. Each turn the policy guesses a number (the
last integer of its turn); the environment answers "higher", "lower" or "correct". The
state is the interval still consistent with the feedback, [lo, hi]:

    reward of a guess g   1 when g is the secret (the episode ends, success)
                          + `consistent_bonus` when lo <= g <= hi (a move that can be right)
                          0 for a guess outside [lo, hi] or no number at all
    state (anchor key)    "lo-hi" before the move: GiGPO groups steps taken in equal states

A turn without a number is malformed: the observation says so and info["malformed"] is 1.
The episode also ends after `max_guesses` guesses (no success).
"""

from __future__ import annotations

import re
from typing import ClassVar

from rollwise.envs.base import StepResult
from rollwise.types import Sample

_INT = re.compile(r"-?\d+")


class GuessEnv:
    tools: ClassVar[list[dict]] = []

    def __init__(self, max_guesses: int = 6, consistent_bonus: float = 0.1):
        self.max_guesses, self.bonus = max_guesses, consistent_bonus
        self.secret = self.lo = self.hi = self.guesses = 0

    def reset(self, sample: Sample) -> str:
        self.secret, self.hi = int(sample.meta["secret"]), int(sample.meta["high"])
        self.lo, self.guesses = 1, 0
        return sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]

    @property
    def state(self) -> str:
        return f"{self.lo}-{self.hi}"

    def step(self, action: str) -> StepResult:
        found = _INT.findall(action)
        if not found:
            return StepResult(f"no number found; guess a number from {self.lo} to {self.hi}",
                              0.0, False, {"malformed": 1, "state": self.state})
        g = int(found[-1])
        self.guesses += 1
        reward = self.bonus if self.lo <= g <= self.hi else 0.0
        if g == self.secret:
            return StepResult("correct", 1.0 + reward, True, {"success": True})
        if g < self.secret:
            self.lo, word = max(self.lo, g + 1), "higher"
        else:
            self.hi, word = min(self.hi, g - 1), "lower"
        done = self.guesses >= self.max_guesses
        return StepResult(f"{g} is wrong, {word}", reward, done,
                          {"success": False, "state": self.state})
