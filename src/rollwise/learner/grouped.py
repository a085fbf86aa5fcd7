"""The grouped layer pass: each group's prompt once, every response beside it, in one pass.

A GRPO group is G responses to one prompt. Run per row, the model processes the prompt G
times. Here every distinct prefix of a micro-batch (the tokens before the position that
predicts a row's first response token) runs once, and each row's suffix (the rest of the
row) runs on its own; in attention a suffix's queries see its group's prefix keys and
its own keys, under one softmax (Prefix Grouper's "prefix self-attention plus suffix
concat-attention"). The outputs and the gradients are those of the per-row pass, float
rounding aside: the gradients of the G suffixes on the shared prefix keys and values add
up, as autograd sums them.

Layout. The tokens that run are one flat stream (`GroupPlan.tokens`: every prefix, then
every suffix, no padding), which the decoder's embedding, projections, MLP and norms see
as one sequence; only attention regroups them, into [groups, longest prefix] for the
prefix self-attention and [rows, longest suffix] for the suffixes. The prefix keys are
read once per group: a group's suffix queries are stacked into one product with them
(`engine.attention.attend_regions`, the engine's own grouped-prefix attention).

The layers are the model's own modules, called one by one (so LoRA, FSDP's per-layer
hooks, bfloat16 autocast and activation checkpointing all see an ordinary layer call);
only the attention function inside them is this module's (`GROUPED`, registered with
transformers), and it falls back to the model's original attention whenever a call does
not carry a plan. A checkpointed layer recomputes both attentions from its input, so
sharing holds under activation checkpointing.

Rows with no trained token leave the forward (their log-probs are 0 anyway); a group of
one row has no prefix pass (its whole row is its suffix). Llama-family decoders
(`SUPPORTED`) run grouped; others run per row.

A group too large for one micro-batch is cut (`split`): its prefix runs once and records
each layer's keys and values (`PrefixKV`); the pieces of its rows then run against
detached copies of them, their gradients on those keys and values accumulate, and one
backward through the prefix follows (`PrefixKV.backward`): an exact sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rollwise.engine.attention import GroupLayout, attend_regions, region_mask
from rollwise.learner.batch import micro_batches, prefix_lengths

GROUPED = "rollwise_grouped"  # the attention implementation's registered name
SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
# learner.share_prompts = "auto" runs a batch grouped when the FLOP model says that saves at
# least this share of the layers' FLOPs: with nothing to save (distinct prompts, rows of one
# length) the grouped pass took 1.10x the per-row one on SmolLM2 (its attention is plain
# products, not the fused kernel; the regrouping gathers), docs/performance.md
AUTO_SAVING = 0.10


@dataclass
class PrefixKV:
    """One group's prefix (its first `length` tokens) as each layer's keys and values:
    recorded by a prefix-only pass (`run_prefix`), or handed to the passes of the group's
    pieces as detached leaves that collect their gradients (`detached`)."""

    length: int
    record: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    given: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def detached(self) -> PrefixKV:
        """A copy for the pieces: the recorded tensors as leaves (needing gradients where
        the recorded ones do)."""
        return PrefixKV(self.length, given={
            i: (k.detach().requires_grad_(k.requires_grad),
                v.detach().requires_grad_(v.requires_grad))
            for i, (k, v) in self.record.items()})

    def backward(self, pieces: PrefixKV) -> None:
        """One backward through the prefix pass with the gradients the pieces left on
        their copies of its keys and values (their sum)."""
        roots, grads = [], []
        for i, (k, v) in self.record.items():
            for mine, theirs in zip((k, v), pieces.given[i]):
                if mine.requires_grad and theirs.grad is not None:
                    roots.append(mine)
                    grads.append(theirs.grad)
        if roots:
            torch.autograd.backward(roots, grads)


@dataclass
class GroupPlan:
    """How a micro-batch's rows run grouped (built on the host, then moved: `to`)."""

    tokens: torch.Tensor  # [T] the flat stream: every prefix, then every suffix
    positions: torch.Tensor  # [T] each token's position in its row
    pre_index: torch.Tensor  # [G, K] flat index of each prefix token (padding: 0)
    pre_len: torch.Tensor  # [G] prefix lengths (0: a group of one row)
    suf_index: torch.Tensor  # [R, W] flat index of each suffix token (padding: 0)
    suf_len: torch.Tensor  # [R] suffix lengths
    group: torch.Tensor  # [R] each running row's group
    place: torch.Tensor  # [R] its place among its group's rows
    predict: torch.Tensor  # [M] flat index of each position predicting a response token
    targets: torch.Tensor  # [M] the token it predicts
    rows: torch.Tensor  # [M] the row (of the micro-batch) of that token
    cols: torch.Tensor  # [M] its column
    width: int  # most rows of one group
    mode: str = "whole"  # whole | prefix (record keys/values) | suffix (given ones)
    kv: PrefixKV | None = None

    def to(self, device) -> GroupPlan:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                 for k, v in self.__dict__.items()}
        return GroupPlan(**moved)

    @property
    def groups(self) -> int:
        return int(self.pre_len.shape[0])

    def run_tokens(self) -> int:
        """Tokens the projections and the MLP process: each prefix once, then the suffixes."""
        return int(self.tokens.shape[0])


def plan_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                loss_mask: torch.Tensor, given: PrefixKV | None = None) -> GroupPlan:
    """The grouped layout of these rows (module docstring), on the host. Rows are grouped
    by their prefix tokens; a row with no trained token is left out (all of them but one
    when none has any: an update still needs a graph). `given`: the rows are pieces of one
    group whose prefix ran before (its first `given.length` tokens): only their suffixes
    run, against its keys and values."""
    ids, lengths = input_ids.cpu(), attention_mask.sum(-1).cpu()
    k = prefix_lengths(loss_mask.cpu())
    running = [r for r in range(ids.shape[0]) if k[r] >= 0] or [0]
    if given is not None:
        groups = [(given.length, running)]
    else:
        keys: dict[tuple[int, ...], list[int]] = {}
        for r in running:
            keys.setdefault(tuple(ids[r, : max(int(k[r]), 0)].tolist()), []).append(r)
        groups = [(len(prefix) if len(rows) > 1 else 0, rows) for prefix, rows in keys.items()]
    tokens, positions, pre_spans = [], [], []
    for start, rows in groups:  # every prefix first
        pre_spans.append((len(tokens), start))
        if given is None:
            tokens += ids[rows[0], :start].tolist()
            positions += range(start)
    order, suf_spans, group_of, place = [], [], [], []
    for g, (start, rows) in enumerate(groups):
        for j, r in enumerate(rows):
            n = int(lengths[r]) - start
            suf_spans.append((len(tokens), n))
            tokens += ids[r, start: start + n].tolist()
            positions += range(start, start + n)
            order.append(r)
            group_of.append(g)
            place.append(j)
    long = torch.long
    kmax = 0 if given is not None else max(n for _, n in pre_spans)
    pre_index = torch.zeros(len(groups), kmax, dtype=long)
    for g, (s, n) in enumerate(pre_spans if given is None else []):
        pre_index[g, :n] = torch.arange(s, s + n)
    suf_index = torch.zeros(len(order), max(n for _, n in suf_spans), dtype=long)
    predict, targets, rows_out, cols = [], [], [], []
    lm = loss_mask.cpu().bool()
    for i, (r, (s, n)) in enumerate(zip(order, suf_spans)):
        suf_index[i, :n] = torch.arange(s, s + n)
        start = groups[group_of[i]][0]
        for t in range(n - 1):  # suffix token t predicts the row's column start + t + 1
            if lm[r, start + t + 1]:
                predict.append(s + t)
                targets.append(int(ids[r, start + t + 1]))
                rows_out.append(r)
                cols.append(start + t + 1)
    return GroupPlan(
        tokens=torch.tensor(tokens, dtype=input_ids.dtype), positions=torch.tensor(positions),
        pre_index=pre_index, pre_len=torch.tensor([n for _, n in pre_spans], dtype=long),
        suf_index=suf_index, suf_len=torch.tensor([n for _, n in suf_spans], dtype=long),
        group=torch.tensor(group_of, dtype=long), place=torch.tensor(place, dtype=long),
        predict=torch.tensor(predict, dtype=long), targets=torch.tensor(targets, dtype=long),
        rows=torch.tensor(rows_out, dtype=long), cols=torch.tensor(cols, dtype=long),
        width=max(len(rows) for _, rows in groups),
        mode="whole" if given is None else "suffix", kv=given)


def run_prefix(model, prefix_ids: torch.Tensor) -> PrefixKV:
    """The prefix pass of a group cut into pieces: its tokens [K] once through every layer,
    each layer's keys and values recorded (with their graph where gradients are on)."""
    n = int(prefix_ids.shape[0])
    kv = PrefixKV(n)
    long, dev = torch.long, prefix_ids.device
    empty = torch.zeros(0, dtype=long, device=dev)
    plan = GroupPlan(tokens=prefix_ids, positions=torch.arange(n, device=dev),
                     pre_index=torch.arange(n, device=dev)[None],
                     pre_len=torch.tensor([n], device=dev), suf_index=empty[None],
                     suf_len=empty, group=empty, place=empty, predict=empty, targets=empty,
                     rows=empty, cols=empty, width=1, mode="prefix", kv=kv)
    grouped_hidden(backbone_and_head(model)[0], plan)
    return kv


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      rollwise_plan: GroupPlan | None = None, **kwargs):
    """transformers' attention interface: query [1, heads, T, hd] and key, value
    [1, kv_heads, T, hd] of the flat stream -> ([1, T, heads, hd], None). Without a plan,
    the model's original attention (`_original`)."""
    if rollwise_plan is None:
        return _original(module)(module, query, key, value, attention_mask, scaling=scaling,
                                 dropout=dropout, **kwargs)
    plan = rollwise_plan
    q, k, v = query[0], key[0], value[0]  # [heads, T, hd]
    heads, kv_heads, hd = q.shape[0], k.shape[0], q.shape[-1]
    rep = heads // kv_heads
    scale = scaling if scaling is not None else hd**-0.5
    out = q.new_zeros(plan.run_tokens(), heads, hd)
    layer = getattr(module, "layer_idx", 0)
    if plan.mode == "suffix":
        pre_k, pre_v = plan.kv.given[layer]
    elif plan.groups and plan.pre_index.shape[1]:
        pre_q = q[:, plan.pre_index].transpose(0, 1)  # [G, heads, K, hd]
        pre_k = k[:, plan.pre_index].transpose(0, 1)
        pre_v = v[:, plan.pre_index].transpose(0, 1)
        pre_out = F.scaled_dot_product_attention(pre_q, pre_k, pre_v, is_causal=True,
                                                 scale=scale, enable_gqa=rep > 1)
        live = torch.arange(plan.pre_index.shape[1], device=q.device) < plan.pre_len[:, None]
        out = out.index_put((plan.pre_index[live],), pre_out.transpose(1, 2)[live].to(out.dtype))
        if plan.mode == "prefix":
            plan.kv.record[layer] = (pre_k, pre_v)
            return out[None], None
    else:
        shape = (max(plan.groups, 1), kv_heads, 0, hd)
        pre_k, pre_v = k.new_zeros(shape), v.new_zeros(shape)
    rows, width = plan.suf_index.shape
    suf = plan.suf_index
    sq = q[:, suf].transpose(0, 1)  # [R, heads, W, hd]
    sq = sq.reshape(rows, kv_heads, rep * width, hd)  # a key head's query heads, then tokens
    sk, sv = k[:, suf].transpose(0, 1), v[:, suf].transpose(0, 1)  # [R, kv_heads, W, hd]
    layout = GroupLayout(plan.group, plan.group, plan.place, pre_k.shape[0], plan.width,
                         fresh=True)
    mask = region_mask(plan.pre_len[plan.group], torch.zeros_like(plan.group), width,
                       pre_k.shape[2], width, rep).to(q.device)
    att = attend_regions(sq, sk, sv, pre_k, pre_v, layout, mask, scale, q.dtype)
    att = att.reshape(rows, heads, width, hd).transpose(1, 2)  # [R, W, heads, hd]
    live = torch.arange(width, device=q.device) < plan.suf_len[:, None]
    out = out.index_put((suf[live],), att[live].to(out.dtype))  # (bfloat16 under autocast)
    return out[None], None


_ORIGINAL = "_rollwise_original_attention"


def _original(module):
    """The attention function the model used before `install` (sdpa, eager, flash...)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(module, _ORIGINAL, "sdpa")
    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    import importlib

    return importlib.import_module(type(module).__module__).eager_attention_forward


def backbone_and_head(model):
    """(callable returning final hidden states [N, L, H], output-layer weight [V, H])."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings().weight


def supported(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(getattr(base, "config", None), "model_type", None) in SUPPORTED


def install(model) -> bool:
    """Route `model`'s attention through `grouped_attention` (registered once with
    transformers; calls without a plan keep the original). False when the architecture is
    not one the grouped pass knows (`SUPPORTED`)."""
    if not supported(model):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(GROUPED, grouped_attention)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    owners: dict[int, tuple] = {}  # config -> the modules holding it
    for m in base.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None:
            owners.setdefault(id(cfg), (cfg, []))[1].append(m)
    for cfg, modules in owners.values():
        current = getattr(cfg, "_attn_implementation", None) or "sdpa"
        if current == GROUPED:
            continue
        for m in modules:  # kept on the modules, not in the config (which exports write out)
            setattr(m, _ORIGINAL, current)
        AttentionMaskInterface.register(GROUPED, ALL_MASK_ATTENTION_FUNCTIONS[
            current if current in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"])
        cfg._attn_implementation = GROUPED
    return True


def grouped_hidden(decoder, plan: GroupPlan) -> torch.Tensor:
    """[M, H] final hidden states of the positions predicting response tokens (prefix mode:
    the prefix pass only, recording keys and values; [0, H])."""
    hidden = decoder.embed_tokens(plan.tokens[None])  # [1, T, H]
    positions = plan.positions[None]
    rotary = decoder.rotary_emb(hidden, position_ids=positions)
    for layer in decoder.layers[: decoder.config.num_hidden_layers]:
        hidden = layer(hidden, attention_mask=None, position_embeddings=rotary,
                       position_ids=positions, rollwise_plan=plan)
        if isinstance(hidden, tuple):  # transformers before 5 returned a tuple
            hidden = hidden[0]
    if plan.mode == "prefix":
        return hidden[0, :0]
    return decoder.norm(hidden)[0, plan.predict]


# -- what it costs: the FLOP model ---------------------------------------------------------

def layer_flops(cfg, tokens: int, pairs: int) -> float:
    """Forward FLOPs of the decoder layers over `tokens` tokens whose queries see `pairs`
    keys in all (2 per multiply-add): the projections and the MLP, 2 x their weights per
    token, and attention, 4 x heads x head size per visible (query, key) pair."""
    hidden, inter = int(cfg.hidden_size), int(cfg.intermediate_size)
    heads = int(cfg.num_attention_heads)
    hd = int(getattr(cfg, "head_dim", None) or hidden // heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    weights = hidden * hd * (2 * heads + 2 * kv) + 3 * hidden * inter
    return int(cfg.num_hidden_layers) * (2.0 * weights * tokens + 4.0 * heads * hd * pairs)


def row_cost(cfg, lengths: list[int]) -> float:
    """`layer_flops` of rows run one by one (causal: n(n+1)/2 pairs a row)."""
    return layer_flops(cfg, sum(lengths), sum(n * (n + 1) // 2 for n in lengths))


def grouped_cost(cfg, prefixes: list[int], suffixes: list[tuple[int, int]]) -> float:
    """`layer_flops` of the grouped pass: each prefix once (causal), each suffix of length s
    over its prefix of length p (s x p pairs) and itself (causal)."""
    pairs = sum(n * (n + 1) // 2 for n in prefixes) + sum(s * p + s * (s + 1) // 2
                                                          for p, s in suffixes)
    return layer_flops(cfg, sum(prefixes) + sum(s for _, s in suffixes), pairs)


def batch_saving(cfg, batch, micro_batch_tokens: int = 4096) -> float:
    """The share of the per-row pass's layer FLOPs that the grouped pass saves on `batch`
    (the FLOP model, each side as it runs): per row, every micro-batch (`micro_batches`)
    pads its rows to its longest; grouped, each group's prefix once, then the suffixes,
    without padding (groups by `batch.group_ids`; rows with no trained token left out)."""
    lengths = batch.attention_mask.sum(-1).tolist()
    k = prefix_lengths(batch.loss_mask).tolist()
    groups: dict[int, list[int]] = {}
    for r, g in enumerate(batch.group_ids.tolist()):
        if k[r] >= 0:
            groups.setdefault(g, []).append(r)
    prefixes, suffixes = [], []
    for members in groups.values():
        p = min(k[r] for r in members) if len(members) > 1 else 0
        prefixes.append(p)
        suffixes += [(p, lengths[r] - p) for r in members]
    padded = []
    for idx in micro_batches(batch, micro_batch_tokens):
        longest = max(lengths[i] for i in idx.tolist())
        padded += [longest] * len(idx)
    per_row = row_cost(cfg, padded)
    return 1.0 - grouped_cost(cfg, prefixes, suffixes) / per_row if per_row else 0.0
