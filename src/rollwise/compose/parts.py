"""The builders of the composition root: each makes one part (the policy, the task, the
reward specs, the engine, the rollout stage, the learner, the allocator, ...) from the
config, taking plain arguments out of it. `build.py` wires them into `Stages`; a Ray actor
(rollwise.distributed) builds its own part with the same builder.
"""

from __future__ import annotations

from collections.abc import Callable

from rollwise.algos import (
    corrections,
    kl_estimators,
    lookup,
    policy_losses,
)
from rollwise.compose.config import Config
from rollwise.compose.precision import ModelShapes, PrecisionChoice
from rollwise.compose.precision import resolve as resolve_precision
from rollwise.control import Controller, PosteriorBook, UniformSampler, make_allocator
from rollwise.engine.base import Engine, RequestEngine, SamplingParams
from rollwise.envs.render import TurnRenderer
from rollwise.learner import Learner
from rollwise.learner.files import FileTrainer
from rollwise.learner.shards import Peers
from rollwise.models import Policy, load_policy
from rollwise.rewards import RewardSpec, get_verifier
from rollwise.rewards.group import GroupTerm, get_group_reward, is_group_term
from rollwise.rollout import RolloutScheduler, RolloutStage, strategy
from rollwise.rollout.dialects import Expect
from rollwise.rollout.episodes import EpisodeRunner, keep_env_rewards
from rollwise.rollout.remote import RemoteRollout
from rollwise.rollout.servers import Servers
from rollwise.rollout.trees import tree_settings
from rollwise.tasks import Task, make_task
from rollwise.types import CORRECT


def build_policy(cfg: Config, task: Task) -> Policy:
    m = cfg.model
    warm = ([(s.prompt, s.reference) for s in task.train if s.reference]
            if m.name == "tiny" else None)
    # a bfloat16 learner trains the model as loaded: no float32 copy is ever made, unless
    # compensated rounding takes its residuals from the float32 weights (learner/stochastic.py);
    # with LoRA, learner.master_dtype is the frozen base's dtype
    lc = cfg.learner
    bf16 = lc.master_dtype == "bfloat16" and lc.master_rounding != "compensated"
    dtype = "bfloat16" if bf16 else "float32"
    policy = load_policy(m.name, device=cfg.run.device, dtype=dtype, warm_start=warm,
                         tiny=m.tiny.model_dump() | {"seed": cfg.run.seed})
    if m.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        policy.model = get_peft_model(policy.model, LoraConfig(
            r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
            target_modules=list(m.lora_targets), task_type="CAUSAL_LM"))
    return policy


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
            return judge if judge is not None else build_judge(cfg)
        return get_verifier(name)

    specs = [RewardSpec(name, verifier(name), w)
             for name, w in cfg.task.rewards.items() if not is_group_term(name)]
    return specs + [RewardSpec(name, fn, w) for name, (fn, w) in (rewards or {}).items()
                    if not is_group_term(fn)]


def reward_timeout(cfg: Config, task: Task) -> float:
    """One verifier call's time limit: task.reward_timeout_s, or more where the task needs
    it (a code task's sandbox run, retried once)."""
    return max(cfg.task.reward_timeout_s, task.reward_timeout_s or 0.0)


def build_sampling(cfg: Config) -> SamplingParams:
    """A training rollout's sampling settings: a group of `group_size` per prompt."""
    r = cfg.rollout
    return SamplingParams(n=r.group_size, temperature=r.temperature, top_p=r.top_p,
                          top_k=r.top_k, max_tokens=r.max_tokens)


def build_rollout_stage(cfg: Config, policy: Policy, precision: PrecisionChoice,
                        scorer: Callable, fetch: Callable | None = None,
                        task: Task | None = None, own_weights: bool = False) -> RolloutStage:
    """The rollout engine, its scheduler and the stage around them (the local driver's,
    or a Ray rollout worker's); `scorer` scores trajectories in place. A `task` with an
    environment rolls out multi-turn episodes, scored by the environment. `own_weights`:
    the engine keeps its own copy of the weights (it generates while the trainer trains)."""
    e = cfg.engine
    engine = build_engine(e.name, policy, e.batch_size, e.kv_budget_tokens,
                           precision.rollout, spec_tokens=cfg.speculation.tokens,
                           decode_step=e.decode_step,
                           spec_max_tokens=cfg.speculation.max_tokens,
                           own_weights=own_weights)
    sampling = build_sampling(cfg)
    if task is not None and task.env is not None:
        return RolloutStage(engine, sampling, policy.decode, keep_env_rewards,
                            episodes=build_episode_runner(cfg, engine, sampling, policy, task))
    return RolloutStage(engine, sampling, policy.decode, scorer,
                        scheduler=build_scheduler(cfg, engine, sampling, policy.decode),
                        fetch=fetch)


def build_learner(cfg: Config, policy: Policy, precision: PrecisionChoice,
                  peers: Peers | None = None) -> Learner:
    """The learner over `policy.model` (the local driver's, a Ray learner actor's, or one
    learner rank's of several: `peers`)."""
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
        skip_zero_advantage=lc.skip_zero_advantage, share_prompts=lc.share_prompts,
        activation_checkpointing=lc.activation_checkpointing,
        memory_budget_mb=lc.memory_budget_mb, optimizer=lc.optimizer,
        master_dtype=trained_dtype(cfg), master_rounding=lc.master_rounding, seed=cfg.run.seed,
        release_memory=lc.release_memory, peers=peers)


def trained_dtype(cfg: Config) -> str:
    """The dtype the learner trains in: learner.master_dtype; with LoRA the adapters stay
    float32 as peft makes them (learner.master_dtype is then the frozen base's dtype)."""
    return "float32" if cfg.model.lora_rank > 0 else cfg.learner.master_dtype


# Text every remote server must tokenize as the run does, and whose log-probs each server
# must give as the trainer does after every weight load (rollout/remote.py): digits,
# arithmetic and words, spelled only with characters the tiny model's vocabulary holds.
PROBE_TEXT = ("Question: what is 17 + 25? Answer: 17 + 25 = 42, so the answer is 42. "
              "The quick brown fox jumps over the lazy dog.")


def place_remote(cfg: Config, policy: Policy, precision: PrecisionChoice, scorer: Callable,
                 task: Task, learner=None) -> tuple[RemoteRollout, FileTrainer]:
    """The rollout port over the servers of engine.remote_urls and the learner in this
    process whose publications are weight folders; the servers load the driver's weights
    as version 0 before the first step (they may have started from other ones)."""
    from rollwise.compose.config import ConfigError

    if task.env is not None:
        raise ConfigError(f"task '{task.name}' rolls out multi-turn episodes, which need the "
                          "engine in this process; engine.name='remote' runs single-turn tasks")
    e = cfg.engine
    servers = Servers(e.remote_urls, timeout_s=e.remote_timeout_s, retries=e.remote_retries)
    probe = policy.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    rollout = RemoteRollout(servers, build_sampling(cfg), policy.decode, scorer,
                            seed=cfg.run.seed, sync=e.remote_sync, concurrency=e.batch_size,
                            kind=e.remote_kind, probe=probe if e.remote_verify else None)
    try:
        rollout.check_servers(Expect(len(policy.tokenizer), PROBE_TEXT, probe,
                                     min(cfg.rollout.max_prompt_tokens + cfg.rollout.max_tokens,
                                         policy.max_context)))
    except BaseException:
        rollout.close()
        raise
    learner = learner if learner is not None else build_learner(cfg, policy, precision)
    # vLLM serves an untied output layer (serve/vllm.py): every publication writes it
    trainer = FileTrainer(learner, policy.model, e.remote_weights_dir,
                          untied=e.remote_kind == "vllm", probe=rollout.probe)
    try:
        # the servers' precisions before the first publication, so that it is written once
        # in each (not in float32 first, then again)
        trainer.weights.expect(rollout.weights_dtypes())
        rollout.publish(trainer.publish(0))
    except BaseException:
        rollout.close()
        trainer.close()
        raise
    return rollout, trainer


def build_eval_tasks(cfg: Config) -> list[tuple[str, Task]]:
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


def verify_by_task(completion: str, sample, *, verifiers: dict) -> float:
    """The verifier of the sample's own evaluation task (eval.tasks)."""
    return verifiers[sample.meta["eval_task"]](completion, sample)


def build_judge(cfg: Config):
    """The LLM judge of [judge], checked with one request now (before the model loads)."""
    from rollwise.rewards.judge import make_judge

    return make_judge(cfg.judge.model_dump())


def build_precision(cfg: Config, policy: Policy) -> PrecisionChoice:
    """engine.dtype, learner.precision and algorithm.correction with every 'auto' settled
    for this machine (rollwise.compose.precision: a cached probe of the model's shapes)."""
    from rollwise.engine.decoder import UnsupportedModel, check_supported

    engine = cfg.engine.name
    try:
        check_supported(policy.model)
    except UnsupportedModel:
        engine = "hf"  # make_engine falls back to it; it samples from the model as it is
    return resolve_precision(cfg.engine.dtype, cfg.learner.precision, cfg.algorithm.correction,
                             shapes=ModelShapes.of(policy.model), device=cfg.run.device,
                             engine=engine)


def check_enough_prompts(usable: int, skipped: int, per_step: int) -> None:
    """A train set smaller than one step would repeat prompts within a step unnoticed."""
    if usable < per_step:
        from rollwise.compose.config import ConfigError

        raise ConfigError(f"{usable} usable training prompts ({skipped} too long) is less "
                          f"than one step (rollout.prompts_per_step = {per_step})")


def build_group_terms(cfg: Config, rewards: dict[str, tuple[Callable, float]]) -> list[GroupTerm]:
    """Group reward terms named in task.rewards (registered or by import path) and the
    caller's marked functions, then DAPO's overlong shaping if on."""
    t, a = cfg.task, cfg.algorithm
    terms = [GroupTerm(name, get_group_reward(name), w, dict(t.reward_options.get(name, {})))
             for name, w in t.rewards.items() if is_group_term(name)]
    terms += [GroupTerm(name, fn, w, dict(t.reward_options.get(name, {})))
              for name, (fn, w) in rewards.items() if is_group_term(fn)]
    if a.overlong_buffer > 0:
        terms.append(GroupTerm("overlong", get_group_reward("overlong"), a.overlong_penalty,
                               {"max_tokens": cfg.rollout.max_tokens, "buffer": a.overlong_buffer}))
    return terms


def build_control(cfg: Config, sampler: UniformSampler) -> Controller:
    c, r = cfg.control, cfg.rollout
    book = PosteriorBook(prior=c.prior, decay_fast=c.decay_fast, decay_slow=c.decay_slow,
                         stale_after=c.stale_after)
    return Controller(sampler.items, make_allocator(c.allocator, **c.allocator_options), book,
                      prompts_per_step=r.prompts_per_step, group_size=r.group_size,
                      explore=c.explore, seed=cfg.run.seed, sampler=sampler)


def request_engine_settings(cfg: Config) -> list[str]:
    """The rollout settings of `cfg` that need the native engine's request-level API (and
    a single-turn task), as they read in the config: a strategy that needs it
    (rollout/strategy.py), speculative drafts, trees."""
    s, sp, t = cfg.schedule, cfg.speculation, cfg.tree
    return [k for k, on in {
        f"schedule.strategy='{s.strategy}'": strategy(s.strategy).needs_request_engine,
        "speculation.group": sp.group, "speculation.reuse": sp.reuse,
        f"tree.mode='{t.mode}'": t.mode != "none"}.items() if on]


def build_scheduler(cfg: Config, engine: Engine, sampling: SamplingParams,
                     decode) -> RolloutScheduler | None:
    """The rollout scheduler over a native engine; None (plain batched generation) for the
    HF engine, which only supports the 'sync'/'continuous' schedules without speculation."""
    from rollwise.compose.config import ConfigError

    s, sp = cfg.schedule, cfg.speculation
    if not isinstance(engine, RequestEngine):
        needs = request_engine_settings(cfg)
        if needs:
            raise ConfigError(f"{', '.join(needs)} needs the native engine; this model runs on "
                              "the HF engine (engine.name='hf' or an unsupported "
                              "architecture)")
        return None
    return RolloutScheduler(
        engine, sampling, decode, strategy=s.strategy, over_provision=s.over_provision,
        max_staleness=s.max_staleness, chunk_tokens=s.chunk_tokens, spec_group=sp.group,
        spec_reuse=sp.reuse, reuse_rule=sp.reuse_rule, lenience=sp.lenience,
        seed=cfg.run.seed, tree=tree_settings(cfg.tree))


def build_episode_runner(cfg: Config, engine: Engine, sampling: SamplingParams, policy: Policy,
                    task: Task, tree: bool = True) -> EpisodeRunner:
    """The episode runner of a task with an environment (native engine only); `tree`
    False: no tree branching (evaluation runs one episode per prompt)."""
    from rollwise.compose.config import ConfigError

    ep = cfg.episodes
    if not isinstance(engine, RequestEngine):
        raise ConfigError(f"task '{task.name}' rolls out multi-turn episodes, which need the "
                          "native engine (engine.name = 'native' and a supported model)")
    single_turn = request_engine_settings(cfg)
    if single_turn:
        raise ConfigError(f"{', '.join(single_turn)} applies to single-turn tasks; task "
                          f"'{task.name}' runs episodes with continuous batching")
    return EpisodeRunner(
        engine, sampling, task.env, TurnRenderer(policy.tokenizer, policy.chat, policy.stop_ids),
        policy.decode, max_turns=ep.max_turns,
        max_context=min(ep.max_tokens, policy.max_context),
        env_timeout_s=ep.env_timeout_s, branches=ep.tree_branches if tree else 1,
        depth=ep.tree_depth, keep_kv=ep.keep_kv, seed=cfg.run.seed)


def build_engine(name: str, policy: Policy, batch_size: int, kv_budget_tokens: int,
                  dtype: str = "float32", weights_from: Engine | None = None,
                  spec_tokens: int | None = None, decode_step: str | None = None,
                  spec_max_tokens: int | None = None, own_weights: bool = False) -> Engine:
    """`dtype`: the native engine's precision; `weights_from`: a native engine whose
    converted weights this one shares (the evaluator reads the rollout engine's copy);
    `spec_tokens`: draft tokens one verification pass takes; `decode_step`: how its
    decode step runs (engine/step.py); `spec_max_tokens`: the widest verification window
    a long draft grows to (0: spec_tokens); each None: the engine's own default (the
    config's, read from it: compose/sections.py); `own_weights`: the native engine's copy of the
    weights even in the parameters' precision."""
    from rollwise.compose.config import ConfigError
    from rollwise.engine import NativeEngine, make_engine

    if name == "hf" and dtype != "float32":
        raise ConfigError(f"engine.dtype='{dtype}' needs the native engine (engine.name="
                          "'native'); the HF engine samples from the float32 model")
    options = {"kv_budget_tokens": kv_budget_tokens} if name == "native" else {}
    if name == "native":
        options |= {"dtype": dtype, "own_weights": own_weights} | {k: v for k, v in {
            "spec_tokens": spec_tokens, "step_mode": decode_step,
            "spec_max_tokens": spec_max_tokens}.items() if v is not None}  # None: its own
        if isinstance(weights_from, NativeEngine):
            options["weights_from"] = weights_from
    return make_engine(name, policy.model, eos_token_ids=policy.stop_ids,
                       pad_token_id=policy.tokenizer.pad_token_id, batch_size=batch_size,
                       **options)
