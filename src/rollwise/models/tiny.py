"""The built-in `tiny` model: a small Llama decoder with a character-level tokenizer.

Built locally (no download). For RL to have something to improve, it is warm-started by
supervised training on reference solutions (prompt -> reference), briefly enough that it is
sometimes right and sometimes wrong. The warm start is cached on disk, keyed by every setting
that affects it (architecture, steps, learning rate, seed and the examples themselves).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from tokenizers.processors import TemplateProcessing
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from rollwise.models.settings import TinySettings

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
# Digits and arithmetic first: every task prompt of the tiny model is spelled with these.
CHARS = list("0123456789+-*/=;#()., ?:") + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
    chr(c) for c in range(ord("A"), ord("Z") + 1)] + list("\n!'\"<>_%")


def cache_root() -> Path:
    """Where rollwise caches converted and warm-started models ($ROLLWISE_CACHE)."""
    return Path(os.environ.get("ROLLWISE_CACHE", Path.home() / ".cache" / "rollwise"))


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, BOS prepended."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def build_model(hidden: int = TinySettings.hidden, layers: int = TinySettings.layers,
                heads: int = TinySettings.heads, kv_heads: int = TinySettings.kv_heads,
                vocab_size: int | None = None, seed: int = 0, context: int = 512
                ) -> LlamaForCausalLM:
    """A randomly initialised Llama-architecture decoder (about 0.8M parameters with
    TinySettings' shape) with a context of `context` tokens."""
    config = LlamaConfig(
        vocab_size=vocab_size or len(SPECIALS) + len(CHARS), hidden_size=hidden,
        intermediate_size=hidden * 3, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=context, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def warm_start_key(settings: dict, examples: list[tuple[str, str]]) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for prompt, reference in examples:
        h.update(prompt.encode() + b"\0" + reference.encode() + b"\1")
    return h.hexdigest()[:16]


def teacher_forced_batch(rows: list[tuple[list[int], list[int]]]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels) of (prompt ids, response ids) rows, right-padded with 0; labels
    are the response tokens, -100 elsewhere."""
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p): len(p) + len(r)] = torch.tensor(r)
    return ids, labels


def _sft(model, tokenizer, examples, steps: int, lr: float, batch: int, seed: int) -> None:
    """Teacher-forced cross-entropy on the reference response tokens only."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    encoded = []
    for prompt, ref in examples:
        p = tokenizer(prompt)["input_ids"]
        r = tokenizer(ref, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((p, r))
    model.train()
    for _ in range(steps):
        ids, labels = teacher_forced_batch(
            [encoded[rng.randrange(len(encoded))] for _ in range(batch)])
        loss = model(input_ids=ids, attention_mask=(ids != 0).long() | (labels != -100).long(),
                     labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()


def load_tiny(examples: list[tuple[str, str]] | None = None, *, seed: int = 0,
              context: int = 512, **settings):
    """The tiny model and tokenizer, warm-started on `examples` (cached), or untrained.
    `settings`: TinySettings' fields (its defaults for those left out). `context`: the
    longest sequence it takes (2048 leaves room for the tool instructions `rollwise serve`
    adds to a chat with tools). No weight depends on it (rotary positions are computed), so
    the cached warm start serves any context and is not keyed by it."""
    tokenizer = build_tokenizer()
    s = TinySettings(**settings)
    hidden, layers, heads, kv_heads = s.hidden, s.layers, s.heads, s.kv_heads
    sft_steps, sft_lr, sft_batch = s.sft_steps, s.sft_lr, s.sft_batch
    settings = asdict(s) | {"seed": seed, "vocab": SPECIALS + CHARS, "format": 1}
    if not examples or sft_steps == 0:
        return build_model(hidden, layers, heads, kv_heads, seed=seed, context=context), tokenizer
    path = cache_root() / "tiny" / warm_start_key(settings, examples)
    if (path / "model.safetensors").is_file():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.config.max_position_embeddings = context
        return model, tokenizer
    model = build_model(hidden, layers, heads, kv_heads, seed=seed, context=context)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        _sft(model, tokenizer, examples, sft_steps, sft_lr, sft_batch, seed)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    (tmp / "warm_start.json").write_text(json.dumps(settings | {"examples": len(examples)}))
    try:
        tmp.rename(path)
    except OSError:  # another process finished the same warm start first
        shutil.rmtree(tmp, ignore_errors=True)
    return model, tokenizer
