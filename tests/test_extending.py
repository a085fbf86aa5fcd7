"""Users' own code: reward functions passed to `rollwise.train`, or named by import path in
a config; clear errors when the import fails or the signature does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rollwise
from rollwise.compose.config import ConfigError, load_config
from rollwise.pipeline.build import build
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


@rollwise.group_reward
def shortest_in_group(trajectories, *, bonus: float = 1.0) -> list[float]:
    """A user's group term: `bonus` for the group's shortest responses, 0 for the others."""
    least = min(t.num_tokens for t in trajectories)
    return [bonus if t.num_tokens == least else 0.0 for t in trajectories]


def _scored_groups(cfg, **kwargs):
    stages = build(cfg, **kwargs)
    groups = stages.rollout(stages.select())
    stages.score(groups)
    return groups


def test_a_group_term_by_import_path_sees_the_group_and_takes_its_options(tmp_path):
    path = f"{__name__}:shortest_in_group"
    cfg = load_config(CONFIG, [f"run.output_dir='{tmp_path}'", *SMALL,
                               f"task.rewards={{correct = 1.0, '{path}' = 0.5}}",
                               f"task.reward_options={{'{path}' = {{ bonus = 3.0 }} }}"])
    groups = _scored_groups(cfg)
    for g in groups:
        least = min(t.num_tokens for t in g.trajectories)
        for t in g.trajectories:
            want = 3.0 if t.num_tokens == least else 0.0
            assert t.scores[path] == want
            assert t.reward == pytest.approx(t.scores["correct"] + 0.5 * want)
    assert any(t.scores[path] == 0.0 for g in groups for t in g.trajectories)


def test_a_marked_function_passed_to_the_api_is_a_group_term(tmp_path):
    from rollwise.api import _reward_terms

    cfg = load_config(CONFIG, [f"run.output_dir='{tmp_path}'", *SMALL])
    extra = _reward_terms(cfg, [shortest_in_group, brief], {})
    groups = _scored_groups(cfg, rewards=extra)
    t = groups[0].trajectories[0]
    assert set(t.scores) == {"correct", "brief", "shortest_in_group"}
    assert t.reward == pytest.approx(t.scores["correct"] + t.scores["brief"]
                                     + t.scores["shortest_in_group"])
    with pytest.raises(ConfigError, match="reward_options.brief: options apply to group"):
        build(load_config(CONFIG, [f"run.output_dir='{tmp_path}'", *SMALL,
                                   "task.reward_options={ brief = { x = 1 } }"]))


ENGINES_MADE: list = []


def recording_engine(model, *, eos_token_ids, pad_token_id, batch_size):
    """A user's engine factory: rollwise's HF engine, remembered so the test can find it."""
    from rollwise.engine import hf_engine

    engine = hf_engine(model, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                       batch_size=batch_size)
    ENGINES_MADE.append(engine)
    return engine


def test_an_engine_by_import_path_is_the_one_that_rolls_out(tmp_path):
    cfg = load_config(CONFIG, [f"run.output_dir='{tmp_path}'", *SMALL,
                               f"engine.name='{__name__}:recording_engine'"])
    stages = build(cfg)
    assert any(stages.engine is e for e in ENGINES_MADE)  # (the evaluator builds one too)
    groups = stages.rollout(stages.select())
    assert len(groups) == 4 and all(len(g.trajectories) == 8 for g in groups)
    with pytest.raises(ConfigError, match=r"engine.name: unknown engine 'natve' \(did you"):
        build(load_config(CONFIG, [f"run.output_dir='{tmp_path}'", "engine.name='natve'"]))


def test_a_run_started_from_the_api_resumes_from_the_api(tmp_path):
    over = [f"run.output_dir='{tmp_path}'", *SMALL]
    rollwise.train(CONFIG, rewards=[brief], echo=None, overrides=over)
    rollwise.train(CONFIG, rewards=[brief], echo=None, resume=True,
                   overrides=[*over, "run.num_steps=3"])
    root = tmp_path / "tiny_arith"
    records = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    store = TrajectoryStore(root / "trajectories.sqlite")
    assert all("brief" in t.scores for t in store.load_step(3))
