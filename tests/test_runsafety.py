"""Run directories: no pickle in checkpoints, one writer at a time, atomic files, checks that
come before the model loads, and a health check that stops runs which learn nothing."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollwise.compose.config import ConfigError, load_config
from rollwise.compose.preflight import check_config
from rollwise.learner.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from rollwise.pipeline.build import build
from rollwise.pipeline.loop import train
from rollwise.replay import TrajectoryStore
from rollwise.rewards import RewardPool, RewardSpec
from rollwise.run.health import HealthCheck, RunUnhealthy, step_problems
from rollwise.run.rundir import Run
from rollwise.system.atomic import atomic_write_text
from rollwise.system.runlock import RunLock, RunLockedError

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"


def small(tmp_path: Path, *extra: str):
    return load_config(CONFIG, [f"run.output_dir='{tmp_path}'", "run.num_steps=4",
                                "run.threads=1", "rollout.prompts_per_step=4",
                                "task.num_eval=20", "eval.every=0", *extra])


def quiet(root: Path, **kw) -> Run:
    return Run(root, echo=lambda s: None, **kw)


# -- checkpoints without pickle ----------------------------------------------------------

def test_checkpoint_is_safetensors_and_json_and_round_trips(tmp_path, tiny_llama):
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    state = {"optimizer": opt.state_dict(), "nan_skips": 2}
    torch.manual_seed(5)
    path = save_checkpoint(tmp_path, model, state, {"step": 3})
    expected = torch.rand(4)
    assert sorted(p.name for p in path.iterdir()) == [
        "model.safetensors", "optimizer.json", "optimizer.safetensors", "rng.json",
        "rng.safetensors", "state.json"]
    torch.manual_seed(99)
    learner_state, run_state = load_checkpoint(path, model)
    assert torch.equal(torch.rand(4), expected)  # the RNG came back
    assert run_state == {"step": 3} and learner_state["nan_skips"] == 2
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(learner_state["optimizer"])  # int keys, tuples and tensors intact
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(fresh.state_dict()["state"][0][k], v)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {Path.cwd() / 'PWNED'}",))


def test_a_planted_pickle_in_an_old_checkpoint_is_refused_not_run(tmp_path, tiny_llama,
                                                                   monkeypatch):
    """Regression: rng.pt / optimizer.pt were read with torch.load(weights_only=False), so
    `rollwise eval DIR` on someone else's run directory ran their code."""
    monkeypatch.chdir(tmp_path)
    model = tiny_llama()
    path = save_checkpoint(tmp_path / "ck", model, {}, {"step": 1})
    (path / "rng.json").unlink()
    (path / "rng.pt").write_bytes(pickle.dumps({"torch": _Payload()}))
    with pytest.raises(ValueError, match="refused to load"):
        load_checkpoint(path, model)
    assert not (tmp_path / "PWNED").exists()


def test_checkpoints_keep_the_last_n_and_a_failed_write_leaves_the_previous(tmp_path,
                                                                            tiny_llama,
                                                                            monkeypatch):
    model = tiny_llama()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, model, {}, {"step": step}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_3"]

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("rollwise.learner.checkpoint.save_tree", full_disk)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, model, {}, {"step": 4}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_3"]
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())
    load_checkpoint(tmp_path / "step_3", model)  # still whole


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    atomic_write_text(target, "old")

    def broken(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", broken)
    with pytest.raises(OSError):
        atomic_write_text(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == [target.name]


# -- the run-directory lock --------------------------------------------------------------

def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path):
    first = RunLock(tmp_path / "r")
    with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
        RunLock(tmp_path / "r")
    first.release()
    RunLock(tmp_path / "r").release()  # free again once released


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    code = ("import sys, time; from rollwise.system.runlock import RunLock; "
            f"lock = RunLock({str(tmp_path / 'r')!r}); print('locked', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(RunLockedError, match=f"pid {proc.pid}"):
        RunLock(tmp_path / "r")
    proc.kill()
    proc.wait()
    lock = RunLock(tmp_path / "r")  # the dead holder's lock file is simply taken over
    assert (tmp_path / "r/.lock").read_text().startswith(f"pid {os.getpid()}")
    lock.release()


# -- checks before the model loads -------------------------------------------------------

@pytest.mark.parametrize(("override", "key"), [
    ("eval.max_tokens=-5", "eval.max_tokens"),
    ("eval.num_prompts=-1", "eval.num_prompts"),
    ("learner.lr=1e40", "learner.lr"),
    ("run.name='../x'", "run.name"),
    ("run.name='/tmp/x'", "run.name"),
    ("algorithm.advantage='grpoo'", "algorithm.advantage"),
    ("algorithm.loss='ppoo'", "algorithm.loss"),
    ("task.rewards={ correct = 1.0, fromat = 0.1 }", "task.rewards.fromat"),
    ("task.name='arihm'", "task.name"),
    ("model.name='no/such/dir'", "model.name"),
    ("task.num_train=2", "task.num_train"),
    ("run.device='cuda:7'", "run.device"),
    ("run.device='tpu'", "run.device"),
    ("rollout.group_size=1", "rollout.group_size"),
])
def test_bad_values_are_named_before_any_model_loads(tmp_path, override, key, monkeypatch):
    import rollwise.pipeline.build

    monkeypatch.setattr(rollwise.pipeline.build, "build_policy",
                        lambda *a: pytest.fail("model loaded"))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build(load_config(CONFIG, [override]))


def test_check_config_passes_the_shipped_configs():
    check_config(load_config(CONFIG))


# -- health ------------------------------------------------------------------------------

def test_step_problems_names_each_way_a_step_can_learn_nothing():
    ok = {"step_rollouts": 8, "reward_errors": 0, "groups_kept": 2, "rows_trained": 8.0,
          "loss": 0.1, "kl": 0.01, "skipped_nonfinite": 0.0}
    assert step_problems(ok) == []
    assert step_problems(ok | {"reward_errors": 5, "reward_timeouts": 3}) == [
        "every reward call failed (8 of 8)"]
    assert step_problems(ok | {"skipped_nonfinite": 1.0})[0].startswith("update skipped")
    assert step_problems(ok | {"rows_trained": 0.0})[0].startswith("no learning signal")
    assert step_problems(ok | {"loss": 5e3}) == ["loss diverging (5e+03)"]
    assert step_problems(ok | {"kl": 50.0}, max_kl=20.0) == ["KL diverging (50)"]
    assert step_problems(ok | {"kl": 50.0}, max_kl=100.0) == []
    check = HealthCheck(patience=2)
    check.observe(ok | {"loss": float("inf")})
    assert check.verdict() is None
    check.observe(ok | {"loss": float("inf")})
    assert "2 steps in a row" in check.verdict()


def _always_fails(text, sample):
    raise RuntimeError("verifier bug")


def test_a_run_whose_every_reward_fails_stops_with_the_reason(tmp_path):
    """Regression: every reward erroring used to end with 'done' and exit 0."""
    cfg = small(tmp_path, "run.num_steps=10")
    stages = build(cfg)
    stages.rollout_stage.scorer = RewardPool([RewardSpec("correct", _always_fails)]).score
    lines = []
    run = Run(tmp_path / "r", resume=False, echo=lines.append, health=HealthCheck(patience=3))
    with pytest.raises(RunUnhealthy, match="every reward call failed"):
        train(stages, run, 10, eval_before=False)
    steps = [x for x in lines if x.startswith("step ")]
    assert len(steps) == 3 and all("WARNING: every reward call failed" in x for x in steps)
    summary = json.loads((tmp_path / "r/summary.json").read_text())
    assert summary["stopped"].startswith("stopped: 3 steps") and summary["steps"] == 3
    assert [p.name for p in list_checkpoints(tmp_path / "r/checkpoints")] == ["step_3"]
    RunLock(tmp_path / "r").release()  # the stopped run released its directory


# -- resume bookkeeping ------------------------------------------------------------------

def test_resume_without_a_checkpoint_does_not_evaluate_before_twice(tmp_path):
    """Regression: --resume of a run killed before its first checkpoint started again at
    step 0 and wrote a second 'before' evaluation into metrics.jsonl."""
    cfg = small(tmp_path, "run.num_steps=2")
    stages = build(cfg)
    run = quiet(tmp_path / "r", resume=False)
    run.record_eval(0, stages.evaluate(), before=True)  # ... then the process died
    run.close()
    train(build(cfg), quiet(tmp_path / "r", resume=True), 2)
    records = [json.loads(x) for x in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [
        ("eval", 0), ("train", 1), ("train", 2), ("eval", 2)]


def test_periodic_checkpoints_let_a_killed_run_resume(tmp_path):
    cfg = small(tmp_path, "run.num_steps=4")
    stages = build(cfg)
    run = quiet(tmp_path / "r", resume=False)
    from rollwise.pipeline.loop import train_step

    run.resume(stages)
    for step in range(3):  # three steps with checkpoint_every = 2, then "kill -9"
        train_step(stages, run, step, 4)
        run.maybe_checkpoint(step + 1, stages, every=2)
    run.close()
    assert [p.name for p in list_checkpoints(tmp_path / "r/checkpoints")] == ["step_2"]
    out = train(build(cfg), quiet(tmp_path / "r", resume=True), 4, eval_before=False)
    assert out["steps"] == 4 and out["rollouts"] == 4 * 4 * 8
    assert TrajectoryStore(tmp_path / "r/trajectories.sqlite").steps() == [1, 2, 3, 4]


def test_checkpoints_are_on_by_default():
    cfg = load_config(None)
    assert cfg.run.checkpoint_every > 0 and cfg.run.checkpoint_minutes > 0
    assert cfg.run.keep_checkpoints == 2


def test_non_utf8_bytes_in_a_data_file_name_the_file_and_line(tmp_path):
    """Regression: the error named neither the file nor the line."""
    from rollwise.tasks import DatasetError, load_samples

    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": 1}\n')
    with pytest.raises(DatasetError, match=rf"{data}:2: not UTF-8 text \(byte 15"):
        load_samples(data)
