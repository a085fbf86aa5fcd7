"""The `Policy` record: a transformers causal LM, its tokenizer and how prompts are encoded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollwise.types import Prompt


@dataclass
class Policy:
    """A model and the text edge around it. The engine only ever sees token ids."""

    model: Any  # transformers PreTrainedModel (possibly a peft PeftModel)
    tokenizer: Any  # transformers tokenizer
    name: str  # "tiny", "smollm2-135m" or a path
    chat: bool  # True when prompts are chat messages rendered by the chat template
    stop_ids: list[int] = field(default_factory=list)  # token ids that end a response
    max_context: int = 2048  # positions the model supports

    def encode(self, prompt: Prompt) -> list[int]:
        """Prompt token ids, with the chat template (and generation prompt) when chat."""
        if isinstance(prompt, list):
            if not self.chat:
                raise ValueError(f"model '{self.name}' has no chat template; use a text prompt")
            out = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                     tokenize=True)
            ids = out["input_ids"] if hasattr(out, "keys") else out
            return [int(i) for i in ids]
        ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids: list[int]) -> str:
        """Response text, special tokens (EOS) removed."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def device(self):
        return next(self.model.parameters()).device
