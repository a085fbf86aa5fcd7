"""`rollwise bench e2e --vs trl`: TRL's GRPOTrainer beside rollwise, step for step.

TRL (an optional extra: `pip install 'rollwise[trl]'`) trains the same model (for SmolLM2,
rollwise's converted directory), on the same task's training prompts as chat messages, with
the same group size, prompts per step, completion budget, temperature and learning rate, no
KL term (beta 0, as in the config when kl_coef is 0), full fine-tune. Its learner runs in
TRL's fastest working CPU configuration by default: bf16 autocast when rollwise's learner
precision resolves to bf16-autocast on this machine (native bfloat16), else float32;
activation checkpointing off (`trl_options` overrides any GRPOConfig
field, e.g. gradient_checkpointing=True for TRL's default).

Alternation in one process: TRL's own training loop runs, and a callback at the end of each
TRL step runs one step of every rollwise variant (outside TRL's timing). TRL's step time is
from `on_step_begin` to `on_step_end` (prompt batch to optimizer step); its rollout is the
time inside `_generate`, its reward (and batch preparation) the rest of
`_generate_and_score_completions`, and its learner everything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollwise.bench.sides import Side, summarise_steps, variant_config


def available() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def _timed(obj: Any, name: str, sink: list[float]) -> None:
    """Wrap the bound method `obj.name` so each call's wall time is appended to `sink`."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t)

    setattr(obj, name, wrapper)


def trl_dataset(stages) -> Any:
    """The rollwise training prompts (chat messages) as a `datasets.Dataset`, with the row
    index that the reward function uses to find each sample's verifier input."""
    from datasets import Dataset

    prompts = [s.prompt for s, _ in stages.sampler.items]
    return Dataset.from_dict({"prompt": prompts, "row": list(range(len(prompts)))})


def trl_reward(stages) -> Callable:
    """TRL reward function: rollwise's task verifier on each completion's text."""
    samples = [s for s, _ in stages.sampler.items]
    verifier = stages.task.verifier

    def correct(prompts, completions, row, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(verifier(t, samples[i])) for t, i in zip(texts, row)]

    return correct


def trl_config(cfg, out: Path, steps: int, options: dict[str, Any], learner_precision: str):
    """GRPOConfig at the rollwise config's settings (see the module docstring);
    `learner_precision`: what rollwise's learner resolved to (auto: per machine), so TRL
    gets bf16 autocast exactly where it is native and fast."""
    from trl import GRPOConfig

    r, lc = cfg.rollout, cfg.learner
    base = {
        "output_dir": str(out / "trl"),
        "per_device_train_batch_size": r.prompts_per_step * r.group_size,
        "gradient_accumulation_steps": 1, "num_generations": r.group_size,
        "max_completion_length": r.max_tokens, "temperature": r.temperature or 1.0,
        "learning_rate": lc.lr, "beta": cfg.algorithm.kl_coef, "max_steps": steps,
        "use_cpu": True, "bf16": learner_precision == "bf16-autocast",
        "gradient_checkpointing": False, "logging_steps": 1, "report_to": "none",
        "save_strategy": "no", "seed": cfg.run.seed, "max_grad_norm": lc.grad_clip,
        "warmup_steps": lc.warmup_steps, "lr_scheduler_type": lc.lr_schedule,
        "dataloader_num_workers": 0,
    }
    return GRPOConfig(**(base | options))


def _trl_model(cfg, stages):
    """A fresh copy of the policy's starting weights for TRL (float32, as TRL loads it)."""
    import transformers

    if cfg.model.name == "smollm2-135m":
        from rollwise.models.smollm2 import converted_dir

        # the converted config still names the GGUF quantization it came from, which makes
        # Trainer refuse a full fine-tune; the weights are plain float32 (models/smollm2.py)
        config = transformers.AutoConfig.from_pretrained(converted_dir())
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = transformers.AutoModelForCausalLM.from_pretrained(
            converted_dir(), config=config, dtype="float32")
    else:  # tiny (warm-started): the same architecture and weights, a separate copy
        import copy

        model = copy.deepcopy(stages.model).float()
    return model.train(), stages.policy.tokenizer


def _trl_trainer(cfg, stages, out: Path, rounds: int, trl_options: dict[str, Any]):
    """TRL's GRPOTrainer on the same model, task, rewards and learner precision as `stages`."""
    from trl import GRPOTrainer

    model, tokenizer = _trl_model(cfg, stages)
    return GRPOTrainer(model=model, reward_funcs=trl_reward(stages),
                       args=trl_config(cfg, out, rounds, trl_options,
                                       stages.info.precision["learner"]),
                       train_dataset=trl_dataset(stages), processing_class=tokenizer)


def run_vs_trl(path: Path, variants: dict[str, tuple[str, ...]], *, steps: int = 5,
               warmup: int = 1, extra: list[str] | None = None, out: Path,
               trl_options: dict[str, Any] | None = None,
               progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The steps part with TRL as the first side; ratios are TRL / each rollwise variant."""
    if not available():
        raise RuntimeError("--vs trl needs TRL: pip install 'rollwise[trl]' (or pip install trl)")
    from transformers import TrainerCallback

    rounds = warmup + steps
    sides = [Side.build(name, variant_config(path, name, ov, out, extra, num_steps=rounds))
             for name, ov in variants.items()]
    trainer = _trl_trainer(variant_config(path, "trl", (), out, extra, num_steps=rounds),
                           sides[0].stages, out, rounds, trl_options or {})
    gen, prep = [], []
    _timed(trainer, "_generate", gen)
    _timed(trainer, "_generate_and_score_completions", prep)
    records: dict[str, list[dict[str, Any]]] = {"trl": [], **{s.name: [] for s in sides}}

    class Alternate(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            gen.clear()
            prep.clear()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            records["trl"].append(_trl_record(state.global_step, time.perf_counter() - self.start,
                                              sum(gen), sum(prep)))
            progress(f"round {state.global_step}/{rounds} trl: step "
                     f"{records['trl'][-1]['time_step']:.1f}s (generate {sum(gen):.1f}s)")
            for side in sides:  # outside TRL's step timing
                records[side.name].append(side.step())
                rec = records[side.name][-1]
                progress(f"round {state.global_step}/{rounds} {side.name}: step "
                         f"{rec['time_step']:.1f}s (rollout {rec.get('time_rollout', 0):.1f}s, "
                         f"train {rec.get('time_train', 0):.1f}s)")

        def on_log(self, args, state, control, logs=None, **kw):  # after on_step_end
            if logs and "completions/mean_length" in logs and records["trl"]:
                batch = args.per_device_train_batch_size
                records["trl"][-1]["step_tokens"] = logs["completions/mean_length"] * batch
                records["trl"][-1]["zero_var_frac"] = logs.get("frac_reward_zero_std")

    trainer.add_callback(Alternate())
    try:
        trainer.train()
    finally:
        for s in sides:
            s.close()
    kept = {name: recs[warmup:] for name, recs in records.items()}
    import trl

    result = summarise_steps(str(path), kept)
    result["trl"] = {"version": trl.__version__, "bf16": trainer.args.bf16,
                     "gradient_checkpointing": trainer.args.gradient_checkpointing,
                     "options": dict(trl_options or {})}
    return result


def _trl_record(step: int, seconds: float, generate: float, prepare: float) -> dict[str, Any]:
    """A TRL step in the shape of a rollwise step record (time_* phases)."""
    return {"step": step, "time_step": seconds, "time_rollout": generate,
            "time_reward": max(prepare - generate, 0.0), "time_train": max(seconds - prepare, 0.0),
            "time_other": 0.0}
