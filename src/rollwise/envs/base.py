"""The environment protocol: what a multi-turn episode talks to.

    observation = env.reset(sample)          # the first observation (the task's prompt)
    result = env.step(action)                # action: the policy's decoded turn
    result.observation, result.reward, result.done, result.info

Text in, text out: an environment never sees token ids or chat templates (the episode
runner renders observations into tokens, rollout/episodes.py). `info` keys the runner reads:

    success (bool)      the episode is solved (its CORRECT score; held-out success rate)
    state (str)         the environment state the *next* turn acts in (GiGPO's anchor
                        states: equal strings are the same state); default: the observation
    malformed (int)     malformed tool calls in this action (a counted metric)

An environment that raises, or whose `step` overruns the runner's time limit, ends its
episode with reward 0 and the error recorded; it never stops the rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rollwise.types import Sample


@dataclass
class StepResult:
    observation: str  # what the environment shows the policy next ("" when done)
    reward: float  # reward of this step (step rewards add up to the episode's reward)
    done: bool  # the episode is over
    info: dict[str, Any] = field(default_factory=dict)  # success, state, malformed, ...


@runtime_checkable
class Env(Protocol):
    """One episode's environment; a fresh instance per episode (the runner makes them)."""

    tools: list[dict]  # OpenAI-style function schemas the policy may call ([]: none)

    def reset(self, sample: Sample) -> str:
        """Start an episode for `sample`; the first observation."""
        ...

    def step(self, action: str) -> StepResult:
        """Act on the policy's decoded turn `action`."""
        ...
