"""The composition root: a validated `Config` becomes `Stages` (stages.py), each part built
once, where it runs.

Wiring only: this, `compose/parts.py` (one builder per part) and the CLI are the only
places that read the config tree, and every part takes plain arguments. The placement
(`run.backend`) decides where the two ports of `Stages` run: 'local' builds the rollout
stage and the learner in this process, 'ray' builds them inside actors
(rollwise.distributed.place_on_ray). Everything else (the allocator, the evaluator, the
driver's copy of the policy) is built here the same way for both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from rollwise.algos import advantage_estimators, lookup
from rollwise.compose.config import Config
from rollwise.compose.parts import (
    build_control,
    build_engine,
    build_episode_runner,
    build_eval_tasks,
    build_group_terms,
    build_judge,
    build_learner,
    build_policy,
    build_precision,
    build_rollout_stage,
    build_sampling,
    build_task,
    check_enough_prompts,
    place_remote,
    reward_specs,
    reward_timeout,
    trained_dtype,
    verify_by_task,
)
from rollwise.compose.precision import PrecisionChoice
from rollwise.compose.preflight import check_config, overlaps_in_process
from rollwise.control import Controller, UniformSampler
from rollwise.engine.base import Engine
from rollwise.learner.sft import SftSettings
from rollwise.learner.stochastic import bfloat16_master
from rollwise.models import Policy
from rollwise.pipeline.evaluate import Episodes, Evaluator, Generated
from rollwise.pipeline.stages import BuildInfo, Stages, encode_prompts
from rollwise.rewards import RewardPool, RewardSpec
from rollwise.system.runtime import allocator_in_use, free_cores
from rollwise.system.runtime import configure as configure_runtime
from rollwise.tasks import Task
from rollwise.types import EncodedPrompt

__all__ = ["Stages", "build", "build_policy", "encode_prompts", "run_steps"]

Rewards = dict[str, tuple[Callable, float]]


@dataclass
class _Scoring:
    """What the reward side needs, settled before the model loads."""

    specs: list[RewardSpec]  # the training verifiers and their weights
    timeout_s: float
    eval_pool: RewardPool  # the evaluation verifier (`correct`), per task of eval.tasks
    extra: list[tuple[str, Task]]  # eval.tasks: (label, Task)


def build(cfg: Config, rewards: Rewards | None = None, *,
          policy: Policy | None = None) -> Stages:
    """`rewards`: the caller's own verifiers (name -> (function, weight)) besides the
    config's terms; the Python API (`rollwise.train`) passes them. `policy`: an already
    built policy to use instead of building one."""
    # names, options, placement and devices, before the model loads
    check_config(cfg, {name: fn for name, (fn, _) in (rewards or {}).items()})
    threads = cfg.run.threads
    if not threads and overlaps_in_process(cfg):  # two sides compute at once: half each
        threads = max(1, free_cores() // 2)
    configure_runtime(threads, cfg.run.allocator)
    torch.manual_seed(cfg.run.seed)
    task = build_task(cfg)
    check_enough_prompts(len(task.train), 0, cfg.rollout.prompts_per_step)
    scoring = _scoring(cfg, task, rewards)
    # Reward worker processes are forked before the model exists: forked later, each would
    # keep a copy-on-write copy of every page training then writes (weights, KV cache).
    train_pool = (RewardPool(scoring.specs, timeout_s=scoring.timeout_s).start()
                  if cfg.run.backend == "local" else None)
    policy = policy if policy is not None else build_policy(cfg, task)
    r = cfg.rollout
    train_prompts, skipped = encode_prompts(policy, task.train, r.max_prompt_tokens, r.max_tokens)
    check_enough_prompts(len(train_prompts), skipped, r.prompts_per_step)
    eval_prompts, eval_skipped = _eval_prompts(cfg, policy, task, scoring.extra)
    precision = build_precision(cfg, policy)
    if trained_dtype(cfg) == "bfloat16":  # before any engine decides what it shares
        bfloat16_master(policy.model, keep_stream=precision.learner == "bf16-autocast",
                        residuals=cfg.learner.master_rounding == "compensated")
    sampler = UniformSampler(train_prompts, r.prompts_per_step, seed=cfg.run.seed)
    control = build_control(cfg, sampler)
    rollout, trainer, resources, weights_from = _place(cfg, policy, precision, task, control,
                                                       scoring, train_pool)
    evaluator = _evaluator(cfg, policy, task, precision, eval_prompts, scoring.eval_pool,
                           weights_from)
    a = cfg.algorithm
    info = BuildInfo(
        train_prompts=len(train_prompts), eval_prompts=len(eval_prompts),
        skipped_train_prompts=skipped, skipped_eval_prompts=eval_skipped,
        parameters=sum(p.numel() for p in policy.model.parameters()),
        trainable_parameters=sum(p.numel() for p in policy.model.parameters()
                                 if p.requires_grad),
        precision=precision.record(), precision_line=precision.line() + _shards_line(cfg),
        allocator=allocator_in_use(),
        placement=_placement(cfg),
        task={**{k: v for _, x in scoring.extra for k, v in x.info.items()}, **task.info})
    return Stages(
        policy=policy, task=task, control=control, rollout_stage=rollout,
        learner=trainer, evaluator=evaluator, info=info,
        advantage_fn=lookup(advantage_estimators, a.advantage, "advantage estimator"),
        advantage_options=dict(a.advantage_options),
        group_rewards=build_group_terms(cfg, rewards or {}), mask_truncated=a.mask_truncated,
        kl_in_reward=a.kl_coef if a.kl_in_reward else 0.0,
        resources=[*resources, scoring.eval_pool], sft=_sft(cfg, precision),
        release_engine_cache=not overlaps_in_process(cfg))


def _place(cfg: Config, policy: Policy, precision: PrecisionChoice, task: Task,
           control: Controller, scoring: _Scoring, train_pool: RewardPool | None):
    """The two ports where run.backend and engine.name put them: (rollout, trainer, what
    closes with them, the rollout engine the evaluator reads its weights from or None)."""
    if cfg.run.backend == "ray":  # the reward actor holds the training pool
        from rollwise.distributed import place_on_ray

        rollout, trainer, connection = place_on_ray(cfg, policy, precision, scoring.specs,
                                                    scoring.timeout_s)
        return rollout, trainer, [connection], None
    # the learner first: sharded, its ranks share the driver's weights, moved to shared
    # memory before any engine reads them
    learner = _learner(cfg, policy, precision)
    if cfg.engine.name == "remote":  # the servers roll out; the evaluator has its own engine
        rollout, trainer = place_remote(cfg, policy, precision, train_pool.score, task, learner)
        return rollout, trainer, [train_pool], None
    own = overlaps_in_process(cfg)  # the engine keeps a copy the trainer cannot change
    rollout = build_rollout_stage(cfg, policy, precision, train_pool.score, task=task,
                                  fetch=control.extra if task.env is None else None,
                                  own_weights=own)
    # the evaluator reads the rollout engine's weights, unless that engine generates
    # while the trainer trains: then it has its own, on the trainer's thread
    return rollout, learner, [train_pool], None if own else rollout.engine


def _learner(cfg: Config, policy: Policy, precision: PrecisionChoice):
    """The learner in this process, or learner.shards ranks started by it."""
    from rollwise.distributed import torchrun

    if torchrun.launched():  # this is rank 0 of a torchrun launch
        return torchrun.start(cfg, policy.model, precision)
    if cfg.learner.shards == 1:
        return build_learner(cfg, policy, precision)
    from rollwise.distributed.shards import start_local

    return start_local(cfg, policy.model, precision)


def _sft(cfg: Config, precision: PrecisionChoice) -> tuple[str, SftSettings] | None:
    """The warm start's demonstrations and settings ([sft]), or None when it is off."""
    s = cfg.sft
    if not s.path:
        return None
    return s.path, SftSettings(**s.model_dump(), seed=cfg.run.seed,
                               bf16_autocast=precision.learner == "bf16-autocast")


def _shards_line(cfg: Config) -> str:
    n = cfg.learner.shards
    if n == 1:
        return ""
    comm = "NCCL" if cfg.run.device.startswith("cuda") else "gloo"
    return f"\nlearner: {n} ranks, FSDP2 over {comm} ({cfg.run.backend} processes)"


def _placement(cfg: Config) -> dict[str, Any]:
    """Where the ports run, for the run's summary."""
    shards = {"learner_shards": cfg.learner.shards} if cfg.learner.shards > 1 else {}
    if cfg.run.backend == "ray":
        return {"backend": "ray", "rollout_workers": cfg.ray.num_workers} | shards
    if cfg.engine.name == "remote":
        return {"rollout": "remote", "remote_servers": len(cfg.engine.remote_urls)} | shards
    return shards


def _scoring(cfg: Config, task: Task, rewards: Rewards | None) -> _Scoring:
    """The training verifiers, their time limit, and the evaluation pool (started here:
    before the model loads, see `build`)."""
    judge = build_judge(cfg) if "judge" in cfg.task.rewards else None  # fails fast, with the URL
    specs = reward_specs(cfg, task, rewards, judge=judge)
    timeout_s = reward_timeout(cfg, task)  # code tasks: a retried sandbox run
    extra = build_eval_tasks(cfg)  # eval.tasks: (label, Task), built before the pools fork
    eval_verify, eval_timeout = task.verifier, timeout_s
    if extra:
        verifiers = {task.name: task.verifier, **{label: x.verifier for label, x in extra}}
        eval_verify = partial(verify_by_task, verifiers=verifiers)
        eval_timeout = max([timeout_s] + [x.reward_timeout_s or 0.0 for _, x in extra])
    eval_pool = RewardPool([RewardSpec("correct", eval_verify)], timeout_s=eval_timeout).start()
    return _Scoring(specs, timeout_s, eval_pool, extra)


def _eval_prompts(cfg: Config, policy: Policy, task: Task,
                  extra: list[tuple[str, Task]]) -> tuple[list[EncodedPrompt], int]:
    """The held-out prompts (each labelled with its task when eval.tasks adds some)."""
    e, r = cfg.eval, cfg.rollout
    samples = task.eval[: e.num_prompts] if e.num_prompts else task.eval
    if extra:  # every sample labelled with its task, for the per-task figures
        samples = [replace(s, meta={**s.meta, "eval_task": label})
                   for label, group in [(task.name, samples)] + [(lb, x.eval) for lb, x in extra]
                   for s in group]
    return encode_prompts(policy, samples, r.max_prompt_tokens, e.max_tokens or r.max_tokens)


def _evaluator(cfg: Config, policy: Policy, task: Task, precision: PrecisionChoice,
               prompts: list[EncodedPrompt], pool: RewardPool,
               weights_from: Engine | None) -> Evaluator:
    """The evaluator over its own engine: one reading the rollout engine's weights in this
    process, else one over the driver's copy of the policy (rollouts on Ray actors or
    remote servers: a native engine)."""
    r, e = cfg.rollout, cfg.eval
    name = "native" if cfg.engine.name == "remote" else cfg.engine.name
    engine = build_engine(name, policy, e.batch_size, cfg.engine.kv_budget_tokens,
                          precision.rollout, weights_from=weights_from,
                          decode_step=cfg.engine.decode_step)
    if task.env is None:
        rollouts = Generated(engine, pool, policy.decode)
    else:  # multi-turn episodes: one greedy episode per held-out prompt (docs/agents.md)
        rollouts = Episodes(build_episode_runner(cfg, engine, build_sampling(cfg), policy,
                                                 task, tree=False))
    return Evaluator(engine=engine, rollouts=rollouts, prompts=prompts,
                     max_tokens=e.max_tokens or r.max_tokens, pass_k=e.pass_k,
                     pass_samples=e.pass_samples, temperature=r.temperature or 1.0,
                     chunk=e.batch_size)


def run_steps(cfg: Config):
    """How the driver runs a step for this config: `loop.SyncSteps`, or the asynchronous
    driver with its staleness bound (`loop.train(..., steps=run_steps(cfg))`)."""
    from rollwise.pipeline.asyncloop import AsyncSteps
    from rollwise.pipeline.loop import SyncSteps

    if cfg.schedule.mode == "sync":
        return SyncSteps
    return partial(AsyncSteps, max_staleness=cfg.schedule.max_staleness,
                   stale_policy=cfg.schedule.stale_policy)
