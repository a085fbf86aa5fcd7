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

from rollwise.compose.config import load_config


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


def load_run_policy(run_dir: Path, step: int | None = None):
    """(policy, checkpoint, run state) of `run_dir` at `step` (default: the latest
    checkpoint), LoRA folded in, on the CPU whatever device the run trained on (its
    checkpoints are plain safetensors): exporting or serving a GPU run needs no GPU."""
    from rollwise.compose.parts import build_policy
    from rollwise.learner.checkpoint import load_checkpoint
    from rollwise.tasks import make_task

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.toml")
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"device": "cpu"})})
    checkpoint = find_checkpoint(run_dir, step)
    t = cfg.task
    task = make_task(t.name, seed=cfg.run.seed, num_train=t.num_train, num_eval=t.num_eval,
                     chat=cfg.model.name != "tiny", path=t.path, **t.options)
    policy = build_policy(cfg, task)  # the same warm start the run began from
    _, state = load_checkpoint(checkpoint, policy.model)
    if hasattr(policy.model, "merge_and_unload"):  # peft LoRA: fold the adapters in
        policy.model = policy.model.merge_and_unload()
    policy.model.eval()
    return policy, checkpoint, state


def export(run_dir: Path, out_dir: Path, step: int | None = None) -> Path:
    """Write the model of `run_dir` at `step` (default: its latest checkpoint) to `out_dir`;
    returns the checkpoint exported."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} exists and is not empty; choose a new folder")
    policy, checkpoint, _ = load_run_policy(run_dir, step)
    model = policy.model
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    policy.tokenizer.save_pretrained(out_dir)
    return checkpoint
