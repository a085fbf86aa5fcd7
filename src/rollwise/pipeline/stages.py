"""The stages of the drivers (`loop.py`, `asyncloop.py`), as one object built by `build.py`.

Each method is one named stage; the work lives in the parts it holds: the controller, the
rollout port, the reward terms applied per group, the trainer port and the evaluator. The
ports (pipeline/ports.py) are where placement shows: the same `Stages` drives a rollout
stage and a learner in this process, or rollout workers and a learner on Ray actors.
Nothing here reads the config tree: `build.py` passes plain arguments.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from rollwise.control import Controller, Request, UniformSampler
from rollwise.engine.base import release_cache
from rollwise.envs.render import TurnRenderer
from rollwise.learner import prepare_batch
from rollwise.learner.sft import SftSettings, encode_demonstration, read_demonstrations, train_sft
from rollwise.models import Policy
from rollwise.pipeline.evaluate import Evaluator
from rollwise.pipeline.inflight import InFlight
from rollwise.pipeline.ports import RolloutPort, TrainerPort
from rollwise.rewards import RewardStats, mask_infra_failures
from rollwise.rewards.group import GroupTerm, apply_group_rewards
from rollwise.tasks import Task
from rollwise.types import Batch, EncodedPrompt, Group, Sample


class Closeable(Protocol):
    def close(self) -> None: ...


@dataclass
class BuildInfo:
    """Figures of a build, for the run's header lines and its summary."""

    train_prompts: int
    eval_prompts: int
    skipped_train_prompts: int  # longer than the context budget
    skipped_eval_prompts: int
    parameters: int
    trainable_parameters: int
    precision: dict[str, Any]  # the precision chosen for each part, and why
    precision_line: str
    allocator: str = "system"  # the C allocator in use (system.runtime.tune_allocator)
    placement: dict[str, Any] = field(default_factory=dict)  # e.g. {"backend": "ray", ...}
    task: dict[str, Any] = field(default_factory=dict)  # the task's own (e.g. "sandbox")

    def summary(self) -> dict[str, Any]:
        """One flat record, as summary.json keeps it."""
        out = asdict(self)
        return {**{k: v for k, v in out.items() if k not in ("placement", "task")},
                **self.placement, **self.task}


@dataclass
class Stages:
    """The built parts; each method is one named stage of the driver."""

    policy: Policy  # the driver's copy: evaluation and checkpoints read it
    task: Task
    control: Controller  # the rollout allocator: which prompts, how many rollouts each
    rollout_stage: RolloutPort  # rollouts and their scoring
    learner: TrainerPort
    evaluator: Evaluator
    advantage_fn: Callable
    info: BuildInfo
    advantage_options: dict[str, Any] = field(default_factory=dict)
    group_rewards: list[GroupTerm] = field(default_factory=list)  # after the verifiers
    mask_truncated: bool = False
    kl_in_reward: float = 0.0  # KL coefficient of the KL-in-reward penalty (0: off)
    resources: list[Closeable] = field(default_factory=list)  # closed with the stages
    sft: tuple[str, SftSettings] | None = None  # demonstrations before RL (path, settings)
    # free the rollout engine's key/value cache before each update (no rollout runs beside
    # it: not in-process asynchronous training)
    release_engine_cache: bool = False
    # the batches collected ahead of training (and a checkpoint's, until a driver restores
    # them): the one owner of what is in flight, and of the snapshot's stage state
    inflight: InFlight = field(default_factory=InFlight)
    # publication (Stages.publish, Stages.activate): one phase at a time; the version staged
    _publishing: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _staged: int | None = field(default=None, repr=False)

    @property
    def sampler(self) -> UniformSampler[EncodedPrompt]:
        """The training prompts' stream: the controller's, which draws from it and saves it."""
        return self.control.sampler

    @property
    def model(self):
        """The driver's model at the latest published version (checkpoints save it)."""
        self._sync_driver()
        return self.policy.model

    @property
    def engine(self):
        """The engine in this process: the rollout engine, else the evaluator's."""
        return getattr(self.rollout_stage, "engine", None) or self.evaluator.engine

    def select(self) -> list[Request]:
        """The allocator's first round of the step: which prompts, how many rollouts each."""
        return self.control.plan()

    def rollout(self, requests: list[Request]) -> list[Group]:
        if not requests:
            return []
        return self.rollout_stage.run([r.prompt for r in requests], [r.n for r in requests])

    def score(self, groups: list[Group]) -> RewardStats:
        stats = self.rollout_stage.score(groups)
        for g in groups:  # a verifier's infrastructure failed: zero advantage, not a 0 reward
            mask_infra_failures(g.trajectories)
        apply_group_rewards(groups, self.group_rewards)
        return stats

    def observe(self, groups: list[Group]) -> list[Request]:
        """Scored groups update the prompt posteriors; the allocator's next round, or []."""
        return self.control.observe(groups)

    def allocation(self) -> tuple[list[Group], list[Group]]:
        """(every group of the step merged per prompt, the groups the allocator trains on)."""
        return self.control.finish()

    def regenerate(self, stale: list[Group]) -> tuple[list[Group], RewardStats, int]:
        """Roll out the prompts of `stale` groups again with the current weights, through
        the controller (which asks for them and sees their scores): (the new groups, their
        reward counts, the trajectories requested)."""
        requests = self.control.regenerate(stale)
        groups = self.rollout(requests)
        stats = self.score(groups)
        self.control.observe_regenerated(groups)
        return groups, stats, sum(r.n for r in requests)

    def control_metrics(self) -> dict[str, float]:
        """The allocator's figures and the rollout port's, for this step's record."""
        return dict(self.control.last) | self.rollout_stage.metrics()

    def advantages(self, groups: list[Group]) -> Batch:
        return prepare_batch(
            groups, self.advantage_fn, pad_id=self.policy.tokenizer.pad_token_id,
            options=self.advantage_options, mask_truncated=self.mask_truncated,
            reference_kl=self.learner.reference_kl, kl_coef=self.kl_in_reward)

    def update(self, batch: Batch) -> dict[str, float]:
        if self.release_engine_cache:  # the update's activations reuse the rollouts' memory
            release_cache(getattr(self.rollout_stage, "engine", None))
        return self.learner.update(batch)

    def publish(self, version: int, activate: bool = True) -> dict[str, float]:
        """The trainer publishes its weights as `version` and the rollout side stages them;
        `activate`: and samples with them from now on (else at `activate()`, a later step
        boundary). Waits while an activation runs: a trainer's next publication may replace
        what the rollout side is loading. The time it took (and the bytes sent, when they
        travel, and the trainer's phases of making them: `weights_write_seconds`...), for
        the step's record."""
        start = time.perf_counter()
        with self._publishing:
            weights = self.learner.publish(version)
            self.rollout_stage.stage(weights)
            self._staged = version
        if activate:
            self.activate()
        out = {"publish_seconds": time.perf_counter() - start} | {
            f"weights_{k.removesuffix('_s')}_seconds": v for k, v in weights.seconds.items()}
        return out | ({"weights_bytes": weights.nbytes} if weights.nbytes else {})

    def activate(self) -> float:
        """The rollout side samples with the latest staged version from now on (none
        staged: nothing to do); the seconds it took."""
        with self._publishing:
            version, self._staged = self._staged, None
            if version is None:
                return 0.0
            start = time.perf_counter()
            self.rollout_stage.activate(version)
            return time.perf_counter() - start

    def evaluate(self) -> dict[str, float]:
        self._sync_driver()
        return self.evaluator()

    def warm_start(self, log: Callable[[dict], None]) -> dict:
        """Supervised steps on the [sft] demonstrations, tokenized as episodes are, then
        published to the rollout side; `log` gets a record per logging interval."""
        path, settings = self.sft
        model = getattr(self.learner, "model", None)
        if model is not self.policy.model:
            raise ValueError("[sft] trains the learner in this process; run.backend = 'ray' "
                             "and engine.name = 'remote' are not supported")
        p = self.policy
        renderer = TurnRenderer(p.tokenizer, p.chat, p.stop_ids)
        rows = [encode_demonstration(m, p, renderer.observation_ids)
                for m in read_demonstrations(path)]
        pad = p.tokenizer.pad_token_id
        figures = train_sft(model, rows, p.tokenizer.eos_token_id if pad is None else pad,
                            settings, log)
        version = self.rollout_stage.version
        self.publish(version)
        self.evaluator.publish(version)
        return figures

    def _sync_driver(self) -> None:
        """The driver's policy brought to the latest published version (a trainer in
        another process); the evaluator's engine follows it."""
        version = self.learner.sync_into(self.policy.model)
        if version is not None:
            self.evaluator.publish(version)

    # -- state -----------------------------------------------------------------------------
    def stage_state(self) -> dict:
        """What a snapshot keeps besides the weights and the optimizer (plain data): the
        in-flight batches' account of it (pipeline/inflight.py), from `own_state`."""
        return self.inflight.state_dict(self.own_state)

    def own_state(self) -> dict:
        """What changes between steps besides the weights and the optimizer, as it is now:
        the controller's (its samplers' cursors too), the rollout port's, the version."""
        state = {"version": self.rollout_stage.version, "control": self.control.state_dict()}
        rollout = self.rollout_stage.state_dict()
        if rollout is not None:  # partial pools, the reuse cache, the group numbering
            state["rollout"] = rollout
        return state

    def load_state_dict(self, learner_state: dict, state: dict) -> None:
        """A checkpoint: the driver's model already holds its weights (load_checkpoint).
        Its batches collected ahead (`ahead`, asynchronous runs) wait in `inflight` for
        the driver; the sampler, controller and rollout state are as of the last of them."""
        self.learner.load_state_dict(learner_state)
        if "sampler" in state:  # checkpoints before the controller saved its sampler
            self.control.sampler.load_state_dict(state["sampler"])
        if "control" in state:  # checkpoints before adaptive allocation have none
            self.control.load_state_dict(state["control"])
        self.rollout_stage.load_state_dict(state.get("rollout"))
        self.inflight.load_state_dict(state.get("ahead", []))
        self.publish(state["version"])

    def samples_by_id(self) -> dict[str, Sample]:
        """The training prompts' samples by id: what a kept batch's groups name."""
        return {p.sample.id: p.sample for p in self.sampler.items}

    def close(self) -> None:
        """Stop what the stages hold: the ports' threads, processes and actors, the pools."""
        for part in [self.rollout_stage, self.learner, *self.resources]:
            part.close()


def encode_prompts(policy: Policy, samples: list[Sample], max_prompt_tokens: int,
                   max_tokens: int) -> tuple[list[EncodedPrompt], int]:
    """Token ids of each prompt; prompts that don't fit the context are skipped and counted."""
    limit = min(max_prompt_tokens, policy.max_context - max_tokens)
    kept, skipped = [], 0
    for s in samples:
        ids = policy.encode(s.prompt)
        if len(ids) > limit:
            skipped += 1
        else:
            kept.append(EncodedPrompt(s, ids))
    return kept, skipped
