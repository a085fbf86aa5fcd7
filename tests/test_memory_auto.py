"""`run.memory = "auto"` (issue 41, item 7): when less memory is free at start than the
run's expected peak, the low-memory settings of docs/performance.md replace the defaults of
the keys the config leaves unset, and the run header says so; explicit settings win.

Free memory is faked with $ROLLWISE_FREE_MEMORY_MB (conftest.py sets 1 TiB for the whole
suite); nothing here loads SmolLM2: its shape is known without it."""

from __future__ import annotations

import json
from pathlib import Path

import rollwise
from rollwise.compose.config import load_config, to_toml
from rollwise.compose.memory import (
    FREE_ENV,
    LOW,
    RUNTIME_MB,
    choose_memory,
    expected_peak_mb,
    free_mb,
    model_shape,
    parameters,
)
from rollwise.compose.preflight import check_config

CONFIGS = Path(__file__).parents[1] / "configs"
QUICKSTART = CONFIGS / "quickstart.toml"
# The quickstart as docs/performance.md measured it: a bf16-autocast learner (a CPU with
# native bfloat16); set here because the suite's `auto` precision means float32.
AUTOCAST = ["learner.precision='bf16-autocast'"]
GB = 1e9 / 2**20  # MiB in a decimal gigabyte, as the docs' peaks are written


def quickstart(*overrides: str):
    return load_config(QUICKSTART, [*AUTOCAST, *overrides])


def learner_values(cfg) -> dict:
    return {key: getattr(cfg.learner, key.split(".")[1]) for key in LOW}


def test_low_memory_settings_from_a_faked_free_memory_figure(monkeypatch):
    monkeypatch.setenv(FREE_ENV, "2048")  # 2 GiB free: below the quickstart's peak
    assert free_mb() == 2048
    cfg = quickstart()
    low, choice = choose_memory(cfg)
    assert choice.choice == "low" and choice.applied == LOW and not choice.kept
    assert learner_values(low) == LOW
    assert learner_values(cfg) == {  # the config given: as it was
        "learner.master_dtype": "float32", "learner.optimizer": "adamw",
        "learner.activation_checkpointing": False, "learner.release_memory": False}
    line = choice.line()
    assert line.startswith(f"memory: 2.0 GiB free < {choice.expected_mb / 1024:.1f} GiB "
                           "expected peak -> low-memory settings (learner.master_dtype="
                           "bfloat16, learner.optimizer=adamw-bf16, "
                           "learner.activation_checkpointing=true, "
                           "learner.release_memory=true; expected peak")
    assert line.endswith("run.memory = 'default' keeps the defaults")
    record = choice.record()
    assert record["choice"] == "low" and record["free_mb"] == 2048
    assert record["expected_mb"] > record["low_mb"] and record["applied"] == LOW
    check_config(low)  # preflight takes the settings it produced
    assert 'master_dtype = "bfloat16"' in to_toml(low)  # config.toml keeps what ran


def test_an_explicit_setting_wins_and_the_others_switch(monkeypatch):
    monkeypatch.setenv(FREE_ENV, "2048")
    low, choice = choose_memory(quickstart("learner.activation_checkpointing=false"))
    assert low.learner.activation_checkpointing is False
    assert (low.learner.master_dtype, low.learner.optimizer,
            low.learner.release_memory) == ("bfloat16", "adamw-bf16", True)
    assert choice.kept == {"learner.activation_checkpointing": False}
    assert "learner.activation_checkpointing" not in choice.applied
    assert "; as set: learner.activation_checkpointing=false" in choice.line()
    # an explicit value equal to the low one is neither applied nor listed as kept
    _, same = choose_memory(quickstart("learner.release_memory=true"))
    assert "learner.release_memory" not in same.applied and not same.kept
    # run.memory itself: 'default' keeps the defaults, 'low' takes them with memory to spare
    cfg = quickstart("run.memory='default'")
    kept, choice = choose_memory(cfg)
    assert kept is cfg and choice.choice == "default" and choice.line() is None
    monkeypatch.setenv(FREE_ENV, str(2**20))
    low, choice = choose_memory(quickstart("run.memory='low'"))
    assert learner_values(low) == LOW
    assert choice.line().startswith("memory: run.memory = 'low' -> low-memory settings (")


def test_plenty_of_free_memory_keeps_the_defaults(monkeypatch):
    monkeypatch.setenv(FREE_ENV, str(64 * 1024))
    cfg = quickstart()
    same, choice = choose_memory(cfg)
    assert same is cfg and choice.choice == "default" and choice.line() is None
    assert choice.record()["free_mb"] == 64 * 1024 and not choice.record()["applied"]
    # the suite's own runs: the tiny model expects well under 1 GiB, CI has 24
    tiny = load_config(CONFIGS / "tiny_arith.toml")
    assert expected_peak_mb(tiny, model_shape(tiny), autocast=False) < 1024
    # memory not measured (another device, or no figure): the defaults stay
    gpu = load_config(QUICKSTART, ["run.device='cuda'"])
    monkeypatch.setenv(FREE_ENV, "1")
    assert choose_memory(gpu)[1].choice == "default"


def test_the_smollm2_estimate_lies_between_the_documented_peaks():
    """The quickstart's estimate, with its defaults and with the low-memory settings,
    against bounds computed from SmolLM2-135M's parameter count (and the documented peaks:
    5.10 GB with the defaults over 3 steps, 2.25-2.7 GB with the low-memory settings)."""
    shape = model_shape(quickstart())
    listed = json.loads((CONFIGS / "shapes" / "smollm2-135m.json").read_text())
    assert {k: listed[k] for k in shape} == shape  # the same model as `bench memory` builds
    p = parameters(shape)
    assert 134e6 < p < 135e6  # "135M parameters"
    mib = p / 2**20  # MiB a byte per parameter takes
    default = expected_peak_mb(quickstart(), shape, autocast=True)
    low_cfg, _ = choose_memory(quickstart("run.memory='low'"))
    low = expected_peak_mb(low_cfg, shape, autocast=True)
    # the defaults: float32 weights, gradients and AdamW's moments (16 bytes a parameter),
    # the engine's and autocast's bfloat16 copies (4) and the runtime, before activations;
    # within the measured region (5.10 GB over 3 steps; a step may train every row)
    assert default > RUNTIME_MB + 20 * mib
    assert 5.10 * GB * 0.9 < default < 6.3 * GB
    # low: bfloat16 weights and gradients (2 + 2) and moments (4), checkpointed activations
    assert RUNTIME_MB + 8 * mib < low < RUNTIME_MB + 8 * mib + 1024
    assert 2.25 * GB * 0.9 < low < 2.7 * GB * 1.1
    assert low < default / 2  # "less than half the quickstart's peak"


def test_a_setting_that_cannot_apply_is_skipped_and_said(monkeypatch):
    monkeypatch.setenv(FREE_ENV, "1024")
    # a float32 learner: bfloat16 weights would make its residual stream bfloat16 too
    low, choice = choose_memory(load_config(QUICKSTART, ["learner.precision='float32'"]))
    assert low.learner.master_dtype == "float32" and "learner.master_dtype" in choice.skipped
    assert low.learner.optimizer == "adamw-bf16" and low.learner.activation_checkpointing
    assert "not applied: learner.master_dtype (the learner computes in float32" in choice.line()
    # LoRA: the adapters' moments are small, the frozen weights' dtype is learner.master_dtype
    low, choice = choose_memory(quickstart("model.lora_rank=8"))
    assert set(choice.skipped) == {"learner.master_dtype", "learner.optimizer"}
    assert low.learner.activation_checkpointing and low.learner.release_memory
    # what preflight refuses is never produced: compensated rounding takes the optimizer
    low, _ = choose_memory(quickstart("learner.master_rounding='compensated'"))
    check_config(low)
    low, _ = choose_memory(quickstart("learner.optimizer='adamw8bit'"))
    assert low.learner.optimizer == "adamw8bit"
    check_config(low)


def test_a_resumed_run_keeps_the_choice_of_its_first_start(monkeypatch):
    monkeypatch.setenv(FREE_ENV, "2048")
    _, first = choose_memory(quickstart())
    monkeypatch.setenv(FREE_ENV, str(2**20))  # memory to spare now: the run's choice holds
    again, choice = choose_memory(quickstart(), resumed=first.record())
    assert learner_values(again) == LOW and choice.resumed
    assert choice.line().startswith("memory: as the run started -> low-memory settings (")
    assert choice.record()["applied"] == LOW and choice.record()["free_mb"] == 2048
    # resumed from its config.toml, every key is set there: nothing left to apply
    from_file = load_config(None, [f"learner.{k.split('.')[1]}={json.dumps(v)}"
                                   for k, v in LOW.items()] + AUTOCAST)
    again, choice = choose_memory(from_file, resumed=first.record())
    assert learner_values(again) == LOW and choice.line() is None
    assert choice.record()["applied"] == LOW  # kept for the next resume
    # a run from before run.memory (no record) keeps its defaults whatever is free
    monkeypatch.setenv(FREE_ENV, "1")
    cfg = quickstart()
    assert choose_memory(cfg, resumed={})[0] is cfg


def test_a_run_takes_the_low_memory_settings_and_says_so(tmp_path, monkeypatch):
    """End to end on the tiny model (its float32 learner keeps float32 weights): the header
    line, the settings trained with, config.toml and summary.json."""
    monkeypatch.setenv(FREE_ENV, "64")
    monkeypatch.setenv("ROLLWISE_NO_PROGRESS", "1")
    lines: list[str] = []
    overrides = [f"run.output_dir='{tmp_path}'", "run.threads=1", "rollout.prompts_per_step=2",
                 "rollout.group_size=4", "task.num_eval=4", "eval.before=false",
                 "learner.release_memory=false"]
    summary = rollwise.train(CONFIGS / "tiny_arith.toml", echo=lines.append,
                             overrides=[*overrides, "run.num_steps=1"])
    [line] = [x for x in lines if x.startswith("memory: ")]
    assert line.startswith("memory: 0.1 GiB free < ") and "more than is free" in line
    assert ("(learner.optimizer=adamw-bf16, learner.activation_checkpointing=true;" in line
            and "as set: learner.release_memory=false" in line)
    record = summary["memory"]
    assert record["choice"] == "low" and record["free_mb"] == 64
    assert record["skipped"].keys() == {"learner.master_dtype"}
    root = Path(summary["run_dir"])
    written = load_config(root / "config.toml")
    assert (written.learner.optimizer, written.learner.activation_checkpointing,
            written.learner.release_memory, written.learner.master_dtype) == (
        "adamw-bf16", True, False, "float32")
    assert json.loads((root / "run.json").read_text())["memory"]["applied"] == {
        "learner.optimizer": "adamw-bf16", "learner.activation_checkpointing": True}
    assert summary["steps"] == 1
    # resumed with memory to spare, from the same config: the run's settings, not refused
    monkeypatch.setenv(FREE_ENV, str(2**20))
    lines.clear()
    again = rollwise.train(CONFIGS / "tiny_arith.toml", echo=lines.append, resume=True,
                           overrides=[*overrides, "run.num_steps=2"])
    assert again["steps"] == 2 and again["memory"]["applied"] == record["applied"]
    assert any(x.startswith("memory: as the run started -> low-memory settings (learner."
                            "optimizer=adamw-bf16") for x in lines), lines
