"""The sharded learner on a device: FSDP2 over NCCL (one rank a GPU) or gloo (CPU ranks).

    python scripts/shard_check.py --device cuda --shape qwen2-1.5b      # every GPU a rank
    python scripts/shard_check.py --device cpu --ranks 2 --shape tiny   # validated on a CPU

Each rank builds the same random-init model of `--shape` (configs/shapes/, seed 0) on its
device, shards it with FSDP2 (`learner.shards`; on a GPU with bfloat16 mixed precision:
bfloat16 parameters in compute, float32 reduction), runs `--updates` updates of the
learner on one synthetic batch (groups sharing a prompt, random advantages), then publishes:
every weight gathered whole in turn (`learner/shards.gather_full`) into rank 0's copy,
which a rollout engine then installs. Rank 0 writes OUT/shard_check.json: per rank the
update seconds, peak device memory (or resident set), bytes of parameters, gradients
and optimizer state held, the loss at each update, and the publication's seconds.
Each rank's loss must fall over the updates (the same batch, a positive learning rate).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _model(shape: str, device: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if shape == "tiny":
        from rollwise.models.tiny import build_model

        return build_model().to(device)
    config = AutoConfig.for_model(**json.loads((ROOT / "configs" / "shapes" / f"{shape}.json")
                                               .read_text()))
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _batch(vocab: int, rows: int, prompt: int, response: int):
    import torch

    from rollwise.learner.batch import collate
    from rollwise.types import Sample, Trajectory

    gen = torch.Generator().manual_seed(1)
    old = -math.log(vocab)  # a random-init model's log-prob of a token: ratios start near 1
    trajs = []
    for g in range(rows // 8):
        p = torch.randint(4, vocab, (prompt,), generator=gen).tolist()
        for _ in range(8):
            r = torch.randint(4, vocab, (response,), generator=gen).tolist()
            trajs.append(Trajectory(sample=Sample(id=str(g), prompt="", answer=""),
                                    prompt_ids=p, response_ids=r, logprobs=[old] * response,
                                    versions=[0] * response, finish_reason="stop"))
    adv = torch.randn(len(trajs), generator=gen)
    return collate(trajs, adv, torch.arange(len(trajs)) // 8, pad_id=0)


def _rank(rank: int, world: int, address: str, args, queue) -> None:
    import torch

    from rollwise.algos import policy_losses
    from rollwise.learner import Learner
    from rollwise.learner.shards import gather_full, held_bytes, init_ranks

    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    torch.set_num_threads(1 if args.device == "cpu" else 4)
    peers = init_ranks(rank, world, address, device, 600)
    model = _model(args.shape, device)
    whole = _model(args.shape, "cpu") if rank == 0 else None  # rank 0's copy, published into
    learner = Learner(model, loss_fn=policy_losses["ppo"], lr=1e-4,
                      loss_options={"aggregation": "token-mean"}, skip_zero_advantage=False,
                      precision="bf16-autocast" if args.device == "cuda" else "float32",
                      micro_batch_tokens=args.micro_batch_tokens, peers=peers)
    batch = _batch(model.config.vocab_size, args.rows, args.prompt, args.response)
    mine = batch if world == 1 else _share(batch, rank, world)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    losses, seconds = [], []
    for _ in range(args.updates):
        start = time.perf_counter()
        losses.append(learner.update(mine)["loss"])
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    start = time.perf_counter()
    gather_full(learner.model, dict(whole.state_dict()) if whole is not None else None)
    publish_s = time.perf_counter() - start
    engine_s = None
    if whole is not None:
        from rollwise.engine import NativeEngine

        start = time.perf_counter()
        engine = NativeEngine(whole.to(device), eos_token_ids=[2])
        engine.publish(1)
        engine_s = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(device) / 2**20 if device.startswith("cuda")
            else None)
    queue.put({"rank": rank, "losses": losses, "update_s": seconds, "publish_s": publish_s,
               "engine_install_s": engine_s, "peak_device_mb": peak,
               "held_mb": {k: v / 2**20 for k, v in held_bytes(learner).items()}})
    import torch.distributed as dist

    dist.destroy_process_group()


def _share(batch, rank: int, world: int):
    from rollwise.distributed.shards import split_rows
    from rollwise.learner.batch import take_rows

    return take_rows(batch, split_rows(batch, world)[rank])


def main() -> int:
    import torch
    import torch.multiprocessing as mp

    from rollwise.distributed.shards import free_address

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ranks", type=int, default=0, help="default: every GPU (CPU: 2)")
    ap.add_argument("--shape", default="qwen2-1.5b")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "gpu_check_out")))
    args = ap.parse_args()
    world = args.ranks or (max(1, torch.cuda.device_count()) if args.device == "cuda" else 2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    address = free_address()
    procs = [ctx.Process(target=_rank, args=(r, world, address, args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(world):
            results.append(queue.get(timeout=1200))
    finally:
        for p in procs:
            p.join(30)
    results.sort(key=lambda r: r["rank"])
    report = {"device": args.device, "ranks": world, "shape": args.shape, "rows": args.rows,
              "prompt": args.prompt, "response": args.response, "results": results,
              "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
              "learns": all(r["losses"][-1] < r["losses"][0] for r in results)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "shard_check.json").write_text(json.dumps(report, indent=1))
    for r in results:
        print(f"rank {r['rank']}: update {min(r['update_s']):.2f}s, publish {r['publish_s']:.2f}s"
              f", loss {r['losses'][0]:.6f} -> {r['losses'][-1]:.6f}, held {r['held_mb']}, "
              f"peak {r['peak_device_mb']}")
    return 0 if report["learns"] else 1


if __name__ == "__main__":
    sys.exit(main())
