"""Replay: the run's trajectory history (SQLite), written and read back by the run directory
(`run`), the reports (`observe`) and the drivers (`pipeline`).

May import: types.
"""

from rollwise.replay.store import TrajectoryStore

__all__ = ["TrajectoryStore"]
