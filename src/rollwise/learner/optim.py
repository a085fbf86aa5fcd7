"""The learner's optimizer, chosen by name (`learner.optimizer`), and its state as plain data.

    adamw        torch's AdamW with its default implementation for the device (one
                 parameter at a time on a CPU): the update of every earlier release, bit
                 for bit (tests/test_pinned_metrics.py pins it)
    adamw-fused  torch's fused AdamW kernel (one pass over each parameter: about 7x faster
                 a step than the default on a CPU at one thread); the same update up to the
                 rounding of float32 operations, so runs are not bit-identical to `adamw`
    adamw8bit  torchao's AdamW8bit: both moments in 8 bits per value with a float32 scale per
               block of 256 (2.03 bytes a parameter instead of 8)
    adamw4bit  torchao's AdamW4bit: 4-bit moments, blocks of 128 (1.06 bytes a parameter)
    adamw-fp8  torchao's AdamWFp8: float8 (e4m3) moments, blocks of 256 (2.03 bytes)
    adamw-bf16   learner/stochastic.py's AdamW with bfloat16 moments written with
                 stochastic rounding (4 bytes a parameter instead of 8)

bfloat16 parameters (`learner.master_dtype = "bfloat16"`, `stochastic=True`) are written
with stochastic rounding, or with an int8 residual (`compensated=True`,
`learner.master_rounding = "compensated"`; learner/stochastic.py): `adamw` and `adamw-fused`
then mean that module's AdamW with float32 moments, `adamw-bf16` its bfloat16 moments, and
the torchao names torchao's own stochastic rounding (`bf16_stochastic_round`, its global
random generator; it has no compensated rounding).

torchao compiles one update kernel per parameter shape with torch.compile (a C++ compiler
is needed on the CPU; the first step pays the compilation) and keeps a parameter's moments
in float32 when it has fewer than 4096 values or its size is not a multiple of the block.
On a 2-core CPU its steps are much slower than the fused AdamW (docs/performance.md,
"Memory"), so the low-bit choices are there for memory, never for speed.

torchao keeps quantized moments as tensor subclasses, which safetensors cannot write:
`plain_state` turns an optimizer's state dict into plain tensors and numbers (a tagged dict
per quantized moment), `load_plain_state` builds them back, so a checkpoint holds the
quantized codes themselves and a resumed run continues from the same state.

Imports: torch, learner.stochastic; torchao only when a low-bit optimizer is asked for.
"""

from __future__ import annotations

from typing import Any

import torch

from rollwise.learner.stochastic import StochasticAdamW

OPTIMIZERS = ("adamw", "adamw-fused", "adamw8bit", "adamw4bit", "adamw-fp8", "adamw-bf16")
_TORCHAO_CLASSES = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit", "adamw-fp8": "AdamWFp8"}
# bytes of optimizer state per trained value (both moments, block scales included)
MOMENT_BYTES = {"adamw": 8.0, "adamw-fused": 8.0, "adamw8bit": 2.0 + 8 / 256,
                "adamw4bit": 1.0 + 8 / 128, "adamw-fp8": 2.0 + 8 / 256, "adamw-bf16": 4.0}


def _torchao_optim():
    try:
        import torchao.optim
    except ImportError as err:
        raise ImportError("learner.optimizer 'adamw8bit', 'adamw4bit' and 'adamw-fp8' need "
                          "torchao: pip install 'rollwise[lowbit]' (or pip install torchao)"
                          ) from err
    return torchao.optim


def fused_available(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW takes these parameters (floating point, one device type
    that this torch has the fused kernel for)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = {p.device.type for p in params}
    return (len(devices) == 1 and devices <= set(_get_fused_kernels_supported_devices())
            and all(p.is_floating_point() for p in params))


def build_optimizer(name: str, params: list[torch.Tensor], *, lr: float,
                    betas: tuple[float, float], weight_decay: float,
                    stochastic: bool = False, seed: int = 0,
                    compensated: bool = False) -> torch.optim.Optimizer:
    """The optimizer `name` (module docstring) over `params`; `stochastic`: bfloat16
    parameters are written with stochastic rounding (its random bits seeded by `seed`),
    or with an int8 residual when `compensated` too."""
    if name == "adamw-bf16" or (stochastic and name in ("adamw", "adamw-fused")):
        moments = torch.bfloat16 if name == "adamw-bf16" else torch.float32
        return StochasticAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                               moment_dtype=moments, seed=seed,
                               compensated=stochastic and compensated)
    if stochastic and compensated:
        raise ValueError(f"learner.master_rounding 'compensated' needs learner.optimizer "
                         f"adamw, adamw-fused or adamw-bf16, not '{name}'")
    if name in ("adamw", "adamw-fused"):
        fused = name == "adamw-fused" and fused_available(params)
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                                 fused=fused or None)
    if name not in _TORCHAO_CLASSES:
        raise ValueError(f"unknown learner.optimizer '{name}'; choose one of {OPTIMIZERS}")
    cls = getattr(_torchao_optim(), _TORCHAO_CLASSES[name])
    return cls(params, lr=lr, betas=betas, weight_decay=weight_decay,
               bf16_stochastic_round=stochastic)


def _is_subclass(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and type(value) is not torch.Tensor
            and hasattr(value, "__tensor_flatten__"))


def _plain_attr(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (tuple, torch.Size)):
        return {"shape": list(value)}
    return value


def _typed_attr(value: Any) -> Any:
    if isinstance(value, dict) and "dtype" in value:
        return getattr(torch, value["dtype"])
    if isinstance(value, dict) and "shape" in value:
        return torch.Size(value["shape"])
    return value


def plain_state(state: Any) -> Any:
    """`state` (an optimizer's state dict, or part of it) with every quantized moment
    replaced by {"quantized": class name, "tensors": {...}, "attrs": [...]}."""
    if _is_subclass(state):
        names, attrs = state.__tensor_flatten__()
        return {"quantized": type(state).__name__,
                "tensors": {n: getattr(state, n) for n in names},
                "attrs": [_plain_attr(a) for a in attrs]}
    if isinstance(state, dict):
        return {k: plain_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [plain_state(v) for v in state]
    return state


def load_plain_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a `plain_state` into `optimizer`, its quantized moments rebuilt."""
    optimizer.load_state_dict(_rebuild(state))


def _rebuild(state: Any) -> Any:
    if isinstance(state, dict) and "quantized" in state and "tensors" in state:
        _torchao_optim()
        import torchao.optim.subclass_4bit as s4
        import torchao.optim.subclass_8bit as s8
        import torchao.optim.subclass_fp8 as sf

        cls = next(getattr(m, state["quantized"]) for m in (s8, s4, sf)
                   if hasattr(m, state["quantized"]))
        return cls.__tensor_unflatten__(state["tensors"],
                                        [_typed_attr(a) for a in state["attrs"]], None, None)
    if isinstance(state, dict):
        return {k: _rebuild(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_rebuild(v) for v in state]
    return state
