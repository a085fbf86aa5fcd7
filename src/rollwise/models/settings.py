"""The tiny model's settings, in a module of their own: the config's [model.tiny] section is
built from them without importing transformers.

Imports nothing of rollwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TinySettings:
    """The tiny model's architecture and warm start: each field's default, bounds and help
    text are declared here once, and the config's [model.tiny] section is built from them
    (compose/schema.py `section_of`)."""

    hidden: int = field(default=128, metadata={
        "ge": 1, "help": "Hidden size of the built-in tiny Llama model."})
    layers: int = field(default=4, metadata={"ge": 1, "help": "Decoder layers."})
    heads: int = field(default=4, metadata={"ge": 1, "help": "Attention heads."})
    kv_heads: int = field(default=2, metadata={
        "ge": 1, "help": "Key/value heads (grouped-query attention)."})
    sft_steps: int = field(default=350, metadata={
        "ge": 0, "help": "Warm-start SFT steps on reference solutions."})
    sft_lr: float = field(default=3e-3, metadata={"gt": 0, "help": "Warm-start learning rate."})
    sft_batch: int = field(default=64, metadata={
        "ge": 1, "help": "Warm-start batch size (sequences)."})
