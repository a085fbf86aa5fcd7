"""bfloat16 master weights with an int8 residual (`learner.master_rounding = "compensated"`,
learner/stochastic.py): the stored pair holds a float32 value to 1/512 of a bfloat16 step,
updates far below a step accumulate as in float32, a checkpoint keeps the residuals, and
the combinations that cannot compensate are refused before a model loads."""

from __future__ import annotations

import pytest
import torch

from rollwise.compose.config import ConfigError, load_config
from rollwise.compose.preflight import check_config
from rollwise.learner.stochastic import (
    StochasticAdamW,
    compensated_load,
    compensated_store,
    compensation_unit,
)


def _step_of(hi: torch.Tensor) -> torch.Tensor:
    """The distance from each bfloat16 value to its neighbour away from zero."""
    up = (hi.view(torch.int16) + 1).view(torch.bfloat16)
    return (up.float() - hi.float()).abs()


def test_the_pair_holds_a_float32_value_to_a_512th_of_a_step() -> None:
    """Store then load: the bfloat16 half is the value's nearest bfloat16 (what the model
    reads), and the pair is within half a residual unit (1/512 of that bfloat16's step) of
    the value, or one unit where the residual saturates (a dropped part over 127.5 units of
    at most 128); the unit is 1/256 of the step, read from the bits."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=gen) * torch.logspace(-4, 1, 50_000)
    hi = torch.empty(x.shape, dtype=torch.bfloat16)
    residual = torch.empty(x.shape, dtype=torch.int8)
    compensated_store(x.clone(), hi, residual)
    assert torch.equal(hi, x.to(torch.bfloat16))
    assert torch.equal(compensation_unit(hi) * 256, _step_of(hi))
    error = (compensated_load(hi, residual) - x).abs()
    unit = compensation_unit(hi)
    assert bool((error <= torch.where(residual == 127, unit, unit / 2)).all())
    # bfloat16 alone is off by up to half a step: the residual is what removes it
    assert float((hi.float() - x).abs().max() / error.max()) > 100


def test_updates_far_below_a_step_accumulate_as_in_float32() -> None:
    """200 additions of a tenth of a step to weights near 1 (step 2^-7): round-to-nearest
    never moves them, the compensated pair ends where float32 does, within 200 residual
    units (each store is off by at most one unit, 2^-15 here), and its bfloat16 half is
    within a step of 20 steps up."""
    w = torch.full((1000,), 1.0) + torch.rand(1000, generator=torch.Generator().manual_seed(1)) / 4
    hi, residual = w.to(torch.bfloat16), torch.zeros(1000, dtype=torch.int8)
    nearest, exact = hi.clone(), hi.float()
    delta = 0.1 * 2.0**-7
    for _ in range(200):
        compensated_store(compensated_load(hi, residual).add_(delta), hi, residual)
        nearest = (nearest.float() + delta).to(torch.bfloat16)
        exact += delta
    assert torch.equal(nearest, w.to(torch.bfloat16))
    error = (compensated_load(hi, residual) - exact).abs().max()
    assert float(error) <= 200 * 2.0**-15, float(error)
    moved = (hi.float() - w.to(torch.bfloat16).float()) / 2.0**-7
    assert bool(((moved - 20).abs() <= 1).all())


def test_compensated_adamw_follows_float32_adamw() -> None:
    """The same gradients into torch's float32 AdamW and the compensated one over bfloat16
    weights (float32 moments: those equal bit for bit, the gradients being given): each of
    the 30 updates of lr 1e-4, a twentieth of a step for weights near 0.25, is stored
    within a residual unit, at most 2^-15 |w| (a step is at most 2^-7 |w|), so the masters
    part by at most 30 * 2^-15 * max|w|. Stochastic rounding of the same updates wanders
    about 0.22 * sqrt(30) = 1.2 steps (sd) a weight, and the largest of 10,000 weights
    about four times that: some twenty bounds."""
    gen = torch.Generator().manual_seed(2)
    start = (0.25 + 0.05 * torch.randn(200, 50, generator=gen)).to(torch.bfloat16)
    ref = torch.nn.Parameter(start.float())
    comp = torch.nn.Parameter(start.clone())
    sr = torch.nn.Parameter(start.clone())
    opts = [torch.optim.AdamW([ref], lr=1e-4, weight_decay=0.0),
            StochasticAdamW([comp], lr=1e-4, compensated=True),
            StochasticAdamW([sr], lr=1e-4, seed=3)]
    for _ in range(30):
        g = torch.randn(start.shape, generator=gen)
        for p, opt in zip((ref, comp, sr), opts):
            p.grad = g.to(torch.bfloat16).to(p.dtype)  # the gradients a bfloat16 model gets
            opt.step()
    master = compensated_load(comp.detach(), opts[1].state[comp]["residual"])
    bound = 30 * 2.0**-15 * float(ref.detach().abs().max())
    assert float((master - ref.detach()).abs().max()) <= bound
    assert float((sr.detach().float() - ref.detach()).abs().max()) > 5 * bound


def test_compensated_learner_resumes_bit_for_bit(tiny_llama, random_trajectories, tmp_path):
    """Two updates straight against one, a checkpoint, a fresh model and learner loading
    it, and one more: the same weights and residuals, the residuals still int8 (torch would
    cast them to the parameter's bfloat16 on load) and not all zero."""
    from rollwise.algos import policy_losses
    from rollwise.learner import Learner, collate
    from rollwise.learner.checkpoint import load_checkpoint, save_checkpoint

    def learner(model):
        return Learner(model, loss_fn=policy_losses["ppo"], lr=1e-3, logprob_chunk=4,
                       loss_options={"aggregation": "token-mean"}, master_dtype="bfloat16",
                       master_rounding="compensated", optimizer="adamw-bf16")

    batches = [collate(random_trajectories(6, seed=s), torch.tensor([1.0, -0.5, 0.3, -1.2,
                                                                     0.8, -0.1]),
                       torch.arange(6) // 2, pad_id=0) for s in range(2)]
    straight = learner(tiny_llama())
    for batch in batches:
        straight.update(batch)
    first = learner(tiny_llama())
    first.update(batches[0])
    path = save_checkpoint(tmp_path, first.model, first.state_dict(), {"step": 1})
    resumed = learner(tiny_llama(seed=1))
    state, _ = load_checkpoint(path, resumed.model)
    resumed.load_state_dict(state)
    resumed.update(batches[1])
    for p, q in zip(straight.params, resumed.params):
        assert torch.equal(p, q)
        a, b = straight.optimizer.state[p]["residual"], resumed.optimizer.state[q]["residual"]
        assert b.dtype == torch.int8 and torch.equal(a, b)
    assert any(bool(straight.optimizer.state[p]["residual"].any()) for p in straight.params)


def test_the_residuals_start_from_the_float32_weights(tiny_llama, random_trajectories):
    """A float32 model converted by a compensated learner: after an update with lr 0 each
    master is its float32 weight to two residual units (two stores, the conversion's and
    the update's, each within one), where zero residuals would leave every master on its
    bfloat16 value, up to half a step (128 units) away; the parameters hold no residual of
    their own any more (the optimizer's state does)."""
    from rollwise.algos import policy_losses
    from rollwise.learner import Learner, collate
    from rollwise.learner.stochastic import RESIDUAL

    model = tiny_llama()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    learner = Learner(model, loss_fn=policy_losses["ppo"], lr=0.0, logprob_chunk=4,
                      loss_options={"aggregation": "token-mean"}, master_dtype="bfloat16",
                      master_rounding="compensated", precision="bf16-autocast")
    learner.update(collate(random_trajectories(4), torch.tensor([1.0, -1.0, 0.5, -0.5]),
                           torch.arange(4) // 2, pad_id=0))
    checked = 0
    for name, p in model.named_parameters():
        assert not hasattr(p, RESIDUAL)
        if p.dtype != torch.bfloat16:
            continue  # the norms' gains stay float32
        master = compensated_load(p.detach(), learner.optimizer.state[p]["residual"])
        error = (master - weights[name]).abs()
        assert bool((error <= 2 * compensation_unit(p.detach())).all()), name
        assert float((p.detach().float() - weights[name]).abs().max()) > 50 * float(error.max())
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("sets, names", [
    (["learner.master_rounding='compensated'"], "master_dtype"),
    (["learner.master_rounding='compensated'", "learner.master_dtype='bfloat16'",
      "learner.optimizer='adamw8bit'"], "adamw8bit"),
])
def test_compensation_it_cannot_give_is_refused(sets, names) -> None:
    cfg = load_config(None, sets)
    with pytest.raises(ConfigError, match=names):
        check_config(cfg)
