"""Scoring ahead of the driver: each complete group starts scoring in a background thread
while the rest of the step still generates; `collect` gathers those results and scores
whatever was not started. The rollout stage in this process and the remote rollout port
(rollout/remote.py) both score this way.

Imports the reward counts and the records only.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from rollwise.rewards.pool import RewardStats
from rollwise.types import Group, Trajectory

Scorer = Callable[[list[Trajectory]], RewardStats]  # scores in place, returns the counts


class ScoreAhead:
    """Groups scored as they complete, by one background thread running `scorer`."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer
        # (group, its scoring) in the order they completed; held by the group itself, not
        # its id(), so a dropped group's address reused by a new one cannot match
        self._started: list[tuple[Group, Future]] = []
        self._thread: ThreadPoolExecutor | None = None

    def start(self, group: Group) -> None:
        """Start scoring a complete group (the reward pool's worker threads run the
        verifiers; generation goes on meanwhile)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="rollwise-score")
        self._started.append((group, self._thread.submit(self.scorer, group.trajectories)))

    def collect(self, groups: list[Group]) -> RewardStats:
        """Every trajectory of `groups` scored: started ones collected, the rest scored now."""
        stats = RewardStats(0, 0, 0, 0.0)
        started, self._started = self._started, []
        rest = []
        for g in groups:
            hit = next((i for i, (h, _) in enumerate(started) if h is g), None)
            if hit is None:
                rest.extend(g.trajectories)
            else:
                stats = stats + started.pop(hit)[1].result()
        self._started = started  # started for groups not asked about (kept for a later call)
        if rest:
            stats = stats + self.scorer(rest)
        return stats

    def close(self) -> None:
        """Stop the scoring thread (started again if used after)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
