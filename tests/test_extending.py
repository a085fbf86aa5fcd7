"""Users' own code: reward functions passed to `rollwise.train`, or named by import path in
a config; clear errors when the import fails or the signature does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rollwise
from rollwise.build import build
from rollwise.config import ConfigError, load_config
from rollwise.replay import TrajectoryStore
from rollwise.types import Sample

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
SMALL = ["run.num_steps=2", "run.threads=1", "rollout.prompts_per_step=4", "task.num_eval=8",
         "eval.every=0", "eval.before=false"]


def brief(completion: str, sample: Sample) -> float:
    """A user's verifier: rewards answers of at most 6 characters."""
    return 1.0 if len(completion) <= 6 else 0.0


def two_args_wrong(completion: str) -> float:  # missing the sample
    return 0.0


def _trajectories(root: Path):
    store = TrajectoryStore(root / "trajectories.sqlite")
    return [t for step in (1, 2) for t in store.load_step(step)]


def test_train_with_a_reward_function_from_this_module(tmp_path):
    summary = rollwise.train(CONFIG, rewards=[brief], weights={"brief": 0.5}, echo=None,
                             overrides=[f"run.output_dir='{tmp_path}'", *SMALL])
    root = tmp_path / "tiny_arith"
    trajs = _trajectories(root)
    assert len(trajs) == 2 * 4 * 8 and summary["python_rewards"] == ["brief"]
    for t in trajs:  # scored by the function above, on every rollout, with its weight
        assert t.scores["brief"] == brief(t.text, t.sample)
        assert t.reward == pytest.approx(t.scores["correct"] + 0.5 * t.scores["brief"])
    assert {t.scores["brief"] for t in trajs} == {0.0, 1.0}  # both outcomes occurred
    records = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]


def test_config_names_a_reward_function_by_import_path(tmp_path):
    cfg = load_config(CONFIG, [f"run.output_dir='{tmp_path}'", *SMALL,
                               f"task.rewards={{correct = 1.0, '{__name__}:brief' = 2.0}}"])
    stages = build(cfg)
    groups = stages.rollout(stages.select())
    stages.score(groups)
    t = groups[0].trajectories[0]
    assert t.scores[f"{__name__}:brief"] == brief(t.text, t.sample)
    assert t.reward == t.scores["correct"] + 2.0 * brief(t.text, t.sample)


@pytest.mark.parametrize(("path", "message"), [
    ("no_such_pkg.rewards:brief", r"cannot import 'no_such_pkg.rewards' \(ModuleNotFoundError"),
    (f"{__name__}:nothing_here", "has no attribute 'nothing_here'"),
    (f"{__name__}:two_args_wrong", r"cannot take \(completion, sample\)"),
    (f"{__name__}:SMALL", "is a list, not a function"),
])
def test_import_path_failures_name_the_key_and_the_problem(tmp_path, path, message):
    cfg = load_config(CONFIG, [f"run.output_dir='{tmp_path}'",
                               f"task.rewards={{correct = 1.0, '{path}' = 1.0}}"])
    with pytest.raises(ConfigError, match=rf"task.rewards.{path}: verifier .*{message}"):
        build(cfg)


def test_api_refuses_a_function_that_does_not_fit(tmp_path):
    with pytest.raises(ConfigError, match=r"rewards: 'two_args_wrong': signature .*cannot take"):
        rollwise.train(CONFIG, rewards=[two_args_wrong], echo=None,
                       overrides=[f"run.output_dir='{tmp_path}'", *SMALL])
    with pytest.raises(ConfigError, match="'correct' is already a term"):
        rollwise.train(CONFIG, rewards={"correct": brief}, echo=None,
                       overrides=[f"run.output_dir='{tmp_path}'", *SMALL])


def constant_task(setup, *, answer: str = "2"):
    """A user's task: one prompt repeated, its own option `answer`."""
    from rollwise.tasks import Task

    def sample(split: str, i: int) -> Sample:
        return Sample(f"const/{split}/{i}", "1+1=", answer)

    return Task("const", [sample("train", i) for i in range(setup.num_train)],
                [sample("eval", i) for i in range(setup.num_eval)], brief)


def test_a_task_builder_by_import_path_gets_the_setup_and_its_own_options():
    from rollwise.tasks import make_task, task_options

    path = f"{__name__}:constant_task"
    assert task_options(path) == {"answer": "2"}
    task = make_task(path, seed=3, num_train=5, num_eval=2, answer="7")
    assert (len(task.train), len(task.eval), task.train[0].answer) == (5, 2, "7")
    with pytest.raises(ValueError, match=r"did you mean 'answer'"):
        make_task(path, answr="7")
