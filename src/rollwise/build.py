"""The composition root: a validated `Config` becomes the parts of `Stages` (stages.py).

Wiring only: this (with the CLI) is the only place that reads the config tree, and every
part it builds takes plain arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from rollwise.algos import (
    advantage_estimators,
    corrections,
    kl_estimators,
    lookup,
    policy_losses,
)
from rollwise.config import Config
from rollwise.control import Controller, PosteriorBook, UniformSampler, make_allocator
from rollwise.engine.base import Engine, RequestEngine, SamplingParams
from rollwise.envs.render import TurnRenderer
from rollwise.evaluate import EpisodeEvaluator, Evaluator
from rollwise.learner import Learner
from rollwise.models import Policy, load_policy
from rollwise.precision import ModelShapes, PrecisionChoice
from rollwise.precision import resolve as resolve_precision
from rollwise.rewards import RewardPool, RewardSpec, get_verifier
from rollwise.rewards.group import GroupTerm, get_group_reward, is_group_term
from rollwise.rollout import RolloutScheduler, RolloutStage
from rollwise.rollout.episodes import EpisodeRunner, keep_env_rewards
from rollwise.runtime import configure as configure_runtime
from rollwise.stages import Stages, encode_prompts
from rollwise.tasks import Task, make_task
from rollwise.types import CORRECT

__all__ = ["Stages", "build", "build_policy", "encode_prompts"]


def build_policy(cfg: Config, task: Task) -> Policy:
    m = cfg.model
    warm = [(s.prompt, s.reference) for s in task.train if s.reference] if m.name == "tiny" else None
    policy = load_policy(m.name, device=cfg.run.device, dtype=m.dtype, warm_start=warm,
                         tiny=m.tiny.model_dump() | {"seed": cfg.run.seed})
    if m.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        policy.model = get_peft_model(policy.model, LoraConfig(
            r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
            target_modules=list(m.lora_targets), task_type="CAUSAL_LM"))
    return policy


def build(cfg: Config, rewards: dict[str, tuple[Callable, float]] | None = None, *,
          policy: Policy | None = None) -> Stages:
    """`rewards`: the caller's own verifiers (name -> (function, weight)) besides the
    config's terms; the Python API (`rollwise.train`) passes them. `policy`: an already
    built policy to use instead of building one (a Ray actor receives the driver's)."""
    from rollwise.preflight import check_config

    check_config(cfg)  # names and devices, before the model loads
    configure_runtime(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    t = cfg.task
    task = build_task(cfg)
    _check_enough_prompts(len(task.train), 0, cfg.rollout.prompts_per_step)
    judge = _judge(cfg) if "judge" in t.rewards else None  # preflight: fails fast, with the URL
    specs = reward_specs(cfg, task, rewards, judge=judge)
    # Verifier worker processes are forked before the model exists: forked later, each would
    # keep a copy-on-write copy of every page training then writes (weights, KV cache).
    timeout_s = reward_timeout(cfg, task)  # code tasks: a retried sandbox run
    train_pool = RewardPool(specs, timeout_s=timeout_s).start()
    extra = _eval_tasks(cfg)  # eval.tasks: (label, Task), built before the pools fork
    eval_verify = task.verifier
    if extra:
        verifiers = {task.name: task.verifier, **{label: x.verifier for label, x in extra}}
        eval_verify = partial(_verify_by_task, verifiers=verifiers)
        timeout_s = max([timeout_s] + [x.reward_timeout_s or 0.0 for _, x in extra])
    eval_pool = RewardPool([RewardSpec("correct", eval_verify)],
                           timeout_s=timeout_s).start()
    policy = policy if policy is not None else build_policy(cfg, task)
    r, e, a = cfg.rollout, cfg.eval, cfg.algorithm
    train_prompts, skipped = encode_prompts(policy, task.train, r.max_prompt_tokens, r.max_tokens)
    _check_enough_prompts(len(train_prompts), skipped, r.prompts_per_step)
    eval_max = e.max_tokens or r.max_tokens
    eval_samples = task.eval[: e.num_prompts] if e.num_prompts else task.eval
    if extra:  # every sample labelled with its task, for the per-task figures
        eval_samples = [replace(s, meta={**s.meta, "eval_task": label})
                        for label, samples in [(task.name, eval_samples)] +
                        [(label, x.eval) for label, x in extra] for s in samples]
    eval_prompts, eval_skipped = encode_prompts(policy, eval_samples, r.max_prompt_tokens, eval_max)
    precision = _precision(cfg, policy)
    rollout_stage = build_rollout_stage(cfg, policy, precision, train_pool.score, task=task)
    engine = rollout_stage.engine
    group_terms = _group_terms(cfg, rewards or {})
    learner = build_learner(cfg, policy, precision)
    eval_engine = _build_engine(r.engine, policy, e.batch_size, r.kv_budget_tokens,
                                precision.rollout, weights_from=engine)
    evaluator = Evaluator(
        engine=eval_engine,
        prompts=eval_prompts,
        pool=eval_pool,
        decode=policy.decode, max_tokens=eval_max, pass_k=e.pass_k, pass_samples=e.pass_samples,
        temperature=r.temperature or 1.0, chunk=e.batch_size)
    sampler = UniformSampler(train_prompts, r.prompts_per_step, seed=cfg.run.seed)
    control = _build_control(cfg, sampler)
    if task.env is None:
        rollout_stage.fetch = control.extra
    else:  # multi-turn episodes: one greedy episode per held-out prompt (docs/agents.md)
        evaluator = EpisodeEvaluator(_episode_runner(cfg, eval_engine, rollout_stage.sampling,
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


def build_task(cfg: Config) -> Task:
    """The task's seeded splits (and environment); chat prompts for instruction models."""
    t = cfg.task
    return make_task(t.name, seed=cfg.run.seed, num_train=t.num_train, num_eval=t.num_eval,
                     chat=cfg.model.name != "tiny", path=t.path, **t.options)


def reward_specs(cfg: Config, task: Task,
                 rewards: dict[str, tuple[Callable, float]] | None = None,
                 judge: Callable | None = None) -> list[RewardSpec]:
    """The verifiers of task.rewards (group terms apart), then the caller's own. `judge`:
    the LLM judge already built (else built here, when task.rewards names it)."""
    def verifier(name: str) -> Callable:
        if name == CORRECT:
            return task.verifier
        if name == "judge":
            return judge if judge is not None else _judge(cfg)
        return get_verifier(name)

    specs = [RewardSpec(name, verifier(name), w)
             for name, w in cfg.task.rewards.items() if not is_group_term(name)]
    return specs + [RewardSpec(name, fn, w) for name, (fn, w) in (rewards or {}).items()
                    if not is_group_term(fn)]


def reward_timeout(cfg: Config, task: Task) -> float:
    """One verifier call's time limit: task.reward_timeout_s, or more where the task needs
    it (a code task's sandbox run, retried once)."""
    return max(cfg.task.reward_timeout_s, task.reward_timeout_s or 0.0)


def build_rollout_stage(cfg: Config, policy: Policy, precision: PrecisionChoice,
                        scorer: Callable, fetch: Callable | None = None,
                        task: Task | None = None) -> RolloutStage:
    """The rollout engine, its scheduler and the stage around them (the local driver's,
    or a Ray rollout worker's); `scorer` scores trajectories in place. A `task` with an
    environment rolls out multi-turn episodes, scored by the environment."""
    r = cfg.rollout
    engine = _build_engine(r.engine, policy, r.batch_size, r.kv_budget_tokens,
                           precision.rollout, spec_tokens=r.spec_tokens)
    sampling = SamplingParams(n=r.group_size, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, max_tokens=r.max_tokens)
    if task is not None and task.env is not None:
        return RolloutStage(engine, sampling, policy.decode, keep_env_rewards,
                            episodes=_episode_runner(cfg, engine, sampling, policy, task))
    return RolloutStage(engine, sampling, policy.decode, scorer,
                        scheduler=_build_scheduler(cfg, engine, sampling, policy.decode),
                        fetch=fetch)


def build_learner(cfg: Config, policy: Policy, precision: PrecisionChoice) -> Learner:
    """The learner over `policy.model` (the local driver's, or a Ray learner actor's)."""
    r, a, lc = cfg.rollout, cfg.algorithm, cfg.learner
    loss_options = {k: v for k, v in {"clip_low": a.clip_low, "clip_high": a.clip_high,
                                      "dual_clip": a.dual_clip}.items() if v is not None}
    loss_options |= {"aggregation": a.aggregation, "max_tokens": r.max_tokens}
    return Learner(
        policy.model, loss_fn=lookup(policy_losses, a.loss, "policy loss"),
        loss_options=loss_options, lr=lc.lr, weight_decay=lc.weight_decay, betas=lc.betas,
        grad_clip=lc.grad_clip, warmup_steps=lc.warmup_steps, lr_schedule=lc.lr_schedule,
        total_steps=cfg.run.num_steps * lc.ppo_epochs,
        micro_batch_tokens=lc.micro_batch_tokens, logprob_chunk=lc.logprob_chunk,
        precision=precision.learner, temperature=r.temperature or 1.0,
        kl_fn=lookup(kl_estimators, a.kl_estimator, "KL estimator"), kl_coef=a.kl_coef,
        ppo_epochs=lc.ppo_epochs, kl_in_reward=a.kl_in_reward, entropy_coef=a.entropy_coef,
        correction_fn=None if precision.correction == "none" else lookup(
            corrections, precision.correction, "correction"),
        correction_options={"cap": a.correction_cap, "low": a.correction_low},
        skip_zero_advantage=lc.skip_zero_advantage, share_prompts=lc.share_prompts)


def _eval_tasks(cfg: Config) -> list[tuple[str, Task]]:
    """The tasks of eval.tasks (each table: name, num_eval, options, path, label)."""
    chat = cfg.model.name != "tiny"
    out: list[tuple[str, Task]] = []
    labels = {cfg.task.name}
    for i, table in enumerate(cfg.eval.tasks):
        table = dict(table)
        unknown = set(table) - {"name", "num_eval", "options", "path", "label"}
        if "name" not in table or unknown:
            raise ValueError(f"eval.tasks[{i}]: expected a table with name (and num_eval, "
                             f"options, path, label); got keys {sorted(table)}")
        label = str(table.get("label", table["name"]))
        if label in labels:
            raise ValueError(f"eval.tasks[{i}]: label {label!r} is taken; give label = '...'")
        labels.add(label)
        task = make_task(table["name"], seed=cfg.run.seed, num_train=0,
                         num_eval=int(table.get("num_eval", cfg.task.num_eval)), chat=chat,
                         path=table.get("path"), **dict(table.get("options", {})))
        out.append((label, task))
    return out


def _verify_by_task(completion: str, sample, *, verifiers: dict) -> float:
    """The verifier of the sample's own evaluation task (eval.tasks)."""
    return verifiers[sample.meta["eval_task"]](completion, sample)


def _judge(cfg: Config):
    """The LLM judge of [judge], checked with one request now (before the model loads)."""
    from rollwise.rewards.judge import make_judge

    options = cfg.judge.model_dump()
    if options["prompt"] is None:
        del options["prompt"]
    return make_judge(options)


def _precision(cfg: Config, policy: Policy) -> PrecisionChoice:
    """rollout.dtype, learner.precision and algorithm.correction with every 'auto' settled
    for this machine (rollwise.precision: a cached probe of the model's shapes)."""
    from rollwise.engine.decoder import UnsupportedModel, check_supported

    engine = cfg.rollout.engine
    try:
        check_supported(policy.model)
    except UnsupportedModel:
        engine = "hf"  # make_engine falls back to it; it samples from the model as it is
    return resolve_precision(cfg.rollout.dtype, cfg.learner.precision, cfg.algorithm.correction,
                             shapes=ModelShapes.of(policy.model), device=cfg.run.device,
                             engine=engine)


def _check_enough_prompts(usable: int, skipped: int, per_step: int) -> None:
    """A train set smaller than one step would repeat prompts within a step unnoticed."""
    if usable < per_step:
        from rollwise.config import ConfigError

        raise ConfigError(f"{usable} usable training prompts ({skipped} too long) is less "
                          f"than one step (rollout.prompts_per_step = {per_step})")


def _group_terms(cfg: Config, rewards: dict[str, tuple[Callable, float]]) -> list[GroupTerm]:
    """Group reward terms named in task.rewards (registered or by import path) and the
    caller's marked functions, then DAPO's overlong shaping if on."""
    t, a = cfg.task, cfg.algorithm
    terms = [GroupTerm(name, get_group_reward(name), w, dict(t.reward_options.get(name, {})))
             for name, w in t.rewards.items() if is_group_term(name)]
    terms += [GroupTerm(name, fn, w) for name, (fn, w) in rewards.items() if is_group_term(fn)]
    if a.overlong_buffer > 0:
        terms.append(GroupTerm("overlong", get_group_reward("overlong"), a.overlong_penalty,
                               {"max_tokens": cfg.rollout.max_tokens, "buffer": a.overlong_buffer}))
    return terms


def _build_control(cfg: Config, sampler: UniformSampler) -> Controller:
    c, r = cfg.control, cfg.rollout
    book = PosteriorBook(prior=c.prior, decay_fast=c.decay_fast, decay_slow=c.decay_slow,
                         stale_after=c.stale_after)
    options = c.model_dump(exclude={"allocator", "explore", "prior", "decay_fast", "decay_slow",
                                    "stale_after"})
    return Controller(sampler.items, make_allocator(c.allocator, **options), book,
                      prompts_per_step=r.prompts_per_step, group_size=r.group_size,
                      explore=c.explore, seed=cfg.run.seed, sampler=sampler)


def _build_scheduler(cfg: Config, engine: Engine, sampling: SamplingParams,
                     decode) -> RolloutScheduler | None:
    """The rollout scheduler over a native engine; None (plain batched generation) for the
    HF engine, which only supports the 'sync'/'continuous' schedules without speculation."""
    from rollwise.config import ConfigError

    r = cfg.rollout
    if not isinstance(engine, RequestEngine):
        needs = [k for k, on in {f"rollout.strategy='{r.strategy}'": r.strategy not in (
            "sync", "continuous"), "rollout.spec_group": r.spec_group,
            "rollout.spec_reuse": r.spec_reuse}.items() if on]
        if needs:
            raise ConfigError(f"{', '.join(needs)} needs the native engine; this model runs on "
                              "the HF engine (rollout.engine='hf' or an unsupported "
                              "architecture)")
        return None
    return RolloutScheduler(
        engine, sampling, decode, strategy=r.strategy, over_provision=r.over_provision,
        max_staleness=r.max_staleness, chunk_tokens=r.chunk_tokens, spec_group=r.spec_group,
        spec_reuse=r.spec_reuse, reuse_rule=r.reuse_rule, lenience=r.lenience,
        seed=cfg.run.seed)


def _episode_runner(cfg: Config, engine: Engine, sampling: SamplingParams, policy: Policy,
                    task: Task, tree: bool = True) -> EpisodeRunner:
    """The episode runner of a task with an environment (native engine only); `tree`
    False: no tree branching (evaluation runs one episode per prompt)."""
    from rollwise.config import ConfigError

    r = cfg.rollout
    if not isinstance(engine, RequestEngine):
        raise ConfigError(f"task '{task.name}' rolls out multi-turn episodes, which need the "
                          "native engine (rollout.engine = 'native' and a supported model)")
    single_turn = [k for k, on in {f"rollout.strategy='{r.strategy}'": r.strategy not in (
        "sync", "continuous"), "rollout.spec_group": r.spec_group,
        "rollout.spec_reuse": r.spec_reuse}.items() if on]
    if single_turn:
        raise ConfigError(f"{', '.join(single_turn)} applies to single-turn tasks; task "
                          f"'{task.name}' runs episodes with continuous batching")
    return EpisodeRunner(
        engine, sampling, task.env, TurnRenderer(policy.tokenizer, policy.chat, policy.stop_ids),
        policy.decode, max_turns=r.max_turns,
        max_context=min(r.max_episode_tokens, policy.max_context),
        env_timeout_s=r.env_timeout_s, branches=r.tree_branches if tree else 1,
        depth=r.tree_depth,
        seed=cfg.run.seed)


def _build_engine(name: str, policy: Policy, batch_size: int, kv_budget_tokens: int,
                  dtype: str = "float32", weights_from: Engine | None = None,
                  spec_tokens: int = 4) -> Engine:
    """`dtype`: the native engine's precision; `weights_from`: a native engine whose
    converted weights this one shares (the evaluator reads the rollout engine's copy);
    `spec_tokens`: draft tokens one verification pass takes."""
    from rollwise.config import ConfigError
    from rollwise.engine import NativeEngine, make_engine

    if name == "hf" and dtype != "float32":
        raise ConfigError(f"rollout.dtype='{dtype}' needs the native engine (rollout.engine="
                          "'native'); the HF engine samples from the float32 model")
    options = {"kv_budget_tokens": kv_budget_tokens} if name == "native" else {}
    if name == "native":
        options |= {"dtype": dtype, "spec_tokens": spec_tokens}
        if isinstance(weights_from, NativeEngine):
            options["weights_from"] = weights_from
    return make_engine(name, policy.model, eos_token_ids=policy.stop_ids,
                       pad_token_id=policy.tokenizer.pad_token_id, batch_size=batch_size,
                       **options)


def check_run_config(cfg: Config) -> None:
    """run.backend / run.mode combinations that cannot work, before anything loads."""
    from rollwise.config import ConfigError

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

    from rollwise.asyncloop import AsyncSteps
    from rollwise.loop import SyncSteps

    if cfg.run.mode == "sync":
        return SyncSteps
    return partial(AsyncSteps, max_staleness=cfg.run.max_staleness,
                   stale_policy=cfg.run.stale_policy)
