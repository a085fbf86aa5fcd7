"""learner.shards under torchrun: `torchrun --nproc-per-node N -m rollwise train CONFIG`.

torchrun starts N copies of the command. Rank 0 is the driver (the run directory, the
rollouts, the evaluation) and learner rank 0; ranks 1..N-1 only serve the learner:

    rank 0                                       ranks 1..N-1 (`serve`)
    open the run, build the stages; at the       wait for rank 0's config and precision
    learner: send the config and the precision   (its choices: `run.memory`, the probe)
    -> build the policy, broadcast its weights   build the policy, take rank 0's weights
    -> ShardedTrainer over TorchrunRanks         RankWorker; then answer each call:
       call(method, per-rank args) -- broadcast -> method(its args) -- gather --> replies

The calls and replies travel as objects over the same gloo (or NCCL) group the learner
shards over, so nothing else is opened. A publication gathers each weight in turn
(`DTensor.full_tensor`, every rank in the same order) and rank 0 copies it into the
driver's copy: one weight at a time beyond the shards, never a second full copy.

A rank that raises answers with its error (the run stops naming it); a rank that dies
breaks the group, and rank 0's next collective fails: torchrun then stops the others.

Imports the compose builders and the learner.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from rollwise.distributed.shards import RankWorker, ShardedTrainer, rank_failed


def launched() -> tuple[int, int] | None:
    """(rank, world size) when torchrun (or another launcher setting RANK and WORLD_SIZE)
    started this process as one of several; else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    return (int(os.environ["RANK"]), world) if world > 1 else None


def _threads(cfg) -> int:
    """Each rank's share of the machine's cores, as the local launch gives it."""
    from rollwise.system.runtime import free_cores

    return max(1, (cfg.run.threads or free_cores()) // cfg.learner.shards)


def _join(timeout_s: float, device: str) -> None:
    from rollwise.learner.shards import init_ranks, rank_device

    rank, world = launched()
    local = int(os.environ.get("LOCAL_RANK", rank))
    init_ranks(rank, world, "env://", rank_device(device, local), timeout_s)


def _broadcast_weights(model) -> None:
    """Every rank takes rank 0's weights (FSDP2 does not copy them: all must start equal)."""
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)


class TorchrunRanks:
    """The learner ranks of a torchrun launch, seen from rank 0 (which is one of them)."""

    shared = False

    def __init__(self, worker: RankWorker, world: int):
        self.worker, self.world = worker, world
        self.pids = [os.getpid()]

    def call(self, method: str, args: list[tuple]) -> list[Any]:
        import torch.distributed as dist

        dist.broadcast_object_list([(method, args)], src=0)
        mine = _answer(self.worker, method, args[0])
        replies: list[Any] = [None] * self.world
        dist.gather_object(mine, replies, dst=0)
        for rank, (status, value) in enumerate(replies):
            if status != "ok":
                raise rank_failed(rank, self.world, method, value)
        return [value for _, value in replies]

    def close(self) -> None:
        import torch.distributed as dist

        if self.world and dist.is_initialized():
            try:
                dist.broadcast_object_list([None], src=0)
            finally:
                self.worker.close()
        self.world = 0


def _answer(worker: RankWorker, method: str, args: tuple) -> tuple[str, Any]:
    from rollwise.distributed.shards import _describe

    try:
        return "ok", getattr(worker, method)(*args)
    except Exception as e:  # noqa: BLE001 - answered, so rank 0 stops the run naming it
        return "error", _describe(e)


def start(cfg, model, precision) -> ShardedTrainer:
    """Rank 0: send the config and precision, the weights, then build this rank's worker
    over its own copy of `model` (the driver keeps `model` whole)."""
    import torch.distributed as dist

    rank, world = launched()
    if world != cfg.learner.shards:
        raise ValueError(f"torchrun started {world} processes, learner.shards = "
                         f"{cfg.learner.shards}: give --set learner.shards={world}")
    _join(cfg.learner.shard_timeout_s, cfg.run.device)
    data = cfg.model_dump()
    dist.broadcast_object_list([(data, precision)], src=0)
    _broadcast_weights(model)
    worker = RankWorker(data, copy.deepcopy(model), precision, rank, world, "env://",
                        threads=_threads(cfg), shared=False, gather=True,
                        into=dict(model.state_dict()))
    return ShardedTrainer(TorchrunRanks(worker, world), model)


def serve(timeout_s: float = 3600.0, device: str = "cpu") -> None:
    """Ranks 1..N-1: build this rank's learner from rank 0's config, answer calls until
    rank 0 closes."""
    import torch.distributed as dist

    from rollwise.compose.config import validate_config
    from rollwise.compose.parts import build_policy, build_task

    rank, world = launched()
    _join(timeout_s, device)
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    data, precision = box[0]
    cfg = validate_config(data)
    policy = build_policy(cfg, build_task(cfg))
    _broadcast_weights(policy.model)
    worker = RankWorker(data, policy.model, precision, rank, world, "env://",
                        threads=_threads(cfg), shared=False, gather=True)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        method, args = box[0]
        dist.gather_object(_answer(worker, method, args[rank]), None, dst=0)
    worker.close()
