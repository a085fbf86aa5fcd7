"""End-to-end: the tiny model trains, resumes exactly, and survives bad input.

These build the real stages from a config (the warm-started tiny model is cached on disk
after the first test that needs it) and run the real driver.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollwise.compose.config import load_config, to_toml
from rollwise.learner.checkpoint import list_checkpoints
from rollwise.pipeline.build import build
from rollwise.pipeline.loop import train
from rollwise.replay import TrajectoryStore
from rollwise.run.rundir import Run

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"


def small(tmp_path: Path, *extra: str):
    """The tiny_arith config, shortened for tests."""
    return load_config(CONFIG, [f"run.output_dir='{tmp_path}'", "run.num_steps=4",
                                "run.threads=1",  # tiny matmuls: a 2nd thread only costs
                                "rollout.prompts_per_step=4", "task.num_eval=40",
                                "eval.every=0", *extra])


def run_dir(cfg, name: str | None = None) -> Path:
    return Path(cfg.run.output_dir) / (name or cfg.run.name)


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_training_raises_reward_and_changes_parameters(tmp_path):
    cfg = small(tmp_path, "run.num_steps=60", "rollout.prompts_per_step=16", "task.num_eval=200")
    stages = build(cfg)
    before = params(stages.model)
    run = Run(run_dir(cfg), resume=False, config_toml=to_toml(cfg), echo=lambda s: None)
    summary = train(stages, run, 60)
    after = params(stages.model)
    changed = sum(not torch.equal(before[n], after[n]) for n in before)
    assert changed == len(before), "every parameter should move under full fine-tuning"
    records = [json.loads(x) for x in (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records if r["kind"] == "train"]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.05, f"mean reward did not rise: {first:.3f} -> {last:.3f}"
    acc_before = summary["eval_before"]["accuracy"]
    acc_after = summary["eval_after"]["accuracy"]
    assert acc_after > acc_before + 0.05, f"held-out accuracy {acc_before} -> {acc_after}"
    for name in ("config.toml", "summary.json", "report.html", "trajectories.sqlite"):
        assert (run_dir(cfg) / name).is_file()
    saved = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert saved["eval_after"]["accuracy"] == acc_after and saved["train_seconds"] > 0
    # memory: each step's peak resident set and its phases', the run's in the summary
    steps = [r for r in records if r["kind"] == "train"]
    assert all(r["peak_rss_mb"] >= r["peak_rss_train_mb"] > 0 for r in steps)
    assert saved["peak_rss_mb"] >= max(r["peak_rss_mb"] for r in steps)
    assert load_config(run_dir(cfg) / "config.toml") == cfg  # the resolved config


def test_resume_continues_exactly(tmp_path):
    straight = small(tmp_path, "run.name='straight'")
    stages = build(straight)
    train(stages, Run(run_dir(straight), resume=False, echo=lambda s: None), 4, eval_before=False)
    expected = params(stages.model)

    cut = small(tmp_path, "run.name='cut'")
    first = build(cut)
    train(first, Run(run_dir(cut), resume=False, echo=lambda s: None), 2, eval_before=False)
    second = build(cut)  # a fresh process would rebuild everything the same way
    run = Run(run_dir(cut), resume=True, echo=lambda s: None)
    train(second, run, 4, eval_before=False)
    got = params(second.model)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=0, atol=1e-6, msg=n)

    def rewards(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["reward_mean"] for x in lines if '"train"' in x]

    assert rewards("cut") == rewards("straight")
    store = TrajectoryStore(run_dir(cut) / "trajectories.sqlite")
    assert store.steps() == [1, 2, 3, 4]  # no completed trajectory lost, none duplicated
    assert store.count() == 4 * 4 * 8


def test_ctrl_c_checkpoints_last_completed_step(tmp_path):
    cfg = small(tmp_path)
    stages = build(cfg)
    real_update = stages.update
    calls = []

    def interrupting_update(batch):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_update(batch)

    stages.update = interrupting_update
    run = Run(run_dir(cfg), resume=False, echo=lambda s: None)
    with pytest.raises(KeyboardInterrupt):
        train(stages, run, 4, eval_before=False)
    found = list_checkpoints(run_dir(cfg) / "checkpoints")
    assert [p.name for p in found] == ["step_2"]
    summary = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert summary["interrupted_at_step"] == 2
    resumed = build(cfg)
    out = train(resumed, Run(run_dir(cfg), resume=True, echo=lambda s: None), 4, eval_before=False)
    assert out["steps"] == 4 and out["rollouts"] == 4 * 4 * 8


def _train_rewards(path: Path) -> list[float]:
    return [r["reward_mean"] for r in map(json.loads, (path / "metrics.jsonl").read_text()
                                          .splitlines()) if r["kind"] == "train"]


def test_ctrl_c_during_rollout_then_resume_equals_the_uninterrupted_run(tmp_path):
    """Regression: the Ctrl-C checkpoint was written after the interrupted step had drawn
    its prompts and advanced the RNG, so the resumed run skipped a batch."""
    straight = small(tmp_path, "run.name='straight'")
    stages = build(straight)
    train(stages, Run(run_dir(straight), resume=False, echo=lambda s: None), 4,
          eval_before=False)
    expected = params(stages.model)

    cut = small(tmp_path, "run.name='cut'")
    first = build(cut)
    real_rollout, calls = first.rollout, []

    def interrupting_rollout(requests):  # step 3 has drawn its prompts: now Ctrl-C
        calls.append(1)
        if len(calls) == 3:
            torch.rand(7)  # ... and the RNG has moved on
            raise KeyboardInterrupt
        return real_rollout(requests)

    first.rollout = interrupting_rollout
    with pytest.raises(KeyboardInterrupt):
        train(first, Run(run_dir(cut), resume=False, echo=lambda s: None), 4, eval_before=False)
    assert [p.name for p in list_checkpoints(run_dir(cut) / "checkpoints")] == ["step_2"]
    second = build(cut)
    train(second, Run(run_dir(cut), resume=True, echo=lambda s: None), 4, eval_before=False)
    assert _train_rewards(run_dir(cut)) == _train_rewards(run_dir(straight))
    got = params(second.model)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=0, atol=1e-6, msg=n)
    assert TrajectoryStore(run_dir(cut) / "trajectories.sqlite").count() == 4 * 4 * 8


def test_nan_loss_skips_the_update_and_is_counted(tmp_path):
    cfg = small(tmp_path, "run.num_steps=3")
    stages = build(cfg)
    real = stages.advantage_fn
    calls = []

    def nan_on_second(rewards, group_ids):
        calls.append(1)
        adv = real(rewards, group_ids)
        return adv * float("nan") if len(calls) == 2 else adv

    stages.advantage_fn = nan_on_second
    snapshots = []
    real_update = stages.update
    stages.update = lambda b: (snapshots.append(params(stages.model)), real_update(b))[1]
    train(stages, Run(run_dir(cfg), resume=False, echo=lambda s: None), 3, eval_before=False)
    records = [json.loads(x) for x in (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in records if r["kind"] == "train"]
    assert [r["skipped_nonfinite"] for r in train_recs] == [0.0, 1.0, 0.0]
    assert stages.learner.nan_skips == 1
    # the skipped step left the weights exactly as they were (snapshot before step 3's update)
    for n, p in snapshots[1].items():
        assert torch.equal(p, snapshots[2][n])


def test_over_long_prompts_are_skipped_and_counted(tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(30)]
    rows += [{"prompt": "1+" * 40 + "1=", "answer": "41"} for _ in range(3)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = small(tmp_path, "task.name='file'", f"task.path='{data}'", "task.num_eval=5",
                "task.options={}",
                "rollout.max_prompt_tokens=20")
    stages = build(cfg)
    info = stages.info
    long_in_train = sum(len(s.prompt) > 19 for s in stages.task.train)
    long_in_eval = sum(len(s.prompt) > 19 for s in stages.task.eval)
    assert long_in_train + long_in_eval == 3
    assert info.skipped_train_prompts == long_in_train
    assert info.skipped_eval_prompts == long_in_eval
    assert all(len(ids) <= 20 for _, ids in stages.sampler.items)


def test_lora_training_moves_only_adapters(tmp_path):
    cfg = small(tmp_path, "model.lora_rank=4", "algorithm.kl_coef=0.05", "run.num_steps=3")
    stages = build(cfg)
    before = params(stages.model)
    train(stages, Run(run_dir(cfg), resume=False, echo=lambda s: None), 3, eval_before=False)
    after = params(stages.model)
    lora = [n for n in before if "lora_" in n]
    assert lora and all(stages.model.get_parameter(n).requires_grad for n in lora)
    assert all(torch.equal(before[n], after[n]) for n in before if n not in lora)
    assert any(not torch.equal(before[n], after[n]) for n in lora if "lora_B" in n)
    records = [json.loads(x) for x in (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]
    kls = [r["kl"] for r in records if r["kind"] == "train"]
    assert kls[0] == pytest.approx(0.0, abs=1e-6)  # adapters start at zero: policy == reference
    assert all(k >= 0 for k in kls) and kls[-1] > 0
