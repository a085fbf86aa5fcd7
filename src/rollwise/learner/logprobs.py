"""Log-probs of response tokens, with the output layer applied in chunks.

The backbone runs on the whole sequence, but the vocabulary projection (the largest
activation: tokens x vocabulary) runs only on positions that predict a response token, a
chunk at a time, inside one autograd function that recomputes each chunk's logits in the
backward pass instead of storing them. Full-vocabulary logits therefore never exist for more
than `chunk` tokens at once, in the forward or the backward pass.

Rows that share a prompt (the G samples of a GRPO group) share its forward pass: each
distinct prompt runs once and only the responses run per row, in one grouped layer pass
(learner/grouped.py); gradients from every response flow back into the shared prompt.
The function computed is the same (float rounding aside); the tokens processed fall from
N x (P + R) to groups x P + N x R, which matters most when prompts are long beside the
responses (a chat template around a short question).
"""

from __future__ import annotations

import torch

from rollwise.learner import grouped
from rollwise.learner.grouped import backbone_and_head


class _ChunkedTokenLogprob(torch.autograd.Function):
    """log softmax(h W^T / T)[target] for rows of h, chunk by chunk; grads for h and W.

    With `with_entropy` it also returns the entropy H = -sum_v p_v log p_v of each row's
    distribution (else an empty tensor); dH/dz_v = -p_v (z_v - sum_u p_u z_u), z = logits/T.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, temperature, dtype, with_entropy):
        # hidden [M, H], weight [V, H], targets [M] -> [M] in float32 (float64 for float64 models)
        acc = torch.promote_types(dtype, torch.float32)  # softmax precision
        out = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        ent = torch.empty(hidden.shape[0] if with_entropy else 0, dtype=acc, device=hidden.device)
        w = weight.to(dtype)
        lse_all = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                # logits / T = (h / T) W^T: the division on [chunk, H], not on [chunk, V]
                logits = (_scaled(hidden[s: s + chunk].to(dtype), temperature) @ w.T).to(acc)
                picked = logits.gather(1, targets[s: s + chunk, None])[:, 0]
                lse = logits.logsumexp(-1)
                out[s: s + chunk] = picked - lse
                lse_all[s: s + chunk] = lse
                if with_entropy:
                    ent[s: s + chunk] = lse - (logits.softmax(-1) * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.chunk, ctx.temperature, ctx.dtype = chunk, temperature, dtype
        ctx.with_entropy = with_entropy
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, grad_ent):
        hidden, weight, targets, lse_all = ctx.saved_tensors
        chunk, temp, dtype = ctx.chunk, ctx.temperature, ctx.dtype
        w = weight.to(dtype)
        acc = torch.promote_types(dtype, torch.float32)
        use_ent = ctx.with_entropy and grad_ent is not None
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                h = _scaled(hidden[s: s + chunk].to(dtype), temp)  # h / T: dz/dW = (h / T)
                g_out = grad_out[s: s + chunk].to(acc)
                z = (h @ w.T).to(acc)  # [chunk, V] logits / T, recomputed
                centred = None
                if use_ent:
                    probs = z.softmax(-1)
                    centred = z - (probs * z).sum(-1, keepdim=True)
                else:  # softmax from the forward's log-sum-exp, in place: one pass over z
                    probs = z.sub_(lse_all[s: s + chunk, None]).exp_()
                # d logp[target] / dz = onehot(target) - softmax
                coef = g_out[:, None]
                if centred is not None:  # plus g_H * dH/dz = -g_H p (z - E_p z)
                    coef = coef + grad_ent[s: s + chunk].to(acc)[:, None] * centred
                g = probs.mul_(-coef)
                g.scatter_add_(1, targets[s: s + chunk, None], g_out[:, None])
                g = g.to(dtype)  # [chunk, V] dL/dz; dz/dh = W / T
                if grad_h is not None:
                    grad_h[s: s + chunk] = _scaled(g @ w, temp).to(hidden.dtype)
                if grad_w is not None:
                    grad_w += (g.T @ h).to(acc)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """x / temperature, skipped at 1 (no copy)."""
    return x if temperature == 1.0 else x / temperature


class TokenLogprobs(torch.nn.Module):
    """`token_logprobs` of `model` as a module: a sharded learner shards it as its root, so
    that the output layer's weight is gathered around the whole computation."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, loss_mask, **options):
        return token_logprobs(self.model, input_ids, attention_mask, loss_mask, **options)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   loss_mask: torch.Tensor, *, chunk: int = 1024, temperature: float = 1.0,
                   with_entropy: bool = False, share_prompts: bool = True,
                   prefix: grouped.PrefixKV | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[N, L] log pi(input_ids[t] | input_ids[<t]) where loss_mask[t] is 1, else 0; with
    `with_entropy`, also [N, L] the entropy of pi(. | input_ids[<t]) at those positions.

    Right-padded rows (prompt, response, padding); position 0 is never a response token.
    The entropy costs one extra reduction per chunk and is skipped unless asked for. With
    `share_prompts` (and a decoder the grouped pass knows), each group's prompt runs once
    (learner/grouped.py); `prefix`: the rows are pieces of one group whose prefix ran
    before (`grouped.run_prefix`).
    """
    decoder, weight = backbone_and_head(model)
    if prefix is not None or (share_prompts and grouped.install(model)):
        plan = grouped.plan_groups(input_ids, attention_mask, loss_mask, prefix
                                   ).to(input_ids.device)
        h = grouped.grouped_hidden(decoder, plan)
        targets, where = plan.targets, (plan.rows, plan.cols)
    else:
        # no key/value cache: nothing reads it, and it would hold every layer's keys and values
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask,
                         use_cache=False).last_hidden_state
        select = loss_mask[:, 1:].bool()  # [N, L-1] positions t-1 predicting response token t
        h = hidden[:, :-1][select]  # [M, H]
        targets = input_ids[:, 1:][select]  # [M]
        rows, cols = torch.nonzero(select, as_tuple=True)
        where = (rows, cols + 1)
    dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) \
        else h.dtype
    picked, ent = _ChunkedTokenLogprob.apply(h, weight, targets, chunk, temperature, dtype,
                                             with_entropy)

    def scatter(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(input_ids.shape, dtype=values.dtype, device=input_ids.device)
        return out.index_put((where[0], where[1]), values)

    return (scatter(picked), scatter(ent)) if with_entropy else scatter(picked)
