"""Skipping zero-advantage rows: the loss declaration checked against autograd, and the
learner's updates with the skip equal to those without it (several steps, every declared
loss and aggregation), with fewer rows through the model."""

from __future__ import annotations

import pytest
import torch

from rollwise.algos import is_zero_at_zero_advantage, kl_estimators, policy_losses
from rollwise.learner import Learner, collate

AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
DECLARED = sorted(name for name, fn in policy_losses.items() if is_zero_at_zero_advantage(fn))


def test_ppo_gspo_cispo_declare_zero_at_zero_advantage() -> None:
    assert {"ppo", "gspo", "cispo"} <= set(DECLARED)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name", DECLARED)
def test_declared_losses_have_zero_gradient_on_zero_advantage_rows(name, aggregation) -> None:
    """The contract itself, for every loss that declares it: with random log-probs far from
    the old ones (clipping active), rows with advantage 0 get exactly zero gradient, and the
    loss equals the loss of the other rows alone under the same batch totals."""
    gen = torch.Generator().manual_seed(1)
    n, t = 6, 9
    old = -torch.rand(n, t, generator=gen, dtype=torch.float64) * 3
    logp = (old + torch.randn(n, t, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    adv[[1, 4]] = 0.0
    mask = (torch.rand(n, t, generator=gen) > 0.3).double()
    totals = {"num_tokens": float(mask.sum()), "num_seqs": float(n), "max_tokens": t}
    loss, _ = policy_losses[name](logp, old, adv, mask, aggregation=aggregation, **totals)
    loss.backward()
    assert float(logp.grad[[1, 4]].abs().max()) == 0.0
    assert float(logp.grad[[0, 2, 3, 5]].abs().max()) > 0  # the others do get a gradient
    live = torch.tensor([0, 2, 3, 5])
    part, _ = policy_losses[name](logp.detach()[live], old[live], adv[live], mask[live],
                                  aggregation=aggregation, **totals)
    assert float(part) == pytest.approx(float(loss.detach()), rel=1e-12, abs=1e-15)


def _batch(random_trajectories, adv: list[float], seed: int = 0):
    trajs = random_trajectories(len(adv), seed=seed)
    return collate(trajs, torch.tensor(adv), torch.arange(len(adv)) // 2, pad_id=0)


def _count_rows(model) -> list[int]:
    """A one-item list counting the rows that go through the model's decoder."""
    rows = [0]

    def pre(module, args, kwargs):
        rows[0] += int(kwargs["input_ids"].shape[0])

    model.get_decoder().register_forward_pre_hook(pre, with_kwargs=True)
    return rows


def _train(tiny_llama, batches, skip: bool, loss: str, aggregation: str, **kw):
    model = tiny_llama(torch.float64)
    rows = _count_rows(model)
    learner = Learner(model, loss_fn=policy_losses[loss], lr=1e-3, micro_batch_tokens=24,
                      loss_options={"aggregation": aggregation, "max_tokens": 8},
                      kl_fn=kl_estimators["k3"], logprob_chunk=4, skip_zero_advantage=skip,
                      share_prompts=False, **kw)  # per row: the decoder sees each row
    metrics = [learner.update(b) for b in batches]
    return {n: p.detach().clone() for n, p in model.named_parameters()}, metrics, rows[0]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("loss", DECLARED)
def test_skipping_zero_advantage_rows_gives_the_same_updates(tiny_llama, random_trajectories,
                                                             loss, aggregation) -> None:
    """Three steps: some zero rows, all rows zero (Adam still steps on its momentum), some
    zero again. Same weights within float32 rounding of the log-prob path; fewer rows run."""
    batches = [_batch(random_trajectories, [1.0, 0.0, -0.7, 0.0, 0.4, -0.2], seed=0),
               _batch(random_trajectories, [0.0] * 4, seed=1),
               _batch(random_trajectories, [0.0, 0.0, 0.9, -0.9], seed=2)]
    start = {n: p.detach().clone() for n, p in tiny_llama(torch.float64).named_parameters()}
    full, m_full, rows_full = _train(tiny_llama, batches, False, loss, aggregation)
    fast, m_fast, rows_fast = _train(tiny_llama, batches, True, loss, aggregation)
    assert max(float((full[n] - start[n]).abs().max()) for n in start) > 1e-3  # it trained
    for name in full:
        torch.testing.assert_close(fast[name], full[name], rtol=0, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert rows_full == 14 and rows_fast == 6  # 8 zero-advantage rows never ran
    assert [m["rows_skipped_zero_adv"] for m in m_fast] == [2.0, 4.0, 2.0]
    assert [m["lr"] for m in m_fast] == [m["lr"] for m in m_full]  # the schedule still steps


def test_skip_is_off_when_the_loss_has_kl_or_entropy_terms(tiny_llama) -> None:
    """Those terms give zero-advantage rows a gradient, so their rows must run."""
    def make(**kw):
        return Learner(tiny_llama(), loss_fn=policy_losses["ppo"], loss_options={}, lr=1e-3,
                       kl_fn=kl_estimators["k3"], **kw)

    assert make().skip_zero_advantage
    assert not make(kl_coef=0.1).skip_zero_advantage
    assert make(kl_coef=0.1, kl_in_reward=True).skip_zero_advantage  # KL is in the advantage
    assert not make(entropy_coef=0.01).skip_zero_advantage
    assert not make(skip_zero_advantage=False).skip_zero_advantage

    def plain_loss(logprobs, old_logprobs, advantages, mask, **options):  # declares nothing
        return (logprobs * mask).sum(), {}

    undeclared = Learner(tiny_llama(), loss_fn=plain_loss, loss_options={}, lr=1e-3)
    assert not undeclared.skip_zero_advantage
