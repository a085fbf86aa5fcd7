"""Is the run learning anything? Problems of one step, and when to give up.

A run whose every reward call fails, whose every update is skipped, or whose loss has
blown up still "finishes" and prints an accuracy; the user learns hours later that
nothing happened. Each step's record is checked here: a problem is shown in the step
line at once, and `patience` consecutive steps with one stop the run with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rollwise.compose.sections import HealthConfig

# The thresholds are the [health] section's (declared once, in compose/sections.py).
_DEFAULT = HealthConfig()


class RunUnhealthy(RuntimeError):
    """The run cannot learn anything; the message says why and what to check."""


def _num(record: dict, key: str) -> float | None:
    v = record.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def step_problems(record: dict, max_loss: float = _DEFAULT.max_loss,
                  max_kl: float = _DEFAULT.max_kl) -> list[str]:
    """What is wrong with one training-step record ([] when nothing is).

    >>> step_problems({"step_rollouts": 8, "reward_errors": 8, "groups_kept": 2,
    ...                "loss": 0.1, "skipped_nonfinite": 0.0})
    ['every reward call failed (8 of 8)']
    >>> step_problems({"step_rollouts": 8, "groups_kept": 2, "loss": float("nan")})
    ['loss diverging (nan)']
    """
    out = []
    n = _num(record, "step_rollouts") or 0
    failed = (_num(record, "reward_errors") or 0) + (_num(record, "reward_timeouts") or 0)
    if n and failed >= n:
        out.append(f"every reward call failed ({failed:.0f} of {n:.0f})")
    if _num(record, "skipped_nonfinite") == 1.0:
        out.append("update skipped (non-finite loss or gradient)")
    if _num(record, "groups_kept") == 0 or _num(record, "rows_trained") == 0:
        out.append("no learning signal (every advantage 0: rewards equal within each group)")
    loss, kl = _num(record, "loss"), _num(record, "kl")
    if loss is not None and (not math.isfinite(loss) or abs(loss) > max_loss):
        out.append(f"loss diverging ({loss:.3g})")
    if kl is not None and (not math.isfinite(kl) or kl > max_kl):
        out.append(f"KL diverging ({kl:.3g})")
    return out


@dataclass
class HealthCheck:
    """Counts consecutive steps with problems; `patience` 0 only warns. The settings are
    [health]'s: `HealthCheck(**cfg.health.model_dump())`."""

    patience: int = _DEFAULT.patience
    max_loss: float = _DEFAULT.max_loss
    max_kl: float = _DEFAULT.max_kl
    streak: int = 0
    problem_steps: int = 0  # steps with a problem over the whole run
    last: list[str] = field(default_factory=list)

    def observe(self, record: dict) -> list[str]:
        """The record's problems (also kept in `last`); updates the streak."""
        self.last = step_problems(record, self.max_loss, self.max_kl)
        self.streak = self.streak + 1 if self.last else 0
        self.problem_steps += bool(self.last)
        return self.last

    def verdict(self) -> str | None:
        """Why the run should stop, or None."""
        if not self.patience or self.streak < self.patience:
            return None
        return (f"stopped: {self.streak} steps in a row with nothing learned "
                f"({'; '.join(self.last)}). Check the verifier and task.rewards (reward "
                "errors are in trajectories.sqlite), learner.lr, rollout.group_size (> 1 "
                "for group baselines); health.patience = 0 only warns")

    def state_dict(self) -> dict:
        return {"streak": self.streak, "problem_steps": self.problem_steps}

    def load_state_dict(self, state: dict) -> None:
        self.streak = int(state.get("streak", 0))
        self.problem_steps = int(state.get("problem_steps", 0))
