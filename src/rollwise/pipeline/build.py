"""The composition root: a validated `Config` becomes the parts of `Stages` (stages.py).

Wiring only: this, `parts.py` (one builder per part) and the CLI are the only places that
read the config tree, and every part takes plain arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from rollwise.algos import advantage_estimators, lookup
from rollwise.compose.config import Config
from rollwise.control import UniformSampler
from rollwise.pipeline.evaluate import EpisodeEvaluator, Evaluator
from rollwise.models import Policy
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
    build_task,
    check_enough_prompts,
    reward_specs,
    reward_timeout,
    verify_by_task,
)
from rollwise.rewards import RewardPool, RewardSpec
from rollwise.system.runtime import configure as configure_runtime
from rollwise.pipeline.stages import Stages, encode_prompts

__all__ = ["Stages", "build", "build_policy", "build_run", "check_run_config", "encode_prompts",
           "run_steps"]


def build(cfg: Config, rewards: dict[str, tuple[Callable, float]] | None = None, *,
          policy: Policy | None = None) -> Stages:
    """`rewards`: the caller's own verifiers (name -> (function, weight)) besides the
    config's terms; the Python API (`rollwise.train`) passes them. `policy`: an already
    built policy to use instead of building one (a Ray actor receives the driver's)."""
    from rollwise.compose.preflight import check_config

    # names, options and devices, before the model loads
    check_config(cfg, {name: fn for name, (fn, _) in (rewards or {}).items()})
    configure_runtime(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    t = cfg.task
    task = build_task(cfg)
    check_enough_prompts(len(task.train), 0, cfg.rollout.prompts_per_step)
    judge = build_judge(cfg) if "judge" in t.rewards else None  # preflight: fails fast, with the URL
    specs = reward_specs(cfg, task, rewards, judge=judge)
    # Verifier worker processes are forked before the model exists: forked later, each would
    # keep a copy-on-write copy of every page training then writes (weights, KV cache).
    timeout_s = reward_timeout(cfg, task)  # code tasks: a retried sandbox run
    train_pool = RewardPool(specs, timeout_s=timeout_s).start()
    extra = build_eval_tasks(cfg)  # eval.tasks: (label, Task), built before the pools fork
    eval_verify = task.verifier
    if extra:
        verifiers = {task.name: task.verifier, **{label: x.verifier for label, x in extra}}
        eval_verify = partial(verify_by_task, verifiers=verifiers)
        timeout_s = max([timeout_s] + [x.reward_timeout_s or 0.0 for _, x in extra])
    eval_pool = RewardPool([RewardSpec("correct", eval_verify)],
                           timeout_s=timeout_s).start()
    policy = policy if policy is not None else build_policy(cfg, task)
    r, e, a = cfg.rollout, cfg.eval, cfg.algorithm
    train_prompts, skipped = encode_prompts(policy, task.train, r.max_prompt_tokens, r.max_tokens)
    check_enough_prompts(len(train_prompts), skipped, r.prompts_per_step)
    eval_max = e.max_tokens or r.max_tokens
    eval_samples = task.eval[: e.num_prompts] if e.num_prompts else task.eval
    if extra:  # every sample labelled with its task, for the per-task figures
        eval_samples = [replace(s, meta={**s.meta, "eval_task": label})
                        for label, samples in [(task.name, eval_samples)] +
                        [(label, x.eval) for label, x in extra] for s in samples]
    eval_prompts, eval_skipped = encode_prompts(policy, eval_samples, r.max_prompt_tokens, eval_max)
    precision = build_precision(cfg, policy)
    rollout_stage = build_rollout_stage(cfg, policy, precision, train_pool.score, task=task)
    engine = rollout_stage.engine
    group_terms = build_group_terms(cfg, rewards or {})
    learner = build_learner(cfg, policy, precision)
    eval_engine = build_engine(r.engine, policy, e.batch_size, r.kv_budget_tokens,
                                precision.rollout, weights_from=engine,
                                decode_step=r.decode_step)
    evaluator = Evaluator(
        engine=eval_engine,
        prompts=eval_prompts,
        pool=eval_pool,
        decode=policy.decode, max_tokens=eval_max, pass_k=e.pass_k, pass_samples=e.pass_samples,
        temperature=r.temperature or 1.0, chunk=e.batch_size)
    sampler = UniformSampler(train_prompts, r.prompts_per_step, seed=cfg.run.seed)
    control = build_control(cfg, sampler)
    if task.env is None:
        rollout_stage.fetch = control.extra
    else:  # multi-turn episodes: one greedy episode per held-out prompt (docs/agents.md)
        evaluator = EpisodeEvaluator(build_episode_runner(cfg, eval_engine, rollout_stage.sampling,
                                                     policy, task, tree=False),
                                     eval_prompts, eval_max, chunk=e.batch_size)
    return Stages(
        policy=policy, task=task, sampler=sampler, control=control,
        rollout_stage=rollout_stage,
        learner=learner, evaluator=evaluator,
        advantage_fn=lookup(advantage_estimators, a.advantage, "advantage estimator"),
        advantage_options=dict(a.advantage_options), group_rewards=group_terms,
        mask_truncated=a.mask_truncated, kl_in_reward=a.kl_coef if a.kl_in_reward else 0.0,
        info={"skipped_train_prompts": skipped, "skipped_eval_prompts": eval_skipped,
              "train_prompts": len(train_prompts), "eval_prompts": len(eval_prompts),
              "parameters": sum(p.numel() for p in policy.model.parameters()),
              "trainable_parameters": sum(p.numel() for p in learner.params),
              "precision": precision.record(), "precision_line": precision.line(),
              **{k: v for _, x in extra for k, v in x.info.items()}, **task.info},
    )


def check_run_config(cfg: Config) -> None:
    """run.backend / run.mode combinations that cannot work, before anything loads."""
    from rollwise.compose.config import ConfigError

    rc = cfg.run
    if rc.mode == "async" and rc.backend == "local" and rc.max_staleness > 0:
        raise ConfigError(
            f"run.mode='async' with run.max_staleness={rc.max_staleness} needs "
            "run.backend='ray': in one process the engine reads the learner's weights, which "
            "an update changes in place while the next rollouts run (max_staleness=0 runs "
            "locally, and is synchronous training)")
    if rc.backend == "local" and cfg.rollout.num_workers > 1:
        raise ConfigError(f"rollout.num_workers={cfg.rollout.num_workers} needs "
                          "run.backend='ray' (the local backend has one engine)")


def build_run(cfg: Config, rewards: dict[str, tuple[Callable, float]] | None = None) -> Stages:
    """The stages a run drives: `build` for run.backend 'local'; with 'ray' the same stages
    with rollout, reward and learner placed on Ray actors (rollwise.distributed)."""
    check_run_config(cfg)
    if cfg.run.backend == "ray":
        from rollwise.distributed import build_distributed

        return build_distributed(cfg, rewards)
    return build(cfg, rewards)


def run_steps(cfg: Config):
    """How the driver runs a step for this config: `loop.SyncSteps`, or the asynchronous
    driver with its staleness bound (`loop.train(..., steps=run_steps(cfg))`)."""
    from functools import partial

    from rollwise.pipeline.asyncloop import AsyncSteps
    from rollwise.pipeline.loop import SyncSteps

    if cfg.run.mode == "sync":
        return SyncSteps
    return partial(AsyncSteps, max_staleness=cfg.run.max_staleness,
                   stale_policy=cfg.run.stale_policy)
