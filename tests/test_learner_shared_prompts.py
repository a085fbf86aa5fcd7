"""The learner runs each distinct prompt of a micro-batch once (rollwise.learner.logprobs):
log-probs and gradients equal those of running every row in full."""

from __future__ import annotations

import pytest
import torch

from rollwise.learner.logprobs import _shared_prefix_plan, token_logprobs


def _groups(prompt_lens: list[int], rows: int, seed: int = 0, vocab: int = 88):
    """Right-padded rows: len(prompt_lens) groups of `rows` rows sharing a prompt, each
    with its own response of 1-6 tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p in prompt_lens:
        prompt = [1] + torch.randint(4, vocab, (p - 1,), generator=gen).tolist()
        for _ in range(rows):
            r = int(torch.randint(1, 7, (1,), generator=gen))
            out.append((prompt, torch.randint(4, vocab, (r,), generator=gen).tolist()))
    width = max(len(p) + len(r) for p, r in out)
    ids = torch.zeros(len(out), width, dtype=torch.long)
    att = torch.zeros(len(out), width, dtype=torch.long)
    mask = torch.zeros(len(out), width, dtype=torch.float64)
    for i, (p, r) in enumerate(out):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        att[i, : len(p) + len(r)] = 1
        mask[i, len(p): len(p) + len(r)] = 1
    return ids, att, mask


def test_shared_prompts_give_the_same_logprobs_and_gradients(tiny_llama) -> None:
    model = tiny_llama().double()
    ids, att, mask = _groups([5, 7, 4], rows=4)
    assert _shared_prefix_plan(ids, att, mask) is not None  # this batch does share
    full = token_logprobs(model, ids, att, mask, share_prompts=False)
    shared = token_logprobs(model, ids, att, mask, share_prompts=True)
    assert torch.equal(full != 0, mask.bool())  # every response token, nothing else
    # float64: the same function up to summation order
    assert torch.allclose(shared, full, rtol=0, atol=1e-9)
    weights = torch.randn(full.shape, dtype=torch.float64, generator=torch.Generator()
                          .manual_seed(1))
    params = [p for p in model.parameters()]
    g_full = torch.autograd.grad((full * weights).sum(), params, allow_unused=True)
    g_shared = torch.autograd.grad(
        (token_logprobs(model, ids, att, mask) * weights).sum(), params, allow_unused=True)
    for a, b in zip(g_full, g_shared):
        if a is None:
            assert b is None
            continue
        # transformers computes the rotary tables in float32 even for a float64 model, and the
        # shared path asks for other positions in another shape: float32-ulp differences
        # (6e-8 relative) in cos/sin reach the first layer's gradients, nothing larger
        assert torch.allclose(b, a, rtol=1e-6, atol=1e-6 * float(a.abs().max())), \
            float((a - b).abs().max())


def test_sharing_is_skipped_when_it_saves_little() -> None:
    ids, att, mask = _groups([3, 4, 5, 6], rows=1)  # every prompt distinct
    assert _shared_prefix_plan(ids, att, mask) is None
    ids, att, mask = _groups([6], rows=4)
    mask[2] = 0  # a row with no trained token (e.g. masked as truncated)
    assert _shared_prefix_plan(ids, att, mask) is None


@pytest.mark.parametrize("with_entropy", [False, True])
def test_learner_update_is_the_same_with_shared_prompts(tiny_llama, with_entropy) -> None:
    """One PPO update from the same start, sharing on and off: the same gradients (compared
    before Adam, whose first step is sign(g) x lr and would magnify rounding near g = 0)."""
    from rollwise.algos import policy_losses
    from rollwise.learner import Learner
    from rollwise.types import Batch

    ids, att, mask = _groups([6, 8], rows=4, seed=3)
    n = ids.shape[0]
    batch = Batch(input_ids=ids, attention_mask=att, loss_mask=mask.float(),
                  old_logprobs=-2.0 * mask.float(), advantages=torch.linspace(-1, 1, n),
                  group_ids=torch.arange(n) // 4, versions=torch.zeros_like(ids))
    grads, moved = [], []
    for share in (False, True):
        model = tiny_llama()
        start = torch.cat([p.detach().flatten() for p in model.parameters()])
        learner = Learner(model, loss_fn=policy_losses["ppo"], loss_options={}, lr=1e-2,
                          grad_clip=0.0, entropy_coef=0.01 if with_entropy else 0.0,
                          share_prompts=share)
        learner.update(batch)  # the gradients of the step stay in .grad after it
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        moved.append(float((torch.cat([p.detach().flatten() for p in model.parameters()])
                            - start).abs().max()))
    assert min(moved) > 1e-3  # the update moved the parameters
    # float32: the same gradients up to rounding (relative ~1e-6 of the largest)
    scale = float(grads[0].abs().max())
    assert scale > 0
    assert torch.allclose(grads[1], grads[0], rtol=0, atol=1e-5 * scale)
