"""An adapter from `gymnasium`-style text environments to rollwise's `Env` protocol.

A gymnasium environment with text observations and actions (`reset(seed=, options=) ->
(obs, info)`, `step(action) -> (obs, reward, terminated, truncated, info)`) becomes an
`Env`: the sample's id seeds the reset, its `meta` is passed as `options`, and terminated
or truncated ends the episode. gymnasium itself is not imported (any object with those two
methods works), so rollwise does not depend on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from rollwise.envs.base import StepResult
from rollwise.types import Sample


class GymTextEnv:
    """`make()` builds the wrapped environment (one per episode); `action(text)` maps the
    policy's decoded turn to the environment's action (default: the text itself)."""

    def __init__(self, make: Callable[[], Any], action: Callable[[str], Any] = str,
                 tools: list[dict] | None = None):
        self.env, self.to_action, self.tools = make(), action, list(tools or [])

    def reset(self, sample: Sample) -> str:
        seed = int.from_bytes(hashlib.blake2b(sample.id.encode(), digest_size=4).digest(), "big")
        obs, _info = self.env.reset(seed=seed, options=dict(sample.meta))
        return str(obs)

    def step(self, action: str) -> StepResult:
        obs, reward, terminated, truncated, info = self.env.step(self.to_action(action))
        info = dict(info or {})
        return StepResult(str(obs), float(reward), bool(terminated or truncated), info)
