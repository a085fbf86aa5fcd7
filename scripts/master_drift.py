"""How far bfloat16 master weights move the policy against float32 ones, on one fixed batch.

    python scripts/master_drift.py [--updates 6] [--lr 2e-5]

The quickstart's batch as `rollwise bench learner` samples it (SmolLM2-135M, 4 prompts x 8
samples, every row trained), then `--updates` updates of the same batch from the same float32
weights by each way of keeping the weights: float32 (the defaults), bfloat16 with stochastic
rounding, and bfloat16 with an int8 residual (`learner.master_rounding = "compensated"`),
each with float32 and with bfloat16 moments. After each update it prints the mean absolute
change of the batch's token log-probs from the start (bf16-autocast, as the learner computes
them): a deterministic counter of how far the policy moved, to set beside float32's.
"""

from __future__ import annotations

import argparse
import copy

import torch

from rollwise.algos import corrections, policy_losses
from rollwise.bench.common import load_workload
from rollwise.bench.learner import _batch
from rollwise.learner import Learner

WAYS = [("float32", "stochastic", "adamw"), ("bfloat16", "stochastic", "adamw"),
        ("bfloat16", "compensated", "adamw"), ("bfloat16", "stochastic", "adamw-bf16"),
        ("bfloat16", "compensated", "adamw-bf16")]


def token_logprobs(model, batch) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    picked = logp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return picked[batch.loss_mask[:, 1:].bool()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--lr", type=float, default=2e-5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy, pairs = load_workload("smollm2-135m", 4, 0, "cpu", split="pairs")
    batch, _ = _batch(policy, pairs, 8, 64, 0, {})
    start = token_logprobs(policy.model, batch)
    for master, rounding, optimizer in WAYS:
        model = copy.deepcopy(policy.model)  # float32: the bfloat16 ones convert it
        learner = Learner(model, loss_fn=policy_losses["ppo"], lr=args.lr,
                          loss_options={"aggregation": "token-mean"}, precision="bf16-autocast",
                          skip_zero_advantage=False, optimizer=optimizer, master_dtype=master,
                          master_rounding=rounding, correction_fn=corrections["tis"],
                          correction_options={"cap": 2.0})
        moved = []
        for _ in range(args.updates):
            learner.update(batch)
            moved.append(float((token_logprobs(model, batch) - start).abs().mean()))
        print(f"{master:8s} {rounding:11s} {optimizer:10s}", " ".join(f"{m:.4f}" for m in moved),
              flush=True)


if __name__ == "__main__":
    main()
