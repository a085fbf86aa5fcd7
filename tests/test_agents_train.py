"""Multi-turn training through the real stages (tiny model, the guess game): the batch the
learner trains on has token-level advantages on the policy's tokens only and replays to the
engine's log-probs; the step record carries the episode figures; evaluation runs episodes."""

from __future__ import annotations

import pytest
import torch

from rollwise.compose.config import ConfigError, load_config
from rollwise.pipeline.build import build


def _config(tmp_path, *extra):
    return load_config(None, [
        f"run.output_dir='{tmp_path}'", "run.threads=1", "model.name='tiny'",
        "task.name='guess'", "task.options={high=8, max_guesses=3}", "task.num_train=64",
        "task.num_eval=8", "rollout.prompts_per_step=3", "rollout.group_size=4",
        "rollout.max_tokens=4", "episodes.max_turns=3", "engine.dtype='float32'",
        "learner.precision='float32'", "algorithm.advantage='gigpo'",
        "model.tiny.sft_steps=30", "model.tiny.hidden=64", "model.tiny.layers=2", *extra])


@pytest.mark.parametrize("extra", [(), ("algorithm.advantage='tree_grpo'",
                                        "episodes.tree_branches=2", "episodes.tree_depth=1")])
def test_trained_batch_is_token_faithful_and_masks_env_tokens(tmp_path, extra):
    stages = build(_config(tmp_path, *extra))
    groups = stages.rollout(stages.select())
    stages.score(groups)
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 12 and any(len(t.turns) > 1 for t in trajs)
    if extra:
        assert sorted(t.tree for t in groups[0].trajectories) == [0, 0, 1, 1]
    batch = stages.advantages(groups)
    m = batch.loss_mask.bool()
    assert int(m.sum()) == sum(sum(t.loss_mask) for t in trajs)
    assert batch.token_advantages.shape[1] in (1, m.shape[1])
    if batch.advantages.dim() == 2:  # gigpo: token level, nothing off the policy's tokens
        assert batch.advantages[~m].abs().max().item() == 0.0
    with torch.no_grad():
        lp = stages.learner._logprobs(stages.model, batch)
    assert torch.allclose(lp[m].double(), batch.old_logprobs[m].double(), atol=1e-4, rtol=0)
    metrics = stages.update(batch)
    assert metrics["rows_trained"] > 0
    figures = stages.control_metrics()
    assert figures["prefix_reuse_tokens"] > 0 and 1.0 <= figures["episode_turns_mean"] <= 3.0
    result = stages.evaluate()
    assert result["num_prompts"] == 8 and 1.0 <= result["mean_turns"] <= 3.0


def test_environment_task_needs_the_native_engine_and_no_single_turn_strategy(tmp_path):
    with pytest.raises(ConfigError, match="native engine"):
        build(_config(tmp_path, "engine.name='hf'"))
    with pytest.raises(ConfigError, match="partial.*single-turn"):
        build(_config(tmp_path, "schedule.strategy='partial'"))
