"""The composition root: a validated `Config` becomes stage objects with plain arguments.

This (with the CLI) is the only place that reads the config tree. `Stages` holds the built
objects and exposes one method per stage of the driver in `loop.py`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rollwise.algos import (
    advantage_estimators,
    corrections,
    kl_estimators,
    lookup,
    policy_losses,
)
from rollwise.config import Config
from rollwise.control import Controller, PosteriorBook, Request, UniformSampler, make_allocator
from rollwise.engine.base import Engine, SamplingParams
from rollwise.evaluate import Evaluator
from rollwise.learner import Learner, prepare_batch
from rollwise.models import Policy, load_policy
from rollwise.precision import ModelShapes, PrecisionChoice
from rollwise.precision import resolve as resolve_precision
from rollwise.rewards import RewardPool, RewardSpec, RewardStats, get_verifier
from rollwise.rewards.filters import drop_zero_variance
from rollwise.rewards.group import GROUP_REWARDS, GroupTerm, apply_group_rewards, get_group_reward
from rollwise.rollout import RolloutScheduler, generate_groups, summarize_rollout
from rollwise.runtime import configure as configure_runtime
from rollwise.tasks import Task, make_task
from rollwise.types import Batch, Group, Sample

EncodedPrompt = tuple[Sample, list[int]]


@dataclass
class Stages:
    """The built stage objects; each method is one named stage of the driver."""

    policy: Policy
    task: Task
    sampler: UniformSampler[EncodedPrompt]
    engine: Engine
    sampling: SamplingParams
    rewards: RewardPool
    learner: Learner
    evaluator: Evaluator
    advantage_fn: Any
    filter_zero_variance: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    advantage_options: dict[str, Any] = field(default_factory=dict)
    group_rewards: list[GroupTerm] = field(default_factory=list)  # after the verifiers
    mask_truncated: bool = False
    kl_in_reward: float = 0.0  # KL coefficient of the KL-in-reward penalty (0: off)
    refill_rounds: int = 0  # extra select/rollout rounds while the filter leaves too few

    @property
    def batch_groups(self) -> int:
        """Groups one update trains on (the filter may leave fewer; refills top it up)."""
        return self.sampler.per_step

    control: Controller | None = None  # the rollout allocator (None: uniform over `sampler`)
    scheduler: RolloutScheduler | None = None  # native engine: the rollout strategies

    def __post_init__(self):
        self._rollout_reports: list[dict] = []
        self._scoring: dict[int, Future] = {}
        self._score_thread = ThreadPoolExecutor(1, thread_name_prefix="rollwise-score")
        if self.control is None:
            self.control = Controller(
                self.sampler.items, make_allocator("uniform"), PosteriorBook(),
                prompts_per_step=self.sampler.per_step, group_size=self.sampling.n,
                sampler=self.sampler)

    @property
    def model(self):
        return self.policy.model

    def select(self) -> list[Request]:
        """The allocator's first round of the step: which prompts, how many rollouts each."""
        return self.control.plan()

    def rollout(self, requests: list[Request]) -> list[Group]:
        """Groups for the requests. Through the rollout scheduler (native engine): its
        strategy decides which groups come back (partial: possibly pooled ones from earlier
        steps instead of some requested), each scored in the background as soon as it is
        complete. Otherwise one engine call per distinct group size, in request order."""
        if self.scheduler is not None:
            report = self.scheduler.run(
                [r.prompt for r in requests], self.sampler.take, sizes=[r.n for r in requests],
                on_group=self._score_later)
            self._rollout_reports.append(report.info)
            return report.groups
        by_n: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_n.setdefault(r.n, []).append(i)
        groups: list[Group] = [None] * len(requests)  # type: ignore[list-item]
        for n, rows in by_n.items():
            out = generate_groups(self.engine, [requests[i].prompt for i in rows],
                                  replace(self.sampling, n=n), self.policy.decode)
            for i, g in zip(rows, out):
                groups[i] = g
        return groups

    def observe(self, groups: list[Group]) -> list[Request]:
        """Scored groups update the prompt posteriors; the allocator's next round, or []."""
        return self.control.observe(groups)

    def allocation(self) -> tuple[list[Group], list[Group]]:
        """(every group of the step merged per prompt, the groups the allocator trains on)."""
        return self.control.finish()

    def control_metrics(self) -> dict[str, float]:
        """The allocator's figures and the rollout scheduler's, for this step's record."""
        out = dict(self.control.last)
        reports, self._rollout_reports = self._rollout_reports, []
        if reports:
            out |= summarize_rollout(reports)
        return out

    def _score_later(self, group: Group) -> None:
        """Start scoring a complete group while the engine decodes the rest (the reward
        pool's worker threads run the verifiers; torch releases the GIL while decoding)."""
        self._scoring[id(group)] = self._score_thread.submit(
            self.rewards.score, group.trajectories)

    def score(self, groups: list[Group]) -> RewardStats:
        stats = RewardStats(0, 0, 0, 0.0)
        rest = []
        for g in groups:
            started = self._scoring.pop(id(g), None)
            if started is None:
                rest.extend(g.trajectories)
            else:
                stats = stats + started.result()
        if rest:
            stats = stats + self.rewards.score(rest)
        apply_group_rewards(groups, self.group_rewards)
        return stats

    def filter(self, groups: list[Group]) -> list[Group]:
        return drop_zero_variance(groups) if self.filter_zero_variance else groups

    def advantages(self, groups: list[Group]) -> Batch:
        return prepare_batch(
            groups, self.advantage_fn, pad_id=self.policy.tokenizer.pad_token_id,
            options=self.advantage_options, mask_truncated=self.mask_truncated,
            reference_kl=self.learner.reference_kl, kl_coef=self.kl_in_reward)

    def update(self, batch: Batch) -> dict[str, float]:
        self._update = self.learner.update(batch)
        return self._update

    def publish(self, version: int) -> None:
        """In process the engine reads the new weights in place, or (rollout.dtype other
        than the model's) converts them: that time goes into this step's update metrics
        as `publish_seconds` (the dict `update` returned, recorded after publication)."""
        start = time.perf_counter()
        self.engine.publish(version)
        if getattr(self, "_update", None) is not None:
            self._update["publish_seconds"] = time.perf_counter() - start
            self._update = None

    def evaluate(self) -> dict[str, float]:
        return self.evaluator()

    def state_dict(self) -> tuple[dict, dict]:
        state = {"sampler": self.sampler.state_dict(), "version": self.engine.version,
                 "control": self.control.state_dict()}
        if self.scheduler is not None:  # the partial pool and the reuse cache
            state["rollout"] = self.scheduler.state_dict()
        return self.learner.state_dict(), state

    def load_state_dict(self, learner_state: dict, state: dict) -> None:
        self.learner.load_state_dict(learner_state)
        self.sampler.load_state_dict(state["sampler"])
        if "control" in state:  # checkpoints before adaptive allocation have none
            self.control.load_state_dict(state["control"])
        if self.scheduler is not None and "rollout" in state:
            self.scheduler.load_state_dict(state["rollout"])
        self.engine.publish(state["version"])


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
            kept.append((s, ids))
    return kept, skipped


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


def build(cfg: Config) -> Stages:
    from rollwise.preflight import check_config

    check_config(cfg)  # names and devices, before the model loads
    configure_runtime(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    chat = cfg.model.name != "tiny"
    t = cfg.task
    task = make_task(t.name, seed=cfg.run.seed, num_train=t.num_train, num_eval=t.num_eval,
                     chat=chat, path=t.path, **t.options)
    _check_enough_prompts(len(task.train), 0, cfg.rollout.prompts_per_step)
    specs = [RewardSpec(name, task.verifier if name == "correct" else get_verifier(name), w)
             for name, w in t.rewards.items() if name not in GROUP_REWARDS]
    # Verifier worker processes are forked before the model exists: forked later, each would
    # keep a copy-on-write copy of every page training then writes (weights, KV cache).
    train_pool = RewardPool(specs, timeout_s=t.reward_timeout_s).start()
    eval_pool = RewardPool([RewardSpec("correct", task.verifier)],
                           timeout_s=t.reward_timeout_s).start()
    policy = build_policy(cfg, task)
    r, e, a, lc = cfg.rollout, cfg.eval, cfg.algorithm, cfg.learner
    train_prompts, skipped = encode_prompts(policy, task.train, r.max_prompt_tokens, r.max_tokens)
    _check_enough_prompts(len(train_prompts), skipped, r.prompts_per_step)
    eval_max = e.max_tokens or r.max_tokens
    eval_samples = task.eval[: e.num_prompts] if e.num_prompts else task.eval
    eval_prompts, eval_skipped = encode_prompts(policy, eval_samples, r.max_prompt_tokens, eval_max)
    precision = _precision(cfg, policy)
    engine = _build_engine(r.engine, policy, r.batch_size, r.kv_budget_tokens,
                           precision.rollout)
    group_terms = _group_terms(cfg)
    loss_options = {k: v for k, v in {"clip_low": a.clip_low, "clip_high": a.clip_high,
                                      "dual_clip": a.dual_clip}.items() if v is not None}
    loss_options |= {"aggregation": a.aggregation, "max_tokens": r.max_tokens}
    learner = Learner(
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
    evaluator = Evaluator(
        engine=_build_engine(r.engine, policy, e.batch_size, r.kv_budget_tokens,
                             precision.rollout, weights_from=engine),
        prompts=eval_prompts,
        pool=eval_pool,
        decode=policy.decode, max_tokens=eval_max, pass_k=e.pass_k, pass_samples=e.pass_samples,
        temperature=r.temperature or 1.0, chunk=e.batch_size)
    sampler = UniformSampler(train_prompts, r.prompts_per_step, seed=cfg.run.seed)
    sampling = SamplingParams(n=r.group_size, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, max_tokens=r.max_tokens)
    return Stages(
        policy=policy, task=task, sampler=sampler, control=_build_control(cfg, sampler),
        engine=engine, sampling=sampling,
        scheduler=_build_scheduler(cfg, engine, sampling, policy.decode),
        rewards=train_pool,
        learner=learner, evaluator=evaluator,
        advantage_fn=lookup(advantage_estimators, a.advantage, "advantage estimator"),
        filter_zero_variance=a.filter_zero_variance,
        advantage_options=dict(a.advantage_options), group_rewards=group_terms,
        mask_truncated=a.mask_truncated, kl_in_reward=a.kl_coef if a.kl_in_reward else 0.0,
        refill_rounds=a.max_refill_rounds,
        info={"skipped_train_prompts": skipped, "skipped_eval_prompts": eval_skipped,
              "train_prompts": len(train_prompts), "eval_prompts": len(eval_prompts),
              "parameters": sum(p.numel() for p in policy.model.parameters()),
              "trainable_parameters": sum(p.numel() for p in learner.params),
              "precision": precision.record(), "precision_line": precision.line()},
    )


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


def _group_terms(cfg: Config) -> list[GroupTerm]:
    """Group reward terms named in task.rewards, then DAPO's overlong shaping if on."""
    t, a = cfg.task, cfg.algorithm
    for name in t.reward_options:
        if name not in GROUP_REWARDS:
            raise ValueError(f"task.reward_options.{name}: options apply to group reward terms "
                             f"({', '.join(sorted(GROUP_REWARDS))}); '{name}' is not one")
    terms = [GroupTerm(name, get_group_reward(name), w, dict(t.reward_options.get(name, {})))
             for name, w in t.rewards.items() if name in GROUP_REWARDS]
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
    from rollwise.engine.native import NativeEngine

    r = cfg.rollout
    if not isinstance(engine, NativeEngine):
        needs = [k for k, on in {f"rollout.strategy='{r.strategy}'": r.strategy not in (
            "sync", "continuous"), "rollout.spec_group": r.spec_group,
            "rollout.spec_reuse": r.spec_reuse}.items() if on]
        if needs:
            raise ConfigError(f"{', '.join(needs)} needs the native engine; this model runs on "
                              "the HF engine (rollout.engine='hf' or an unsupported "
                              "architecture)")
        return None
    if "partial" in r.strategy and cfg.control.allocator != "uniform":
        raise ConfigError(f"rollout.strategy='{r.strategy}' returns groups from earlier steps "
                          f"in place of requested ones, which control.allocator="
                          f"'{cfg.control.allocator}' does not expect; use the uniform "
                          "allocator with partial rollouts")
    engine.spec_tokens = r.spec_tokens
    return RolloutScheduler(
        engine, sampling, decode, strategy=r.strategy, over_provision=r.over_provision,
        max_staleness=r.max_staleness, chunk_tokens=r.chunk_tokens, spec_group=r.spec_group,
        spec_reuse=r.spec_reuse, reuse_rule=r.reuse_rule, lenience=r.lenience,
        seed=cfg.run.seed)


def _build_engine(name: str, policy: Policy, batch_size: int, kv_budget_tokens: int,
                  dtype: str = "float32", weights_from: Engine | None = None) -> Engine:
    """`dtype`: the native engine's precision; `weights_from`: a native engine whose
    converted weights this one shares (the evaluator reads the rollout engine's copy)."""
    from rollwise.config import ConfigError
    from rollwise.engine import NativeEngine, make_engine

    if name == "hf" and dtype != "float32":
        raise ConfigError(f"rollout.dtype='{dtype}' needs the native engine (rollout.engine="
                          "'native'); the HF engine samples from the float32 model")
    options = {"kv_budget_tokens": kv_budget_tokens} if name == "native" else {}
    if name == "native":
        options["dtype"] = dtype
        if isinstance(weights_from, NativeEngine):
            options["weights_from"] = weights_from
    return make_engine(name, policy.model, eos_token_ids=policy.stop_ids,
                       pad_token_id=policy.tokenizer.pad_token_id, batch_size=batch_size,
                       **options)
