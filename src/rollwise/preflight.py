"""Checks of a config that need more than its schema, run before any model is loaded.

Why here and not in the pydantic models: these look names up in registries (algorithms,
verifiers, tasks, models) and ask torch whether a device exists. Running them first means
a typo costs a second, not a model load, and nothing on disk has been touched yet (a run
directory is created, or replaced, only after they pass).
"""

from __future__ import annotations

from pathlib import Path

from rollwise.config import Config, ConfigError


def check_config(cfg: Config) -> None:
    """Raise ConfigError naming the key of the first problem found."""
    _check_algorithms(cfg)
    _check_rewards(cfg)
    _check_allocator(cfg)
    _check_task_and_model(cfg)
    _check_combinations(cfg)
    check_device(cfg.run.device)


def _known(key: str, name: str, registry, kind: str = "") -> None:
    """`name` is registered, or an import path that imports and fits the signature."""
    try:
        registry.get(name)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def _check_algorithms(cfg: Config) -> None:
    from rollwise.algos import advantage_estimators, corrections, kl_estimators, policy_losses

    a = cfg.algorithm
    _known("algorithm.advantage", a.advantage, advantage_estimators, "advantage estimator")
    _known("algorithm.loss", a.loss, policy_losses, "policy loss")
    _known("algorithm.kl_estimator", a.kl_estimator, kl_estimators, "KL estimator")
    if a.correction not in ("none", "auto"):  # auto: rollwise.precision decides
        _known("algorithm.correction", a.correction, corrections, "correction")


def _check_rewards(cfg: Config) -> None:
    from rollwise.rewards.group import GROUP_REWARDS, is_group_term
    from rollwise.rewards.verifiers import VERIFIERS
    from rollwise.types import CORRECT

    t = cfg.task
    for name in t.rewards:  # the task's own verifier, a group term, or a verifier
        if name in (CORRECT, "judge"):  # the judge: checked by build, with one request
            continue
        if is_group_term(name):
            _known(f"task.rewards.{name}", name, GROUP_REWARDS)
        else:
            _known(f"task.rewards.{name}", name, VERIFIERS)
    for name in t.reward_options:
        if not is_group_term(name):
            raise ConfigError(f"task.reward_options.{name}: options apply to group reward "
                              f"terms ({', '.join(sorted(GROUP_REWARDS))}, or a function marked "
                              f"with rollwise.group_reward); '{name}' is not one")


def _check_allocator(cfg: Config) -> None:
    from rollwise.control.allocators import ALLOCATORS

    _known("control.allocator", cfg.control.allocator, ALLOCATORS)


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
    from rollwise.engine import ENGINES

    r = cfg.rollout
    _known("rollout.engine", r.engine, ENGINES)
    if r.group_size == 1 and cfg.algorithm.advantage in GROUP_BASELINES:
        raise ConfigError(f"rollout.group_size = 1: advantage '{cfg.algorithm.advantage}' "
                          "compares the responses within a group, so every advantage would "
                          "be 0 and nothing learned; use group_size >= 2 (or a batch baseline, "
                          "algorithm.advantage = 'reinforce_pp')")
    needs = [k for k, on in {f"rollout.strategy='{r.strategy}'": r.strategy not in (
        "sync", "continuous"), "rollout.spec_group": r.spec_group,
        "rollout.spec_reuse": r.spec_reuse}.items() if on]
    if r.engine != "native" and needs:
        raise ConfigError(f"{', '.join(needs)} needs the native engine "
                          "(rollout.engine='native')")


def check_device(device: str) -> None:
    """The torch device exists in this torch build and on this machine."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"run.device = {device!r}: not a torch device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only torch build" if torch.version.cuda is None else "no visible GPU"
            raise ConfigError(f"run.device = {device!r}: CUDA is not available here ({build}); "
                              "use run.device = 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"run.device = {device!r}: only {torch.cuda.device_count()} "
                              "CUDA device(s) visible")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"run.device = {device!r}: MPS is not available here; use 'cpu'")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"run.device = {device!r}: rollwise runs on 'cpu', 'cuda' or 'mps'")
