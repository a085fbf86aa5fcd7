"""The vLLM worker extension `rollwise serve-vllm` starts vLLM with (`--worker-extension-cls
rollwise.rollout.vllm_worker.VLLMFolderWeights`): what `/collective_rpc` runs on each of
vLLM's workers to load a published weights folder (rollout/dialects.py `VLLMDialect`).

Runs inside vLLM's own environment (`.venv-vllm`, where rollwise is installed without its
dependencies): imports only the standard library at the top, vLLM's own modules inside.
"""

from __future__ import annotations


class VLLMFolderWeights:
    """A vLLM worker extension (`--worker-extension-cls rollwise.rollout.vllm_worker.
    VLLMFolderWeights`, which `rollwise serve-vllm` passes): `/collective_rpc` calls
    `rollwise_reload(folder)` on every worker, which checks `<folder>/model.safetensors`
    against the checkpoint the server started from (every tensor there, each of the same
    shape, the file whole) and then loads it. A file that fails the check raises, naming
    the tensor, before any weight changes.

    The load is direct where the served model allows it (`direct_plan`): each parameter
    takes its tensor (or its stacked parts, q/k/v into qkv_proj) and each layer is
    prepared for the CPU kernels again by its own `process_weights_after_loading`, as at
    start-up. Elsewhere it is vLLM's stock `reload_weights`, which does the same through a
    round trip of every layer to the meta device (1.6x the time for SmolLM2: docs/remote.md)."""

    def rollwise_reload(self, folder: str, loader: str = "auto") -> dict:
        """{'tensors': how many the file holds, 'loader': 'direct' or 'stock'}. `loader`:
        'auto' (direct where `direct_plan` allows it) or 'stock' (vLLM's own reload)."""
        if loader not in ("auto", "stock"):
            raise ValueError(f"loader {loader!r}: 'auto' or 'stock'")
        from pathlib import Path

        path = Path(folder) / "model.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no full-weights file")
        expected = getattr(self, "_rollwise_expected", None)
        if expected is None:  # the start-up checkpoint's tensors, read before any reload
            start = Path(self.model_runner.vllm_config.model_config.model)  # type: ignore[attr-defined]
            expected = {}
            for file in sorted(start.glob("*.safetensors")):
                expected |= {k: v["shape"] for k, v in safetensors_header(file).items()}
            self._rollwise_expected = expected
        got = safetensors_header(path)
        for name, shape in expected.items():
            if name not in got:
                raise ValueError(f"{path}: tensor {name} is missing")
            if got[name]["shape"] != shape:
                raise ValueError(f"{path}: tensor {name} has shape {got[name]['shape']}, the "
                                 f"served model's is {shape}")
        runner = self.model_runner  # type: ignore[attr-defined]
        plan = direct_plan(runner, got) if loader == "auto" else None
        if plan is None:
            runner.reload_weights(weights_path=folder)
            return {"tensors": len(got), "loader": "stock"}
        direct_load(plan, path)
        config = runner.vllm_config.model_config  # as the stock reload leaves it
        config.model, config.model_weights, config.revision = folder, "", None
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            getattr(runner, reset, lambda: None)()
        return {"tensors": len(got), "loader": "direct"}


# the architectures whose direct load test_vllm_server.py proves equal to a fresh one
DIRECT = {"LlamaForCausalLM"}


def direct_plan(runner, header: dict[str, dict]) -> list | None:
    """How the file whose tensors `header` lists loads straight into the served model:
    [(layer, parameter name, the file's tensor names stacked in order)], or None where a
    direct load is not known to equal a fresh one, and the stock reload is used: not on
    the CPU, an architecture not in DIRECT, sharded (tensor or pipeline parallel),
    quantized, a layer prepared by other than the unquantized linear and embedding
    methods, checkpoint names renamed on loading (other than q/k/v and gate/up stacking),
    or any tensor of the file or parameter of the model left unmatched or of another
    shape (but a vocabulary padded past the file's rows)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    config = runner.vllm_config
    parallel = config.parallel_config
    model = runner.get_model()
    if (type(model).__name__ not in DIRECT or not current_platform.is_cpu()
            or current_platform.is_zen_cpu()  # zentorch may keep a view of the weight
            or config.model_config.quantization is not None
            or parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1):
        return None
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and any(getattr(mapper, f, None) for f in (
            "orig_to_new_substr", "orig_to_new_prefix", "orig_to_new_suffix",
            "orig_to_new_regex", "orig_to_new_renaming")):
        return None
    stacked = getattr(model, "packed_modules_mapping", None) or {}
    plan, used = [], set()
    for module_name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        method = getattr(module, "quant_method", None)
        if own and method is not None and not isinstance(
                method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
            return None
        name = module_name.replace(".base_layer", "")  # a LoRA-wrapped layer's own
        parent, _, leaf = name.rpartition(".")
        for param_name, param in own:
            parts = [f"{parent}.{p}.{param_name}".lstrip(".") for p in stacked.get(leaf, [])]
            parts = parts or [f"{name}.{param_name}"]
            if any(p in used for p in parts) or not _fits(module, param, parts, header):
                return None
            used.update(parts)
            plan.append((module, param_name, parts))
    return plan if used == set(header) else None


def _fits(module, param, parts: list[str], header: dict[str, dict]) -> bool:
    """The file's tensors `parts`, stacked by rows, are of `param`'s shape: a linear
    layer's weight packed away for the CPU kernels (empty) by the layer's own sizes; a
    vocabulary padded past the file's rows (vLLM's loader fills zeros there) allowed."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if any(p not in header for p in parts):
        return False
    shapes = [header[p]["shape"] for p in parts]
    if any(s[1:] != shapes[0][1:] for s in shapes):
        return False
    shape = [sum(s[0] for s in shapes), *shapes[0][1:]]
    if param.numel() == 0:
        want = [getattr(module, "output_size_per_partition", -1),
                getattr(module, "input_size_per_partition", -1)]
    else:
        want = list(param.shape)
    padded = (isinstance(module, VocabParallelEmbedding) and len(parts) == 1
              and shape[0] == module.org_vocab_size and want[0] > shape[0]
              and shape[1:] == want[1:])
    return shape == want or padded


def direct_load(plan: list, path) -> None:
    """The file's tensors into the model by `plan` (direct_plan), layer by layer, each
    layer prepared for the CPU kernels again by its `process_weights_after_loading` as
    soon as its tensors are in. A weight the CPU kernels keep packed apart (the layer's own
    emptied) passes through one staging buffer, reused layer after layer: no fresh memory
    per load, and the packing reads what was just written. A layer whose preparation keeps
    the weight itself gets a copy of its own."""
    import math

    import torch
    from safetensors import safe_open

    stage: torch.Tensor | None = None
    with torch.no_grad(), safe_open(str(path), framework="pt") as file:
        for k, (module, param_name, parts) in enumerate(plan):
            tensors = [file.get_tensor(p) for p in parts]
            param = getattr(module, param_name)
            if param.numel() == 0:
                shape = (sum(len(t) for t in tensors), *tensors[0].shape[1:])
                size = math.prod(shape)
                if stage is None or stage.numel() < size or stage.dtype != param.dtype:
                    stage = torch.empty(size, dtype=param.dtype)
                target = stage[:size].view(shape)
                setattr(module, param_name, torch.nn.Parameter(target, requires_grad=False))
            else:
                target = param.data
            at = 0
            for t in tensors:  # stacked parts (q/k/v, gate/up) by rows
                target[at:at + len(t)].copy_(t)
                at += len(t)
            target[at:].zero_()  # a padded vocabulary's rows past the file's
            if k + 1 < len(plan) and plan[k + 1][0] is module:
                continue  # the layer has more to take
            if getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)
            for name, kept in list(module.named_parameters(recurse=False)):
                if stage is not None and kept.numel() and (
                        kept.untyped_storage().data_ptr() == stage.untyped_storage().data_ptr()):
                    setattr(module, name, torch.nn.Parameter(kept.detach().clone(),
                                                             requires_grad=False))


def safetensors_header(path) -> dict[str, dict]:
    """The tensors a safetensors file lists ({name: {dtype, shape, data_offsets}}); an
    error when the file is shorter than its header says (a truncated write)."""
    import json
    import os
    import struct

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ValueError(f"{path}: truncated (its header says {n} bytes, the file has "
                             f"{size})")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise ValueError(f"{path}: truncated ({size} bytes; its tensors need {8 + n + end})")
    return header
