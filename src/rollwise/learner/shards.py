"""The learner sharded over N processes with torch's FSDP2 (`fully_shard` over a DeviceMesh).

Every rank holds the same `Learner`; `fully_shard` splits each decoder layer's parameters,
and the root's (embeddings, final norm, output layer), along their first dimension, so a
rank keeps 1/N of the weights, of their gradients and of the optimizer's moments. A layer's
full weights exist on a rank only while it runs (gathered before, dropped after); gradients
are reduce-scattered as each layer's backward ends, summed over ranks (not averaged: each
rank's loss is already normalised by the whole batch's token and sequence counts).

    what             one process        N ranks (this module)
    weights          whole              1/N each, gathered layer by layer to compute
    gradients        whole              1/N each (reduce-scatter, summed)
    AdamW moments    whole              1/N each
    a micro-batch    any rows           the same number on every rank (`Peers.plan`)

FSDP's gathers and reductions are collectives: every rank must run the same number of
forward and backward passes through each layer, in the same order. `Peers.plan` makes the
ranks agree before an update: the largest micro-batch count wins (a rank with fewer runs a
zero-weight pass over one of its rows). Whether a micro-batch runs grouped (each group's
prompt once, learner/grouped.py) or per row is each rank's own choice: both call every
layer once. A group too large for one micro-batch runs whole on a rank (cut into pieces,
its prefix would be run and differentiated apart from them: passes its peers would not
match).

Weights move between the ranks and one full copy (the driver's policy, which the rollout
engine reads, a checkpoint saves and publications are made from) without collectives: each
rank copies its own rows into, or out of, the full tensors (`write_full`, `read_full`); no
rank ever holds a second full copy.

Imports torch only.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Peers:
    """This rank's place among the learner ranks, over the default process group."""

    rank: int
    world: int
    device: str = "cpu"

    def _reduce(self, values: list[float], op) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=op)
        return t.cpu().tolist()

    def _comm_device(self) -> str:
        # NCCL reduces CUDA tensors, gloo CPU ones
        return self.device if self.device.startswith("cuda") else "cpu"

    def total(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over the ranks (every rank passes the same keys)."""
        import torch.distributed as dist

        keys = sorted(values)
        return dict(zip(keys, self._reduce([values[k] for k in keys], dist.ReduceOp.SUM)))

    def largest(self, value: float) -> float:
        import torch.distributed as dist

        return self._reduce([value], dist.ReduceOp.MAX)[0]

    def plan(self, pieces: list[Any], spare: Any | None) -> list[Any]:
        """The micro-batches this rank runs, as many as the rank with the most: `pieces`,
        then `spare` (a micro-batch of weight 0: one of its rows; None when it has none)
        repeated. Every rank calls each decoder layer once per micro-batch, whatever path
        its rows take (grouped or per row), so only the count must agree."""
        count = int(self.largest(len(pieces)))
        if count > len(pieces) and spare is None:
            raise RuntimeError(f"learner rank {self.rank} has no row to run while its peers "
                               "run micro-batches (more learner.shards than rows)")
        return list(pieces) + [spare] * (count - len(pieces))


def rank_device(device: str, local_rank: int) -> str:
    """The device a rank computes on: its own GPU (`cuda:<local rank>`, whatever index
    run.device names) or the CPU.

    >>> rank_device("cuda", 3), rank_device("cuda:0", 1), rank_device("cpu", 2)
    ('cuda:3', 'cuda:1', 'cpu')
    """
    return f"cuda:{local_rank}" if device.startswith("cuda") else "cpu"


def init_ranks(rank: int, world: int, address: str, device: str, timeout_s: float) -> Peers:
    """Join the learner ranks' process group (gloo on CPU, NCCL on CUDA); collectives
    that wait longer than `timeout_s` fail instead of hanging."""
    import torch.distributed as dist

    if dist.is_initialized():  # joined before (torchrun: the config came over the group)
        return Peers(rank, world, device)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return Peers(rank, world, device)


def shard(root: torch.nn.Module, layers: list[torch.nn.Module], device: str,
          mixed_bf16: bool = False) -> None:
    """fully_shard each of `layers`, then `root` (the rest), over all ranks, on an explicit
    mesh of `device`'s type (without one, FSDP picks CUDA when a GPU exists). `mixed_bf16`:
    bfloat16 compute, float32 reduction (on a GPU)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu",
                            (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_bf16 else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    for module in _sharded(root):
        # a sum: each rank's loss already carries the whole batch's normalisers (and a plain
        # SUM: gloo has no pre-multiplied reduction)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


def _sharded(root: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in root.modules() if isinstance(m, FSDPModule)]


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def total_norm(norm: torch.Tensor) -> float:
    """A gradient norm as a float; over sharded gradients it is a DTensor whose value is
    the norm over every rank's shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def _rows(p) -> tuple[int, int]:
    """(first row, row count) of the full tensor that this rank's shard of `p` holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return (offset[0], shape[0]) if shape else (0, 0)


def _params(model: torch.nn.Module, trainable_only: bool):
    """(name, parameter) of each (trainable) parameter, a tied one once: the order every
    rank walks them in (a gather is a collective)."""
    seen = set()
    for name, p in model.named_parameters():
        if (trainable_only and not p.requires_grad) or id(p) in seen:
            continue
        seen.add(id(p))
        yield name, p


def _local_rows(p) -> tuple[int, torch.Tensor]:
    """(first row, the rows of the full tensor this rank's shard of `p` holds)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return 0, p.data
    start, count = _rows(p)
    return start, p.to_local().view(count, *p.shape[1:])


def _pairs(model: torch.nn.Module, full: dict[str, torch.Tensor], trainable_only: bool):
    """(this rank's rows of each parameter, the same rows of its full tensor in `full`)."""
    for name, p in _params(model, trainable_only):
        start, local = _local_rows(p)
        if local.shape == full[name].shape:
            yield local, full[name]
        elif local.shape[0]:
            yield local, full[name][start: start + local.shape[0]]


@torch.no_grad()
def write_full(model: torch.nn.Module, full: dict[str, torch.Tensor],
               trainable_only: bool = True) -> int:
    """Copy this rank's rows of each (trainable) parameter into `full` (name -> the full
    tensor, e.g. in memory shared with the driver); bytes written."""
    written = 0
    for local, target in _pairs(model, full, trainable_only):
        target.copy_(local)
        written += local.numel() * target.element_size()
    return written


@torch.no_grad()
def read_full(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy each parameter's rows of `full` into this rank's shard (every parameter)."""
    for local, source in _pairs(model, full, trainable_only=False):
        local.copy_(source)


@torch.no_grad()
def gather_full(model: torch.nn.Module, into: dict[str, torch.Tensor] | None) -> None:
    """Every trainable weight gathered whole (a collective: every rank, the same order),
    one at a time, and copied into `into` where given (rank 0's whole copy)."""
    from torch.distributed.tensor import DTensor

    for name, p in _params(model, trainable_only=True):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if into is not None:
            into[name].copy_(full)
        del full


def shard_arrays(model: torch.nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    """name -> (first row, this rank's rows) of each trainable parameter: what a rank in
    another process sends for the driver to place into its full copy."""
    out = {}
    for name, p in _params(model, trainable_only=True):
        start, local = _local_rows(p)
        out[name] = (start, local.detach().cpu())
    return out


def place_arrays(full: dict[str, torch.Tensor], parts: list[dict]) -> None:
    """The inverse of `shard_arrays`, on the driver: every rank's rows into `full`."""
    with torch.no_grad():
        for part in parts:
            for name, (start, rows) in part.items():
                full[name][start: start + rows.shape[0]].copy_(torch.as_tensor(rows))


# -- optimizer state: torch.distributed.checkpoint, sharded, no pickle --------------------

def save_optimizer(model: torch.nn.Module, optimizer, folder: Path) -> None:
    """Every rank writes its shard of the optimizer state into `folder` (one DCP checkpoint:
    loadable by any number of ranks, or by one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=str(folder))


def load_optimizer(model: torch.nn.Module, optimizer, folder: Path) -> None:
    """Load a DCP optimizer checkpoint written by any number of ranks: here sharded over
    this process group, or whole in a process without one (the ranks' shards are
    resharded on loading)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_full_optimizer(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Load a one-process optimizer state (torch's `state_dict()` layout, full tensors)
    into sharded parameters: each rank keeps its rows."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [name for name, p in model.named_parameters() if p.requires_grad]
    by_name = {"state": {names[int(i)]: v for i, v in state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name,
                             options=StateDictOptions(full_state_dict=True))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(learner) -> dict[str, float]:
    """Bytes of the trained weights, their gradients and the optimizer state this process
    holds (its shards when sharded; frozen weights, e.g. LoRA's base, under `frozen`). The
    gradients are counted as an update holds them, one per trained weight (freed after it
    with `release_memory`)."""
    def size(t) -> int:
        t = _local(t)
        return t.numel() * t.element_size()

    seen: set[int] = set()
    out = {"parameters": 0, "gradients": 0, "optimizer": 0, "frozen": 0}
    for p in learner.model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        out["parameters" if p.requires_grad else "frozen"] += size(p)
        if p.requires_grad:
            out["gradients"] += size(p)
    for state in learner.optimizer.state.values():
        out["optimizer"] += sum(size(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {k: float(v) for k, v in out.items()}
