"""Checks of a config that need more than its schema, run before any model is loaded: the
one place a config is checked (`check_config`), for every front end and placement.

Why here and not in the pydantic models: these look names up in registries (algorithms,
verifiers, tasks, models) and ask torch whether a device exists. Running them first means
a typo costs a second, not a model load, and nothing on disk has been touched yet (a run
directory is created, or replaced, only after they pass).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from pathlib import Path

from rollwise.compose.config import Config, ConfigError
from rollwise.registry import options_misfit, options_of

# What the controller calls on an allocator (docs/extending.md, rollwise/control/allocators.py)
ALLOCATOR_METHODS = ("plan", "observe", "train_groups", "max_rollouts", "state_dict",
                     "load_state_dict")


def check_config(cfg: Config, functions: Mapping[str, Callable] | None = None) -> None:
    """Raise ConfigError naming the key of the first problem found. `functions`: reward
    terms passed from Python (`rollwise.train(rewards=...)`), by name, whose options
    task.reward_options may hold."""
    _check_algorithms(cfg)
    _check_rewards(cfg, dict(functions or {}))
    _check_allocator(cfg)
    _check_task_and_model(cfg)
    _check_combinations(cfg)
    _check_placement(cfg)
    check_device(cfg.run.device)
    _check_shards(cfg)
    _check_sft(cfg)
    if cfg.engine.decode_step == "graph" and not cfg.run.device.startswith("cuda"):
        raise ConfigError(f"engine.decode_step = 'graph' captures CUDA graphs: it needs "
                          f"run.device = 'cuda' (here {cfg.run.device!r}); 'auto' picks "
                          "graphs on a GPU and the eager step elsewhere")


def _known(key: str, name: str, registry, kind: str = "") -> None:
    """`name` is registered, or an import path that imports and fits the signature."""
    try:
        registry.get(name)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def _check_algorithms(cfg: Config) -> None:
    from rollwise.algos import advantage_estimators, corrections, kl_estimators, policy_losses
    from rollwise.algos.inputs import INPUT_NAMES

    a = cfg.algorithm
    _known("algorithm.advantage", a.advantage, advantage_estimators, "advantage estimator")
    _known("algorithm.loss", a.loss, policy_losses, "policy loss")
    _known("algorithm.kl_estimator", a.kl_estimator, kl_estimators, "KL estimator")
    if a.correction not in ("none", "auto"):  # auto: rollwise.compose.precision decides
        _known("algorithm.correction", a.correction, corrections, "correction")
    problem = options_misfit(advantage_estimators.get(a.advantage), a.advantage_options,
                             passes=advantage_estimators.takes, inputs=INPUT_NAMES)
    if problem:
        raise ConfigError(f"algorithm.advantage_options: advantage estimator "
                          f"{a.advantage!r}: {problem}")


def _check_rewards(cfg: Config, functions: dict[str, Callable]) -> None:
    """Every term of task.rewards is known and fits its signature; every table of
    task.reward_options belongs to a group term (of the config or from Python) and holds
    only options its function takes."""
    from rollwise.rewards.group import GROUP_REWARDS, is_group_term
    from rollwise.rewards.verifiers import VERIFIERS
    from rollwise.types import CORRECT

    t = cfg.task
    groups: dict[str, Callable] = {}  # name -> function of every group term
    for name in t.rewards:  # the task's own verifier, a group term, or a verifier
        if name in (CORRECT, "judge"):  # the judge: checked by build, with one request
            continue
        if is_group_term(name):
            _known(f"task.rewards.{name}", name, GROUP_REWARDS)
            groups[name] = GROUP_REWARDS.get(name)
        else:
            _known(f"task.rewards.{name}", name, VERIFIERS)
    groups |= {name: fn for name, fn in functions.items() if is_group_term(fn)}
    for name in t.reward_options:
        if name not in groups:
            terms = [*t.rewards, *functions]
            close = difflib.get_close_matches(name, terms, n=1)
            what = ("a verifier (only group terms take options)" if name in terms else
                    "no reward term" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(f"task.reward_options.{name}: options apply to group reward "
                              f"terms ({', '.join(sorted(GROUP_REWARDS))}, or a function marked "
                              f"with rollwise.group_reward); '{name}' is {what}")
    for name, fn in groups.items():
        problem = options_misfit(fn, t.reward_options.get(name, {}),
                                 passes=GROUP_REWARDS.takes)
        if problem:
            raise ConfigError(f"task.reward_options.{name}: group reward {name!r}: {problem}")


def _check_allocator(cfg: Config) -> None:
    """The allocator is known; a class of the user's has the methods the controller calls;
    control.allocator_options fit its constructor."""
    from rollwise.control.allocators import ALLOCATORS

    name = cfg.control.allocator
    _known("control.allocator", name, ALLOCATORS)
    cls = ALLOCATORS.get(name)
    missing = [m for m in ("name", *ALLOCATOR_METHODS) if not hasattr(cls, m)]
    if missing:
        raise ConfigError(f"control.allocator: allocator {name!r} lacks {', '.join(missing)}; "
                          f"an allocator class has a name and the methods "
                          f"{', '.join(ALLOCATOR_METHODS)} (docs/extending.md)")
    options = cfg.control.allocator_options
    problem = options_misfit(cls, options)
    if problem:
        owners = {f"{option!r} is an option of {other!r}" for option in options
                  for other, c in ALLOCATORS.items()
                  if other != name and option in options_of(c).defaults}
        raise ConfigError(f"control.allocator_options: allocator {name!r}: {problem}"
                          + "".join(f"; {o}" for o in sorted(owners)))


def _check_task_and_model(cfg: Config) -> None:
    from rollwise.models import MODEL_NAMES
    from rollwise.tasks import TASKS

    _known("task.name", cfg.task.name, TASKS, "task")
    if cfg.task.name == "file" and not cfg.task.path:
        raise ConfigError("task.path: task 'file' needs the path of its data file or folder")
    name = cfg.model.name
    if name not in MODEL_NAMES and not (Path(name) / "config.json").is_file():
        raise ConfigError(f"model.name = {name!r}: neither one of {', '.join(MODEL_NAMES)} nor "
                          "a local Hugging Face directory with a config.json (nothing is "
                          "downloaded)")
    if cfg.task.name != "file" and cfg.task.num_train < cfg.rollout.prompts_per_step:
        raise ConfigError(f"task.num_train = {cfg.task.num_train} is smaller than one step "
                          f"(rollout.prompts_per_step = {cfg.rollout.prompts_per_step})")


GROUP_BASELINES = ("grpo", "dr_grpo", "rloo", "mc_grpo", "drpo", "pass_at_k")


def _check_combinations(cfg: Config) -> None:
    from rollwise.compose.parts import request_engine_settings
    from rollwise.engine import ENGINES

    r = cfg.rollout
    if cfg.engine.name == "remote":
        _check_remote(cfg)
    else:
        _known("engine.name", cfg.engine.name, ENGINES)
    if r.group_size == 1 and cfg.algorithm.advantage in GROUP_BASELINES:
        raise ConfigError(f"rollout.group_size = 1: advantage '{cfg.algorithm.advantage}' "
                          "compares the responses within a group, so every advantage would "
                          "be 0 and nothing learned; use group_size >= 2 (or a batch baseline, "
                          "algorithm.advantage = 'reinforce_pp')")
    needs = request_engine_settings(cfg)
    if cfg.engine.name != "native" and needs:
        raise ConfigError(f"{', '.join(needs)} needs the native engine "
                          "(engine.name='native')")
    _check_tree(cfg)
    _check_master(cfg)


def _check_master(cfg: Config) -> None:
    """learner.master_rounding 'compensated' rounds bfloat16 master weights in rollwise's
    own AdamW (learner/stochastic.py)."""
    lc = cfg.learner
    if lc.master_rounding != "compensated":
        return
    if cfg.model.lora_rank > 0:
        raise ConfigError("learner.master_rounding = 'compensated' rounds trained bfloat16 "
                          f"weights; with LoRA (model.lora_rank = {cfg.model.lora_rank}) the "
                          "adapters train in float32 and learner.master_dtype is the frozen "
                          "base's dtype")
    if lc.master_dtype != "bfloat16":
        raise ConfigError("learner.master_rounding = 'compensated' keeps the bits that "
                          "bfloat16 master weights drop: it needs learner.master_dtype = "
                          f"'bfloat16' (here {lc.master_dtype!r})")
    if lc.optimizer not in ("adamw", "adamw-fused", "adamw-bf16"):
        raise ConfigError("learner.master_rounding = 'compensated' needs learner.optimizer "
                          f"adamw, adamw-fused or adamw-bf16 (here {lc.optimizer!r}: torchao's "
                          "optimizers round stochastically)")


def _check_tree(cfg: Config) -> None:
    """tree.mode: the strategy and speculation a tree can grow under, and a group that
    divides into its branches."""
    t, s, n = cfg.tree, cfg.schedule, cfg.rollout.group_size
    if t.mode == "none":
        return
    key = f"tree.mode = '{t.mode}'"
    if s.strategy != "continuous":
        why = {"sync": "admits requests only into an empty batch, so every fork would wait "
               "for the whole batch", "partial": "keeps unfinished responses across steps, "
               "and a tree's branches are not resumable samples",
               "context": "re-queues requests in chunks by predicted length, which a "
               "tree's forks do not have"}[s.strategy.split("+")[0]]
        raise ConfigError(f"{key} grows groups under schedule.strategy = 'continuous'; "
                          f"'{s.strategy}' {why}")
    for flag in ("reuse", "group"):
        if getattr(cfg.speculation, flag):
            raise ConfigError(f"{key} and speculation.{flag} both decide where a response's "
                              "tokens come from; turn one off")
    if t.mode == "entropy" and n % t.entropy_branches:
        raise ConfigError(f"{key}: rollout.group_size = {n} is not a multiple of "
                          f"tree.entropy_branches = {t.entropy_branches} (each root and "
                          "its forks make one share of the group)")
    if t.mode == "latr" and n < 2:
        raise ConfigError(f"{key}: rollout.group_size = 1 leaves no room for a branch")


def _check_placement(cfg: Config) -> None:
    """Placement and driver combinations that cannot work."""
    s = cfg.schedule
    if overlaps_in_process(cfg) and cfg.engine.name != "native":
        raise ConfigError(
            f"schedule.mode='async' with schedule.max_staleness={s.max_staleness} in one "
            f"process needs engine.name='native' (now '{cfg.engine.name}'), which keeps its "
            "own copy of the weights: the HF engine reads the learner's weights, which an "
            "update changes in place while the next rollouts run (or use run.backend='ray' "
            "or engine.name='remote'; max_staleness=0 is synchronous training)")
    if cfg.run.backend == "local" and cfg.ray.num_workers > 1:
        raise ConfigError(f"ray.num_workers={cfg.ray.num_workers} needs "
                          "run.backend='ray' (the local backend has one engine)")


def _check_shards(cfg: Config) -> None:
    """learner.shards > 1: what FSDP2 shards, on devices that exist, over rows enough."""
    n, lc = cfg.learner.shards, cfg.learner
    if n == 1:
        return
    if lc.master_dtype == "bfloat16":
        raise ConfigError(f"learner.master_dtype = 'bfloat16' cannot be sharded (its stochastic "
                          f"rounding keeps per-weight state FSDP2 does not split); with "
                          f"learner.shards = {n} keep 'float32' (each rank holds 1/{n} of it)")
    if lc.optimizer not in ("adamw", "adamw-fused"):
        raise ConfigError(f"learner.optimizer = '{lc.optimizer}' cannot be sharded (torchao's "
                          f"quantized moments are not DTensors); with learner.shards = {n} use "
                          "'adamw' or 'adamw-fused'")
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if rows < n:
        raise ConfigError(f"learner.shards = {n} is more than the {rows} rows of a step "
                          f"(rollout.prompts_per_step x rollout.group_size): a rank would "
                          "have nothing to train on")
    if cfg.run.device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count()
        if count < n:
            raise ConfigError(f"learner.shards = {n} on run.device = '{cfg.run.device}' needs "
                              f"{n} GPUs, one a rank; this machine has {count}")
    if cfg.sft.path:
        raise ConfigError("sft.path: the warm start trains the learner in this process; "
                          f"it is not supported with learner.shards = {n} (yet)")


def overlaps_in_process(cfg: Config) -> bool:
    """Rollouts of later steps run in this process while a step trains: asynchronous
    training with staleness >= 1 and the engine here (not on Ray, not a server)."""
    s = cfg.schedule
    return (s.mode == "async" and s.max_staleness > 0 and cfg.run.backend == "local"
            and cfg.engine.name != "remote")


def _check_sft(cfg: Config) -> None:
    """[sft]: demonstrations that read, and a learner in this process."""
    from rollwise.learner.sft import DemonstrationError, read_demonstrations

    if not cfg.sft.path:
        return
    if cfg.run.backend == "ray" or cfg.engine.name == "remote":
        raise ConfigError("sft.path: the warm start trains the learner and the engine in "
                          "this process; run.backend = 'ray' and engine.name = 'remote' are "
                          "not supported (yet)")
    try:
        read_demonstrations(cfg.sft.path)
    except DemonstrationError as e:
        raise ConfigError(f"sft.path: {e}") from None


def _check_remote(cfg: Config) -> None:
    """engine.name = 'remote': servers to send to, and only what they can run."""
    from rollwise.compose.parts import request_engine_settings

    e = cfg.engine
    if not e.remote_urls:
        raise ConfigError("engine.name = 'remote' needs at least one server in "
                          "engine.remote_urls, e.g. ['http://127.0.0.1:8001'] (a `rollwise "
                          "serve` process)")
    bad = [u for u in e.remote_urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ConfigError(f"engine.remote_urls: {bad[0]!r} is not an http:// or https:// URL")
    if cfg.run.backend != "local":
        raise ConfigError(f"engine.name = 'remote' runs with run.backend = 'local' (the "
                          f"servers are the rollout workers), not {cfg.run.backend!r}")
    if e.remote_kind == "sglang" and cfg.model.lora_rank > 0:
        raise ConfigError(f"model.lora_rank = {cfg.model.lora_rank} with engine.remote_kind = "
                          "'sglang': the weights published after the first are the adapter "
                          "alone, which `rollwise serve` merges and vLLM loads as an adapter "
                          "(engine.remote_kind = 'rollwise' or 'vllm'); train full weights "
                          "for sglang")
    needs = request_engine_settings(cfg)
    if needs:
        raise ConfigError(f"{', '.join(needs)} needs the request engine in this process; "
                          "engine.name = 'remote' runs schedule.strategy = 'continuous' or "
                          "'sync', without speculative drafts or trees")


def check_device(device: str, setting: str = "run.device") -> None:
    """The torch device exists in this torch build and on this machine; `setting` names
    where it was asked for (a config key or a command-line option) in the error."""
    import torch

    said = f"{setting} = {device!r}" if "." in setting else f"{setting} {device}"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"{said}: not a torch device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda
                     is None else f"torch {torch.__version__} sees no GPU")
            raise ConfigError(f"{said}: CUDA is not available here ({build}); use 'cpu', or a "
                              "CUDA build of torch on a machine with an NVIDIA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"{said}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{said}: MPS is not available here; use 'cpu'")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{said}: rollwise runs on 'cpu', 'cuda' or 'mps'")


def require_device(device: str) -> None:
    """For command-line tools: exit with one line, not a traceback, when this torch cannot
    use `device` (their `--device` option)."""
    try:
        check_device(device, "--device")
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
