"""learner.shards ranks as Ray actors (run.backend = "ray"): `RankActor`, one a bundle of a
placement group, and `RayRanks`, the rank transport `ShardedTrainer` calls them through
(distributed/shards.py has the trainer port and the other transports).

Imports the sharded trainer's rank worker; Ray only when ranks are placed.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from rollwise.distributed.shards import RankWorker, free_address, rank_failed


class RankActor:
    """A learner rank as a Ray actor (`ray.remote` in `RayRanks`): its `RankWorker` is built
    once rank 0's address is known."""

    def __init__(self):
        self.worker: RankWorker | None = None

    def address(self) -> str:
        """A rendezvous address on this actor's node (asked of rank 0)."""
        import ray

        return free_address(ray.util.get_node_ip_address())

    def start(self, cfg_data: dict, policy, precision, rank: int, world: int, address: str,
              threads: int) -> int:
        self.worker = RankWorker(cfg_data, policy.model, precision, rank, world, address,
                                 threads, shared=False)
        return os.getpid()

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)


class RayRanks:
    """N learner ranks as Ray actors, one a bundle of a placement group (packed on as few
    nodes as fit); the rendezvous address is rank 0's. Weights travel as arrays through
    the object store (no memory is shared with the driver)."""

    shared = False

    def __init__(self, ray, cfg_data: dict, policy_ref, precision, world: int, threads: int,
                 timeout_s: float, gpus: int = 0, runtime_env: dict | None = None,
                 cpus: float = 1.0):
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray, self.world, self.timeout_s = ray, world, timeout_s
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        self.group = placement_group([bundle] * world, strategy="PACK")
        self._remove = remove_placement_group
        self.actors = []
        try:
            ray.get(self.group.ready(), timeout=timeout_s)
            cls = ray.remote(RankActor)
            self.actors = [cls.options(
                num_cpus=cpus, num_gpus=gpus, max_restarts=0, runtime_env=runtime_env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=r)).remote()
                for r in range(world)]
            address = ray.get(self.actors[0].address.remote(), timeout=timeout_s)
            self.pids = self._wait([a.start.remote(cfg_data, policy_ref, precision, r, world,
                                                   address, threads)
                                    for r, a in enumerate(self.actors)], "start")
        except BaseException:
            self.close()
            raise

    def call(self, method: str, args: list[tuple]) -> list[Any]:
        return self._wait([a.call.remote(method, *x) for a, x in
                           zip(self.actors, args, strict=True)], method)

    def _wait(self, refs: list, phase: str) -> list[Any]:
        """Every rank's reply; the first failure (a dead actor, an error, the time-out)
        stops all of them, naming its rank."""
        ray, rank_of = self.ray, {ref: r for r, ref in enumerate(refs)}
        pending, deadline = list(refs), time.monotonic() + self.timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1,
                                     timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                self._fail(rank_of[pending[0]], phase, "no answer within "
                           f"learner.shard_timeout_s = {self.timeout_s:g} s")
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                self._fail(rank_of[done[0]], phase, f"its actor died ({type(e).__name__})")
            except ray.exceptions.RayTaskError as e:
                self._fail(rank_of[done[0]], phase, str(e.cause or e).splitlines()[0])
        return ray.get(refs)

    def _fail(self, rank: int, phase: str, why: str):
        world = self.world
        self.close()
        raise rank_failed(rank, world, phase, why)

    def close(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)
        with contextlib.suppress(Exception):
            self._remove(self.group)
        self.actors, self.world = [], 0
