"""What `rollwise serve --model` loads: a built-in model name, a local Hugging Face folder,
or a run directory (its latest checkpoint, rebuilt the way `rollwise export` rebuilds it),
and the names clients may call it by: a run directory is served as its run's name, and
`NAME@step_N` (the checkpoint served) is accepted too."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rollwise.models import Policy


@dataclass
class Served:
    policy: Policy
    name: str  # the id clients pass as `model`
    version: int  # policy version of the weights (a run's checkpoint step; 0 otherwise)
    source: str  # where the weights came from, for /v1/models and the log
    aliases: tuple[str, ...] = field(default=())  # other ids accepted for `name`


def load_served(model: str, *, step: int | None = None, dtype: str = "float32",
                device: str = "cpu", tiny_context: int | None = None) -> Served:
    """`model`: 'tiny', 'smollm2-135m', a Hugging Face folder, or a run directory (a folder
    with config.toml and checkpoints/; `step` picks a checkpoint, default the latest),
    loaded on `device` (a checkpoint saved on any device loads on any other).
    `tiny_context`: the built-in tiny model's context in tokens (default 512)."""
    if tiny_context is not None and model != "tiny":
        raise ValueError(f"the tiny model's context applies to model 'tiny', not '{model}'")
    served = _load(model, step, dtype, tiny_context)
    served.policy.model.to(device)
    return served


def _load(model: str, step: int | None, dtype: str, tiny_context: int | None) -> Served:
    from rollwise.models import load_policy

    path = Path(model)
    if (path / "config.toml").is_file():
        return _load_run(path, step)
    if step is not None:
        raise ValueError(f"--step applies to run directories; '{model}' is not one")
    policy = load_policy(model, dtype=dtype,
                         tiny=None if tiny_context is None else {"context": tiny_context})
    name = model if model in ("tiny", "smollm2-135m") else path.name
    return Served(policy, name, 0, model)


def _load_run(run_dir: Path, step: int | None) -> Served:
    from rollwise.run.export import load_run_policy

    policy, checkpoint, state = load_run_policy(run_dir, step)
    name = run_dir.resolve().name
    return Served(policy, name, int(state.get("step", 0)), str(checkpoint),
                  aliases=(f"{name}@{checkpoint.name}",))
