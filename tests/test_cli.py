"""The command line as a user runs it: `python -m rollwise ...` in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
ENV = {**os.environ, "ROLLWISE_NO_PROGRESS": "1", "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
QUICK = ["--set", "run.num_steps=3", "--set", "rollout.prompts_per_step=4",
         "--set", "run.threads=1", "--set", "task.num_eval=20", "--set", "eval.every=0"]


def rollwise(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollwise", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=600, check=False)


def test_train_writes_the_run_directory_and_a_summary_line(tmp_path):
    out = rollwise("train", str(ROOT / "configs/tiny_arith.toml"), *QUICK, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) == 3
    done = [line for line in lines if line.startswith("done:")]
    assert len(done) == 1 and "->" in done[0] and "runs/tiny_arith" in done[0]
    summary = json.loads((tmp_path / "runs/tiny_arith/summary.json").read_text())
    assert 0 <= summary["eval_before"]["accuracy"] <= 1
    assert 0 <= summary["eval_after"]["accuracy"] <= 1
    assert summary["train_seconds"] > 0 and summary["steps"] == 3
    assert summary["rollouts"] == 3 * 4 * 8
    # a second run of the same name never overwrites the first
    again = rollwise("train", str(ROOT / "configs/tiny_arith.toml"), *QUICK,
                     "--set", "eval.before=false", cwd=tmp_path)
    assert again.returncode == 0 and (tmp_path / "runs/tiny_arith-2/summary.json").is_file()
    report = rollwise("report", "runs/tiny_arith", cwd=tmp_path)
    assert report.returncode == 0
    assert "<img" in (tmp_path / "runs/tiny_arith/report.html").read_text()


def test_config_typo_is_a_clear_error(tmp_path):
    out = rollwise("train", str(ROOT / "configs/tiny_arith.toml"), "--set", "learner.lrr=1",
                   cwd=tmp_path)
    assert out.returncode == 2
    text = " ".join(out.stdout.split())
    assert "unknown key 'learner.lrr'" in text and "did you mean 'learner.lr'" in text
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # `make test` stays within 8 minutes on 2 cores
def test_ctrl_c_checkpoints_and_resume_finishes(tmp_path):
    args = [sys.executable, "-m", "rollwise", "train", str(ROOT / "configs/tiny_arith.toml"),
            *QUICK, "--set", "run.num_steps=200", "--set", "eval.before=false"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    deadline = time.time() + 300
    for line in proc.stdout:  # wait for the second completed step, then press Ctrl-C
        seen.append(line)
        if line.startswith("step 2/") or time.time() > deadline:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, "".join(seen) + rest
    run = tmp_path / "runs/tiny_arith"
    summary = json.loads((run / "summary.json").read_text())
    step = summary["interrupted_at_step"]
    assert step >= 2 and (run / f"checkpoints/step_{step}/model.safetensors").is_file()
    out = rollwise("train", "--resume", str(run), "--set", "run.num_steps=" + str(step + 1),
                   cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:]
    assert f"step {step + 1}/{step + 1}" in out.stdout
    final = json.loads((run / "summary.json").read_text())
    assert final["steps"] == step + 1 and final["rollouts"] == (step + 1) * 4 * 8


@pytest.mark.slow
def test_quickstart_config_loads_smollm2_and_evaluates(tmp_path):
    out = rollwise("eval", str(ROOT / "configs/quickstart.toml"), "--set", "task.num_eval=8",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert result["num_prompts"] == 8 and 0 <= result["accuracy"] <= 1
