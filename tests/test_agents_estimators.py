"""GiGPO and Tree-GRPO against hand-computed examples, and the multi-turn inputs that
prepare_batch builds for them from trajectories' turn records."""

from __future__ import annotations

import math

import pytest
import torch

from rollwise.algos.advantages import gigpo, tree_grpo
from rollwise.learner.prepare import prepare_batch
from rollwise.types import Group, Sample, Trajectory

S = math.sqrt(0.5)  # 0.7071: a two-member group's (x - mean) / unbiased std


def _hand_case():
    """Rows 0, 1 in group 0, row 2 alone in group 1 (same state name 's0', other group).

    row 0: R = 1.1; turns 0 (cols 1-2, state s0, reward 0.1), 1 (col 4, state a, reward 1.0)
    row 1: R = 0.1; turns 0 (col 1, state s0, reward 0.1), 1 (cols 4-5, state b, reward 0)
    row 2: R = 0.5; turn 0 (cols 1-2, state s0, reward 0.5)
    """
    turns = torch.full((3, 6), -1)
    turns[0, 1:3], turns[0, 4] = 0, 1
    turns[1, 1], turns[1, 4:6] = 0, 1
    turns[2, 1:3] = 0
    step_rewards = torch.tensor([[0.1, 1.0], [0.1, 0.0], [0.5, 0.0]], dtype=torch.float64)
    anchors = torch.tensor([[0, 1], [0, 2], [0, -1]])  # s0 = 0, a = 1, b = 2
    return (torch.tensor([1.1, 0.1, 0.5]), torch.tensor([0, 0, 1]), turns, step_rewards,
            anchors)


def test_gigpo_matches_hand_computed_example():
    rewards, gids, turns, step_rewards, anchors = _hand_case()
    adv = gigpo(rewards, gids, turns=turns, step_rewards=step_rewards, anchors=anchors,
                omega=0.5, gamma=0.5)
    # episode: group 0 is {1.1, 0.1} -> +-S; row 2 alone -> 0
    # step returns (gamma 0.5): row 0 (0.1 + 0.5 * 1.0, 1.0), row 1 (0.1, 0.0)
    # step group (group 0, s0) = {0.6, 0.1} -> +-S; (0, a) and (0, b) are alone -> 0;
    # row 2's s0 is in group 1, so it is alone too
    want = torch.zeros(3, 6)
    want[0, 1:3], want[0, 4] = S + 0.5 * S, S
    want[1, 1], want[1, 4:6] = -S - 0.5 * S, -S
    assert torch.allclose(adv.double(), want.double(), atol=1e-5)


def test_gigpo_mean_only_variant():
    rewards, gids, turns, step_rewards, anchors = _hand_case()
    adv = gigpo(rewards, gids, turns=turns, step_rewards=step_rewards, anchors=anchors,
                omega=1.0, gamma=0.5, normalize=False)
    # episode R - mean: +-0.5; step G - mean over (0, s0): 0.6 - 0.35, 0.1 - 0.35
    assert adv[0, 1].item() == pytest.approx(0.5 + 0.25, abs=1e-6)
    assert adv[0, 4].item() == pytest.approx(0.5, abs=1e-6)
    assert adv[1, 1].item() == pytest.approx(-0.5 - 0.25, abs=1e-6)
    assert adv[2].abs().max().item() == pytest.approx(0.0, abs=1e-6)


def test_tree_grpo_matches_hand_computed_example():
    # one group of 4 leaves in 2 trees; R = 1, 0 (tree 0) and 1, 1 (tree 1)
    # inter-tree (group): mean 0.75, unbiased std 0.5 -> 0.5, -1.5, 0.5, 0.5
    # intra-tree: tree 0 -> +-S, tree 1 (equal rewards) -> 0
    adv = tree_grpo(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 0]),
                    trees=torch.tensor([0, 0, 1, 1]))
    assert torch.allclose(adv, torch.tensor([0.5 + S, -1.5 - S, 0.5, 0.5]), atol=1e-5)


def _episode(reward: float, turns, states, rewards, response_len: int, mask) -> Trajectory:
    t = Trajectory(sample=Sample(id="g", prompt="p", answer="1"), prompt_ids=[1],
                   response_ids=list(range(4, 4 + response_len)), logprobs=[-1.0] * response_len,
                   versions=[0] * response_len, finish_reason="stop", loss_mask=mask,
                   turns=turns, turn_rewards=rewards, turn_states=states)
    t.reward = reward
    return t


def test_prepare_batch_feeds_gigpo_turn_records():
    """The same hand case built from trajectories: prepare_batch derives turns, step rewards
    and anchor ids from the turn records, and the batch's env tokens carry advantage 0."""
    rows = [
        _episode(1.1, [(0, 2), (3, 4)], ["s0", "a"], [0.1, 1.0], 4, [1, 1, 0, 1]),
        _episode(0.1, [(0, 1), (3, 5)], ["s0", "b"], [0.1, 0.0], 5, [1, 0, 0, 1, 1]),
    ]
    alone = _episode(0.5, [(0, 2)], ["s0"], [0.5], 2, [1, 1])
    batch = prepare_batch([Group(rows[0].sample, rows), Group(alone.sample, [alone])], gigpo,
                          pad_id=0, options={"omega": 0.5, "gamma": 0.5})
    want = torch.zeros(3, 6)
    want[0, 1:3], want[0, 4] = S + 0.5 * S, S
    want[1, 1], want[1, 4:6] = -S - 0.5 * S, -S
    assert batch.advantages.shape == (3, 6)
    assert torch.allclose(batch.advantages.double(), want.double(), atol=1e-5)
    # env-inserted tokens: out of the loss, no behaviour log-prob, no version
    assert batch.loss_mask[0].tolist() == [0, 1, 1, 0, 1, 0]
    assert batch.old_logprobs[1].tolist() == [0, -1, 0, 0, -1, -1]
    assert batch.versions[1].tolist() == [-1, 0, -1, -1, 0, 0]


def test_single_turn_trajectories_are_the_one_turn_case():
    """A plain single-turn trajectory (no turn records) gets GiGPO = GRPO on its tokens:
    one turn, all in the prompt's state (the step group is the whole group)."""
    from rollwise.algos.advantages import grpo

    trajs = []
    for r in (1.0, 0.0, 0.0):
        t = Trajectory(sample=Sample(id="s", prompt="p", answer="1"), prompt_ids=[1, 5],
                       response_ids=[6, 7], logprobs=[-1.0, -1.0], versions=[0, 0],
                       finish_reason="stop")
        t.reward = r
        trajs.append(t)
    batch = prepare_batch([Group(trajs[0].sample, trajs)], gigpo, pad_id=0,
                          options={"omega": 1.0})
    base = grpo(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0, 0, 0]))
    assert torch.allclose(batch.advantages[:, 2:], (2 * base)[:, None].expand(3, 2), atol=1e-5)
    assert batch.advantages[:, :2].abs().max().item() == 0.0


def test_without_turn_inputs_each_row_is_one_turn():
    """Called like a single-turn estimator (no turns/anchors/trees): GiGPO is
    (1 + omega) x GRPO on the mask's tokens, Tree-GRPO (one tree a group) 2 x GRPO."""
    from rollwise.algos.advantages import grpo

    rewards, gids = torch.tensor([1.0, 0.0, 0.5, 2.0]), torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.float32)
    base = grpo(rewards, gids)
    assert torch.allclose(gigpo(rewards, gids, mask=mask, omega=0.5),
                          1.5 * base[:, None] * mask, atol=1e-5)
    assert torch.allclose(gigpo(rewards, gids), 2 * base, atol=1e-5)
    assert torch.allclose(tree_grpo(rewards, gids), 2 * base, atol=1e-5)
