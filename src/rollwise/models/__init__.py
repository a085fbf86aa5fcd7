"""Load a policy: the built-in `tiny` model, SmolLM2-135M-Instruct, or a local HF directory.

May import: types, system.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollwise.models.policy import Policy

MODEL_NAMES = ("tiny", "smollm2-135m")


def load_policy(name_or_path: str = "tiny", *, device: str = "cpu", dtype: str = "float32",
                warm_start: list[tuple[str, str]] | None = None,
                tiny: dict | None = None) -> Policy:
    """A `Policy` (`.model`, `.tokenizer`, `.encode`, `.decode`) ready for rollouts and training.

    `warm_start` (tiny only): (prompt, reference) pairs the tiny model is first trained on.
    `tiny`: its architecture and warm-start settings (see `rollwise.models.tiny.load_tiny`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    if name_or_path == "tiny":
        from rollwise.models.tiny import load_tiny

        model, tokenizer = load_tiny(warm_start, **(tiny or {}))
        chat = False
    else:
        if name_or_path == "smollm2-135m":
            from rollwise.models.smollm2 import converted_dir

            path = converted_dir()
        else:
            path = Path(name_or_path)
            if not (path / "config.json").is_file():
                raise FileNotFoundError(
                    f"model '{name_or_path}' is neither one of {MODEL_NAMES} nor a local "
                    "Hugging Face directory with a config.json (nothing is downloaded)"
                )
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        chat = bool(getattr(tokenizer, "chat_template", None))
    model.to(device=device, dtype=torch_dtype).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    stop = {tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id))
    return Policy(model=model, tokenizer=tokenizer, name=name_or_path, chat=chat,
                  stop_ids=sorted(i for i in stop if i is not None),
                  max_context=int(getattr(model.config, "max_position_embeddings", 2048)))


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


__all__ = ["MODEL_NAMES", "Policy", "load_policy"]
