"""The learner's memory, estimated from the model's shape, and micro-batches sized to a budget.

An update holds the weights, their gradients and AdamW's two moments (`state_mb`: 4 bytes
each per trainable parameter, times four, plus the frozen weights; low-bit moments take
their bytes a value from learner/optim.py), and, during one
micro-batch, the activations that the backward pass reads. Per token and decoder layer a
Llama/Qwen2 layer keeps about ACT_HIDDEN x hidden + ACT_MLP x intermediate values (norm
inputs and outputs, q/k/v, attention output, the MLP's gate, up and product); under bfloat16
autocast most of them are bfloat16 copies beside float32 ones. With activation checkpointing
a layer keeps only its input (hidden values) and one layer at a time recomputes its full
set in the backward pass. The output layer's log-probs add logprob_chunk x vocabulary x
LOGIT_BYTES (the chunk's logits, softmax and gradient in float32; learner/logprobs.py).

The constants were measured with peak resident set (`rollwise.system.runtime.rss_peak`) on the
SmolLM2-135M shape at 512 to 4096 tokens (1.5 MiB a token in float32, 1.3 under
autocast) (docs/performance.md, "Memory"); they are an
estimate to size micro-batches with, not a guarantee.
"""

from __future__ import annotations

import copy

import torch

from rollwise.learner.optim import MOMENT_BYTES

ACT_HIDDEN = {"float32": 32.0, "bf16-autocast": 28.0}  # bytes per hidden unit, token, layer
ACT_MLP = {"float32": 22.0, "bf16-autocast": 19.0}  # bytes per MLP unit, token, layer
CKPT_BYTES = 4.0  # bytes per hidden unit, token and layer kept with checkpointing
LOGIT_BYTES = 12.0  # bytes per vocabulary entry and token of a log-prob chunk
MIN_TOKENS = 256  # a smaller micro-batch wastes the products more than it saves memory


def _config(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config


def activation_mb_per_token(model, precision: str = "float32",
                            checkpointing: bool = False) -> float:
    """Estimated MiB of activations one token of a micro-batch holds through the backward
    pass (module docstring)."""
    cfg = _config(model)
    layers, hidden = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    key = precision if precision in ACT_HIDDEN else "float32"
    layer = ACT_HIDDEN[key] * hidden + ACT_MLP[key] * int(cfg.intermediate_size)
    if checkpointing:
        return (layers * CKPT_BYTES * hidden + layer) / 2**20
    return layers * layer / 2**20


def logits_mb(model, chunk: int) -> float:
    """Estimated MiB of one log-prob chunk over the vocabulary."""
    return chunk * int(_config(model).vocab_size) * LOGIT_BYTES / 2**20


def state_mb(model, optimizer: str = "adamw") -> dict[str, float]:
    """MiB of the weights, the gradients and the optimizer's moments (`adamw_mb`; low-bit
    ones at their bytes a value, learner/optim.py) the update keeps throughout."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    values = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # AdamW keeps its moments in the parameters' dtype, float32 at least (bfloat16 masters:
    # learner/stochastic.py); torchao's and adamw-bf16's at fixed bytes
    moments = 2 * sum(p.numel() * max(p.element_size(), 4) for p in model.parameters()
                      if p.requires_grad) if optimizer in ("adamw", "adamw-fused") \
        else values * MOMENT_BYTES[optimizer]
    return {"weights_mb": weights / 2**20, "grads_mb": trained / 2**20,
            "adamw_mb": moments / 2**20}


def fit_budget(model, budget_mb: float, *, precision: str, checkpointing: bool,
               micro_batch_tokens: int, logprob_chunk: int) -> tuple[int, int]:
    """(micro-batch tokens, log-prob chunk), each at most the configured one, whose
    activations fit `budget_mb` MiB (the update's memory beyond `state_mb`): the chunk takes
    at most a quarter of the budget, the micro-batch the rest, never below MIN_TOKENS."""
    per_chunk_token = logits_mb(model, 1)
    chunk = max(1, min(logprob_chunk, int(budget_mb / 4 / per_chunk_token)))
    left = budget_mb - chunk * per_chunk_token
    tokens = int(left / activation_mb_per_token(model, precision, checkpointing))
    return max(MIN_TOKENS, min(micro_batch_tokens, tokens)), chunk


def enable_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward pass (transformers'
    gradient checkpointing, non-reentrant: LoRA's frozen embeddings need no input grads)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers 5's name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_checkpointing(model) -> None:
    """Undo `enable_checkpointing` (a benchmark that times several settings on one model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "activation_checkpointing_disable"):
        base.activation_checkpointing_disable()
    else:
        base.gradient_checkpointing_disable()


def reference_copy(model, precision: str):
    """A frozen copy of `model`, the reference policy of the KL term in full fine-tuning.
    Under bf16-autocast its linear layers are kept in bfloat16: autocast casts them to
    bfloat16 at every product anyway (the same rounding), so the reference log-probs are
    those of a float32 copy, from about half the memory. A weight tied to the input
    embedding stays as it is (the embedding lookup is not autocast)."""
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    if precision == "bf16-autocast":
        embedding = ref.get_input_embeddings().weight
        for module in ref.modules():
            if isinstance(module, torch.nn.Linear) and module.weight is not embedding:
                module.to(torch.bfloat16)
    return ref
