"""The ports of `Stages` placed on Ray actors (ROLL's single controller).

The driver process keeps the allocator, the sampler, the advantage computation, the
evaluator and a copy of the policy (evaluation, checkpoints), brought to the latest
published weights only when one of those needs them. The actors hold the rest:

    RayRollout   ray.num_workers x RolloutWorker   a step's prompts split between them,
                                                   groups numbered (seeded) as one
                                                   scheduler would
                 RewardWorker                      the reward pool, called by the workers
                                                   as each group completes
    RayTrainer   LearnerWorker                     the update; `publish` puts its weights
                                                   once into the object store, workers
                                                   load that version before their next
                                                   request

Faults: rollout and reward actors restart (Ray `max_restarts`) and Ray re-runs the calls
they had not answered (`max_task_retries`), from the same prompts and group numbers, so
the step gets exactly the groups it asked for, once. A dead learner ends the run; the
last checkpoint on disk is whole and `--resume` continues from it.

Imports the compose builders (through the actors) and the components; never the
pipeline that drives these ports.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from rollwise.distributed.actors import load_plain, to_plain
from rollwise.distributed.shards import LearnerDied
from rollwise.rewards import RewardStats
from rollwise.rollout.figures import RolloutFigures
from rollwise.rollout.strategy import strategy
from rollwise.types import Batch, EncodedPrompt, Group, Published, WeightSlots

PLACEMENT = "Ray rollout workers"  # how publication errors name this placement
RESTARTS = 4  # times Ray restarts a dead rollout or reward actor


def _referenced(weights: Published) -> Published:
    if weights.handle is None:
        raise ValueError("the trainer published no object store reference for the workers "
                         "(run.backend='ray' needs the Ray learner's publication)")
    return weights


class RayRollout:
    """The rollout port over rollout worker actors and a reward actor."""

    def __init__(self, ray, workers: list, reward, *, numbered: bool, version: int,
                 policy_ref: Any = None):
        self.ray, self.workers, self.reward, self.numbered = ray, workers, reward, numbered
        # the policy in the object store: a restarted worker is rebuilt from it, so the
        # driver holds the reference for the run's life
        self.policy_ref = policy_ref
        self._lock = threading.Lock()
        self._uid = 0  # the next group number (the driver numbers groups: seeded rollouts)
        self.slots = WeightSlots(PLACEMENT, version)  # the publication protocol
        self._pending: dict[int, RewardStats] = {}
        self._figures: list[RolloutFigures] = []
        self._load_s = 0.0
        self._pids = ray.get([w.pid.remote() for w in workers])
        self.restarts = 0  # rollout workers seen restarted

    @property
    def version(self) -> int:
        return self.slots.active.version

    def run(self, prompts: list[EncodedPrompt], sizes: list[int]) -> list[Group]:
        k = max(1, min(len(self.workers), len(prompts)))
        bounds = [round(i * len(prompts) / k) for i in range(k + 1)]
        with self._lock:
            first, weights = self._uid, self.slots.active
            self._uid += len(prompts)
        calls = [w.rollout.remote(prompts[a:b], sizes[a:b],
                                  first + a if self.numbered else None, weights.version,
                                  [weights.handle])
                 for w, a, b in zip(self.workers, bounds, bounds[1:])]
        groups: list[Group] = []
        for i, reply in enumerate(self.ray.get(calls)):
            with self._lock:
                if reply.groups:
                    self._pending[id(reply.groups[0])] = reply.stats
                self._figures += reply.figures
                self._load_s = max(self._load_s, reply.weights_load_seconds)
                if reply.pid != self._pids[i]:  # restarted: Ray re-ran the call
                    self.restarts += 1
                    self._pids[i] = reply.pid
            groups += reply.groups
        return groups

    def score(self, groups: list[Group]) -> RewardStats:
        """The workers scored each group as it completed: their counts."""
        stats = RewardStats(0, 0, 0, 0.0)
        with self._lock:
            for g in groups:
                stats = stats + self._pending.pop(id(g), RewardStats(0, 0, 0, 0.0))
        return stats

    def metrics(self) -> dict[str, float]:
        with self._lock:
            rounds, self._figures = self._figures, []
            load, self._load_s = self._load_s, 0.0
        figures = sum(rounds, RolloutFigures()).metrics() if rounds else {}
        return figures | {"weights_load_seconds": load,
                          "rollout_worker_restarts": self.restarts}

    def stage(self, weights: Published) -> None:
        """The trainer put the weights in the object store: the reference is staged (the
        workers fetch nothing yet)."""
        self.slots.stage(weights, _referenced)

    def activate(self, version: int) -> None:
        """Workers load the staged version (from the object store) before their next
        request; the requests already sent finish with the weights they had."""
        with self._lock:
            self.slots.activate(version, lambda weights: None)

    def publish(self, weights: Published) -> None:
        """Stage and activate at once (no step runs in between)."""
        self.stage(weights)
        self.activate(weights.version)

    def state_dict(self) -> dict[str, Any] | None:
        """Every worker's rollout state, in worker order (a partial strategy's pool of
        unfinished groups, the previous responses `spec_reuse` drafts from, its own group
        numbering), and the driver's next group number when it numbers the groups."""
        workers = self.ray.get([w.state.remote() for w in self.workers])
        with self._lock:
            return {"uid": self._uid, "workers": workers}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        pools = state.get("workers", [])
        if pools and len(pools) != len(self.workers):
            raise ValueError(
                f"this checkpoint holds the rollout state of {len(pools)} rollout workers "
                f"(partial pools, previous responses); resume it with ray.num_workers = "
                f"{len(pools)} (now {len(self.workers)}), or that state would be lost")
        self.ray.get([w.load_state.remote(s) for w, s in zip(self.workers, pools)])
        with self._lock:
            self._uid = state.get("uid", self._uid)

    def worker_pids(self) -> list[int]:
        return list(self._pids)

    def close(self) -> None:
        for actor in [*self.workers, self.reward]:
            with contextlib.suppress(Exception):  # already gone
                self.ray.kill(actor)


class RayTrainer:
    """The trainer port over a learner actor. `model`: the driver's copy of the policy,
    whose weights a checkpoint restores and the evaluator reads."""

    def __init__(self, ray, actor, model):
        self.ray, self.actor, self.model = ray, actor, model
        self._published = Published(-1)  # the latest version put in the object store
        self._driver_version = -1  # the version `model` holds (-1: unknown)

    def _call(self, method: str, *args):
        try:
            return self.ray.get(getattr(self.actor, method).remote(*args))
        except self.ray.exceptions.RayActorError as e:
            raise LearnerDied(f"the learner actor died ({type(e).__name__}); the run's last "
                              "checkpoint is intact: continue it with --resume") from None

    def update(self, batch: Batch) -> dict[str, float]:
        out, busy = self._call("update", batch)
        return out | {"learner_update_seconds": busy}

    def reference_kl(self, batch: Batch):
        return self._call("reference_kl", batch)

    def publish(self, version: int) -> Published:
        (ref,), nbytes = self._call("publish", version)
        self._published = Published(version, ref, nbytes)
        return self._published

    def sync_into(self, model) -> int | None:
        published = self._published
        if published.handle is None or published.version == self._driver_version:
            return None
        load_plain(model, self.ray.get(published.handle))
        self._driver_version = published.version
        return published.version

    def state_dict(self) -> dict:
        return self._call("state")

    def load_state_dict(self, state: dict) -> None:
        """The learner actor receives the driver's weights (just loaded from a checkpoint)
        with the optimizer state."""
        self._call("load", state, to_plain(self.model.state_dict()))
        self._driver_version = -1  # the evaluator's copy is refreshed at the next sync

    def pid(self) -> int:
        return self._call("pid")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ray.kill(self.actor)


class RayConnection:
    """The Ray connection a run started; closing it shuts Ray down (one it joined stays)."""

    def __init__(self, ray, started: bool):
        self.ray, self.started = ray, started

    def close(self) -> None:
        if self.started:
            self.started = False
            self.ray.shutdown()


def place_on_ray(cfg, policy, precision, specs, timeout_s: float,
                 address: str | None = None) -> tuple[RayRollout, RayTrainer, RayConnection]:
    """The rollout and trainer ports on Ray actors, each built where it runs by the same
    builders as in one process (compose/parts.py, inside the actors)."""
    from rollwise.distributed.cluster import connect, worker_env

    ray, started = connect(address or cfg.ray.address)
    data = cfg.model_dump()
    policy_ref = ray.put(policy)
    r = cfg.ray
    env = worker_env()
    reward = ray.remote(_actor("RewardWorker")).options(
        num_cpus=0, max_restarts=RESTARTS, max_task_retries=RESTARTS, runtime_env=env,
        max_concurrency=4).remote(specs, timeout_s)
    threads = cfg.run.threads or max(1, int(r.worker_cpus))
    # on a GPU the learner and the rollout workers share it: Ray places each on a GPU slice
    # and the weights the driver sends arrive there
    gpus = 1 / (r.num_workers + 1) if cfg.run.device.startswith("cuda") else 0
    workers = [ray.remote(_actor("RolloutWorker")).options(
        num_cpus=r.worker_cpus, num_gpus=gpus, max_restarts=RESTARTS,
        max_task_retries=RESTARTS, max_concurrency=2, runtime_env=env).remote(
            data, policy_ref, precision, reward, threads)
        for _ in range(r.num_workers)]
    numbered = not strategy(cfg.schedule.strategy).pools_partials
    rollout = RayRollout(ray, workers, reward, numbered=numbered,
                         version=0, policy_ref=policy_ref)
    if cfg.learner.shards > 1:
        trainer = _sharded_trainer(ray, cfg, policy, policy_ref, precision, env)
        return rollout, trainer, RayConnection(ray, started)
    learner = ray.remote(_actor("LearnerWorker")).options(
        num_cpus=r.learner_cpus, num_gpus=gpus, max_restarts=0, runtime_env=env).remote(
        data, policy_ref, precision, cfg.run.threads or 1)
    ray.get(learner.pid.remote())  # constructed (a bad config fails here, not mid-step)
    return rollout, RayTrainer(ray, learner, policy.model), RayConnection(ray, started)


def _sharded_trainer(ray, cfg, policy, policy_ref, precision, env):
    """learner.shards ranks as actors of a placement group; each publication puts the
    driver's copy (which the ranks just wrote their rows into) once into the object store."""
    from rollwise.distributed.actors import put_weights
    from rollwise.distributed.rayranks import RayRanks
    from rollwise.distributed.shards import ShardedTrainer

    lc = cfg.learner
    ranks = RayRanks(ray, cfg.model_dump(), policy_ref, precision, lc.shards,
                     threads=cfg.run.threads or 1, timeout_s=lc.shard_timeout_s,
                     cpus=cfg.ray.learner_cpus,
                     gpus=1 if cfg.run.device.startswith("cuda") else 0, runtime_env=env)

    def handoff(version: int) -> Published:
        return Published(version, *put_weights(ray, policy.model))

    return ShardedTrainer(ranks, policy.model, handoff)


def _actor(name: str):
    from rollwise.distributed import actors

    return getattr(actors, name)
