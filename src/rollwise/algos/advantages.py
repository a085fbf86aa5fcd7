"""Advantage estimators: fn(rewards [N], group_ids [N], **inputs, **options) -> advantages.

Every estimator sees the flat batch of rewards and the group each one belongs to, so a
group need not be contiguous and groups may differ in size. Outcome-level estimators
return [N]. Token-level ones return [N, T] and take what else they need by keyword: the
fields of `AdvantageInputs` (algos/inputs.py: mask, lengths, token_rewards, and for
multi-turn episodes turns, step_rewards, anchors, trees) they declare with `@uses`.
`call_estimator` passes those and the options. An estimator that
excludes rows from the gradient altogether (MC-GRPO's pivot) returns a pair
(advantages, keep [N] bool); the caller drops the rows where keep is False.

Simplifications, stated up front: the whitening of REINFORCE++ uses the population
(biased) standard deviation; DRPO is the "minimal implementable variant" of the DRPO paper
(docs/algorithms.md: a self-normalised length weight on positive advantages, not the DisCO
objective).
"""

from __future__ import annotations

import math

import torch

from rollwise.algos.inputs import AdvantageInputs, inputs_of, uses
from rollwise.algos.registry import advantage_estimators, register


def group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row mean and unbiased std of the row's group ([N] each); std is 0 for a group of 1."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    values = values.double()
    sums = values.new_zeros(len(counts)).index_add_(0, inverse, values)
    mean = sums / counts
    sq = torch.zeros_like(sums).index_add_(0, inverse, (values - mean[inverse]) ** 2)
    var = sq / (counts - 1).clamp(min=1)
    return mean[inverse], var.sqrt()[inverse]


def whiten(values: torch.Tensor, mask: torch.Tensor | None = None,
           eps: float = 1e-6) -> torch.Tensor:
    """(x - mean) / (std + eps) over the whole batch (the entries where mask is 1), population
    std; masked-out entries come back as 0."""
    if mask is None:
        mask = torch.ones_like(values)
    mask = mask.to(values.dtype)
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    var = (((values - mean) * mask) ** 2).sum() / count
    return (values - mean) / (var.sqrt() + eps) * mask


@register(advantage_estimators, "grpo")
def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (DeepSeekMath, arXiv 2402.03300): A_i = (r_i - mean_g(r)) / (std_g(r) + eps).

    std is the unbiased group standard deviation; a zero-variance group gets A = 0.
    """
    mean, std = group_stats(rewards, group_ids)
    return ((rewards.double() - mean) / (std + eps)).to(rewards.dtype)


@register(advantage_estimators, "dr_grpo")
def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al., arXiv 2503.20783): A_i = r_i - mean_g(r), no division by the std.

    The paper's other half, a constant token normaliser, is the loss aggregation
    "seq-mean-token-sum-norm".
    """
    mean, _ = group_stats(rewards, group_ids)
    return (rewards.double() - mean).to(rewards.dtype)


@register(advantage_estimators, "rloo")
def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al., arXiv 2402.14740): A_i = r_i - 1/(G-1) sum_{j != i} r_j
    = G/(G-1) (r_i - mean_g(r)); a group of one gets A = 0."""
    mean, _ = group_stats(rewards, group_ids)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    g = counts[inverse].double()
    scale = torch.where(g > 1, g / (g - 1).clamp(min=1), torch.zeros_like(g))
    return (scale * (rewards.double() - mean)).to(rewards.dtype)


def _last_token(mask: torch.Tensor) -> torch.Tensor:
    """[N, T] one-hot of each row's last position where mask is 1 (all 0 for an empty row)."""
    m = mask > 0
    return (m & (m.cumsum(-1) == m.sum(-1, keepdim=True))).to(torch.float64)


@register(advantage_estimators, "reinforce_pp")
@uses("mask", "token_rewards")
def reinforce_pp(rewards: torch.Tensor, group_ids: torch.Tensor, *,
                 mask: torch.Tensor | None = None, token_rewards: torch.Tensor | None = None,
                 gamma: float = 1.0, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ (Hu, arXiv 2501.03262): returns whitened over the global batch, no critic.

    Token rewards r_t = token_rewards_t (e.g. -beta KL_t), plus the outcome reward r_i on the
    last response token; G_t = sum_{s >= t} gamma^(s-t) r_s; A_t = (G_t - mean) / (std + eps)
    with mean and std over all response tokens of the batch. Without `mask` it is outcome
    level: A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps). `group_ids` are not used.
    """
    del group_ids
    if mask is None:
        return whiten(rewards.double(), eps=eps).to(rewards.dtype)
    mask = mask.double()
    step = _last_token(mask) * rewards.double()[:, None]
    if token_rewards is not None:
        step = step + token_rewards.double() * mask
    returns = torch.zeros_like(step)
    running = torch.zeros_like(step[:, 0])
    for t in reversed(range(step.shape[1])):  # [N] discounted return from t to the end
        running = step[:, t] + gamma * running
        returns[:, t] = running
    return whiten(returns, mask, eps).to(rewards.dtype)


@register(advantage_estimators, "reinforce_pp_baseline")
@uses("mask", "token_rewards")
def reinforce_pp_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, *,
                          mask: torch.Tensor | None = None,
                          token_rewards: torch.Tensor | None = None,
                          eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++-baseline (arXiv 2501.03262): a_i = r_i - mean_g(r), broadcast to the
    response tokens plus token_rewards_t (e.g. -beta KL_t), then whitened over all response
    tokens of the batch. Without `mask`: a_i whitened over the rows of the batch."""
    mean, _ = group_stats(rewards, group_ids)
    centred = rewards.double() - mean
    if mask is None:
        return whiten(centred, eps=eps).to(rewards.dtype)
    per_token = centred[:, None] * torch.ones_like(mask, dtype=torch.float64)
    if token_rewards is not None:
        per_token = per_token + token_rewards.double()
    return whiten(per_token, mask.double(), eps).to(rewards.dtype)


def _groups(group_ids: torch.Tensor) -> list[torch.Tensor]:
    """Row indices of each group, in order of first appearance of the group id."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return [torch.nonzero(inverse == g)[:, 0] for g in range(int(inverse.max()) + 1)] \
        if len(group_ids) else []


@register(advantage_estimators, "mc_grpo")
def mc_grpo(rewards: torch.Tensor, group_ids: torch.Tensor, *, scale: str = "mad",
            eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """MC-GRPO (Kim, arXiv 2601.22582): median baseline for small groups; sample G+1 rollouts
    (set the group size odd) and drop the median pivot from the gradient.

        m = median_g(r);  A_i = (r_i - m) / (s + eps)
        s = MAD = median_g |r - m|  (scale "mad"; the group's unbiased std when MAD is 0),
            std_g(r) (scale "std"), or 1 (scale "none")

    The median is the lower middle value; the pivot is the row at the median position of
    a stable sort of the group's rewards. Returns (advantages [N], keep [N]), keep False
    at the one pivot per group. With binary rewards MAD is 0 (the median is the majority),
    and the paper's 1e-3 floor would give +-1000; falling back to the std keeps the scale
    of GRPO (docs/algorithms.md).
    """
    if scale not in ("mad", "std", "none"):
        raise ValueError(f"mc_grpo: unknown scale '{scale}'; use mad, std or none")
    r = rewards.double()
    adv = torch.zeros_like(r)
    keep = torch.ones(len(r), dtype=torch.bool, device=r.device)
    _, std = group_stats(r, group_ids)
    for rows in _groups(group_ids):
        vals = r[rows]
        order = torch.sort(vals.detach(), stable=True).indices
        mid = order[(len(rows) - 1) // 2]
        median = vals[mid]
        keep[rows[mid]] = False
        if scale == "none":
            s = r.new_ones(())
        elif scale == "std":
            s = std[rows[0]]
        else:
            dev = (vals - median).abs()
            s = dev[torch.sort(dev.detach(), stable=True).indices[(len(rows) - 1) // 2]]
            if float(s.detach()) == 0.0:
                s = std[rows[0]]
        adv = adv.index_put((rows,), (vals - median) / (s + eps))
    return adv.to(rewards.dtype), keep


@register(advantage_estimators, "drpo")
@uses("lengths")
def drpo(rewards: torch.Tensor, group_ids: torch.Tensor, *, lengths: torch.Tensor,
         lam: float = 1.0, correct_threshold: float = 0.5, eps: float = 1e-6) -> torch.Tensor:
    """DRPO (Li et al., arXiv 2510.04474), decoupled length reward: the length signal is
    normalised among the correct rollouts only, so it never turns a correct rollout's
    advantage negative.

        A_i = GRPO advantage;  P = {i in group : r_i >= correct_threshold}
        z_i = (L_i - mean_P(L)) / (std_P(L) + eps)            (population std, i in P)
        w_i = exp(-z_i / lam) / sum_{j in P} exp(-z_j / lam)  (DRPO's self-normalised weight)
        A'_i = A_i * |P| * w_i  for i in P with A_i > 0, else A'_i = A_i

    The weights have mean 1 over P, so the positive mass of a group is kept and moved
    toward shorter correct responses. Reconstructed from the paper's abstract (the DisCO
    objective itself is not implemented); see docs/algorithms.md.
    """
    base = grpo(rewards, group_ids, eps=eps).double()
    factor = torch.ones_like(base)
    correct = rewards.detach() >= correct_threshold
    length = lengths.to(torch.float64)
    for rows in _groups(group_ids):
        pos = rows[correct[rows]]
        if len(pos) < 2:
            continue
        lp = length[pos]
        z = (lp - lp.mean()) / ((lp - lp.mean()).pow(2).mean().sqrt() + eps)
        w = torch.softmax(-z / lam, 0) * len(pos)
        factor[pos] = torch.where(base[pos].detach() > 0, w, torch.ones_like(w))
    return (base * factor).to(rewards.dtype)


@register(advantage_estimators, "pass_at_k")
def pass_at_k(rewards: torch.Tensor, group_ids: torch.Tensor, *, k: int = 4,
              correct_threshold: float = 0.5, eps: float = 1e-6) -> torch.Tensor:
    """Pass@k training (Chen et al., arXiv 2508.10751): the analytic advantage of the
    reward max(r over a random k-subset of the group), binary rewards (r >= threshold).

    With n rollouts, c correct (n - c = m wrong) and k' = min(k, n):
        R = 1 - C(m, k') / C(n, k');  s = sqrt(R (1 - R))
        A_correct = (1 - R) / (s + eps)
        A_wrong   = (1 - R - C(m - 1, k' - 1) / C(n - 1, k' - 1)) / (s + eps)
    k = 1 is GRPO with the population std. Rewards enter only through the threshold, so no
    gradient flows to them.
    """
    correct = (rewards.detach() >= correct_threshold)
    adv = torch.zeros(len(rewards), dtype=torch.float64, device=rewards.device)
    for rows in _groups(group_ids):
        n = len(rows)
        kk = min(k, n)
        m = n - int(correct[rows].sum())
        mean = 1 - math.comb(m, kk) / math.comb(n, kk)
        s = math.sqrt(mean * (1 - mean)) + eps
        miss = math.comb(m - 1, kk - 1) / math.comb(n - 1, kk - 1) if m > 0 else 0.0
        adv[rows] = torch.where(correct[rows], adv.new_tensor((1 - mean) / s),
                                adv.new_tensor((1 - mean - miss) / s))
    return adv.to(rewards.dtype)


@register(advantage_estimators, "gigpo")
@uses("turns", "step_rewards", "anchors", "mask")
def gigpo(rewards: torch.Tensor, group_ids: torch.Tensor, *,
          turns: torch.Tensor | None = None, step_rewards: torch.Tensor | None = None,
          anchors: torch.Tensor | None = None, mask: torch.Tensor | None = None,
          omega: float = 1.0, gamma: float = 0.95, normalize: bool = True,
          eps: float = 1e-6) -> torch.Tensor:
    """GiGPO (Feng et al., arXiv 2505.10978): group-in-group credit for multi-turn agents.

        episode level   A_E(i) = (R_i - mean_g(R)) / (std_g(R) + eps)        (GRPO)
        step level      returns G_ik = sum_{j >= k} gamma^(j-k) r_ij from turn k on;
                        steps of one group that acted in the same anchor state s form a
                        step group S; A_S(i, k) = (G_ik - mean_S(G)) / (std_S(G) + eps)
                        (0 for a step whose state no other step of the group reached)
        token t of turn k of row i:  A = A_E(i) + omega * A_S(i, k)

    `normalize` False drops both divisions by the std (the paper's mean-only variant).
    std is the unbiased one, as in `grpo`. Returns [N, T], 0 off the policy's tokens.
    Without the multi-turn inputs each row is one turn in one state per group (a
    single-turn batch): A = A_E + omega * A_S on the `mask`'s tokens, or [N] without it.
    """
    r = rewards.double()
    if step_rewards is None:
        step_rewards = r[:, None]
    if anchors is None:
        anchors = torch.zeros(step_rewards.shape, dtype=torch.long, device=r.device)
    mean, std = group_stats(r, group_ids)
    episode = (r - mean) / (std + eps) if normalize else r - mean
    k_max = step_rewards.shape[1]
    rets = torch.zeros_like(step_rewards, dtype=torch.float64)
    running = r.new_zeros(len(r))
    for k in reversed(range(k_max)):  # [N] discounted return from turn k to the end
        running = step_rewards[:, k].double() + gamma * running
        rets[:, k] = running
    step = torch.zeros_like(rets)
    valid = anchors >= 0
    rows, ks = torch.nonzero(valid, as_tuple=True)
    if len(rows):
        keys = torch.stack([group_ids[rows], anchors[rows, ks]], 1)  # (group, state)
        m, s = group_stats(rets[rows, ks], torch.unique(keys, dim=0, return_inverse=True)[1])
        centred = rets[rows, ks] - m
        step[rows, ks] = centred / (s + eps) if normalize else centred
    if turns is None:
        if mask is None:
            return (episode + omega * step[:, 0]).to(rewards.dtype)
        turns = torch.where(mask > 0, 0, -1)
    idx = turns.clamp(min=0)
    out = episode[:, None] + omega * step.gather(1, idx.clamp(max=max(k_max - 1, 0)))
    return (out * (turns >= 0)).to(rewards.dtype)


@register(advantage_estimators, "tree_grpo")
@uses("trees")
def tree_grpo(rewards: torch.Tensor, group_ids: torch.Tensor, *,
              trees: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Tree-GRPO (Ji et al., arXiv 2509.21240): rollouts as trees that branch at turn
    boundaries (episodes.tree_branches); each leaf's advantage adds the intra-tree and the
    inter-tree (whole group) GRPO advantages:

        A_i = (R_i - mean_tree(R)) / (std_tree(R) + eps) + (R_i - mean_g(R)) / (std_g(R) + eps)

    Returns [N]. The shared prefix of a tree's leaves is a row segment of each leaf, so a
    prefix token's total gradient weight is the sum over the leaves below it (the paper's
    step-level preference signal from the tree structure).
    """
    r = rewards.double()
    if trees is None:  # one tree per group (no tree rollouts): twice GRPO
        trees = torch.zeros_like(group_ids)
    mean_g, std_g = group_stats(r, group_ids)
    key = torch.unique(torch.stack([group_ids, trees], 1), dim=0, return_inverse=True)[1]
    mean_t, std_t = group_stats(r, key)
    return ((r - mean_t) / (std_t + eps) + (r - mean_g) / (std_g + eps)).to(rewards.dtype)


def call_estimator(fn, rewards: torch.Tensor, group_ids: torch.Tensor,
                   inputs: AdvantageInputs, options: dict | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Call an estimator with the `inputs` it declared (`uses`), plus `options`; returns
    (advantages, keep or None)."""
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:  # every estimator would spread a NaN over its group or batch
        raise ValueError(f"non-finite rewards at rows {bad[:5]} (values "
                         f"{[float(rewards[i]) for i in bad[:5]]}); a reward term returned NaN "
                         "or inf")
    out = fn(rewards, group_ids, **inputs.pick(inputs_of(fn)), **(options or {}))
    return out if isinstance(out, tuple) else (out, None)
