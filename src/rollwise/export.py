"""`rollwise export RUN_DIR OUT_DIR [--step N]`: a run's trained model as a Hugging Face folder.

The policy is rebuilt from the run's config exactly as training built it (the tiny model's
cached warm start, SmolLM2's converted weights, or the local directory), the checkpoint's
trainable weights are loaded into it, LoRA adapters are merged into the base weights, and
the result is written with `save_pretrained` (config.json, model.safetensors,
generation_config.json) beside the tokenizer (and its chat template). Nothing in the run
directory changes, and nothing is pickled: `AutoModelForCausalLM.from_pretrained(OUT_DIR)`
loads it with no rollwise installed.
"""

from __future__ import annotations

from pathlib import Path

from rollwise.config import load_config


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """checkpoints/step_N of the run (the latest when `step` is None)."""
    from rollwise.learner.checkpoint import list_checkpoints

    found = list_checkpoints(Path(run_dir) / "checkpoints")
    if not found:
        raise ValueError(f"{run_dir} has no checkpoint to export")
    if step is None:
        return found[-1]
    chosen = [p for p in found if p.name == f"step_{step}"]
    if not chosen:
        kept = ", ".join(p.name.removeprefix("step_") for p in found)
        raise ValueError(f"{run_dir} has no checkpoint of step {step} (kept: {kept}; "
                         "run.keep_checkpoints decides how many are kept)")
    return chosen[0]


def export(run_dir: Path, out_dir: Path, step: int | None = None) -> Path:
    """Write the model of `run_dir` at `step` (default: its latest checkpoint) to `out_dir`;
    returns the checkpoint exported."""
    from rollwise.learner.checkpoint import load_checkpoint
    from rollwise.parts import build_policy
    from rollwise.tasks import make_task

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    cfg = load_config(run_dir / "config.toml")
    checkpoint = find_checkpoint(run_dir, step)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} exists and is not empty; choose a new folder")
    t = cfg.task
    task = make_task(t.name, seed=cfg.run.seed, num_train=t.num_train, num_eval=t.num_eval,
                     chat=cfg.model.name != "tiny", path=t.path, **t.options)
    policy = build_policy(cfg, task)  # the same warm start the run began from
    load_checkpoint(checkpoint, policy.model)
    model = policy.model
    if hasattr(model, "merge_and_unload"):  # peft LoRA: fold the adapters into the weights
        model = model.merge_and_unload()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    policy.tokenizer.save_pretrained(out_dir)
    return checkpoint
