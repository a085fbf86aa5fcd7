"""What a run holds between collecting a step's groups and training on them.

The batches collected ahead of training, by step, each with the stages' state as of its
collection (the sampler's cursor, the controller, the rollout pools): the asynchronous
driver's queue, empty in a synchronous run except for what a resumed checkpoint kept.
`InFlight` is their one owner, `Stages.inflight` holds it, and its `state_dict` is the one
source of the stages' state a snapshot keeps (`Stages.stage_state`):

    batches ready               the state as of the last one's collection, and the batches
                                (`ahead`, plain data, in step order)
    none, a batch taken         the state as of the last taken batch's collection (the
    while rolling out ahead     producer may be collecting the next one: not kept; a
                                resumed run asks for its groups again, from that state)
    none                        the stages' own state now

and the version of the last trained step. A resumed run trains the kept batches first, as
they are; the batches are decoded by the driver (`restore`), since only it knows the task's
prompts. Imports nothing of rollwise.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any


class InFlight:
    """The batches collected ahead of training, by step, and the state a snapshot keeps;
    thread-safe (a producer puts, the training thread takes)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._ready: dict[int, tuple[Any, dict | None]] = {}  # step -> (batch, state)
        self._loaded: list[dict] = []  # a checkpoint's batches (plain) until `restore`
        self._after: dict | None = None  # the state as of the last taken batch's collection
        self._trained: int | None = None  # the version of the last trained step
        self._error: BaseException | None = None

    def load_state_dict(self, ahead: list[dict]) -> None:
        """A checkpoint's batches collected ahead (plain data, in step order), kept as they
        are until a driver `restore`s them."""
        with self._cv:
            self.close()
            self._loaded = list(ahead)

    def restore(self, start: int, decode: Callable[[dict], Any], state: dict) -> int:
        """The checkpoint's batches decoded for the steps from `start` on; the last carries
        `state` (the stages' own, which is as of its collection). How many there are."""
        with self._cv:
            plain, self._loaded = self._loaded, []
            self._trained = start
            for i, data in enumerate(plain):
                last = i == len(plain) - 1
                self._ready[start + i] = (decode(data), _copy(state) if last else None)
            return len(plain)

    def put(self, step: int, batch: Any, state: dict | None = None) -> None:
        """Step `step`'s batch and the stages' state as of its collection (None: the
        stages' own state, nothing having been rolled out since)."""
        with self._cv:
            self._ready[step] = (batch, None if state is None else _copy(state))
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        """The producer failed: `take` raises `error`."""
        with self._cv:
            self._error = error
            self._cv.notify_all()

    def has(self, step: int) -> bool:
        with self._cv:
            return step in self._ready

    def take(self, step: int) -> tuple[Any, int]:
        """Step `step`'s batch (waiting until it is ready, or the producer failed) and the
        number of later batches waiting."""
        with self._cv:
            while step not in self._ready and self._error is None:
                self._cv.wait()
            if step not in self._ready:
                raise self._error  # type: ignore[misc]
            batch, self._after = self._ready.pop(step)
            self._trained = step + 1
            return batch, len(self._ready)

    def state_dict(self, own: Callable[[], dict]) -> dict:
        """The stages' state a snapshot of the last trained step keeps (the table above);
        `own`: the stages' own state now."""
        with self._cv:
            ready = [self._ready[s] for s in sorted(self._ready)]
            after, trained, loaded = self._after, self._trained, list(self._loaded)
        if ready:
            state = dict(ready[-1][1] or own())
            state["ahead"] = [batch.to_plain() for batch, _ in ready]
        elif after is not None:
            state = dict(after)
        else:
            state = own() | ({"ahead": loaded} if loaded else {})
        return state | ({"version": trained} if trained is not None else {})

    def close(self) -> None:
        """The driver ended: nothing in flight any more."""
        with self._cv:
            self._ready.clear()
            self._loaded, self._after, self._trained, self._error = [], None, None, None


def _copy(state: dict) -> dict:
    """A plain copy of `state`, as a checkpoint will read it."""
    return json.loads(json.dumps(state))
