"""What `rollwise serve --model` loads: a built-in model name, a local Hugging Face folder,
or a run directory (its latest checkpoint, rebuilt the way `rollwise export` rebuilds it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollwise.models import Policy


@dataclass
class Served:
    policy: Policy
    name: str  # the id clients pass as `model`
    version: int  # policy version of the weights (a run's checkpoint step; 0 otherwise)
    source: str  # where the weights came from, for /v1/models and the log


def load_served(model: str, *, step: int | None = None, dtype: str = "float32",
                device: str = "cpu") -> Served:
    """`model`: 'tiny', 'smollm2-135m', a Hugging Face folder, or a run directory (a folder
    with config.toml and checkpoints/; `step` picks a checkpoint, default the latest),
    loaded on `device` (a checkpoint saved on any device loads on any other)."""
    served = _load(model, step, dtype)
    served.policy.model.to(device)
    return served


def _load(model: str, step: int | None, dtype: str) -> Served:
    from rollwise.models import load_policy

    path = Path(model)
    if (path / "config.toml").is_file():
        return _load_run(path, step)
    if step is not None:
        raise ValueError(f"--step applies to run directories; '{model}' is not one")
    policy = load_policy(model, dtype=dtype)
    name = model if model in ("tiny", "smollm2-135m") else path.name
    return Served(policy, name, 0, model)


def _load_run(run_dir: Path, step: int | None) -> Served:
    from rollwise.config import load_config
    from rollwise.export import find_checkpoint
    from rollwise.learner.checkpoint import load_checkpoint
    from rollwise.parts import build_policy
    from rollwise.tasks import make_task

    cfg = load_config(run_dir / "config.toml")
    checkpoint = find_checkpoint(run_dir, step)
    t = cfg.task
    task = make_task(t.name, seed=cfg.run.seed, num_train=t.num_train, num_eval=t.num_eval,
                     chat=cfg.model.name != "tiny", path=t.path, **t.options)
    policy = build_policy(cfg, task)  # the model the run started from, then its weights
    _, state = load_checkpoint(checkpoint, policy.model)
    if hasattr(policy.model, "merge_and_unload"):  # LoRA: fold the adapters in
        policy.model = policy.model.merge_and_unload()
    policy.model.eval()
    name = f"{run_dir.resolve().name}@{checkpoint.name}"
    return Served(policy, name, int(state.get("step", 0)), str(checkpoint))
