"""Training on ROLLWISE_TEST_DEVICE (default cpu; scripts/gpu_check.sh sets cuda): a short
tiny run through the same stages as every driver, its checkpoint loaded on the CPU, and a
command's --device refused with one line where this torch cannot use it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollwise.compose.config import load_config, to_toml
from rollwise.learner.checkpoint import load_checkpoint
from rollwise.pipeline.build import build
from rollwise.pipeline.loop import train
from rollwise.run.rundir import Run

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"


@pytest.mark.device
def test_training_on_the_device_and_its_checkpoint_on_the_cpu(tmp_path, test_device):
    cfg = load_config(CONFIG, [f"run.output_dir='{tmp_path}'", "run.num_steps=2",
                               "run.threads=1", "rollout.prompts_per_step=4", "task.num_eval=8",
                               "eval.every=0", f"run.device='{test_device}'"])
    stages = build(cfg)
    model = stages.policy.model
    assert next(model.parameters()).device.type == test_device.type
    before = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    run = Run(tmp_path / cfg.run.name, resume=False, config_toml=to_toml(cfg),
              echo=lambda s: None)
    train(stages, run, cfg.run.num_steps, eval_every=0)
    records = [json.loads(x) for x in
               (tmp_path / cfg.run.name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    assert len(steps) == 2 and all(r["step_tokens"] > 0 for r in steps)
    assert all(("cuda_max_allocated_mb" in r) == (test_device.type == "cuda") for r in steps)
    after = {n: p.detach().cpu() for n, p in model.named_parameters()}
    assert any(not torch.equal(before[n], after[n]) for n in before)  # it learned something
    # the checkpoint written from the device loads into a model on the CPU, exactly
    cpu_cfg = load_config(CONFIG, [f"run.output_dir='{tmp_path / 'cpu'}'", "run.threads=1",
                                   "task.num_eval=8"])
    cpu_model = build(cpu_cfg).policy.model
    checkpoint = max((tmp_path / cfg.run.name / "checkpoints").glob("step_*"))
    load_checkpoint(checkpoint, cpu_model)
    for n, p in cpu_model.named_parameters():
        assert torch.equal(p.detach(), after[n]), n


def test_device_options_fail_with_one_line_where_torch_cannot_use_them():
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA: the refusal is for machines without it")
    out = subprocess.run([sys.executable, "-m", "rollwise", "bench", "rollout", "--device",
                          "cuda"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "--device cuda: CUDA is not available here" in out.stderr
