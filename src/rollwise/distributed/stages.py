"""The same stages with rollout, reward and learner on Ray actors (ROLL's single controller).

`RayStages` is a `Stages`: the driver (`loop.py`, `asyncloop.py`) calls the same methods.
What the driver process keeps: the allocator, the sampler, the advantage computation, the
evaluator and a copy of the policy (evaluation, checkpoints), refreshed from the
published weights only when one of those needs it. What the actors hold:

    rollout.num_workers x RolloutWorker   a step's prompts split between them, groups
                                          numbered (seeded) as one scheduler would
    RewardWorker                          the reward pool, called by the workers as each
                                          group completes (scoring overlaps decoding)
    LearnerWorker                         the update; `publish` puts its weights once
                                          into the object store, workers load that version
                                          before their next request

Faults: rollout and reward actors restart (Ray `max_restarts`) and Ray re-runs the calls
they had not answered (`max_task_retries`), from the same prompts and group numbers, so
the step gets exactly the groups it asked for, once. A dead learner ends the run; the
last checkpoint on disk is whole and `--resume` continues from it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any

from rollwise.control import Request
from rollwise.rewards import RewardStats
from rollwise.rewards.group import apply_group_rewards
from rollwise.rollout.figures import RolloutFigures
from rollwise.pipeline.stages import Stages
from rollwise.types import Batch, Group

RESTARTS = 4  # times Ray restarts a dead rollout or reward actor


class LearnerDied(RuntimeError):
    """The learner actor is gone: the run stops; its last checkpoint is intact."""


@dataclass
class RayStages(Stages):
    ray: Any = None
    workers: list = field(default_factory=list)
    reward: Any = None
    learner_actor: Any = None
    numbered: bool = True  # the driver numbers groups (not with partial rollouts' pools)
    owns_ray: bool = False  # this process started the Ray connection (shuts it down)
    policy_ref: Any = None  # the policy in the object store: a restarted actor is rebuilt
    # from it, so the driver holds the reference for the run's life

    def __post_init__(self):
        self._lock = threading.Lock()
        self._uid = 0
        self._weights: tuple[int, Any] = (self.rollout_stage.engine.version, None)
        self._driver_version = self._weights[0]
        self._pending: dict[int, RewardStats] = {}
        self._figures: list[RolloutFigures] = []
        self._load_s = 0.0
        self._pids = self.ray.get([w.pid.remote() for w in self.workers])
        self.restarts = 0  # rollout workers seen restarted

    # -- the stage methods -----------------------------------------------------------------
    @property
    def model(self):
        self._sync_driver()
        return self.policy.model

    def rollout(self, requests: list[Request]) -> list[Group]:
        if not requests:
            return []
        prompts, sizes = [r.prompt for r in requests], [r.n for r in requests]
        k = max(1, min(len(self.workers), len(prompts)))
        bounds = [round(i * len(prompts) / k) for i in range(k + 1)]
        with self._lock:
            first, version, ref = self._uid, *self._weights
            self._uid += len(prompts)
        calls = [w.rollout.remote(prompts[a:b], sizes[a:b],
                                  first + a if self.numbered else None, version, [ref])
                 for w, a, b in zip(self.workers, bounds, bounds[1:])]
        groups: list[Group] = []
        for i, (out, stats, figures, info) in enumerate(self.ray.get(calls)):
            with self._lock:
                if out:
                    self._pending[id(out[0])] = stats
                self._figures += figures
                self._load_s = max(self._load_s, info["weights_load_seconds"])
                if info["pid"] != self._pids[i]:  # restarted: Ray re-ran the call
                    self.restarts += 1
                    self._pids[i] = info["pid"]
            groups += out
        return groups

    def score(self, groups: list[Group]) -> RewardStats:
        """The workers scored each group as it completed; their counts, and group terms."""
        stats = RewardStats(0, 0, 0, 0.0)
        with self._lock:
            for g in groups:
                stats = stats + self._pending.pop(id(g), RewardStats(0, 0, 0, 0.0))
        apply_group_rewards(groups, self.group_rewards)
        return stats

    def control_metrics(self) -> dict[str, float]:
        with self._lock:
            rounds, self._figures = self._figures, []
            load, self._load_s = self._load_s, 0.0
        figures = sum(rounds, RolloutFigures()).metrics() if rounds else {}
        return dict(self.control.last) | figures | {
            "weights_load_seconds": load, "rollout_worker_restarts": self.restarts}

    def update(self, batch: Batch) -> dict[str, float]:
        try:
            out, busy = self.ray.get(self.learner_actor.update.remote(batch))
        except self.ray.exceptions.RayActorError as e:
            raise LearnerDied(f"the learner actor died ({type(e).__name__}); the run's last "
                              "checkpoint is intact: continue it with --resume") from None
        return out | {"learner_update_seconds": busy}

    def publish(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        (ref,), nbytes = self.ray.get(self.learner_actor.publish.remote(version))
        with self._lock:
            self._weights = (version, ref)
        return {"publish_seconds": time.perf_counter() - start, "weights_bytes": nbytes}

    def evaluate(self) -> dict[str, float]:
        self._sync_driver()
        return self.evaluator()

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict, dict]:
        return self.ray.get(self.learner_actor.state.remote()), self.stage_state()

    def stage_state(self) -> dict:
        with self._lock:
            uid, version = self._uid, self._weights[0]
        state = {"sampler": self.sampler.state_dict(), "version": version,
                 "control": self.control.state_dict()}
        if self.numbered:  # the workers keep no pool: the group numbering is the state
            state["rollout"] = {"uid": uid, "pool": [], "previous": []}
        return state

    def load_state_dict(self, learner_state: dict, state: dict) -> None:
        """A checkpoint: the driver's model already holds its weights (load_checkpoint);
        the learner actor receives them with the optimizer, then they are published."""
        from rollwise.distributed.actors import to_plain

        self.sampler.load_state_dict(state["sampler"])
        if "control" in state:
            self.control.load_state_dict(state["control"])
        if self.numbered and state.get("rollout"):
            self._uid = state["rollout"]["uid"]
        weights = to_plain(self.policy.model.state_dict())
        self.ray.get(self.learner_actor.load.remote(learner_state, weights))
        self.publish(state["version"])
        self._driver_version = state["version"]
        self.rollout_stage.publish(state["version"])

    def _sync_driver(self) -> None:
        """The driver's copy of the policy brought to the latest published version."""
        from rollwise.distributed.actors import load_plain

        with self._lock:
            version, ref = self._weights
        if ref is None or version == self._driver_version:
            return
        load_plain(self.policy.model, self.ray.get(ref))
        self.rollout_stage.publish(version)  # the evaluator reads the same converted copy
        self._driver_version = version

    def worker_pids(self) -> list[int]:
        return list(self._pids)

    def shutdown(self) -> None:
        """Stop the actors (and the Ray connection this run started)."""
        for actor in [*self.workers, self.reward, self.learner_actor]:
            with contextlib.suppress(Exception):  # already gone
                self.ray.kill(actor)
        if self.owns_ray:
            self.ray.shutdown()


def build_distributed(cfg, rewards=None, *, address: str | None = None) -> RayStages:
    """`build(cfg)` for the driver, then the actors around the same stage builders."""
    from rollwise.pipeline.build import build
    from rollwise.distributed.cluster import connect, worker_env
    from rollwise.compose.parts import build_precision, reward_specs, reward_timeout

    ray, started = connect(address or cfg.run.ray_address)
    local = build(cfg, rewards)
    precision = build_precision(cfg, local.policy)
    data = cfg.model_dump()
    policy = ray.put(local.policy)
    r = cfg.rollout
    env = worker_env()
    reward = ray.remote(_actor("RewardWorker")).options(
        num_cpus=0, max_restarts=RESTARTS, max_task_retries=RESTARTS, runtime_env=env,
        max_concurrency=4).remote(reward_specs(cfg, local.task, rewards),
                                  reward_timeout(cfg, local.task))
    threads = cfg.run.threads or max(1, int(r.worker_cpus))
    # on a GPU the learner and the rollout workers share it: Ray places each on a GPU slice
    # and the weights the driver sends arrive there
    gpus = 1 / (r.num_workers + 1) if cfg.run.device.startswith("cuda") else 0
    workers = [ray.remote(_actor("RolloutWorker")).options(
        num_cpus=r.worker_cpus, num_gpus=gpus, max_restarts=RESTARTS,
        max_task_retries=RESTARTS, max_concurrency=2, runtime_env=env).remote(
            data, policy, precision, reward, threads)
        for _ in range(r.num_workers)]
    learner = ray.remote(_actor("LearnerWorker")).options(
        num_cpus=1, num_gpus=gpus, max_restarts=0, runtime_env=env).remote(
        data, policy, precision, cfg.run.threads or 1)
    ray.get(learner.pid.remote())  # constructed (a bad config fails here, not mid-step)
    base = {f.name: getattr(local, f.name) for f in fields(Stages)}
    base["info"] = dict(local.info, backend="ray", rollout_workers=r.num_workers)
    return RayStages(**base, ray=ray, workers=workers, reward=reward, learner_actor=learner,
                     numbered="partial" not in r.strategy, owns_ray=started, policy_ref=policy)


def _actor(name: str):
    from rollwise.distributed import actors

    return getattr(actors, name)
