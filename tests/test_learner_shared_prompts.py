"""The grouped layer pass (rollwise.learner.grouped): each group's prompt once, every
response beside it. Log-probs and every parameter gradient equal the per-row pass's.

Bounds. float64 is where equality is checked tightly: log-probs to 1e-9, gradients to 1e-9
relative to each tensor's largest entry. transformers' RMSNorm computes in float32 even in a
float64 model, so two passes whose norm inputs differ by one float64 rounding can round to
float32 differently (6e-8 relative); the `exact_norms` fixture makes the norm float64 for
these tests, as everything else already is. In float32 the two passes sum the same products
in other orders and shapes: each layer's relative error is at most about sqrt(n) * u (u =
2^-24, n the longest reduction, a random-walk bound), L layers compound it: gradients within
L * sqrt(n) * u relative (n = 1536, the MLP's width, for the SmolLM2 shape; 384 for the tiny
model), times 4 for the backward's second product. Under bfloat16 autocast u = 2^-8.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollwise.learner import grouped
from rollwise.learner.batch import group_micro_batches
from rollwise.learner.logprobs import token_logprobs
from rollwise.types import Batch


@pytest.fixture
def exact_norms(monkeypatch):
    """RMSNorm in the model's own dtype (float64 here), not float32 (module docstring)."""
    from transformers.models.llama import modeling_llama

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                               + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


def smollm2_shape(layers: int = 2, vocab: int = 256) -> LlamaForCausalLM:
    """SmolLM2-135M's layer shape (576 wide, MLP 1536, 9 query and 3 key/value heads, tied
    embeddings), `layers` deep, a small vocabulary."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
        max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)).eval()


def rows(sizes: list[int], prompt_lens: list[int], seed: int = 0, vocab: int = 88,
         response: tuple[int, int] = (1, 9)):
    """(ids, attention mask, loss mask, group ids): group g has sizes[g] rows sharing a
    prompt of prompt_lens[g] tokens, each with its own response; right-padded."""
    gen = torch.Generator().manual_seed(seed)
    out, groups = [], []
    for g, (n, p) in enumerate(zip(sizes, prompt_lens)):
        prompt = [1] + torch.randint(4, vocab, (p - 1,), generator=gen).tolist()
        for _ in range(n):
            r = int(torch.randint(*response, (1,), generator=gen))
            out.append((prompt, torch.randint(4, vocab, (r,), generator=gen).tolist()))
            groups.append(g)
    width = max(len(p) + len(r) for p, r in out)
    ids = torch.zeros(len(out), width, dtype=torch.long)
    att = torch.zeros(len(out), width, dtype=torch.long)
    mask = torch.zeros(len(out), width, dtype=torch.float64)
    for i, (p, r) in enumerate(out):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        att[i, : len(p) + len(r)] = 1
        mask[i, len(p): len(p) + len(r)] = 1
    return ids, att, mask, torch.tensor(groups)


def mixed(vocab: int = 88):
    """Groups of 8, 3 and 1 rows; one row truncated (no trained token: it leaves the
    forward), one multi-turn (tokens an environment inserted, not trained, mid-response)."""
    ids, att, mask, groups = rows([8, 3, 1], [9, 5, 7], vocab=vocab, response=(4, 12))
    mask[2] = 0  # truncated under mask_truncated
    start = int(mask[9].nonzero()[0])
    mask[9, start + 1: start + 3] = 0  # an environment's tokens
    return ids, att, mask, groups


def grads(model, ids, att, mask, share: bool, with_entropy: bool = False):
    """(log-probs, entropies or None, every parameter's gradient) of a fixed weighted sum."""
    out = token_logprobs(model, ids, att, mask, share_prompts=share, with_entropy=with_entropy)
    logp, ent = out if with_entropy else (out, None)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(ids.shape, generator=gen, dtype=torch.float64).to(logp.dtype)
    loss = (logp * w).sum() + (0 if ent is None else (ent * w.flip(0)).sum())
    params = [p for p in model.parameters() if p.requires_grad]
    return logp.detach(), ent, torch.autograd.grad(loss, params)


def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest difference, relative to each tensor's largest entry."""
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-300))
               for x, y in zip(a, b))


@pytest.mark.parametrize("shape", ["tiny", "smollm2-layers"])
def test_grouped_pass_equals_per_row_float64(tiny_llama, exact_norms, shape) -> None:
    model = (tiny_llama() if shape == "tiny" else smollm2_shape()).double()
    vocab = model.config.vocab_size
    ids, att, mask, _ = mixed(vocab)
    plan = grouped.plan_groups(ids, att, mask)
    # one prefix pass per group of two or more rows; the truncated row does not run
    assert plan.pre_len.tolist() == [8, 4, 0] and plan.suf_len.shape[0] == 11
    assert plan.run_tokens() == 8 + 4 + int(att.sum(-1)[[0, 1, *range(3, 8)]].sum()) - 7 * 8 \
        + int(att.sum(-1)[8:11].sum()) - 3 * 4 + int(att.sum(-1)[11])
    a_logp, a_ent, a_g = grads(model, ids, att, mask, share=False, with_entropy=True)
    b_logp, b_ent, b_g = grads(model, ids, att, mask, share=True, with_entropy=True)
    assert torch.equal(a_logp != 0, mask.bool())  # every trained token, nothing else
    assert torch.allclose(b_logp, a_logp, rtol=0, atol=1e-9)
    assert torch.allclose(b_ent, a_ent, rtol=0, atol=1e-9)
    assert worst(b_g, a_g) <= 1e-9


@pytest.mark.parametrize("autocast", [False, True, "bf16-weights"])
def test_grouped_pass_equals_per_row_float32_and_bf16(autocast) -> None:
    """SmolLM2's layer shape, 2 layers: within L * sqrt(n) * u relative (module docstring),
    n = 1536, u = 2^-24 in float32, 2^-8 under bfloat16 autocast and with bfloat16 weights
    (the bfloat16 master's model)."""
    model = smollm2_shape()
    if autocast == "bf16-weights":
        model = model.to(torch.bfloat16)
    ids, att, mask, _ = mixed(model.config.vocab_size)
    u = 2.0**-8 if autocast else 2.0**-24
    bound = 4 * 2 * math.sqrt(1536) * u
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is True):
        a_logp, _, a_g = grads(model, ids, att, mask, share=False)
        b_logp, _, b_g = grads(model, ids, att, mask, share=True)
    scale = float(a_logp.abs().max())
    assert float((b_logp - a_logp).abs().max()) <= bound * scale
    assert worst(b_g, a_g) <= bound
    if not autocast:
        assert worst(b_g, a_g) < 1e-4  # observed about 1e-6: the bound has room


def batch_of(ids, att, mask, groups, advantages=None) -> Batch:
    n = ids.shape[0]
    adv = advantages if advantages is not None else torch.linspace(-1, 1, n, dtype=torch.float64)
    return Batch(input_ids=ids, attention_mask=att, loss_mask=mask.float(),
                 old_logprobs=(-2.0 * mask).float(), advantages=adv.float(), group_ids=groups,
                 versions=torch.zeros_like(ids))


def test_micro_batches_hold_whole_groups_and_count_the_prefix_once() -> None:
    ids, att, mask, groups = rows([4, 4, 2], [30, 20, 10], response=(3, 6))
    batch = batch_of(ids, att, mask, groups)
    lengths = att.sum(-1).tolist()

    def cost(members):
        p = int(mask[members[0]].nonzero()[0]) - 1
        return p + sum(lengths[r] - p for r in members)

    units = [list(range(0, 4)), list(range(4, 8)), [8, 9]]
    total = sum(cost(u) for u in units)
    whole = group_micro_batches(batch, total)
    assert [(sorted(i.tolist()), cut) for i, cut, _ in whole] == [(list(range(10)), None)]
    # a budget that fits the two largest groups but not all three: whole groups, no cut
    two = group_micro_batches(batch, cost(units[0]) + cost(units[1]))
    assert sorted(sorted(i.tolist()) for i, _, _ in two) == [list(range(8)), [8, 9]]
    # a budget below the largest group: it is cut, each piece within budget prefix included
    small = cost(units[0]) - 1
    cut = [(i.tolist(), c, k) for i, c, k in group_micro_batches(batch, small) if c is not None]
    assert len(cut) >= 2 and len({c for _, c, _ in cut}) == 1
    assert sorted(r for i, _, _ in cut for r in i) == units[0]
    for members, _, k in cut:
        assert k == 29 and k + sum(lengths[r] - k for r in members) <= small
    # sharded ranks do not cut: the group runs whole, over the budget
    assert all(c is None for _, c, _ in group_micro_batches(batch, small, split=False))


def learner(model, **kw):
    from rollwise.algos import policy_losses
    from rollwise.learner import Learner

    return Learner(model, loss_fn=policy_losses["ppo"], loss_options={}, lr=1e-2,
                   grad_clip=0.0, **kw)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=16,
                                            target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():  # lora_B starts at 0: move it, so that A's gradients are not 0
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft


CASES = {  # learner settings, LoRA; each update compared with sharing off
    "kl-frozen-reference+entropy": ({"kl_coef": 0.1, "entropy_coef": 0.01}, False),
    "kl-lora-reference": ({"kl_coef": 0.1}, True),
    "tis": ({"correction": "tis"}, False),
    "checkpointing": ({"activation_checkpointing": True}, False),
    "cut-groups": ({"micro_batch_tokens": 24}, False),
    "cut-groups+checkpointing+kl": ({"micro_batch_tokens": 24, "activation_checkpointing": True,
                                     "kl_coef": 0.1}, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_learner_update_equals_per_row(tiny_llama, exact_norms, case) -> None:
    """One update from the same float64 start, prompts grouped and per row: the same
    gradients (compared before Adam, whose first step is sign(g) x lr and would magnify
    rounding near g = 0) and figures, to 1e-9 relative."""
    from rollwise.algos import corrections, kl_estimators

    settings, lora = CASES[case]
    settings = dict(settings)
    ids, att, mask, groups = mixed()
    batch = batch_of(ids, att, mask, groups)
    if settings.pop("correction", None):
        settings |= {"correction_fn": corrections["tis"], "correction_options": {}}
        batch.old_logprobs = batch.old_logprobs - 0.1 * mask.float()  # behaviour != learner
    if settings.get("kl_coef"):
        settings["kl_fn"] = kl_estimators["k3"]
    base = tiny_llama(torch.float64)
    out = []
    for share in (False, True):
        model = copy.deepcopy(base)
        model = _lora(model) if lora else model
        run = learner(model, share_prompts=share, **settings)
        if share and "micro_batch_tokens" in settings:
            plan = run._plan(batch)
            assert any(m.cut is not None for m in plan)  # the 8-row group is cut
        figures = run.update(batch)
        out.append((figures, [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    (a, ga), (b, gb) = out
    assert worst(gb, ga) <= 1e-9
    assert max(float(g.abs().max()) for g in ga) > 0
    for key in ("loss", "kl", "entropy"):
        if key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12), key


def test_auto_shares_when_the_flop_model_says_it_pays() -> None:
    """`auto`: long shared prompts run grouped; distinct prompts of one length (nothing to
    save: the grouped pass would only cost its overhead) and short prompts beside long
    responses run per row. The per-row side of the model pads each micro-batch's rows to
    its longest, as that pass does."""
    cfg = smollm2_shape(layers=1).config
    long = batch_of(*rows([8, 8], [512, 512], response=(32, 64)))
    distinct = batch_of(*rows([1] * 8, [40] * 8, response=(50, 51)))
    short = batch_of(*rows([2, 2], [4, 4], response=(120, 122)))
    assert grouped.batch_saving(cfg, long) > 0.7  # the FLOP model: 3.9x at P = 512, R = 64
    assert grouped.batch_saving(cfg, distinct) == pytest.approx(0.0, abs=1e-12)
    assert 0 < grouped.batch_saving(cfg, short) < grouped.AUTO_SAVING
    # ragged rows: the per-row pass runs padding the grouped one does not
    ragged = batch_of(*rows([1] * 8, [40] * 8, response=(10, 90)))
    assert grouped.batch_saving(cfg, ragged) > grouped.AUTO_SAVING
    model = smollm2_shape(layers=1)
    run = learner(model, share_prompts="auto")
    assert run._shares(long) and not run._shares(distinct) and not run._shares(short)


def test_flops_counted_match_the_model_with_one_prefix_pass_per_group() -> None:
    """torch's FLOP counter on the grouped and the per-row forward against the FLOP model
    (`grouped.layer_flops`, plus the output layer's 2 x vocabulary x width per trained
    token), within 2%. The model is given the tokens each pass runs (per row: every row at
    the padded width; grouped: one prefix per group, then the suffixes) and the attention
    pairs its kernels compute (whole padded blocks, as the counter counts them)."""
    from rollwise.bench.common import count_flops

    model = smollm2_shape()
    cfg = model.config
    ids, att, mask, _ = rows([8, 8], [96, 96], vocab=cfg.vocab_size, response=(8, 16))
    n, width = ids.shape
    head = 2 * cfg.vocab_size * cfg.hidden_size * int(mask.sum())
    counted = {}
    for share in (False, True):
        with torch.no_grad():
            counted[share] = count_flops(lambda s=share: token_logprobs(
                model, ids, att, mask, share_prompts=s))[1]
    plan = grouped.plan_groups(ids, att, mask)
    assert plan.pre_len.tolist() == [95, 95]  # one prefix pass per group
    assert plan.run_tokens() == 2 * 95 + int(att.sum()) - n * 95
    k, (r, w) = plan.pre_index.shape[1], plan.suf_index.shape
    per_row = grouped.layer_flops(cfg, n * width, n * width * width) + head
    shared = grouped.layer_flops(cfg, plan.run_tokens(), 2 * k * k + r * w * (k + w)) + head
    assert counted[False] == pytest.approx(per_row, rel=0.02)
    assert counted[True] == pytest.approx(shared, rel=0.02)
    # and the saving the FLOP model predicts for these rows, without padding, is there
    lengths = att.sum(-1).tolist()
    ideal = grouped.row_cost(cfg, lengths) / grouped.grouped_cost(
        cfg, [95, 95], [(95, x - 95) for x in lengths])
    assert counted[False] / counted[True] > 0.9 * ideal > 3.0
