"""Learner: chunked log-probs, collate / micro-batches, and updates, against slow references."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from rollwise.algos import kl_estimators, policy_losses
from rollwise.learner import Learner, collate, micro_batches, token_logprobs

AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


# -- reference log-probs ---------------------------------------------------------------------


def _padded_rows(vocab: int = 88, seed: int = 0):
    """Three right-padded rows (prompt, response, padding) of different lengths; pad id 0."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (3, 11), generator=gen)
    attn = torch.zeros(3, 11, dtype=torch.long)
    loss_mask = torch.zeros(3, 11)
    for i, (prompt, response) in enumerate([(4, 7), (3, 4), (2, 3)]):
        attn[i, : prompt + response] = 1
        loss_mask[i, prompt: prompt + response] = 1
    ids[attn == 0] = 0
    return ids, attn, loss_mask


def _reference_entries(model, ids, attn, loss_mask, temperature=1.0):
    """{(row, t): log softmax(logits[row, t-1] / T)[ids[row, t]]} for every response position,
    from the plain Hugging Face forward pass (full logits), one entry at a time."""
    logits = model(input_ids=ids, attention_mask=attn).logits
    out = {}
    for i in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if loss_mask[i, t]:
                out[(i, t)] = torch.log_softmax(logits[i, t - 1] / temperature, -1)[ids[i, t]]
    return out


def _check_values(got, ref, loss_mask, tol):
    for i in range(got.shape[0]):
        for t in range(got.shape[1]):
            if (i, t) in ref:
                assert abs(float(got[i, t]) - float(ref[(i, t)].detach())) < tol, (i, t)
            else:
                assert float(got[i, t]) == 0.0, (i, t)  # outside the loss mask: exactly 0
    assert len(ref) == int(loss_mask.sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_token_logprobs_equal_full_forward_float32(tiny_llama, chunk, temperature) -> None:
    model = tiny_llama()
    ids, attn, loss_mask = _padded_rows()
    with torch.no_grad():
        got = token_logprobs(model, ids, attn, loss_mask, chunk=chunk, temperature=temperature)
        ref = _reference_entries(model, ids, attn, loss_mask, temperature)
    assert got.shape == ids.shape
    _check_values(got, ref, loss_mask, tol=1e-5)


def _weights(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _grads_float64(tiny_llama, chunk, temperature):
    """(token_logprobs, d(sum w * logp)/d params) and the same from the reference forward."""
    model = tiny_llama(torch.float64)
    ids, attn, loss_mask = _padded_rows()
    w = _weights(ids.shape)
    params = list(model.parameters())
    got = token_logprobs(model, ids, attn, loss_mask, chunk=chunk, temperature=temperature)
    grads = torch.autograd.grad((got.double() * w).sum(), params)
    ref = _reference_entries(model, ids, attn, loss_mask, temperature)
    ref_grads = torch.autograd.grad(sum(w[k] * v for k, v in ref.items()), params)
    return got, ref, grads, ref_grads, loss_mask


@pytest.mark.parametrize("chunk, temperature", [(1, 1.0), (3, 0.7), (1000, 1.0)])
def test_token_logprobs_gradients_match_reference_all_parameters(tiny_llama, chunk,
                                                                 temperature) -> None:
    got, ref, grads, ref_grads, loss_mask = _grads_float64(tiny_llama, chunk, temperature)
    _check_values(got.detach(), ref, loss_mask, tol=1e-5)
    assert len(grads) == 9 * 2 + 2  # every parameter: 2 layers x 9, final norm, tied embedding
    for g, r in zip(grads, ref_grads):
        assert r.abs().max() > 0
        torch.testing.assert_close(g, r, rtol=0, atol=1e-5 * float(r.abs().max()))


def test_token_logprobs_float64_exact(tiny_llama) -> None:
    got, ref, grads, ref_grads, loss_mask = _grads_float64(tiny_llama, 3, 0.7)
    _check_values(got.detach(), ref, loss_mask, tol=1e-10)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


def test_token_logprobs_chunk_sizes_agree(tiny_llama) -> None:
    model = tiny_llama(torch.float64)
    ids, attn, loss_mask = _padded_rows(seed=3)
    w = _weights(ids.shape, seed=4)
    results = []
    for chunk in (1, 3, 10_000):
        model.zero_grad()
        out = token_logprobs(model, ids, attn, loss_mask, chunk=chunk, temperature=0.9)
        (out.double() * w).sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    for out, grads in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=0, atol=1e-12)
        for g, g0 in zip(grads, results[0][1]):
            torch.testing.assert_close(g, g0, rtol=0, atol=1e-10 * float(g0.abs().max()))


# -- collate and micro-batches ---------------------------------------------------------------


def test_collate_layout(make_trajectory) -> None:
    trajs = [make_trajectory([1, 5, 6], [7, 8], [-0.5, -1.5], version=3),
             make_trajectory([1, 9], [10, 11, 12, 13], [-1.0, -2.0, -3.0, -4.0], version=4),
             make_trajectory([1, 5, 6, 7, 8], [2], [-0.25], version=5)]
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1])
    b = collate(trajs, adv, groups, pad_id=3)
    assert b.input_ids.shape == (3, 6) and b.num_rows == 3 and b.num_response_tokens == 7
    pad, none = 3, -1
    assert b.input_ids.tolist() == [[1, 5, 6, 7, 8, pad], [1, 9, 10, 11, 12, 13],
                                    [1, 5, 6, 7, 8, 2]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1] * 6, [1] * 6]
    assert b.loss_mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]]
    assert b.old_logprobs.tolist() == [[0, 0, 0, -0.5, -1.5, 0], [0, 0, -1, -2, -3, -4],
                                       [0, 0, 0, 0, 0, -0.25]]
    assert b.versions.tolist() == [[none, none, none, 3, 3, none], [none, none, 4, 4, 4, 4],
                                   [none] * 5 + [5]]
    assert b.advantages.dtype == torch.float32 and b.advantages.tolist() == [0.5, -1.0, 2.0]
    assert torch.equal(b.group_ids, groups)


def test_collate_positions_align_with_token_logprobs(tiny_llama, random_trajectories) -> None:
    # the log-prob placed at a response position is that of the token there given its prefix
    model = tiny_llama()
    trajs = random_trajectories(5, seed=2)
    b = collate(trajs, torch.zeros(5), torch.arange(5), pad_id=0)
    with torch.no_grad():
        got = token_logprobs(model, b.input_ids, b.attention_mask, b.loss_mask)
        for i, t in enumerate(trajs):
            seq = torch.tensor([t.prompt_ids + t.response_ids])
            logp = torch.log_softmax(model(input_ids=seq).logits[0], -1)
            p = len(t.prompt_ids)
            for k, tok in enumerate(t.response_ids):
                assert abs(float(got[i, p + k]) - float(logp[p + k - 1, tok])) < 1e-5


@pytest.mark.parametrize("max_tokens", [1, 5, 9, 12, 20, 33, 10**6])
def test_micro_batches_partition_rows_within_token_bound(random_trajectories, max_tokens) -> None:
    trajs = random_trajectories(11, seed=5)
    b = collate(trajs, torch.zeros(11), torch.zeros(11, dtype=torch.long), pad_id=0)
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
    parts = micro_batches(b, max_tokens)
    rows = sorted(i for part in parts for i in part.tolist())
    assert rows == list(range(11))  # every row exactly once
    for part in parts:
        idx = part.tolist()
        assert len(idx) >= 1
        if len(idx) > 1:
            assert len(idx) * max(lengths[i] for i in idx) <= max_tokens
    if max_tokens == 1:
        assert len(parts) == 11
    if max_tokens == 10**6:
        assert len(parts) == 1


# -- learner updates ---------------------------------------------------------------------------


def _learner(model, *, aggregation="token-mean", lr=1e-3, micro_batch_tokens=4096,
             kl_coef=0.0, max_tokens=None, **kw) -> Learner:
    options = {"clip_low": 0.2, "clip_high": 0.28, "aggregation": aggregation}
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    return Learner(model, loss_fn=policy_losses["ppo"], loss_options=options, lr=lr,
                   kl_fn=kl_estimators["k3"], kl_coef=kl_coef,
                   micro_batch_tokens=micro_batch_tokens, logprob_chunk=4, **kw)


def _batch(random_trajectories, n=6, seed=0):
    trajs = random_trajectories(n, seed=seed)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8, -0.1, 0.6, -0.9][:n])
    return collate(trajs, adv, torch.arange(n) // 2, pad_id=0)


def _perturb(model, seed=7, scale=0.02):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _one_update(tiny_llama, batch, micro_batch_tokens, **kw):
    model = tiny_llama(torch.float64)
    learner = _learner(model, micro_batch_tokens=micro_batch_tokens, **kw)
    if kw.get("kl_coef", 0) > 0:
        _perturb(model)  # the policy moves away from the frozen reference copy
    before = _params(model)
    metrics = learner.update(batch)
    # the learner leaves the accumulated (clipped) gradient in .grad after its step
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return before, _params(model), grads, metrics


def _assert_same_update(tiny_llama, batch, param_atol=1e-6, **kw):
    """One update split into one-row micro-batches vs one micro-batch: same gradient, same
    new weights. Tolerances are float32-level (1e-3 of the Adam step of ~lr = 1e-3), as
    the log-prob path computes in float32 (see test_token_logprobs_float64_exact); an error
    in how micro-batch losses are normalised moves weights by O(lr)."""
    before, split, g_split, m_split = _one_update(tiny_llama, batch, 1, **kw)
    _, whole, g_whole, m_whole = _one_update(tiny_llama, batch, 10**6, **kw)
    assert len(micro_batches(batch, 1)) == batch.num_rows
    moved = max(float((split[n] - before[n]).abs().max()) for n in before)
    assert moved > 0.5e-3  # Adam's first step moves weights by about lr
    for name in before:
        scale = float(g_whole[name].abs().max())
        torch.testing.assert_close(g_split[name], g_whole[name], rtol=0, atol=1e-6 * scale,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
        torch.testing.assert_close(split[name], whole[name], rtol=0, atol=param_atol,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert m_split["loss"] == pytest.approx(m_whole["loss"], rel=1e-6, abs=1e-9)
    if "kl" in m_whole:
        assert m_split["kl"] == pytest.approx(m_whole["kl"], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gradient_accumulation_is_exact(tiny_llama, random_trajectories, aggregation) -> None:
    batch = _batch(random_trajectories)
    _assert_same_update(tiny_llama, batch, aggregation=aggregation, max_tokens=16)


@pytest.mark.parametrize("aggregation", AGGREGATIONS[:2])
def test_gradient_accumulation_is_exact_with_kl(tiny_llama, random_trajectories,
                                                aggregation) -> None:
    batch = _batch(random_trajectories)
    _assert_same_update(tiny_llama, batch, aggregation=aggregation, kl_coef=0.5)


def test_gradient_accumulation_is_exact_with_kl_sum_norm(tiny_llama, random_trajectories) -> None:
    batch = _batch(random_trajectories)
    _assert_same_update(tiny_llama, batch, aggregation="seq-mean-token-sum-norm",
                        max_tokens=16, kl_coef=0.5)


def test_gradient_accumulation_is_exact_float64_tight(tiny_llama, random_trajectories) -> None:
    """Per row, one-row micro-batches run each row's very products: the weights agree to
    1e-12. (Grouped, a cut group's pieces run other products than the whole group, and
    transformers' float32 RMSNorm turns float64 reorderings into float32-ulp differences:
    tests/test_learner_shared_prompts.py checks that path with the norm in float64.)"""
    batch = _batch(random_trajectories)
    _assert_same_update(tiny_llama, batch, param_atol=1e-12, aggregation="token-mean",
                        share_prompts=False)


def _sequence_logprob(model, batch, row):
    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    return float(lp[row].sum())


def test_updates_raise_logprob_of_positive_advantage_response(tiny_llama,
                                                              make_trajectory) -> None:
    model = tiny_llama()
    learner = _learner(model, lr=1e-2)
    prompt = [1, 5, 6, 7]
    trajs = [make_trajectory(prompt, [10, 11, 12, 13]), make_trajectory(prompt, [20, 21, 22, 2])]
    adv = torch.tensor([1.0, -1.0])
    start = _params(model)
    history = []
    for _ in range(3):
        batch = collate(trajs, adv, torch.zeros(2, dtype=torch.long), pad_id=0)
        with torch.no_grad():  # on-policy: old log-probs are the current ones
            batch.old_logprobs = token_logprobs(model, batch.input_ids, batch.attention_mask,
                                                batch.loss_mask)
        history.append((_sequence_logprob(model, batch, 0), _sequence_logprob(model, batch, 1)))
        metrics = learner.update(batch)
        assert metrics["skipped_nonfinite"] == 0.0
        assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # on-policy
    history.append((_sequence_logprob(model, batch, 0), _sequence_logprob(model, batch, 1)))
    pos = [h[0] for h in history]
    neg = [h[1] for h in history]
    assert all(b > a for a, b in itertools.pairwise(pos)), pos  # up at every update
    assert pos[-1] - pos[0] > 0.5  # a clear change, not rounding
    assert neg[-1] < neg[0] - 0.5, neg  # Adam at lr 1e-2 may overshoot on a single step
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, start[n])]
    assert len(changed) == len(start)


@pytest.mark.parametrize("micro_batch_tokens", [1, 10**6])
def test_nonfinite_loss_skips_the_update(tiny_llama, random_trajectories,
                                         micro_batch_tokens) -> None:
    model = tiny_llama()
    learner = _learner(model, micro_batch_tokens=micro_batch_tokens)
    start = _params(model)

    nan_trajs = random_trajectories(4, seed=1)
    longest = max(range(4), key=lambda i: len(nan_trajs[i].prompt_ids + nan_trajs[i].response_ids))
    shortest = min(range(4), key=lambda i: len(nan_trajs[i].prompt_ids + nan_trajs[i].response_ids))
    nan_trajs[shortest].logprobs[-1] = float("nan")  # in the last micro-batch when split
    batch = collate(nan_trajs, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.zeros(4).long(), 0)
    metrics = learner.update(batch)
    assert metrics["skipped_nonfinite"] == 1.0 and learner.nan_skips == 1
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert all(len(s) == 0 for s in learner.optimizer.state.values())  # no Adam step taken

    inf_adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    inf_adv[longest] = float("inf")
    clean = random_trajectories(4, seed=1)
    metrics = learner.update(collate(clean, inf_adv, torch.zeros(4).long(), 0))
    assert metrics["skipped_nonfinite"] == 1.0 and metrics["nan_skips"] == 2.0
    assert learner.nan_skips == 2
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())

    metrics = learner.update(collate(clean, torch.tensor([1.0, -1.0, 0.5, -0.5]),
                                     torch.zeros(4).long(), 0))
    assert metrics["skipped_nonfinite"] == 0.0 and learner.nan_skips == 2
    assert any(not torch.equal(p, start[n]) for n, p in model.named_parameters())


def _kl_reference(model, ref_model, batch) -> float:
    """token-mean of k3(pi_theta, pi_ref) over response tokens, by a loop over tokens."""
    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
        rl = token_logprobs(ref_model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    total, count = 0.0, 0
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if batch.loss_mask[i, t]:
                d = float(rl[i, t]) - float(lp[i, t])
                total += torch.tensor(d, dtype=torch.float64).exp().item() - d - 1
                count += 1
    return total / count


def test_lora_kl_reference_is_the_base_model(tiny_llama, random_trajectories) -> None:
    from peft import LoraConfig, get_peft_model

    base = tiny_llama()
    base_copy = copy.deepcopy(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    learner = _learner(model, lr=1e-2, kl_coef=0.1, aggregation="token-mean")
    assert learner.ref_model is None  # no second copy: adapters are disabled instead
    batch = _batch(random_trajectories, n=4, seed=3)
    start = _params(model)
    first = learner.update(batch)
    assert abs(first["kl"]) < 1e-7  # LoRA B starts at 0: policy == base
    lora = [n for n in start if "lora_" in n]
    frozen = [n for n in start if "lora_" not in n]
    assert len(lora) == 2 * 2 * 2 and frozen
    now = _params(model)
    assert all(torch.equal(now[n], start[n]) for n in frozen)
    assert any(not torch.equal(now[n], start[n]) for n in lora if "lora_B" in n)
    # the next update's KL is measured against the untouched base model
    expected = _kl_reference(model, base_copy, batch)
    assert expected > 1e-5
    second = learner.update(batch)
    assert second["kl"] == pytest.approx(expected, rel=1e-4, abs=1e-9)
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters() if n in frozen)


def test_full_finetune_kl_reference_is_a_frozen_copy(tiny_llama, random_trajectories) -> None:
    model = tiny_llama()
    initial = copy.deepcopy(model)
    learner = _learner(model, lr=1e-2, kl_coef=0.1)
    batch = _batch(random_trajectories, n=4, seed=3)
    assert learner.update(batch)["kl"] == pytest.approx(0.0, abs=1e-7)
    expected = _kl_reference(model, initial, batch)
    assert expected > 1e-5
    assert learner.update(batch)["kl"] == pytest.approx(expected, rel=1e-4, abs=1e-9)
    for p, q in zip(learner.ref_model.parameters(), initial.parameters()):
        assert torch.equal(p, q) and not p.requires_grad


def test_bf16_autocast_loss_close_to_float32(tiny_llama, random_trajectories) -> None:
    batch = _batch(random_trajectories, n=6, seed=4)
    batch.advantages = torch.tensor([1.0, 0.5, 2.0, -0.3, 1.5, 0.7])  # a loss far from 0
    model32 = tiny_llama()
    with torch.no_grad():
        batch.old_logprobs = token_logprobs(model32, batch.input_ids, batch.attention_mask,
                                            batch.loss_mask)
    batch.old_logprobs[batch.loss_mask.bool()] += 0.1  # some ratios off 1
    losses = {}
    for precision in ("float32", "bf16-autocast"):
        model = tiny_llama()
        start = _params(model)
        metrics = _learner(model, precision=precision).update(batch)
        losses[precision] = metrics["loss"]
        assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
        assert any(not torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert abs(losses["float32"]) > 0.5
    assert losses["bf16-autocast"] == pytest.approx(losses["float32"], abs=5e-2)


def test_reported_lr_is_the_one_used(tiny_llama, random_trajectories) -> None:
    model = tiny_llama()
    learner = _learner(model, lr=1e-3, warmup_steps=4)
    batch = _batch(random_trajectories, n=4)
    used = [learner.optimizer.param_groups[0]["lr"]]
    reported = [learner.update(batch)["lr"]]
    assert used[0] == pytest.approx(1e-3 / 4)
    assert reported[0] == pytest.approx(used[0])
