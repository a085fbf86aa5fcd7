"""The trainer port over N learner ranks (learner.shards = N): FSDP2 on torch.distributed.

    driver (this process)                     rank r of N (another process)
    ShardedTrainer                            RankWorker: the same Learner, sharded
      update(batch)  -- 1/N of the rows -->     update: normalisers summed over ranks
      reference_kl   -- 1/N of the rows -->     reference_kl
      publish(v)     -- "publish" ------->      its rows of each weight into the driver's
                                                copy (shared memory) or sent back (Ray)
      state_dict     -- a folder -------->      its optimizer shard (DCP) into the folder
      load_state_dict -- state --------->       its rows of the driver's weights, and the
                                                optimizer state (resharded to N)

How the ranks are reached is the only difference between placements (`LocalRanks`:
processes this one started, over pipes; `rayranks.RayRanks`: actors of a placement group),
so the `Stages`, the drivers, the rollout side and checkpoints see one trainer port,
whatever N.

The driver's policy stays whole: the rollout engine in this process reads it, checkpoints
save it, and publications to Ray workers and inference servers are made from it. After an
update it is stale until `publish` brings it to the new version, as with the Ray learner
actor's publication.

Faults: every call waits at most `timeout_s`; a rank that died (its process gone, its actor
dead) or did not answer stops the run with `LearnerDied` naming the rank and the phase;
the others are then stopped too (they would wait in a collective for the lost one). A
checkpoint's optimizer state is written into a folder the checkpoint takes in only once
every rank finished, so a failure mid-save leaves the previous checkpoint the last whole one.
A local rank whose driver died (SIGKILL) exits within a fraction of a second, whatever it
was doing. tests/crashranks.py kills one rank or the driver at random instants and checks
all of this (`scripts/crash_harness.py --ranks 2`).

Imports the compose builders, the learner and the records.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from rollwise.learner import shards
from rollwise.learner.batch import take_rows
from rollwise.types import Batch, LearnerDied, Published


def rank_failed(rank: int, world: int, phase: str, why: str) -> LearnerDied:
    return LearnerDied(f"learner rank {rank} of {world} failed during '{phase}': {why}; "
                       "the run's last checkpoint is intact: continue it with --resume")


class _Model:
    """The part of a `Policy` that `build_learner` reads."""

    def __init__(self, model):
        self.model = model


class RankWorker:
    """One learner rank: the run's `Learner` over this process's copy of the policy, sharded
    with its peers. `full`: the driver's weights in shared memory (the local placement),
    which `publish` writes this rank's rows into and `load` reads them from; None where
    weights travel as arrays (Ray)."""

    def __init__(self, cfg_data: dict, model, precision, rank: int, world: int, address: str,
                 threads: int, shared: bool, gather: bool = False,
                 into: dict[str, torch.Tensor] | None = None):
        """`gather`: publications gather each weight whole, one at a time, on every rank,
        and copy it into `into` where given (torchrun's rank 0: the driver's copy)."""
        from rollwise.compose.config import validate_config
        from rollwise.compose.parts import build_learner
        from rollwise.system.runtime import configure as configure_runtime

        cfg = validate_config(cfg_data)
        configure_runtime(threads, cfg.run.allocator)
        torch.manual_seed(cfg.run.seed)
        self.rank = rank
        local = int(os.environ.get("LOCAL_RANK", rank))  # torchrun's, else the rank
        device = shards.rank_device(cfg.run.device, local)
        self.peers = shards.init_ranks(rank, world, address, device,
                                       cfg.learner.shard_timeout_s)
        # the driver's tensors (shared memory, or CUDA IPC handles) before this rank's copy
        self.full = dict(model.state_dict()) if shared else None
        model = model if str(next(model.parameters()).device) == device else (
            copy.deepcopy(model).to(device) if shared else model.to(device))
        self.gather, self.into = gather, into
        self.learner = build_learner(cfg, _Model(model), precision, peers=self.peers)

    def pid(self) -> int:
        return os.getpid()

    def update(self, batch: Batch) -> tuple[dict[str, float], float, float]:
        """The update's figures, its seconds, and the MiB it added to this process's peak
        resident set (activations and workspace; the gradients at a run's first update)."""
        from rollwise.system.runtime import rss_peak

        with rss_peak() as before:
            pass
        start = time.perf_counter()
        with rss_peak() as peak:
            out = self.learner.update(batch)
        return out, time.perf_counter() - start, peak["mb"] - before["mb"]

    def reference_kl(self, batch: Batch) -> torch.Tensor:
        return self.learner.reference_kl(batch)

    def publish(self):
        """This rank's rows of every trained weight: written into the driver's copy (None
        returned), or returned for the driver to place; gathered, into the driver's copy
        on rank 0 (None returned)."""
        if self.gather:
            shards.gather_full(self.learner.model, self.into)
            return None
        if self.full is not None:
            shards.write_full(self.learner.model, self.full)
            return None
        return shards.shard_arrays(self.learner.model)

    def save(self, folder: str) -> dict:
        return self.learner.state_dict(Path(folder))

    def load(self, state: dict, weights: dict | None) -> None:
        """The driver's weights (just loaded from a checkpoint), then the optimizer state."""
        source = self.full if weights is None else {
            k: torch.as_tensor(v) for k, v in weights.items()}
        shards.read_full(self.learner.model, source)
        self.learner.load_state_dict(state)

    def memory(self) -> dict[str, float]:
        """Bytes this rank holds: parameters, gradients, optimizer state (its shards)."""
        return shards.held_bytes(self.learner)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def free_address(host: str = "127.0.0.1") -> str:
    """A rendezvous address on a free port of `host`."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def _exit_with_parent(poll_s: float = 0.2) -> None:
    """Exit this process soon after its parent dies (a SIGKILLed driver): an orphaned rank
    would otherwise hold its copy of the model until its current call or collective ends,
    or, while it starts, until it has built its learner."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="rollwise-rank-parent", daemon=True).start()


def _rank_main(conn, cfg_data, model, precision, rank, world, address, threads) -> None:
    """A local rank's process: build the worker, then answer calls until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it checkpoints
    _exit_with_parent()
    try:
        worker = RankWorker(cfg_data, model, precision, rank, world, address, threads,
                            shared=True)
        del model
        conn.send_bytes(pickle.dumps(("ok", os.getpid())))
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which stops the run
        conn.send_bytes(pickle.dumps(("error", _describe(e))))
        return
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if message is None:
            break
        method, args = message
        try:
            reply = ("ok", getattr(worker, method)(*args))
        except BaseException as e:  # noqa: BLE001 - as above
            reply = ("error", _describe(e))
        conn.send_bytes(pickle.dumps(reply))
    worker.close()


def _describe(e: BaseException) -> str:
    last = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    where = f" ({last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
    return f"{type(e).__name__}: {e}{where}"


@contextlib.contextmanager
def _main_not_rerun():
    """A spawned rank runs rollwise code only: it must not run the caller's main script
    again, as multiprocessing would. A script without an `if __name__ == "__main__"` guard
    would start ranks from each rank (and the parent would wait forever to hand the first
    one its arguments). Hidden while a rank starts, the script is not named to it."""
    import sys

    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if hasattr(main, k)}
    try:
        for k in saved:
            setattr(main, k, None) if k == "__spec__" else delattr(main, k)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


@contextlib.contextmanager
def _preloaded(allocator: str):
    """With run.allocator = "jemalloc", the processes started inside have jemalloc
    preloaded (the driver's re-run takes LD_PRELOAD back, so that its other children do
    not): a rank allocates as its driver does. A rank's resident set under each allocator:
    docs/scaling.md."""
    from rollwise.system.preload import jemalloc_library, preload_env

    library = jemalloc_library() if allocator == "jemalloc" else None
    if library is None:
        yield
        return
    before = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = preload_env(library)["LD_PRELOAD"]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


class LocalRanks:
    """N learner ranks as processes of this machine (torch.multiprocessing, spawned), each
    over a pipe. `model` must live in shared memory (`share_memory()`): every rank maps it,
    copies its rows from it and writes them back at publication."""

    shared = True  # the ranks write into the driver's weights themselves

    def __init__(self, cfg_data: dict, model, precision, world: int, threads: int,
                 timeout_s: float):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.timeout_s, self.world = timeout_s, world
        self.conns, self.procs = [], []
        address = free_address()
        allocator = cfg_data.get("run", {}).get("allocator", "reuse")
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, name=f"rollwise-learner-rank-{rank}",
                               args=(child, cfg_data, model, precision, rank, world,
                                     address, threads), daemon=True)
            with _main_not_rerun(), _preloaded(allocator):
                proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        try:
            self.pids = self._replies("start")
        except BaseException:
            self.close()
            raise

    def call(self, method: str, args: list[tuple]) -> list[Any]:
        """`method(*args[r])` on every rank r at once; their replies, in rank order."""
        for conn, a in zip(self.conns, args, strict=True):
            try:
                conn.send_bytes(pickle.dumps((method, a)))
            except (BrokenPipeError, OSError):
                pass  # found dead below, with its rank named
        return self._replies(method)

    def _replies(self, phase: str) -> list[Any]:
        deadline = time.monotonic() + self.timeout_s
        replies: dict[int, Any] = {}
        while len(replies) < self.world:
            for rank, (conn, proc) in enumerate(zip(self.conns, self.procs)):
                if rank in replies:
                    continue
                if conn.poll(0.05):
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        self._fail(rank, phase, self._exit(proc))
                    if status != "ok":
                        self._fail(rank, phase, value)
                    replies[rank] = value
                elif proc.exitcode is not None:
                    self._fail(rank, phase, self._exit(proc))
            if time.monotonic() > deadline:
                late = [r for r in range(self.world) if r not in replies]
                self._fail(late[0], phase, f"no answer within learner.shard_timeout_s = "
                                           f"{self.timeout_s:g} s")
        return [replies[r] for r in range(self.world)]

    @staticmethod
    def _exit(proc) -> str:
        proc.join(1.0)
        code = proc.exitcode
        if code is not None and code < 0:
            return f"its process was killed by signal {-code}"
        return f"its process exited (code {code})"

    def _fail(self, rank: int, phase: str, why: str):
        """Stop every rank and raise, naming the rank whose process is gone when one is (the
        others then only report a broken connection to it)."""
        world = self.world
        for other, proc in enumerate(self.procs):
            proc.join(0.5 if other != rank else 0)
            if other != rank and proc.exitcode is not None:
                rank, why = other, self._exit(proc)
                break
        self.close()
        raise rank_failed(rank, world, phase, why)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send_bytes(pickle.dumps(None))
        for proc in self.procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.close()
        self.conns, self.procs, self.world = [], [], 0


def split_rows(batch: Batch, n: int) -> list[torch.Tensor]:
    """Row indices of each of `n` ranks, balanced by tokens (each unit to the rank with the
    fewest so far, longest first). The units are whole groups when there are at least `n`
    (a group's prompt is then run once, on one rank), else single rows."""
    lengths = batch.attention_mask.sum(-1).tolist()
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(batch.group_ids.tolist()):
        groups.setdefault(g, []).append(i)
    units = list(groups.values()) if len(groups) >= n else [[i] for i in range(batch.num_rows)]
    units.sort(key=lambda u: (-sum(lengths[i] for i in u), u[0]))
    load, parts = [0] * n, [[] for _ in range(n)]
    for unit in units:
        r = min(range(n), key=lambda k: (load[k], len(parts[k]), k))
        parts[r] += unit
        load[r] += sum(lengths[i] for i in unit)
    return [torch.tensor(sorted(p), dtype=torch.long) for p in parts]


class ShardedTrainer:
    """The trainer port over learner ranks (`LocalRanks` or `RayRanks`). `model`: the
    driver's whole copy of the policy (in shared memory for local ranks), which holds the
    latest published weights. `handoff(version)`: what a publication gives the rollout
    side once the driver's copy holds it (default: nothing more, the engine in this
    process reads the copy; Ray workers get an object store reference)."""

    def __init__(self, ranks, model, handoff=None):
        self.ranks, self.model = ranks, model
        self.handoff = handoff or Published
        self.world = ranks.world
        self._published: int | None = None
        self._synced: int | None = None
        self.publish_seconds = 0.0

    def _parts(self, batch: Batch) -> list[tuple[torch.Tensor, Batch]]:
        if batch.num_rows < self.world:
            raise ValueError(f"a batch of {batch.num_rows} rows cannot be split over "
                             f"learner.shards = {self.world} ranks")
        return [(idx, take_rows(batch, idx)) for idx in split_rows(batch, self.world)]

    def update(self, batch: Batch) -> dict[str, float]:
        replies = self.ranks.call("update", [(part,) for _, part in self._parts(batch)])
        metrics = replies[0][0]  # every rank reports the whole batch's (summed) figures
        return metrics | {"learner_update_seconds": max(r[1] for r in replies),
                          "learner_rank_peak_rss_added_mb": max(r[2] for r in replies),
                          "learner_ranks": float(self.world)}

    def reference_kl(self, batch: Batch) -> torch.Tensor:
        parts = self._parts(batch)
        replies = self.ranks.call("reference_kl", [(part,) for _, part in parts])
        out = torch.zeros(batch.loss_mask.shape, dtype=replies[0].dtype)
        for (idx, _), values in zip(parts, replies):
            out[idx, : values.shape[1]] = values
        return out

    def publish(self, version: int) -> Published:
        """Every rank's rows into the driver's copy, which then holds `version` (the
        rollout engine in this process reads it; other placements send it on)."""
        start = time.perf_counter()
        replies = self.ranks.call("publish", [()] * self.world)
        if any(r is not None for r in replies):
            shards.place_arrays(dict(self.model.state_dict()), replies)
        self.publish_seconds = time.perf_counter() - start
        self._published = version
        return self.handoff(version)

    def sync_into(self, model) -> int | None:
        """The driver's model is the one publications write: current once published."""
        if self._published == self._synced:
            return None
        self._synced = self._published
        return self._published

    def state_dict(self) -> dict:
        """The schedule and counters, and a folder holding every rank's optimizer shard
        (a checkpoint moves it in: learner/checkpoint.py)."""
        folder = tempfile.mkdtemp(prefix="rollwise-optimizer-")
        return self.ranks.call("save", [(folder,)] * self.world)[0]

    def load_state_dict(self, state: dict) -> None:
        """Each rank takes its rows of the driver's weights (loaded from the checkpoint
        before) and its share of the optimizer state, from a run of any number of ranks."""
        weights = None if self.ranks.shared else _plain(self.model)
        self.ranks.call("load", [(state, weights)] * self.world)

    def memory(self) -> list[dict[str, float]]:
        return self.ranks.call("memory", [()] * self.world)

    def close(self) -> None:
        self.ranks.close()


def _plain(model) -> dict:
    from rollwise.distributed.actors import to_plain

    return to_plain(model.state_dict())


def start_local(cfg, model, precision) -> ShardedTrainer:
    """learner.shards ranks as processes of this machine over the driver's `model`, which
    is moved into shared memory (before any engine reads it: do this first)."""
    from rollwise.system.runtime import free_cores

    model.share_memory()
    lc = cfg.learner
    threads = max(1, (cfg.run.threads or free_cores()) // lc.shards)
    return ShardedTrainer(LocalRanks(cfg.model_dump(), model, precision, lc.shards,
                                     threads=threads, timeout_s=lc.shard_timeout_s), model)
