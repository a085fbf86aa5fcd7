"""A guard, run on the CPU, for a bug class only a GPU shows: a tensor made on the host and
used with tensors on the device (`RuntimeError: Expected all tensors to be on the same
device`). The native engine once crashed on CUDA before its first token because its rotary
table was computed from `torch.zeros(1)`.

The rule, over the packages whose code runs on the model's device (engine, learner, algos):
a torch tensor factory (zeros, ones, empty, full, arange, tensor, rand*, linspace, eye, ...)
passes `device=`, or is moved at once (`torch.tensor(x).to(dev)`), or stands in a function
of ALLOWED, which says why its tensors are meant to live on the host. `*_like` and
`x.new_*` factories follow their argument's device and are always fine.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "rollwise"
PACKAGES = ("engine", "learner", "algos")
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "range", "tensor", "as_tensor",
             "rand", "randn", "randint", "randperm", "linspace", "logspace", "eye",
             "empty_strided", "tril_indices", "triu_indices"}

# (file relative to src/rollwise, function): why its factories make host tensors
ALLOWED = {
    ("engine/decoder.py", "_input_ranges"): "fixed pseudo-random calibration tokens, drawn "
    "on the host for determinism and moved to the weights' device before use",
    ("engine/passes.py", "prefill_from"): "index and mask plan built on the host from "
    "Python lists, moved to the device once per call",
    ("engine/passes.py", "plan"): "the general chunk pass's plan, built on the host from "
    "Python lists and moved to the device in one place (RowPlan)",
    ("engine/hf.py", "_generate_batch"): "padded prompt ids built on the host, moved to the "
    "model's device for generate",
    ("engine/native.py", "submit"): "a random seed drawn as a host integer",
    ("engine/native.py", "generate"): "a random seed drawn as a host integer",
    ("engine/native.py", "_prefill"): "padded prompt ids built on the host, moved to the "
    "decoder's device for the prefill",
    ("engine/step.py", "inputs"): "the decode step's host-side inputs: made in one pass "
    "over the rows, copied to the device once per step",
    ("learner/batch.py", "collate"): "the batch is assembled on the host; take_rows moves "
    "each micro-batch to the learner's device",
    ("learner/batch.py", "micro_batches"): "row indices (host bookkeeping)",
    ("learner/learner.py", "_over_batch"): "host accumulator of values brought back with "
    ".cpu()",
    ("learner/learner.py", "_plan"): "a row index into the host batch (take_rows moves the "
    "rows to the device)",
    ("learner/shards.py", "place_arrays"): "the driver's whole copy of the weights is filled "
    "from ranks' host arrays (copy_ moves them to its device)",
    ("learner/grouped.py", "plan_groups"): "the grouped layout built on the host from "
    "lists; token_logprobs moves it with GroupPlan.to(device) before the pass",
    ("learner/batch.py", "group_micro_batches"): "row indices (host bookkeeping)",
    ("learner/prepare.py", "prepare_batch"): "host-side batch records (moved by take_rows)",
    ("learner/prepare.py", "episode_inputs"): "host-side batch records (moved by take_rows)",
    ("learner/prepare.py", "ref_values"): "host-side batch records (moved by take_rows)",
}


def _findings(source: str, filename: str) -> list[tuple[str, int, str]]:
    """(function, line, factory) of each factory call that names no device and is not moved
    at once."""
    tree = ast.parse(source, filename)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"):
            continue
        if any(k.arg == "device" for k in node.keywords):
            continue
        up = parents.get(node)
        if isinstance(up, ast.Attribute) and up.attr in ("to", "cuda"):
            continue
        fn = node
        while fn in parents and not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fn = parents[fn]
        out.append((getattr(fn, "name", "<module>"), node.lineno, node.func.attr))
    return out


def test_no_host_tensor_factories_in_device_code():
    bad, used = [], set()
    for pkg in PACKAGES:
        for path in sorted((SRC / pkg).rglob("*.py")):
            rel = path.relative_to(SRC).as_posix()
            for fn, line, factory in _findings(path.read_text(), rel):
                if (rel, fn) in ALLOWED:
                    used.add((rel, fn))
                else:
                    bad.append(f"{rel}:{line} {fn}: torch.{factory}(...) without device=")
    assert not bad, ("tensor factories that would make host tensors in device code (pass "
                     "device=..., use *_like / x.new_*, or add the function to ALLOWED with "
                     "the reason):\n" + "\n".join(bad))
    stale = set(ALLOWED) - used
    assert not stale, f"ALLOWED entries with nothing left to allow: {sorted(stale)}"


def test_guard_catches_the_rotary_table_bug():
    """The line that crashed the engine on CUDA is found; its fix passes."""
    crashed = ("def __init__(self, hf, pos):\n"
               "    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)\n")
    fixed = crashed.replace("torch.float32)", "torch.float32, device=pos.device)")
    assert _findings(crashed, "x.py") == [("__init__", 2, "zeros")]
    assert _findings(fixed, "x.py") == []
    moved = "def f(x):\n    return torch.tensor([1, 2]).to(x.device)\n"
    assert _findings(moved, "x.py") == []


def test_the_decode_step_makes_no_host_tensors():
    """The static step's device function (captured as a CUDA graph) allows nothing."""
    source = (SRC / "engine" / "step.py").read_text()
    found = [f for f in _findings(source, "step.py") if f[0] != "inputs"]
    assert found == []
