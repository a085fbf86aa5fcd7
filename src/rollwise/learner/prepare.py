"""From scored groups to the learner's `Batch`: advantages through the estimator registry.

    groups -> padded Batch -> (truncated rows masked) -> (KL in the reward)
           -> estimator(rewards, group_ids, **the inputs it uses) -> advantages
           -> rows the estimator excluded (keep False) dropped

Nothing here special-cases an estimator by name: the `AdvantageInputs` are built for the
ones an estimator declares (`rollwise.algos.uses`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rollwise.algos import AdvantageInputs, call_estimator, inputs_of
from rollwise.learner.batch import collate, take_rows
from rollwise.types import Batch, Group, Trajectory


def prepare_batch(groups: list[Group], estimator: Callable, *, pad_id: int,
                  options: dict | None = None, mask_truncated: bool = False,
                  reference_kl: Callable[[Batch], torch.Tensor] | None = None,
                  kl_coef: float = 0.0) -> Batch:
    """The learner's batch for `groups`, advantages included.

    mask_truncated: responses cut at max_tokens (finish_reason "length") get loss mask 0
        (DAPO's overlong filtering); their rewards still count in the group baselines.
    reference_kl: with kl_coef, puts the KL in the reward: [N, L] per-token KL of the
        behaviour policy to the reference. An estimator that takes `token_rewards` gets
        -kl_coef * KL_t per token; any other gets r_i - kl_coef * sum_t KL_t.
    """
    trajs = [t for g in groups for t in g.trajectories]
    group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.trajectories])
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    batch = collate(trajs, torch.zeros(len(trajs)), group_ids, pad_id=pad_id)
    if mask_truncated:
        truncated = torch.tensor([t.finish_reason == "length" for t in trajs])
        batch.loss_mask[truncated] = 0
    token_rewards = None
    if reference_kl is not None and kl_coef > 0:
        token_rewards = -kl_coef * reference_kl(batch).float() * batch.loss_mask
        if "token_rewards" not in inputs_of(estimator):
            rewards = rewards + token_rewards.sum(-1)
    inputs = AdvantageInputs(
        mask=batch.loss_mask, token_rewards=token_rewards,
        # sampled tokens only (a multi-turn episode's observations are not its length)
        lengths=torch.tensor([sum(t.sampled_mask) for t in trajs], dtype=torch.float32),
        logprobs=batch.old_logprobs, input_ids=batch.input_ids, ref_values=ref_values(trajs),
        **episode_inputs(trajs, batch.loss_mask.shape[1], inputs_of(estimator)))
    adv, keep = call_estimator(estimator, rewards, group_ids, inputs, options)
    batch.advantages = adv.detach().float()
    record_advantages(trajs, batch.advantages, batch.loss_mask, keep)
    if keep is not None and not bool(keep.all()):
        batch = take_rows(batch, torch.nonzero(keep)[:, 0])
    return batch



def record_advantages(trajs: list[Trajectory], advantages: torch.Tensor, mask: torch.Tensor,
                      keep: torch.Tensor | None) -> None:
    """Each trajectory's `advantage`, as the update uses it: [N] outcome-level values, or
    the mean of [N, L] token-level ones over the row's loss mask; None for a row the
    estimator dropped (keep False). The trajectory store and the report keep them."""
    if advantages.dim() == 2:
        advantages = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    for i, (traj, value) in enumerate(zip(trajs, advantages.tolist(), strict=True)):
        traj.advantage = value if keep is None or bool(keep[i]) else None


def ref_values(trajs: list[Trajectory]) -> torch.Tensor | None:
    """[N] each row's prompt value under a reference policy, its sample's
    `meta["ref_value"]` (PVPO's anchor), NaN where it has none; None when no sample has one."""
    values = [t.sample.meta.get("ref_value") for t in trajs]
    if all(v is None for v in values):
        return None
    return torch.tensor([math.nan if v is None else float(v) for v in values],
                        dtype=torch.float64)


def episode_inputs(trajs: list[Trajectory], width: int, wanted: tuple[str, ...]
                   ) -> dict[str, torch.Tensor]:
    """Those of the multi-turn inputs (`turns`, `step_rewards`, `anchors`, `trees`) named in
    `wanted` (the estimator's declared inputs), from the trajectories' turn records
    (algos/inputs.py). A single-turn trajectory is one turn with the whole reward, in its
    prompt's state."""
    out: dict[str, torch.Tensor] = {}
    n = len(trajs)
    if "turns" in wanted:
        turns = torch.full((n, width), -1, dtype=torch.long)
        for i, t in enumerate(trajs):
            p = len(t.prompt_ids)
            for k, (a, b) in enumerate(t.turns or [(0, len(t.response_ids))]):
                turns[i, p + a: p + b] = k
        out["turns"] = turns
    k_max = max((t.num_turns for t in trajs), default=1)
    if "step_rewards" in wanted:
        rewards = torch.zeros((n, k_max), dtype=torch.float64)
        for i, t in enumerate(trajs):
            rewards[i, : t.num_turns] = torch.tensor(t.turn_rewards or [t.reward],
                                                     dtype=torch.float64)
        out["step_rewards"] = rewards
    if "anchors" in wanted:
        ids: dict[str, int] = {}
        anchors = torch.full((n, k_max), -1, dtype=torch.long)
        for i, t in enumerate(trajs):
            states = t.turn_states or [str(t.prompt_ids)]
            anchors[i, : len(states)] = torch.tensor([ids.setdefault(s, len(ids))
                                                      for s in states])
        out["anchors"] = anchors
    if "trees" in wanted:
        out["trees"] = torch.tensor([t.tree for t in trajs], dtype=torch.long)
    return out
