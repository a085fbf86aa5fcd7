"""Replay: the run's trajectory history (SQLite), read back by control, rollout and reports."""

from rollwise.replay.store import TrajectoryStore

__all__ = ["TrajectoryStore"]
