"""From scored groups to the learner's `Batch`: advantages through the estimator registry.

    groups -> padded Batch -> (truncated rows masked) -> (KL in the reward)
           -> estimator(rewards, group_ids, **the inputs it names) -> advantages
           -> rows the estimator excluded (keep False) dropped

Nothing here special-cases an estimator by name: the inputs an estimator receives are the
ones its signature asks for (see `rollwise.algos.advantages`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollwise.algos import accepts, call_estimator
from rollwise.learner.batch import collate, take_rows
from rollwise.types import Batch, Group


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
    inputs = {"mask": batch.loss_mask,
              "lengths": torch.tensor([t.num_tokens for t in trajs], dtype=torch.float32)}
    if reference_kl is not None and kl_coef > 0:
        token_rewards = -kl_coef * reference_kl(batch).float() * batch.loss_mask
        inputs["token_rewards"] = token_rewards
        if not accepts(estimator, "token_rewards"):
            rewards = rewards + token_rewards.sum(-1)
    adv, keep = call_estimator(estimator, rewards, group_ids, inputs, options)
    batch.advantages = adv.detach().float()
    if keep is not None and not bool(keep.all()):
        batch = take_rows(batch, torch.nonzero(keep)[:, 0])
    return batch

