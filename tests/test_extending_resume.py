"""Users' own code, all the way (issue 25): a run that plugs in code of its own (by import
path or as Python objects; verifiers, group terms, estimators, allocators, engines) resumes
exactly, is refused where its code would silently go missing, shows each reward term, and
fails before the model loads when an option does not fit."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import rollwise
from crashtest import read_run
from rollwise.cli import app
from rollwise.compose.config import ConfigError, load_config, to_toml
from rollwise.control import Request
from rollwise.types import Sample

CONFIG = str(Path(__file__).parents[1] / "configs" / "tiny_arith.toml")
HERE = __name__  # the import path of this module's functions
TINY = ["run.threads=1", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "task.num_eval=4", "eval.every=0", "eval.before=false", "run.checkpoint_every=1"]


def brief(completion: str, sample: Sample) -> float:
    """A user's verifier: 1 for answers of at most 6 characters."""
    return 1.0 if len(completion) <= 6 else 0.0


@rollwise.group_reward
def token_penalty(trajectories, *, limit: int, scale: float = 1.0) -> list[float]:
    """A user's group term: minus `scale` per token beyond `limit`, relative to the group."""
    return [-scale * max(t.num_tokens - limit, 0) / 10 for t in trajectories]


@rollwise.algos.uses("lengths")
def centered(rewards: torch.Tensor, group_ids: torch.Tensor, *, lengths: torch.Tensor,
             scale: float = 1.0) -> torch.Tensor:
    """A user's advantage estimator: the reward minus its group's mean, times `scale`, over
    the square root of the response length (`lengths`, an input it declares; a keyword
    without a default, which the signature check once refused)."""
    groups = int(group_ids.max()) + 1
    sums = torch.zeros(groups).index_add_(0, group_ids, rewards)
    counts = torch.zeros(groups).index_add_(0, group_ids, torch.ones_like(rewards))
    return scale * (rewards - (sums / counts)[group_ids]) / lengths.clamp(min=1).sqrt()


class HalfEveryOtherStep:
    """A user's allocator: uniform prompts; every `max_rounds`-th step trains on half the
    groups. Its step count is state a resumed run must restore (else the halves shift);
    its constructor takes a control option without a default (once refused)."""

    name = "half_every_other_step"

    def __init__(self, max_rounds: int):
        self.steps, self.every = 0, max_rounds

    def plan(self, ctl):
        self.steps += 1
        return [Request(p, ctl.group_size) for p in ctl.stream(ctl.prompts_per_step)]

    def observe(self, ctl, groups):
        return []

    def train_groups(self, ctl, groups):
        return groups if self.steps % self.every else groups[: len(groups) // 2]

    def max_rollouts(self, ctl):
        return ctl.budget

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


class NoState:
    """A user's allocator without state_dict and load_state_dict (a checkpoint needs them)."""

    name = "no_state"
    plan, observe = HalfEveryOtherStep.plan, HalfEveryOtherStep.observe
    train_groups, max_rollouts = HalfEveryOtherStep.train_groups, HalfEveryOtherStep.max_rollouts


def hf_engine_factory(model, *, eos_token_ids, pad_token_id, batch_size):
    """A user's engine factory: rollwise's HF engine."""
    from rollwise.engine import hf_engine

    return hf_engine(model, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                     batch_size=batch_size)


def crash_in_step_2(root: Path) -> tuple:
    """The finished 2-step run in `root` (its metrics, stored trajectories and summary),
    then `root` as if its process had died in step 2: no step-2 checkpoint, no summary."""
    finished = read_run(root)
    shutil.rmtree(root / "checkpoints/step_2")
    (root / "summary.json").unlink()
    return finished


def cli(*args: str) -> tuple[int, str]:
    out = CliRunner().invoke(app, ["train", *args])
    return out.exit_code, " ".join(out.output.split())


def sets(*items: str) -> list[str]:
    return [x for item in items for x in ("--set", item)]


PLUGINS = {  # one way of plugging in code each, all by import path in the config
    "verifier": [f"task.rewards={{correct = 1.0, '{HERE}:brief' = 0.5}}"],
    "group_term": [f"task.rewards={{correct = 1.0, '{HERE}:token_penalty' = 1.0}}",
                   f"task.reward_options={{'{HERE}:token_penalty' = {{ limit = 6 }} }}"],
    "estimator": [f"algorithm.advantage='{HERE}:centered'",
                  "algorithm.advantage_options={ scale = 2.0 }"],
    "allocator": [f"control.allocator='{HERE}:HalfEveryOtherStep'",
                  "control.allocator_options={max_rounds=2}"],
    "engine": [f"engine.name='{HERE}:hf_engine_factory'"],
}


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_cli_resume_of_a_run_with_code_by_import_path_equals_the_uninterrupted_run(
        tmp_path, monkeypatch, plugin):
    """Regression: config.toml wrote `{ test_x:brief = 0.5 }` unquoted, so --resume failed
    with 'not valid TOML'; each plug-in also keeps its own state across the resume."""
    monkeypatch.setenv("ROLLWISE_NO_PROGRESS", "1")
    code, text = cli(CONFIG, *sets(*TINY, *PLUGINS[plugin], f"run.output_dir='{tmp_path}'",
                                   "run.num_steps=2"))
    assert code == 0, text
    root = tmp_path / "tiny_arith"
    whole = crash_in_step_2(root)
    code, text = cli("--resume", str(root))
    assert code == 0 and "resumed from" in text and "(step 1;" in text, text
    again = read_run(root)
    assert again[0] == whole[0] and again[1] == whole[1]  # metrics; stored trajectories
    assert [r["step"] for r in again[0] if r["kind"] == "train"] == [1, 2]


def test_per_term_metrics_and_stored_advantages(tmp_path):
    """Each reward term's mean and failures reach metrics.jsonl, the loggers' names and the
    report; train accuracy is absent without a `correct` term (not 0.0); the completions
    view shows the advantages the run's estimator gave (stored), not GRPO's."""
    from rollwise.observe.loggers import scalars
    from rollwise.replay import TrajectoryStore

    path = f"{HERE}:brief"
    summary = rollwise.train(CONFIG, echo=None, overrides=[
        f"run.output_dir='{tmp_path}'", *TINY, "run.num_steps=2",
        f"task.rewards={{'{path}' = 1.0}}", f"algorithm.advantage='{HERE}:centered'",
        "algorithm.advantage_options={ scale = 3.0 }"])
    root = Path(summary["run_dir"])
    train = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()
             if '"train"' in x]
    store = TrajectoryStore(root / "trajectories.sqlite")
    for r in train:
        trajs = store.load_step(r["step"])
        assert r["reward_terms"] == {path: pytest.approx(
            sum(t.scores[path] for t in trajs) / len(trajs))}
        assert r["reward_term_errors"] == {path: 0} and "accuracy" not in r
        assert scalars(r)[f"reward_terms/{path}"] == r["reward_terms"][path]
        for g in store.load_groups(r["step"]):
            mean = sum(t.reward for t in g.trajectories) / len(g.trajectories)
            for t in g.trajectories:
                assert t.advantage == pytest.approx(
                    3.0 * (t.reward - mean) / max(t.num_tokens, 1) ** 0.5, rel=1e-5)
    report = (root / "report.html").read_text()
    assert "Reward terms" in report and "the one the update used" in report


def test_per_term_error_counts_and_accuracy_with_a_correct_term():
    from rollwise.run.records import reward_terms
    from rollwise.types import RewardIssue, Trajectory

    def traj(scores, errors=()):
        return Trajectory(Sample("a/0", "1+1=", "2"), [], [], [], [], "stop", scores=scores,
                          reward_errors=[RewardIssue.from_text(e) for e in errors])

    got = reward_terms([
        traj({"correct": 1.0, "m:f": 0.0}, ["m:f: ValueError: bad", "correct: note: slow"]),
        traj({"correct": 0.0, "m:f": 1.0}, ["m:f: timeout after 5s"])])
    assert got == {"accuracy": 0.5, "reward_terms": {"correct": 0.5, "m:f": 0.5},
                   "reward_term_errors": {"correct": 0, "m:f": 2}}


def test_python_objects_resume_from_python_and_the_cli_refuses_without_them(tmp_path,
                                                                             monkeypatch):
    """Regression: `--resume` of a run started with function objects scored the steps after
    it with `correct` alone. Now the CLI refuses, naming them; Python resumes exactly with
    the same functions, a group term among them taking task.reward_options."""
    monkeypatch.setenv("ROLLWISE_NO_PROGRESS", "1")
    over = [*TINY, f"run.output_dir='{tmp_path}'", "run.num_steps=2",
            "task.reward_options={ token_penalty = { limit = 6, scale = 0.5 } }"]
    fns = {"rewards": [brief, token_penalty], "weights": {"brief": 0.5}, "echo": None}
    rollwise.train(CONFIG, **fns, overrides=over)
    root = tmp_path / "tiny_arith"
    whole = crash_in_step_2(root)
    files = sorted(p.name for p in root.iterdir())
    code, text = cli("--resume", str(root))
    assert code == 2 and "started from Python with reward functions" in text, text
    assert f"brief = {HERE}:brief (verifier, weight 0.5)" in text
    assert f"token_penalty = {HERE}:token_penalty (group term, weight 1)" in text
    assert sorted(p.name for p in root.iterdir()) == files
    with pytest.raises(ConfigError, match=r"cannot name: brief = .*:brief \(verifier, weight"):
        rollwise.train(CONFIG, rewards=[token_penalty], echo=None, resume=True, overrides=over)
    rollwise.train(CONFIG, **fns, resume=True, overrides=over)
    again = read_run(root)
    assert again[0] == whole[0] and again[1] == whole[1]
    step2 = next(r for r in again[0] if r.get("step") == 2 and r["kind"] == "train")
    assert set(step2["reward_terms"]) == {"correct", "brief", "token_penalty"}


def test_resume_of_a_finished_run_touches_nothing(tmp_path, monkeypatch):
    """Regression: it said "done" after opening every logger (empty W&B, TensorBoard and
    MLflow runs)."""
    monkeypatch.setenv("ROLLWISE_NO_PROGRESS", "1")
    code, text = cli(CONFIG, *sets(*TINY, f"run.output_dir='{tmp_path}'", "run.num_steps=1"))
    assert code == 0, text
    root = tmp_path / "tiny_arith"
    (root / "config.toml").write_text(to_toml(load_config(root / "config.toml", [
        "run.loggers=['jsonl', 'tensorboard']"])))  # as if it had logged to TensorBoard
    files = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    code, text = cli("--resume", str(root))
    assert code == 0 and f"{root}: run finished at step 1; nothing to do" in text, text
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == files


@pytest.mark.parametrize(("extra", "message"), [
    ([f"task.rewards={{correct = 1.0, '{HERE}:token_penalty' = 1.0}}",
      f"task.reward_options={{'{HERE}:token_penalty' = {{ limt = 6 }} }}"],
     (rf"task.reward_options.{HERE}:token_penalty: group reward '{HERE}:token_penalty': no "
      r"option 'limt' \(did you mean 'limit'\?\); its options: limit, scale")),
    ([f"task.rewards={{correct = 1.0, '{HERE}:token_penalty' = 1.0}}"],
     r"option 'limit' has no default and is not set"),
    (["algorithm.advantage='pass_at_k'", "algorithm.advantage_options={ kk = 4 }"],
     (r"algorithm.advantage_options: advantage estimator 'pass_at_k': no option 'kk' "
      r"\(did you mean 'k'\?\)")),
    ([f"algorithm.advantage='{HERE}:centered'", "algorithm.advantage_options={ mask = 1 }"],
     r"option 'mask' is an input rollwise passes itself"),
    ([f"control.allocator='{HERE}:NoState'"],
     (rf"control.allocator: allocator '{HERE}:NoState' lacks state_dict, load_state_dict; an "
      r"allocator class has a name and the methods plan, observe")),
    (["task.reward_options={ brief = { x = 1 } }"],
     r"task.reward_options.brief: .*'brief' is no reward term"),
])
def test_every_option_is_checked_before_the_model_loads(tmp_path, monkeypatch, extra,
                                                        message):
    """Regression: `{ limt = 6 }` failed at step 1 with a 90-line traceback and a half-written
    run directory; a user allocator without state_dict failed after the model loaded."""
    code, text = cli(CONFIG, *sets(f"run.output_dir='{tmp_path}'", *extra))
    assert code == 2 and len([x for x in text.split("error:") if x.strip()]) == 1, text
    assert re.search(message, text), text
    assert "Traceback" not in text and not (tmp_path / "tiny_arith").exists()


def test_a_group_term_from_python_takes_its_options(tmp_path):
    """Regression: reward_options of a group term passed from Python was refused
    ("'token_penalty' is not one")."""
    from rollwise.api import _reward_terms
    from rollwise.pipeline.build import build

    cfg = load_config(CONFIG, [f"run.output_dir='{tmp_path}'", *TINY,
                               "task.reward_options={ token_penalty = { limit = 2 } }"])
    stages = build(cfg, rewards=_reward_terms(cfg, [token_penalty], {}))
    groups = stages.rollout(stages.select())
    stages.score(groups)
    for t in (t for g in groups for t in g.trajectories):
        assert t.scores["token_penalty"] == -max(t.num_tokens - 2, 0) / 10


def test_a_resumed_run_continues_its_mlflow_and_wandb_runs(tmp_path, monkeypatch):
    """Regression: each --resume started a new MLflow run and a new W&B run of one name;
    MLflow logged no config params."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    import mlflow

    monkeypatch.setenv("ROLLWISE_NO_PROGRESS", "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    code, text = cli(CONFIG, *sets(*TINY, f"run.output_dir='{tmp_path}'", "run.num_steps=2",
                                   "run.loggers=['jsonl', 'mlflow', 'wandb']"))
    assert code == 0, text
    root = tmp_path / "tiny_arith"
    ids = json.loads((root / "run.json").read_text())["loggers"]
    crash_in_step_2(root)
    code, text = cli("--resume", str(root))
    assert code == 0, text
    assert json.loads((root / "run.json").read_text())["loggers"] == ids
    client = mlflow.MlflowClient(tracking_uri=(root / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name("rollwise").experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]]
    history = client.get_metric_history(ids["mlflow"], "reward_mean")
    assert sorted({m.step for m in history}) == [1, 2]
    assert runs[0].data.params["rollout.group_size"] == "4"
    assert runs[0].data.params["task.rewards.correct"] == "1.0"
    offline = sorted(p.name for p in (root / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(ids["wandb"]) for name in offline)
