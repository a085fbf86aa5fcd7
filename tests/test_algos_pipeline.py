"""The algorithm library inside the learner and driver: token entropies (value and gradient),
batch preparation (truncation mask, KL in the reward, excluded rows), corrections in the
learner, and the group reward terms (majority vote, DARE, overlong)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from rollwise.algos import advantage_estimators, corrections, policy_losses
from rollwise.learner import Learner, collate, prepare_batch, token_logprobs
from rollwise.rewards.group import (
    GroupTerm,
    answer_of,
    apply_group_rewards,
    dare_scores,
    get_group_reward,
    majority_vote_scores,
    overlong_penalty,
)
from rollwise.types import Group


def _rows(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 88, (3, 10), generator=gen)
    attn = torch.zeros(3, 10, dtype=torch.long)
    mask = torch.zeros(3, 10)
    for i, (p, r) in enumerate([(3, 7), (2, 4), (4, 2)]):
        attn[i, : p + r] = 1
        mask[i, p: p + r] = 1
    return ids, attn, mask


@pytest.mark.parametrize("chunk,temperature", [(2, 1.0), (1000, 0.7)])
def test_token_entropy_value_and_gradient_match_full_softmax(tiny_llama, chunk, temperature):
    model = tiny_llama(torch.float64)
    ids, attn, mask = _rows()
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(3, 10, generator=gen, dtype=torch.float64)
    b = torch.randn(3, 10, generator=gen, dtype=torch.float64)

    logp, ent = token_logprobs(model, ids, attn, mask, chunk=chunk, temperature=temperature,
                               with_entropy=True)
    got = (a * logp).sum() + (b * ent).sum()
    grads = torch.autograd.grad(got, list(model.parameters()))

    logits = model(input_ids=ids, attention_mask=attn).logits / temperature
    want = torch.zeros((), dtype=torch.float64)
    for i in range(3):
        for t in range(1, 10):
            if mask[i, t]:
                lsm = torch.log_softmax(logits[i, t - 1], -1)
                h = -(lsm.exp() * lsm).sum()
                assert abs(float(ent[i, t].detach()) - float(h.detach())) < 1e-10
                want = want + a[i, t] * lsm[ids[i, t]] + b[i, t] * h
            else:
                assert float(ent[i, t].detach()) == 0.0
    ref = torch.autograd.grad(want, list(model.parameters()))
    assert abs(float(got.detach()) - float(want.detach())) < 1e-9
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-7, atol=1e-10)
    plain = token_logprobs(model, ids, attn, mask, chunk=chunk, temperature=temperature)
    assert torch.equal(plain, logp.detach())


def _groups(make_trajectory) -> list[Group]:
    out = []
    specs = [([1.0, 0.0, 1.0], ["stop", "length", "stop"]), ([0.0, 1.0, 0.5], ["stop"] * 3)]
    for k, (rewards, finishes) in enumerate(specs):
        trajs = []
        for j, (r, f) in enumerate(zip(rewards, finishes)):
            t = make_trajectory([1, 5 + k], [7] * (2 + j), [-0.5] * (2 + j))
            t.reward, t.finish_reason = r, f
            trajs.append(t)
        out.append(Group(sample=trajs[0].sample, trajectories=trajs))
    return out


def test_prepare_batch_masks_truncated_rows_and_puts_kl_in_the_reward(make_trajectory):
    groups = _groups(make_trajectory)
    plain = prepare_batch(groups, advantage_estimators["dr_grpo"], pad_id=0)
    want = torch.tensor([1 / 3, -2 / 3, 1 / 3, -0.5, 0.5, 0.0])
    torch.testing.assert_close(plain.advantages, want)
    assert plain.loss_mask[1].sum() == 3

    masked = prepare_batch(groups, advantage_estimators["dr_grpo"], pad_id=0, mask_truncated=True)
    assert masked.loss_mask[1].sum() == 0 and masked.loss_mask[0].sum() == 2
    torch.testing.assert_close(masked.advantages, want)  # rewards still count in the baseline

    def kl(batch):
        return batch.loss_mask.double() * 0.1  # 0.1 per response token

    shaped = prepare_batch(groups, advantage_estimators["dr_grpo"], pad_id=0,
                           reference_kl=kl, kl_coef=2.0)
    lengths = torch.tensor([2.0, 3, 4, 2, 3, 4])
    r = torch.tensor([1.0, 0, 1, 0, 1, 0.5]) - 2.0 * 0.1 * lengths  # r_i - beta sum_t KL_t
    want_kl = advantage_estimators["dr_grpo"](r, torch.tensor([0, 0, 0, 1, 1, 1]))
    torch.testing.assert_close(shaped.advantages, want_kl)

    token = prepare_batch(groups, advantage_estimators["reinforce_pp_baseline"], pad_id=0,
                          reference_kl=kl, kl_coef=2.0)
    assert token.advantages.shape == token.loss_mask.shape  # token level: [N, L]
    direct = advantage_estimators["reinforce_pp_baseline"](
        torch.tensor([1.0, 0, 1, 0, 1, 0.5]), torch.tensor([0, 0, 0, 1, 1, 1]),
        mask=token.loss_mask, token_rewards=-0.2 * token.loss_mask)
    torch.testing.assert_close(token.advantages, direct.float())


def test_prepare_batch_drops_rows_the_estimator_excludes(make_trajectory):
    groups = _groups(make_trajectory)
    batch = prepare_batch(groups, advantage_estimators["mc_grpo"], pad_id=0)
    assert batch.num_rows == 4  # one pivot per group of 3 left out of the update
    # group 0 rewards 1,0,1 (lengths 2,3,4): stable sort rows 1,0,2, pivot row 0;
    # group 1 rewards 0,1,0.5 (lengths 2,3,4): sort rows 0,2,1, pivot row 2 (0.5)
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.loss_mask.sum(-1).tolist() == [3.0, 4.0, 2.0, 3.0]


def _learner(model, correction=None, entropy_coef=0.0):
    return Learner(model, loss_fn=policy_losses["ppo"], loss_options={}, lr=1e-3,
                   correction_fn=correction, correction_options={"cap": 2.0},
                   entropy_coef=entropy_coef)


def test_learner_correction_is_neutral_on_policy_and_reports_mismatch(tiny_llama,
                                                                     random_trajectories):
    trajs = random_trajectories(6, seed=3)
    model = tiny_llama()
    batch = collate(trajs, torch.linspace(-1, 1, 6), torch.arange(6), pad_id=0)
    with torch.no_grad():
        own = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    on_policy = collate(trajs, torch.linspace(-1, 1, 6), torch.arange(6), pad_id=0)
    on_policy.old_logprobs = own.float()
    m = _learner(model, corrections["tis"]).update(on_policy)
    assert m["correction_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["correction_ess"] == pytest.approx(1.0, abs=1e-6)
    assert m["correction_clipped_frac"] == 0.0 and abs(m["correction_kl"]) < 1e-8

    # the engine's stored log-probs differ: weights = min(pi_train / pi_rollout, 2)
    model2 = tiny_llama()
    m2 = _learner(model2, corrections["tis"]).update(batch)
    lr = (own - batch.old_logprobs.double())[batch.loss_mask.bool()]
    assert m2["correction_weight_mean"] == pytest.approx(float(lr.exp().clamp(max=2).mean()),
                                                         rel=1e-5)
    assert m2["correction_kl"] == pytest.approx(float((lr.exp() - 1 - lr).mean()), rel=1e-4)


def test_entropy_bonus_changes_the_update_only_when_its_coefficient_is_positive(
        tiny_llama, random_trajectories):
    trajs = random_trajectories(5, seed=4)
    batch = collate(trajs, torch.zeros(5), torch.arange(5), pad_id=0)  # A = 0: only entropy
    m0 = _learner(tiny_llama()).update(batch)
    assert "entropy" not in m0 and m0["grad_norm"] == 0.0
    model = tiny_llama()
    with torch.no_grad():
        _, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask,
                                with_entropy=True)
    m1 = _learner(model, entropy_coef=0.1).update(batch)
    want = float((ent * batch.loss_mask).sum() / batch.loss_mask.sum())
    assert m1["entropy"] == pytest.approx(want, rel=1e-5)
    assert m1["loss"] == pytest.approx(-0.1 * want, rel=1e-5) and m1["grad_norm"] > 0


# -- group reward terms ----------------------------------------------------------------------


def _ref_dare(answers, unc, alpha, tau, eps=1e-6):
    """DARE (docs/algorithms.md), written independently: dict-free loops over rollouts."""
    alive = [i for i, a in enumerate(answers) if a is not None]

    def score(idx):
        m = len(idx)
        labels = sorted({answers[i] for i in idx})
        n = {a: sum(answers[i] == a for i in idx) for a in labels}
        u = {a: sum(unc[i] for i in idx if answers[i] == a) / n[a] for a in labels}
        z = sum(n[a] / (u[a] + eps) for a in labels)
        p = {a: n[a] / (u[a] + eps) / z for a in labels}
        umin, umax = min(u.values()), max(u.values())
        un = {a: 0.0 if umax == umin else (u[a] - umin) / (umax - umin) for a in labels}
        return p, {a: (1 - n[a] / m) * (1 - un[a]) for a in labels}

    p, b = score(alive)
    if tau > 0:
        alive = [i for i in alive if p[answers[i]] >= tau]
        if alive:
            p, b = score(alive)
    return [p[answers[i]] + alpha * b[answers[i]] if i in alive else 0.0
            for i in range(len(answers))]


@pytest.mark.parametrize("alpha,tau", [(0.0, 0.0), (0.5, 0.0), (0.7, 0.2)])
def test_dare_matches_reference_on_random_groups(alpha, tau):
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        m = int(torch.randint(2, 12, (1,), generator=gen))
        answers = [None if x == 0 else str(x)
                   for x in torch.randint(0, 4, (m,), generator=gen).tolist()]
        unc = (torch.rand(m, generator=gen) * 2).tolist()
        got = dare_scores(answers, unc, alpha=alpha, tau=tau)
        assert got == pytest.approx(_ref_dare(answers, unc, alpha, tau), abs=1e-12)
    # equal uncertainty, no bonus: the reward is the answer's frequency
    assert dare_scores(["7", "7", "7", "2"], [1.0] * 4, alpha=0.0) == pytest.approx(
        [0.75, 0.75, 0.75, 0.25])


def test_majority_vote_matches_counter_mode():
    gen = torch.Generator().manual_seed(6)
    for _ in range(20):
        answers = [None if x == 0 else str(x)
                   for x in torch.randint(0, 4, (9,), generator=gen).tolist()]
        counts = Counter(a for a in answers if a is not None)
        got = majority_vote_scores(answers)
        if not counts:
            assert got == [0.0] * 9
            continue
        top = max(counts.values())
        mode = next(a for a in answers if counts.get(a) == top)
        assert got == [1.0 if a == mode else 0.0 for a in answers]


def test_group_terms_add_weighted_scores_in_place(make_trajectory):
    trajs = [make_trajectory([1], [5] * n, [-0.2] * n) for n in (3, 5, 6)]
    for t, text in zip(trajs, ["so 41 #### 42", "42", "#### 7"]):
        t.text, t.reward = text, 0.25
    group = Group(sample=trajs[0].sample, trajectories=trajs)
    apply_group_rewards([group], [
        GroupTerm("majority_vote", get_group_reward("majority_vote"), 2.0),
        GroupTerm("overlong", get_group_reward("overlong"), 0.5, {"max_tokens": 6, "buffer": 2}),
    ])
    assert [answer_of(t.text) for t in trajs] == ["42", "42", "7"]
    assert [t.scores["majority_vote"] for t in trajs] == [1.0, 1.0, 0.0]
    assert [t.scores["overlong"] for t in trajs] == [0.0, -0.5, -1.0]
    assert [t.reward for t in trajs] == pytest.approx([2.25, 2.0, -0.25])


def test_overlong_penalty_piecewise_boundaries():
    # L_max 20, L_cache 4: 0 up to 16, then linear to -1 at 20, -1 beyond; off with buffer 0
    want = {0: 0.0, 16: 0.0, 17: -0.25, 19: -0.75, 20: -1.0, 25: -1.0}
    for n, v in want.items():
        assert overlong_penalty(n, 20, 4) == pytest.approx(v)
    assert overlong_penalty(20, 20, 0) == 0.0
    assert math.isclose(overlong_penalty(18, 20, 4), (16 - 18) / 4)


def test_docs_page_lists_every_registered_name():
    from pathlib import Path

    from rollwise.algos import kl_estimators
    from rollwise.rewards.group import GROUP_REWARDS

    page = (Path(__file__).parents[1] / "docs" / "algorithms.md").read_text()
    names = [*advantage_estimators, *policy_losses, *kl_estimators, *corrections,
             *(n for n in GROUP_REWARDS if n != "overlong")]
    missing = [n for n in names if f"`{n}`" not in page]
    assert not missing, f"docs/algorithms.md lacks {missing}"
