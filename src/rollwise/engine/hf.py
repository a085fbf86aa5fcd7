"""The `hf` engine: Hugging Face `generate`, batched and left-padded. The baseline.

Behaviour log-probs are captured by a logits processor that is the last (and only) one to
shape the distribution: it applies temperature, top-k and top-p itself, so `generate`
samples from exactly the distribution whose log-probs are recorded. It keeps one step of
[B, V] log-probs and gathers the previous step's sampled token on the next call, so memory
stays O(B x V) whatever the response length.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from rollwise.engine.base import ENGINE_ROWS, SamplingParams
from rollwise.engine.sampling import warp_logits
from rollwise.types import Completion


class _BehaviourLogprobs(LogitsProcessor):
    def __init__(self, params: SamplingParams, prompt_len: int):
        self.params = params
        self.prompt_len = prompt_len
        self.last: torch.Tensor | None = None  # [B, V] log-probs of the previous step
        self.picked: list[torch.Tensor] = []  # per step: [B] log-prob of the sampled token

    def gather_last(self, tokens: torch.Tensor) -> None:
        if self.last is not None:
            self.picked.append(self.last.gather(-1, tokens[:, None])[:, 0])

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            self.gather_last(input_ids[:, -1])
        p = self.params
        self.last = warp_logits(scores, p.temperature, p.top_k, p.top_p)
        return self.last


class HFEngine:
    """Batched `model.generate`; shares the model (and so the learner's weights) in process."""

    def __init__(self, model, *, pad_token_id: int, eos_token_ids: list[int],
                 batch_size: int = ENGINE_ROWS, version: int = 0):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.batch_size = batch_size
        self.version = version
        self.forward_passes = 0  # decode steps run (one per generated position per batch)

    def publish(self, version: int) -> None:
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if params.seed is not None:
            torch.manual_seed(params.seed)
        requests = [(i, p) for i, p in enumerate(prompts) for _ in range(params.n)]
        # sort by prompt length so padding inside a batch stays small; restore order after
        order = sorted(range(len(requests)), key=lambda j: len(requests[j][1]))
        out: list[Completion | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start: start + self.batch_size]
            for j, c in zip(chunk, self._generate_batch([requests[j] for j in chunk], params)):
                out[j] = c
        return out  # type: ignore[return-value]

    def _generate_batch(self, reqs, params: SamplingParams) -> list[Completion]:
        device = next(self.model.parameters()).device
        width = max(len(p) for _, p in reqs)
        ids = torch.full((len(reqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (_, p) in enumerate(reqs):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        stops = list(params.stop_token_ids or self.eos_token_ids)
        greedy = params.temperature == 0
        recorder = _BehaviourLogprobs(params, width)
        # the recorder applies temperature, top-k and top-p; generate's own warpers must be
        # off (an unset top_k would fall back to transformers' default of 50)
        neutral = {} if greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
        config = GenerationConfig(
            max_new_tokens=params.max_tokens, do_sample=not greedy,
            min_new_tokens=params.max_tokens if params.ignore_eos else 0,
            eos_token_id=None if params.ignore_eos else stops, pad_token_id=self.pad_token_id,
            **neutral)
        was_training = self.model.training
        self.model.eval()
        with stream_autocast(self.model, device):
            seqs = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                       generation_config=config,
                                       logits_processor=LogitsProcessorList([recorder]))
        self.model.train(was_training)
        new = seqs[:, width:].cpu()
        recorder.gather_last(new[:, -1].to(recorder.last.device))
        self.forward_passes += new.shape[1]
        lp = (torch.stack(recorder.picked, dim=1).cpu() if recorder.picked
              else torch.zeros(len(reqs), 0))
        return [self._completion(i, new[row], lp[row], stops, params)
                for row, (i, _) in enumerate(reqs)]

    def _completion(self, index, tokens, logprobs, stops, params) -> Completion:
        toks = tokens.tolist()
        end = len(toks)
        reason = "length"
        if not params.ignore_eos:
            for t, tok in enumerate(toks):
                if tok in stops:
                    end, reason = t + 1, "stop"
                    break
        return Completion(prompt_index=index, token_ids=toks[:end],
                          logprobs=logprobs[:end].tolist(), finish_reason=reason)


def stream_autocast(model, device: torch.device):
    """bfloat16 autocast for a model whose projections are bfloat16 and whose residual
    stream is float32 (its norm gains float32: a bfloat16 learner under autocast keeps them
    so, learner/stochastic.py), as that learner runs it; otherwise nothing."""
    table = model.get_input_embeddings().weight
    stream = any(type(m).__name__.endswith(("RMSNorm", "LayerNorm"))
                 and m.weight.dtype == torch.float32
                 for m in model.modules())
    if table.dtype == torch.bfloat16 and stream:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
