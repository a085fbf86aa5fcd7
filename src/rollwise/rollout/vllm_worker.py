"""The vLLM worker extension `rollwise serve-vllm` starts vLLM with (`--worker-extension-cls
rollwise.rollout.vllm_worker.VLLMFolderWeights`): what `/collective_rpc` runs on each of
vLLM's workers to load a published weights folder (rollout/dialects.py `VLLMDialect`).

Runs inside vLLM's own environment (`.venv-vllm`, where rollwise is installed without its
dependencies): imports only the standard library.
"""

from __future__ import annotations


class VLLMFolderWeights:
    """A vLLM worker extension (`--worker-extension-cls rollwise.rollout.dialects.
    VLLMFolderWeights`, which `rollwise serve-vllm` passes): `/collective_rpc` calls
    `rollwise_reload(folder)` on every worker, which checks `<folder>/model.safetensors`
    against the checkpoint the server started from (every tensor there, each of the same
    shape, the file whole) and then has vLLM reload it with its own `reload_weights`
    (which repacks the weights for the CPU kernels as the start-up load does). A file that
    fails the check raises, naming the tensor, before any weight changes."""

    def rollwise_reload(self, folder: str) -> int:
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
        self.model_runner.reload_weights(weights_path=folder)  # type: ignore[attr-defined]
        return len(got)


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
