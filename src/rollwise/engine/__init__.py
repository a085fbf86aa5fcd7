"""Generation engines: token ids in, completions (ids, behaviour log-probs, finish reason,
policy versions) out. `NativeEngine` is rollwise's own; `HFEngine` wraps Hugging Face
`generate` as the baseline and the fallback for architectures the native engine lacks.

`NativeEngine` is three objects. `native.py` holds the request-level API (`submit`, `step`,
`abort`, ...) and the step loop: prompt prefill, single-token decode, draws, emitting tokens
and deciding when a request has finished. It composes an `Admission` (`admission.py`: the
request table, waiting queue, resident rows, prefix slots and KV budget, with every cache
move they imply: admit, make room, park, restore, evict prefixes) and a `DraftVerifier`
(`verifier.py`: asks the drafter, verifies drafts in one pass and emits through the loop's
`emit`, handed to it as a callable). Neither imports `native.py`.

`ENGINES` names their constructors, `fn(model, *, eos_token_ids, pad_token_id, batch_size,
**options) -> Engine`; `engine.name` may also name a user's own by import path
("package.module:factory", docs/extending.md).

May import: types, registry, system.
"""

from __future__ import annotations

import warnings

from rollwise.engine.base import ENGINE_ROWS, Engine, EngineStats, RequestEngine, SamplingParams
from rollwise.engine.decoder import SUPPORTED_MODEL_TYPES, UnsupportedModel
from rollwise.engine.native import NativeEngine
from rollwise.registry import Registry

ENGINES: Registry = Registry("engine", takes=("model",),
                             keywords=("eos_token_ids", "pad_token_id", "batch_size"))


@ENGINES.register("hf")
def hf_engine(model, *, eos_token_ids: list[int], pad_token_id: int,
              batch_size: int = ENGINE_ROWS) -> Engine:
    from rollwise.engine.hf import HFEngine

    return HFEngine(model, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids,
                    batch_size=batch_size)


@ENGINES.register("native")
def native_engine(model, *, eos_token_ids: list[int], pad_token_id: int,
                  batch_size: int = ENGINE_ROWS,
                  **options) -> Engine:
    """The native engine; `hf` (with a warning) for architectures outside
    SUPPORTED_MODEL_TYPES. `options`: NativeEngine's own (kv_budget_tokens, dtype, ...)."""
    try:
        return NativeEngine(model, eos_token_ids=eos_token_ids, max_num_seqs=batch_size,
                            **options)
    except UnsupportedModel as e:
        warnings.warn(f"{e}; falling back to the 'hf' engine", stacklevel=2)
    return hf_engine(model, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                     batch_size=batch_size)


def make_engine(name: str, model, *, eos_token_ids: list[int], pad_token_id: int,
                batch_size: int = ENGINE_ROWS, **options) -> Engine:
    """The engine `name` (registered, or "package.module:factory") over `model`."""
    return ENGINES.get(name)(model, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                             batch_size=batch_size, **options)


__all__ = ["ENGINES", "SUPPORTED_MODEL_TYPES", "Engine", "EngineStats", "NativeEngine",
           "RequestEngine", "SamplingParams", "UnsupportedModel", "make_engine"]
