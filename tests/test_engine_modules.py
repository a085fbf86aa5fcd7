"""The native engine's forward pass is split by concern (weights: decoder.py; layer
computations: layers.py; attention: attention.py; general passes: passes.py; the static
decode step: step.py), and no module reaches into another's private names: a read
`x._name` where x is not `self`/`cls` and `_name` is defined (assigned on `self`, or a
method, function or class) in another engine module fails here. Also checks, on the CPU,
the properties the CUDA path relies on: the group layout's view, the graph key's
independence of the cache's capacity, and staging that does nothing off CUDA.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from rollwise.engine.attention import GroupLayout
from rollwise.engine.decoder import Decoder
from rollwise.engine.kvcache import KVCache
from rollwise.engine.layers import Layers
from rollwise.engine.step import DecodeStep, Staging, StepShape, graph_key

ENGINE = Path(__file__).parents[1] / "src" / "rollwise" / "engine"


def _defined(tree: ast.Module) -> set[str]:
    """Underscore names a module defines: functions, classes, methods, `self._x = ...`."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            out.add(node.attr)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def foreign_private_reads(sources: dict[str, str]) -> list[str]:
    """'module:line x._name' for each read of another module's private name."""
    trees = {name: ast.parse(src, name) for name, src in sources.items()}
    owners: dict[str, set[str]] = {}
    for name, tree in trees.items():
        for attr in _defined(tree):
            owners.setdefault(attr, set()).add(name)
    bad = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in owners):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if owners[node.attr] - {name}:
                bad.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    return bad


def test_the_check_finds_a_foreign_private_read() -> None:
    sources = {"a.py": "class A:\n    def __init__(self):\n        self._w = 1\n",
               "b.py": "def f(a):\n    return a._w + a.w\n"}
    assert foreign_private_reads(sources) == ["b.py:2 a._w"]


def test_no_engine_module_reads_another_modules_private_names() -> None:
    sources = {p.name: p.read_text() for p in sorted(ENGINE.glob("*.py"))}
    assert foreign_private_reads(sources) == []


def test_the_layer_body_and_the_attention_are_written_once() -> None:
    """One loop over the decoder's layers (`Layers.forward`), one two-region attention
    and one prompt attention (`scaled_dot_product_attention`) in the engine."""
    text = {p.name: p.read_text() for p in ENGINE.glob("*.py")}
    loops = sorted(n for n, s in text.items() if "in enumerate(d.layers)" in s
                   or "in enumerate(self.layers)" in s)
    assert loops == ["layers.py"]
    assert sorted(n for n, s in text.items() if "scaled_dot_product_attention(" in s) == [
        "attention.py"]
    assert sorted(n for n, s in text.items() if "to_groups(" in s) == ["attention.py"]


def test_group_layout_is_a_view_of_one_buffer_per_shape() -> None:
    """Rows 0, 1 in group 0 and row 2 in group 1 (nmax 2): the result views the layout's
    buffer (allocated once: a second call by the same name writes the same storage, another
    name has its own), absent places zero, and `to_rows` inverts it."""
    put = torch.tensor([0, 0, 1])
    layout = GroupLayout(put, put, torch.tensor([0, 1, 0]), groups=2, nmax=2)
    t = torch.arange(3 * 2 * 1 * 4, dtype=torch.float32).view(3, 2, 1, 4) + 1
    g = layout.to_groups(t, "x")
    assert g.shape == (2, 2, 2, 4)
    assert (g[1, :, 1] == 0).all() and torch.equal(g[0, :, 1], t[1, :, 0])
    g2 = layout.to_groups(t * 2, "x")
    assert g2.data_ptr() == g.data_ptr() and g2._base is g._base  # no new allocation
    assert torch.equal(layout.to_rows(g2), t * 2)
    assert layout.to_groups(t, "y").data_ptr() != g.data_ptr()


def test_graph_key_and_cache_stay_put_while_sequences_grow(tiny_llama) -> None:
    """Bucketed shapes (a CUDA graph's, run eagerly by `padded`) size the cache once to the
    engine's limits: rows and lengths growing within them reallocate nothing (captured
    graphs stay valid), where the exact-shape step grows the cache as it goes; and the key
    a graph is looked up by names no capacity."""
    dec = Decoder(tiny_llama())

    def epochs(mode: str) -> set[int]:
        cache = KVCache(2, dec.kv_heads, dec.head_dim, dec.dtype, dec.device)
        step = DecodeStep(Layers(dec), cache, mode, max_rows=8, kv_budget_tokens=2048)
        seen = set()
        for rows, length in ((1, 2), (2, 70), (8, 200), (5, 256)):
            step.reserve(rows, length)
            seen.add(cache.epoch)
        assert cache.rk[0].shape[0] >= 8 and cache.rk[0].shape[2] >= 256
        return seen

    assert len(epochs("padded")) == 1 and len(epochs("eager")) > 1
    small, grown = StepShape(4, 8, 1, 64, 128, "plain"), StepShape(4, 16, 1, 192, 256, "plain")
    assert graph_key(small) == graph_key(grown) != graph_key(StepShape(8, 8, 1, 64, 128,
                                                                       "plain"))


def test_staging_does_nothing_on_the_cpu() -> None:
    staging = Staging(torch.device("cpu"))
    ints, floats = torch.zeros(6, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.float64)
    got = staging.inputs(ints, floats)
    assert got[0] is ints and got[1] is floats and not staging.pinned
    out = torch.tensor([[1.0, 2.0, 0.0], [-0.5, -0.25, 0.0]], dtype=torch.float64)
    assert torch.equal(staging.result(out, 2), out[:, :2])
