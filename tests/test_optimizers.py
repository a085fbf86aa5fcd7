"""The learner's optimizers (rollwise.learner.optim): torch's fused AdamW against the
default one, torchao's low-bit AdamW against AdamW on a small regression, and a resume
from a checkpoint holding quantized moments against the uninterrupted run.

torchao compiles one kernel per parameter shape (seconds each on this CPU), so the fast tests
use the float8 one (the quickest to compile); 8-bit and 4-bit run with `-m slow`."""

from __future__ import annotations

import sys

import pytest
import torch

from rollwise.learner.optim import build_optimizer, fused_available

torchao = pytest.importorskip("torchao", reason="the low-bit optimizers need torchao")

BETAS = (0.9, 0.999)


def _problem(seed: int = 0):
    """Least squares with a 128 x 64 weight (8192 values: torchao quantizes moments of
    parameters of at least 4096 values whose size is a multiple of its block)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 128, generator=gen)
    y = x @ (torch.randn(128, 64, generator=gen) * 0.1)
    return x, y


def _train(name: str, steps: int, weight=None, opt_state=None, lr: float = 1e-2):
    """(weight, losses, optimizer) after `steps` steps of `name` from `weight` (zeros)."""
    x, y = _problem()
    w = torch.nn.Parameter(torch.zeros(128, 64) if weight is None else weight.clone())
    opt = build_optimizer(name, [w], lr=lr, betas=BETAS, weight_decay=0.01)
    if opt_state is not None:
        from rollwise.learner.optim import load_plain_state
        load_plain_state(opt, opt_state)
    losses = []
    for _ in range(steps):
        loss = ((x @ w - y) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return w.detach(), losses, opt


def test_fused_adamw_equals_the_default_path() -> None:
    """The fused kernel computes the same AdamW update: 20 steps agree to float32 rounding
    (a few ulps of the weights, far below one step's change of lr = 1e-2); `adamw` is
    torch's default implementation, exactly."""
    w = torch.nn.Parameter(torch.zeros(128, 64))
    assert fused_available([w])
    assert build_optimizer("adamw-fused", [w], lr=1e-2, betas=BETAS,
                           weight_decay=0.0).defaults["fused"]
    assert not build_optimizer("adamw", [w], lr=1e-2, betas=BETAS,
                               weight_decay=0.0).defaults["fused"]
    fused, _, _ = _train("adamw-fused", 20)
    plain, _, _ = _train("adamw", 20)
    x, y = _problem()
    ref = torch.nn.Parameter(torch.zeros(128, 64))
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=BETAS, weight_decay=0.01)
    for _ in range(20):
        opt.zero_grad(set_to_none=True)
        ((x @ ref - y) ** 2).mean().backward()
        opt.step()
    assert torch.equal(plain, ref.detach())
    torch.testing.assert_close(fused, ref.detach(), rtol=1e-5, atol=1e-6)


def _tracks_adamw(name: str, bound: float) -> None:
    """30 steps of `name` end within `bound` (relative) of AdamW's weights and at AdamW's
    loss within 5%. The bound comes from the moments' rounding: float8 e4m3 keeps 3
    mantissa bits (relative error up to 2^-4 on each moment), so m / sqrt(v) is off by at
    most about 2^-4 + 2^-5 ~ 9.4% a step; 8-bit codes are at least as fine near a block's
    largest values. A wrong update (a sign, a missed bias correction) is off by 100%."""
    ref, ref_losses, _ = _train("adamw", 30)
    w, losses, opt = _train(name, 30)
    assert type(opt.state[opt.param_groups[0]["params"][0]]["exp_avg"]) is not torch.Tensor
    assert float((w - ref).norm() / ref.norm()) < bound
    assert losses[-1] < 0.05 * losses[0]
    assert losses[-1] == pytest.approx(ref_losses[-1], rel=0.05)


@pytest.mark.slow  # `make test` stays within 8 minutes on 2 cores
def test_float8_adamw_tracks_adamw() -> None:
    _tracks_adamw("adamw-fp8", bound=0.094)


@pytest.mark.slow
def test_8bit_adamw_tracks_adamw() -> None:
    _tracks_adamw("adamw8bit", bound=0.094)


@pytest.mark.slow
def test_4bit_adamw_decreases_the_loss() -> None:
    """4-bit moments (one of 16 levels per block of 128) are too coarse to track AdamW's
    trajectory step by step (33% apart after 30 steps here); the loss still falls."""
    _, losses, _ = _train("adamw4bit", 30)
    assert losses[-1] < 0.15 * losses[0]


def test_resume_from_quantized_moments_equals_the_uninterrupted_run(tmp_path) -> None:
    """5 steps, a checkpoint written as safetensors + JSON (learner/checkpoint.py), 5 more
    in a new optimizer: bit-identical to 10 uninterrupted steps."""
    from rollwise.learner.checkpoint import load_tree, save_tree
    from rollwise.learner.optim import plain_state

    whole, _, _ = _train("adamw-fp8", 10)
    half, _, opt = _train("adamw-fp8", 5)
    save_tree(tmp_path, "optimizer", plain_state(opt.state_dict()))
    state = load_tree(tmp_path, "optimizer")
    assert state["state"][0]["exp_avg"]["quantized"] == "OptimStateFp8"
    resumed, _, _ = _train("adamw-fp8", 5, weight=half, opt_state=state)
    assert torch.equal(resumed, whole)


@pytest.mark.slow  # `make test` stays within 8 minutes on 2 cores
def test_learner_trains_and_resumes_with_a_low_bit_optimizer(tiny_llama, random_trajectories,
                                                             tmp_path) -> None:
    """The learner's state dict (optimizer + learning-rate schedule) round-trips through a
    checkpoint with torchao's optimizer, and the next update equals the uninterrupted one."""
    from rollwise.algos import policy_losses
    from rollwise.learner import Learner, collate
    from rollwise.learner.checkpoint import load_tree, save_tree

    batch = collate(random_trajectories(4), torch.tensor([1.0, -0.5, 0.3, -1.2]),
                    torch.arange(4) // 2, pad_id=0)

    def learner(model):
        return Learner(model, loss_fn=policy_losses["ppo"], lr=1e-3, logprob_chunk=4,
                       loss_options={"aggregation": "token-mean"}, optimizer="adamw-fp8",
                       lr_schedule="linear", total_steps=4)

    a_model, b_model = tiny_llama(), tiny_llama()
    a = learner(a_model)
    start = [p.detach().clone() for p in a_model.parameters()]
    a.update(batch)
    assert any(not torch.equal(p, q) for p, q in zip(a_model.parameters(), start))
    save_tree(tmp_path, "optimizer", a.state_dict())
    b_model.load_state_dict(a_model.state_dict())
    b = learner(b_model)
    b.load_state_dict(load_tree(tmp_path, "optimizer"))
    a.update(batch)
    b.update(batch)
    for p, q in zip(a_model.parameters(), b_model.parameters()):
        assert torch.equal(p, q)


def test_a_missing_torchao_is_named(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    w = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ImportError, match=r"rollwise\[lowbit\]"):
        build_optimizer("adamw8bit", [w], lr=1e-3, betas=BETAS, weight_decay=0.0)
    with pytest.raises(ValueError, match="unknown learner.optimizer"):
        build_optimizer("sgd", [w], lr=1e-3, betas=BETAS, weight_decay=0.0)


@pytest.mark.slow  # `make test` stays within 8 minutes on 2 cores
def test_loading_a_model_beside_torchao_prints_no_import_noise() -> None:
    """transformers imports torchao at every model load when it is installed; its warnings
    about GPU-only kernels (and torch's deprecation notes) must not reach a run's output."""
    import subprocess

    code = ("import rollwise, rollwise.models.tiny\n"
            "import transformers.quantizers.auto\n"  # what imports torchao
            "import torchao\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Failed to load" not in out.stderr and "deprecated" not in out.stderr, out.stderr
