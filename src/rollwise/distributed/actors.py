"""The Ray actors: each wraps a stage object the local driver uses, built by `build.py`.

    RolloutWorker   a `RolloutStage` (engine + scheduler); loads the published weights
                    between requests; scores through the reward actor while it decodes
    RewardWorker    a `RewardPool` (verifier processes with time limits)
    LearnerWorker   a `Learner`; publishes its weights once per version into the object
                    store (one copy, read by every worker)

Plain classes: `rollwise.distributed.ports` makes them actors (`ray.remote`) with the
restart options, so this module imports without Ray.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollwise.rewards import RewardPool, RewardStats
from rollwise.rollout.figures import RolloutFigures
from rollwise.system.runtime import configure as configure_runtime
from rollwise.types import Group, Published, Trajectory


def _config(data: dict):
    from rollwise.compose.config import validate_config

    return validate_config(data)


def put_weights(ray, model: torch.nn.Module) -> tuple[Any, int]:
    """The model's weights put once into the object store (`to_plain`): (reference, bytes)."""
    state = to_plain(model.state_dict())
    nbytes = sum(v.nbytes if isinstance(v, np.ndarray) else v.numel() * v.element_size()
                 for v in state.values())
    return ray.put(state), nbytes


def to_plain(state: dict[str, torch.Tensor]) -> dict:
    """Tensors as numpy arrays where numpy has the dtype (read zero-copy from the object
    store), else as tensors (bfloat16). A tensor that shares its memory with an earlier
    one (tied embeddings) is sent once: loading the first updates both."""
    out, seen = {}, set()
    for k, v in state.items():
        v = v.detach().cpu()
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key in seen:
            continue
        seen.add(key)
        out[k] = v.numpy() if v.dtype in (torch.float32, torch.float16, torch.float64,
                                          torch.int64, torch.int32) else v.clone()
    return out


def load_plain(model, state: dict) -> None:
    """Copy a `to_plain` state into `model`'s tensors, in place (the engine reads them)."""
    own = model.state_dict()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only arrays of the object store: copied
        for k, v in state.items():
            own[k].copy_(torch.as_tensor(v) if isinstance(v, np.ndarray) else v)


@dataclass
class RolloutReply:
    """What a rollout worker answers for one share of a step: its groups, scored."""

    groups: list[Group]
    stats: RewardStats  # the scoring's counts
    figures: list[RolloutFigures]  # the scheduler's figures of each round
    weights_load_seconds: float  # loading the weights of the asked version first (0: held)
    pid: int  # the worker process (another one: Ray restarted the worker and re-ran this)


class RemoteScorer:
    """A rollout stage's scorer that calls the reward actor (scores copied in place)."""

    def __init__(self, reward):
        self.reward = reward

    def __call__(self, trajectories: list[Trajectory]) -> RewardStats:
        import ray

        if not trajectories:
            return RewardStats(0, 0, 0, 0.0)
        out, stats = ray.get(self.reward.score.remote(trajectories))
        for t, (reward, scores, errors, seconds) in zip(trajectories, out, strict=True):
            t.reward, t.scores, t.reward_errors = reward, scores, errors
            t.timings["reward"] = seconds
        return stats


class RolloutWorker:
    def __init__(self, cfg_data: dict, policy, precision, reward, threads: int):
        from rollwise.compose.parts import build_rollout_stage, build_task

        cfg = _config(cfg_data)
        configure_runtime(threads, cfg.run.allocator)
        self.policy = policy
        task = build_task(cfg)  # an environment task rolls out episodes in the worker
        self.stage = build_rollout_stage(cfg, policy, precision, RemoteScorer(reward),
                                         task=task if task.env is not None else None)
        self.busy = False

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def is_busy(self) -> bool:
        return self.busy

    def state(self):
        """The rollout stage's state between steps (a partial strategy's pool, as plain data)."""
        return self.stage.state_dict()

    def load_state(self, state) -> None:
        self.stage.load_state_dict(state)

    def rollout(self, prompts, sizes, first_uid, version, weights):
        """Groups for `prompts`, scored; the weights of `version` loaded first when this
        worker holds another (`weights`: [the object store reference])."""
        self.busy = True
        try:
            loaded = self._load(version, weights[0])
            if first_uid is not None and self.stage.scheduler is not None:
                self.stage.scheduler.number_groups_from(first_uid)
            groups = self.stage.run(prompts, [int(n) for n in sizes])
            return RolloutReply(groups, self.stage.score(groups), self.stage.take_figures(),
                                weights_load_seconds=loaded, pid=os.getpid())
        finally:
            self.busy = False

    def _load(self, version: int, ref) -> float:
        if version == self.stage.engine.version or ref is None:
            return 0.0
        import ray

        start = time.perf_counter()
        load_plain(self.policy.model, ray.get(ref))
        self.stage.publish(Published(version))
        return time.perf_counter() - start


class RewardWorker:
    def __init__(self, specs, timeout_s: float):
        self.pool = RewardPool(specs, timeout_s=timeout_s).start()

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def score(self, trajectories: list[Trajectory]):
        stats = self.pool.score(trajectories)
        return [(t.reward, t.scores, t.reward_errors, t.timings.get("reward", 0.0))
                for t in trajectories], stats


class LearnerWorker:
    def __init__(self, cfg_data: dict, policy, precision, threads: int):
        from rollwise.compose.parts import build_learner

        cfg = _config(cfg_data)
        configure_runtime(threads, cfg.run.allocator)
        torch.manual_seed(cfg.run.seed)
        self.policy = policy
        self.learner = build_learner(cfg, policy, precision)

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def update(self, batch):
        start = time.perf_counter()
        out = self.learner.update(batch)
        return out, time.perf_counter() - start

    def reference_kl(self, batch):
        return self.learner.reference_kl(batch)

    def publish(self, version: int):
        """The weights of `version` put once into the object store: ([reference], bytes)."""
        import ray

        ref, nbytes = put_weights(ray, self.policy.model)
        return [ref], nbytes

    def state(self) -> dict:
        return self.learner.state_dict()

    def load(self, learner_state: dict, weights: dict) -> None:
        load_plain(self.policy.model, weights)
        self.learner.load_state_dict(learner_state)
