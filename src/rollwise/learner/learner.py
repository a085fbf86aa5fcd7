"""The learner: policy-gradient updates on a `Batch`, through the algorithm registries.

A single on-policy update per batch uses the engine's behaviour log-probs as the old
log-probs, so no extra forward pass is spent recomputing them. The reference policy is only
evaluated when the KL coefficient is positive: with LoRA it is the base model with the
adapters disabled, otherwise a frozen copy made at start (its linear layers in bfloat16 under
bf16-autocast, where the products are bfloat16 anyway: learner/memory.py).

With an off-policy correction (TIS/MIS, `correction_fn`), the learner first recomputes the
old log-probs with its own weights (one extra forward pass, no gradient): the PPO ratio is
taken against those, and the correction's per-token weights compare them with the engine's
behaviour log-probs. The entropy bonus is only computed when its coefficient is positive.

Rows whose advantage is 0 everywhere contribute exactly nothing to a loss declared
`zero_at_zero_advantage` (PPO, GSPO, CISPO) when no KL or entropy term is in the loss; with
`skip_zero_advantage` the learner runs no forward or backward pass for them. The loss keeps
its normalisers (token and sequence counts of the whole batch), and a step where every row is
skipped still steps the optimizer on zero gradients, so the update is the same as without the
skip (up to float summation order).

Memory: the output layer's log-probs are computed in chunks (learner/logprobs.py); with
`activation_checkpointing` each decoder layer keeps only its input and recomputes the rest
in the backward pass (one more forward pass of the decoder; a grouped layer recomputes its
prompt and responses alike, so prompts stay shared); `memory_budget_mb` caps the micro-batch
and the log-prob chunk so that the activations fit (learner/memory.py). With `master_dtype`
"bfloat16" the weights and gradients are bfloat16 (half the bytes; the engine then reads them
in place) and the optimizer rounds its updates stochastically (learner/stochastic.py).
The process keeps the memory an update frees for reuse (`system.runtime.tune_allocator`), but
reuses it imperfectly: over steps the resident set grows well past the live tensors (0.8 to
1.7 GB on the quickstart's update, docs/performance.md). With `release_memory` the gradients
are freed right after the optimizer step (not at the next update's start) and the freed heap
is given back after each update (glibc `malloc_trim`), at the cost of faulting pages in again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import torch

from rollwise.algos import aggregate, is_zero_at_zero_advantage
from rollwise.learner import grouped, shards
from rollwise.learner.batch import group_micro_batches, micro_batches, take_rows
from rollwise.learner.grouped import backbone_and_head
from rollwise.learner.logprobs import TokenLogprobs
from rollwise.learner.memory import enable_checkpointing, fit_budget, reference_copy
from rollwise.learner.optim import build_optimizer, load_plain_state, plain_state
from rollwise.learner.stochastic import bfloat16_master
from rollwise.system.runtime import trim_heap
from rollwise.types import Batch, Published


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of an update: its row indices in the batch (None: a spare row a
    rank runs at weight 0), the rows on the device, its weight, whether it runs grouped
    (learner/grouped.py), and for a piece of a group cut over several micro-batches, the
    group (`cut`) and its prefix's tokens."""

    idx: torch.Tensor | None
    rows: Batch
    weight: float
    share: bool
    cut: int | None = None
    prefix_ids: torch.Tensor | None = None


class Learner:
    def __init__(self, model, *, loss_fn: Callable, loss_options: dict, lr: float,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 grad_clip: float = 1.0, warmup_steps: int = 0, lr_schedule: str = "constant",
                 total_steps: int = 0, micro_batch_tokens: int = 4096,
                 logprob_chunk: int = 1024, precision: str = "float32", temperature: float = 1.0,
                 kl_fn: Callable | None = None, kl_coef: float = 0.0, ppo_epochs: int = 1,
                 kl_in_reward: bool = False, entropy_coef: float = 0.0,
                 correction_fn: Callable | None = None, correction_options: dict | None = None,
                 skip_zero_advantage: bool = True, share_prompts: bool | str = "auto",
                 activation_checkpointing: bool = False, memory_budget_mb: float = 0.0,
                 optimizer: str = "adamw", master_dtype: str = "float32", seed: int = 0,
                 release_memory: bool = False, master_rounding: str = "stochastic",
                 peers: shards.Peers | None = None):
        """`share_prompts`: each group's prompt runs once (learner/grouped.py; "auto": where
        that saves `grouped.AUTO_SAVING`). `activation_checkpointing`, `memory_budget_mb`
        (0: none): the module docstring.
        `optimizer`: a name of learner/optim.py (AdamW, or AdamW with 8-bit, 4-bit, float8
        or bfloat16 moments).
        `master_dtype` "bfloat16": the model is converted in place (a no-op when loaded so),
        its updates rounded stochastically (`seed` seeds it) or, `master_rounding`
        "compensated", kept by an int8 residual each (learner/stochastic.py).
        `release_memory`: gradients freed after each step, freed heap memory given back.
        `peers`: one of several learner ranks; the model is sharded over them with FSDP2,
        each trains on its share of a batch (learner/shards.py)."""
        if master_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"learner.master_dtype must be float32 or bfloat16, not "
                             f"'{master_dtype}'")
        stochastic, compensated = master_dtype == "bfloat16", master_rounding == "compensated"
        if stochastic:
            bfloat16_master(model, keep_stream=precision == "bf16-autocast", residuals=compensated)
        self.model, self.peers, self.share_prompts = model, peers, share_prompts
        if activation_checkpointing:
            enable_checkpointing(model)
        self._scorers(model, precision, kl_coef)
        self.loss_fn, self.loss_options = loss_fn, dict(loss_options)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(optimizer, self.params, lr=lr, betas=betas,
                                         weight_decay=weight_decay, stochastic=stochastic,
                                         seed=seed, compensated=compensated)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup_steps, lr_schedule, total_steps))
        if memory_budget_mb > 0:
            micro_batch_tokens, logprob_chunk = fit_budget(
                model, memory_budget_mb, precision=precision, logprob_chunk=logprob_chunk,
                checkpointing=activation_checkpointing, micro_batch_tokens=micro_batch_tokens)
        self.grad_clip, self.micro_batch_tokens = grad_clip, micro_batch_tokens
        self.logprob_chunk, self.precision, self.temperature = logprob_chunk, precision, temperature
        self.kl_fn, self.kl_coef, self.ppo_epochs = kl_fn, kl_coef, ppo_epochs
        self.kl_loss_coef = 0.0 if kl_in_reward else kl_coef  # else in the reward (driver)
        self.entropy_coef = entropy_coef
        self.correction_fn, self.correction_options = correction_fn, dict(correction_options or {})
        # zero-advantage rows add nothing to the gradient: safe to skip (module docstring)
        self.skip_zero_advantage = (skip_zero_advantage and is_zero_at_zero_advantage(loss_fn)
                                    and self.kl_loss_coef == 0 and entropy_coef == 0)
        self.rows_skipped = 0  # zero-advantage rows not run through the model, all steps
        # the version last published and the one `sync_into` last reported
        self._published, self._synced = None, None
        self.nan_skips = 0  # updates skipped for a non-finite loss or gradient
        self.release_memory = release_memory
        self.device = self.params[0].device

    def _scorers(self, model, precision: str, kl_coef: float) -> None:
        """The policy (and the KL reference: LoRA's base, else a frozen copy) as modules
        computing log-probs; a sharded learner shards them as roots around their decoder
        layers."""
        self.ref_model = None
        if kl_coef > 0 and not hasattr(model, "disable_adapter"):
            self.ref_model = reference_copy(model, precision)
        self.scorer = TokenLogprobs(model)
        self.ref_scorer = TokenLogprobs(self.ref_model) if self.ref_model is not None else None
        # every model this learner scores with runs grouped, or none does
        self.groupable = self.share_prompts is not False and all(
            grouped.install(m) for m in filter(None, (model, self.ref_model)))
        self._model_config = backbone_and_head(model)[0].config
        if self.peers is not None:
            device = str(next(model.parameters()).device)
            mixed = device.startswith("cuda") and precision == "bf16-autocast"
            for scorer in filter(None, (self.scorer, self.ref_scorer)):
                shards.shard(scorer, list(backbone_and_head(scorer.model)[0].layers), device,
                             mixed_bf16=mixed)

    def _autocast(self):
        if self.precision == "bf16-autocast" and not (self.peers and self.device.type == "cuda"):
            # (sharded on a GPU, FSDP's mixed precision computes in bfloat16 instead)
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _logprobs(self, model, rows: Batch, with_entropy: bool = False,
                  micro: MicroBatch | None = None, prefix: grouped.PrefixKV | None = None):
        """Log-probs (and entropy) of `rows`, grouped as `micro` says; `prefix`: its group's
        prefix, run before (a piece of a cut group); else run here, without gradients."""
        scorer = self.ref_scorer if model is self.ref_model else self.scorer
        share = micro.share if micro is not None else self._shares(rows)
        if prefix is None and micro is not None and micro.cut is not None:
            with torch.no_grad():
                prefix = grouped.run_prefix(model, micro.prefix_ids).detached()
        with self._autocast():
            return scorer(rows.input_ids, rows.attention_mask, rows.loss_mask,
                          chunk=self.logprob_chunk, temperature=self.temperature,
                          with_entropy=with_entropy, share_prompts=share, prefix=prefix)

    def _shares(self, batch: Batch) -> bool:
        """Whether `batch` runs grouped (each group's prompt once): `share_prompts` true,
        or "auto" and the FLOP model's saving reaches `grouped.AUTO_SAVING`."""
        if self.share_prompts is False or not self.groupable:
            return False
        if self.share_prompts is True:
            return True
        return grouped.batch_saving(self._model_config, batch,
                                    self.micro_batch_tokens) >= grouped.AUTO_SAVING

    def _plan(self, batch: Batch, spare: Batch | None = None) -> list[MicroBatch]:
        """The micro-batches of `batch`: whole groups when it runs grouped (a group over
        the budget cut into pieces, in one process), else rows by length. Learner ranks
        agree on their number (`shards.Peers.plan`); a rank with fewer runs one row of
        `spare` (default: `batch`) at weight 0."""
        share = self._shares(batch)
        if share:
            pieces = group_micro_batches(batch, self.micro_batch_tokens,
                                         split=self.peers is None)
        else:
            pieces = [(idx, None, 0) for idx in micro_batches(batch, self.micro_batch_tokens)]
        out = [MicroBatch(idx, take_rows(batch, idx, trim=True, device=self.device), 1.0,
                          share, cut, None if cut is None else
                          batch.input_ids[idx[0], :k].to(self.device))
               for idx, cut, k in pieces]
        if self.peers is None:
            return out
        spare = batch if spare is None else spare
        extra = MicroBatch(None, take_rows(spare, torch.arange(1), trim=True,
                                           device=self.device), 0.0, False) \
            if spare.num_rows else None
        return self.peers.plan(out, extra)

    @torch.no_grad()
    def _ref_logprobs(self, rows: Batch, micro: MicroBatch | None = None) -> torch.Tensor:
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, rows, micro=micro)
        with self.model.disable_adapter():
            return self._logprobs(self.model, rows, micro=micro)

    @torch.no_grad()
    def _over_batch(self, batch: Batch, fn: Callable[[Batch, MicroBatch], torch.Tensor],
                    spare: Batch | None = None) -> torch.Tensor:
        """[N, L] values of `fn(rows, micro)` on each micro-batch of `batch`, in row order
        (`spare`: `_plan`'s)."""
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float64)
        for micro in self._plan(batch, spare):
            values = fn(micro.rows, micro)
            if micro.weight:
                out[micro.idx, : micro.rows.loss_mask.shape[1]] = values.double().cpu()
        return out

    def reference_kl(self, batch: Batch) -> torch.Tensor:
        """[N, L] per-token KL estimate of the behaviour policy against the reference,
        kl_fn(behaviour logp, reference logp) on response tokens (0 elsewhere): the
        KL-in-reward penalty. Needs kl_coef > 0 (the reference model)."""
        if self.kl_coef <= 0:
            raise ValueError("reference_kl needs kl_coef > 0 (no reference model otherwise)")
        self.model.eval()
        return self._over_batch(batch, lambda rows, micro: self.kl_fn(
            rows.old_logprobs, self._ref_logprobs(rows, micro).to(rows.old_logprobs.dtype)
        ) * rows.loss_mask)

    def _correct(self, batch: Batch, spare: Batch | None = None
                 ) -> tuple[Batch, torch.Tensor | None, dict[str, float]]:
        """(batch with the learner's own old log-probs, per-token weights, metrics);
        `spare`: the rows a rank whose rows were all skipped runs at weight 0."""
        if self.correction_fn is None:
            return batch, None, {}
        self.model.eval()  # no dropout in the recomputed log-probs
        old = self._over_batch(batch, lambda rows, micro: self._logprobs(self.model, rows,
                                                                         micro=micro), spare)
        old = old.to(batch.old_logprobs.dtype) * batch.loss_mask
        weights, metrics = self.correction_fn(old, batch.old_logprobs, batch.loss_mask,
                                              **self.correction_options)
        corrected = dataclasses.replace(batch, old_logprobs=old)
        if self.peers is not None:  # each rank's means, weighted by its rows
            rows = self.peers.total({"rows": float(batch.num_rows)})["rows"]
            metrics = {k: v / max(rows, 1.0) for k, v in self.peers.total(
                {k: float(v) * batch.num_rows for k, v in metrics.items()}).items()}
        return corrected, weights, {f"correction_{k}": v for k, v in metrics.items()}

    def update(self, batch: Batch) -> dict[str, float]:
        """One optimizer step per PPO epoch over `batch`; returns averaged metrics. Learner
        ranks each pass their share of one batch: the normalisers and figures are the
        whole batch's."""
        spare = batch  # (before rows are skipped: a rank keeps a row to run at weight 0)
        counts = {"num_tokens": float(batch.num_response_tokens), "num_seqs": batch.num_rows}
        if self.peers is not None:
            counts = self.peers.total(counts)
        totals = {"num_tokens": max(int(counts["num_tokens"]), 1),
                  "num_seqs": int(counts["num_seqs"])}
        batch, skipped = self._active_rows(batch)  # correction weights are per row
        rows = {"rows_trained": float(batch.num_rows), "rows_skipped_zero_adv": float(skipped)}
        if self.peers is not None:
            rows = self.peers.total(rows)
        batch, weights, correction = self._correct(batch, spare)
        self.model.train()
        metrics: dict[str, float] = {}
        for _ in range(self.ppo_epochs):
            metrics = self._step(batch, totals, weights, rows["rows_trained"], spare)
        self.model.eval()
        if self.release_memory:
            trim_heap()
        return metrics | correction | rows

    def _active_rows(self, batch: Batch) -> tuple[Batch, int]:
        """(the rows with a non-zero advantage, rows dropped) when skipping is on; the totals
        the loss is normalised by are taken from the whole batch before."""
        if not self.skip_zero_advantage:
            return batch, 0
        live = (batch.token_advantages != 0).any(-1)  # [N]
        dropped = int((~live).sum())
        if dropped:
            self.rows_skipped += dropped
            batch = take_rows(batch, torch.nonzero(live)[:, 0])
        return batch, dropped

    def _penalties(self, logp, entropy, rows: Batch, totals: dict, sums: dict,
                   micro: MicroBatch | None = None) -> torch.Tensor:
        """KL penalty + entropy bonus of one micro-batch, aggregated like the policy loss
        (normalised by batch totals, so micro-batch parts add up)."""
        agg = self.loss_options.get("aggregation", "token-mean")
        extra = torch.zeros((), dtype=logp.dtype, device=logp.device)
        if self.kl_loss_coef > 0:
            kl = self.kl_fn(logp, self._ref_logprobs(rows, micro))
            kl_loss = aggregate(kl, rows.loss_mask, agg,
                                max_tokens=self.loss_options.get("max_tokens"), **totals)
            extra = extra + self.kl_loss_coef * kl_loss
            sums["kl"] = sums.get("kl", 0.0) + kl_loss.item()
        if entropy is not None:
            ent = aggregate(entropy, rows.loss_mask, agg,
                            max_tokens=self.loss_options.get("max_tokens"), **totals)
            extra = extra - self.entropy_coef * ent
            sums["entropy"] = sums.get("entropy", 0.0) + ent.item()
        return extra

    def _step(self, batch: Batch, totals: dict, weights: torch.Tensor | None,
              rows_trained: float, spare: Batch) -> dict[str, float]:
        """One optimizer step over `batch` (`rows_trained`: its rows on every rank;
        `spare`: the rows a rank with fewer micro-batches than its peers runs at weight 0)."""
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"loss": 0.0}  # skipped rows (if any) add exactly 0
        finite = True
        plan = self._plan(batch, spare)
        prefixes: dict[int, tuple[grouped.PrefixKV, grouped.PrefixKV]] = {}
        for i, micro in enumerate(plan):
            prefix = None
            if micro.cut is not None:  # a piece of a cut group: its prefix ran once
                if micro.cut not in prefixes:
                    with self._autocast():
                        ran = grouped.run_prefix(self.model, micro.prefix_ids)
                    prefixes[micro.cut] = (ran, ran.detached())
                prefix = prefixes[micro.cut][1]
            loss, m = self._micro_loss(micro, totals, weights, sums, prefix)
            if not torch.isfinite(loss):
                finite = False
                if self.peers is None:
                    break
                loss = loss.nan_to_num(0.0) * 0  # its peers' collectives still run
            loss.backward()
            if micro.cut is not None and all(later.cut != micro.cut for later in plan[i + 1:]):
                ran, given = prefixes.pop(micro.cut)  # its last piece: the prefix's backward
                ran.backward(given)
            part = len(micro.rows.input_ids) * micro.weight / max(rows_trained, 1.0)
            for k, v in m.items():  # a mean over rows
                sums[k] = sums.get(k, 0.0) + v * part
            sums["loss"] = sums.get("loss", 0.0) + loss.item() * micro.weight
        if self.peers is not None:
            finite = self.peers.largest(0.0 if finite else 1.0) == 0.0
            sums = self.peers.total(sums)
        if not plan:  # every row skipped: Adam still steps, on zero gradients
            for p in self.params:
                p.grad = torch.zeros_like(p)
        grad_norm = self._clip()
        if not finite or not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.nan_skips += 1
            return {"skipped_nonfinite": 1.0, "nan_skips": float(self.nan_skips)}
        lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
        self.optimizer.step()
        if self.release_memory:  # else left in .grad until the next update (tests read them)
            # freed now, they leave room for the rollouts and the next update's forward passes
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return sums | {"grad_norm": grad_norm, "lr": lr, "skipped_nonfinite": 0.0}

    def _micro_loss(self, micro: MicroBatch, totals: dict, weights: torch.Tensor | None,
                    sums: dict, prefix: grouped.PrefixKV | None = None
                    ) -> tuple[torch.Tensor, dict]:
        """The loss of one micro-batch (times its weight) and the loss function's figures;
        `prefix`: its group's prefix keys and values (a piece of a cut group)."""
        rows, idx, weight = micro.rows, micro.idx, micro.weight
        entropy = None
        if self.entropy_coef > 0:
            logp, entropy = self._logprobs(self.model, rows, with_entropy=True, micro=micro,
                                           prefix=prefix)
        else:
            logp = self._logprobs(self.model, rows, micro=micro, prefix=prefix)
        extra = {} if weights is None else {"weights": (
            weights[idx][:, : logp.shape[1]].to(self.device, logp.dtype) if idx is not None
            else torch.ones_like(logp))}
        loss, m = self.loss_fn(logp, rows.old_logprobs, rows.advantages, rows.loss_mask,
                               **self.loss_options, **totals, **extra)
        penalty_sums: dict[str, float] = {}
        loss = loss + self._penalties(logp, entropy, rows, totals, penalty_sums, micro)
        for k, v in penalty_sums.items():
            sums[k] = sums.get(k, 0.0) + v * weight
        return loss * weight if weight != 1.0 else loss, m

    def _clip(self) -> float:
        if self.grad_clip > 0:
            return shards.total_norm(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        if self.peers is not None:  # over every rank's shard
            grads = [p.grad for p in self.params if p.grad is not None]
            return shards.total_norm(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        grads = [p.grad.norm() for p in self.params if p.grad is not None]
        return float(torch.stack(grads).norm()) if grads else 0.0

    # -- the trainer port (pipeline/ports.py), in this process ------------------------------
    def publish(self, version: int) -> Published:
        """In one process the rollout engine reads this learner's tensors: nothing to send."""
        self._published = version
        return Published(version)

    def sync_into(self, model) -> int | None:
        """The driver's model is the one this learner trains: always current. The version
        when it changed since the last call (an evaluator's engine with its own copy of the
        weights re-reads them then; one reading the rollout engine's only follows)."""
        if self._published == self._synced:
            return None
        self._synced = self._published
        return self._published

    def close(self) -> None:
        pass

    def state_dict(self, folder: Path | None = None) -> dict:
        """The optimizer's state, the schedule's and the counters. Sharded (`peers`), each
        rank writes its shard of the optimizer state into `folder` (a DCP checkpoint, which
        any number of ranks can load) and the state names the folder."""
        own = {"scheduler": self.scheduler.state_dict(), "nan_skips": self.nan_skips}
        if self.peers is None:
            return own | {"optimizer": plain_state(self.optimizer.state_dict())}
        if folder is None:
            raise ValueError("a sharded learner writes its optimizer state into a folder")
        shards.save_optimizer(self.model, self.optimizer, folder)
        return own | {"folder": str(folder)}

    def load_state_dict(self, state: dict) -> None:
        """A state of `state_dict`, from a learner of any number of ranks: a sharded one's
        (`folder`) is resharded to this one's; a one-process one's is split over ranks."""
        if "folder" in state:
            shards.load_optimizer(self.model, self.optimizer, Path(state["folder"]))
        elif self.peers is not None:
            shards.load_full_optimizer(self.model, self.optimizer, state["optimizer"])
        else:
            load_plain_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.nan_skips = state.get("nan_skips", 0)


def lr_factor(step: int, warmup: int, schedule: str, total: int) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based).

    >>> [round(lr_factor(s, 2, "linear", 6), 2) for s in range(6)]
    [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "linear" and total > warmup:
        return max(0.0, (total - step) / (total - warmup))
    return 1.0
