"""learner.shards = N: the learner sharded over N gloo ranks with FSDP2 makes the update one
process makes, checkpoints reshard, and a dead rank stops the run with its name.

Bounds. In float64, a gradient summed in another order (rows split over ranks, other
micro-batches) differs from the one-process gradient by at most about n*u*kappa relative
(u = 2^-53 ~ 1.1e-16, n <= 10^3 terms in a reduction of these batches, kappa <= 10^3 for the
cancellation within a sum), i.e. delta <= 1.1e-10. AdamW's step lr * m/(sqrt(v) + eps) moves by
at most 2 * delta of its size (m and v each carry it), a step at most lr (times 1/(1 - beta1)
while moments build up: 10), so after K updates max |dtheta| <= K * lr * 10 * 2 * delta =
1.1e-11 for K = 5, lr = 1e-3. Per-step figures (loss, grad norm, KL) are sums of the same
terms: relative 1e-9 leaves the same margin. Observed here: 4e-16.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rollwise.compose.config import ConfigError, validate_config
from rollwise.compose.parts import build_learner
from rollwise.compose.precision import PrecisionChoice
from rollwise.compose.preflight import check_config
from rollwise.distributed.shards import LearnerDied, _Model, split_rows, start_local
from rollwise.learner.batch import collate
from rollwise.learner.checkpoint import load_checkpoint, save_checkpoint

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
K, LR = 5, 1e-3
THETA_BOUND = K * LR * 10 * 2 * 1.1e-10  # module docstring
FIGURE_RTOL = 1e-9
EXPLICIT = {"rollout": "explicit", "learner": "explicit", "correction": "explicit"}


def _batch(make_trajectory, seed: int, groups: int = 4, size: int = 4, vocab: int = 88):
    """`groups` groups of `size` rows sharing a prompt, ragged responses, random advantages."""
    gen = torch.Generator().manual_seed(seed)
    trajs, gids = [], []
    for g in range(groups):
        n = int(torch.randint(3, 9, (1,), generator=gen))
        prompt = [1] + torch.randint(4, vocab, (n,), generator=gen).tolist()
        for _ in range(size):
            r = int(torch.randint(1, 9, (1,), generator=gen))
            trajs.append(make_trajectory(prompt, torch.randint(4, vocab, (r,), generator=gen)
                                         .tolist(), (-torch.rand(r, generator=gen) * 3 - 1)
                                         .tolist()))
            gids.append(g)
    return collate(trajs, torch.randn(len(trajs), generator=gen), torch.tensor(gids), pad_id=0)


def _cfg(algorithm: dict | None = None, **learner):
    return validate_config({
        "learner": {"lr": LR, "micro_batch_tokens": 40, "shards": 2, **learner},
        "algorithm": {"kl_coef": 0.1, **(algorithm or {})}, "run": {"threads": 1}})


def _close(a: float, b: float, rtol: float = FIGURE_RTOL) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-30)


def _train_both(one, two, batches, rtol: float = FIGURE_RTOL,
                keys: tuple[str, ...] = ("loss", "grad_norm", "kl")) -> list[tuple[dict, dict]]:
    """Each batch through the one-process learner and the ranks (then published, so the
    driver's copy holds the ranks' weights); the per-step figures must agree to `rtol`.
    (clip_frac and the ratio figures are means of micro-batch means, weighted by rows, in
    one process too: they follow micro_batch_tokens and the split, so are not compared.)"""
    out = []
    for step, batch in enumerate(batches):
        a, b = one.update(batch), two.update(batch)
        two.publish(step + 1)
        for key in keys:
            assert _close(a[key], b[key], rtol), (step, key, a[key], b[key])
        out.append((a, b))
    return out


def _pair(cfg, model, learner: str = "float32", correction: str = "none"):
    """(one-process learner over `model`, 2 ranks over a copy of it, that copy)."""
    precision = PrecisionChoice("float32", learner, correction, EXPLICIT)
    copied = copy.deepcopy(model)
    return build_learner(cfg, _Model(model), precision), start_local(cfg, copied, precision), \
        copied


def _worst(a, b, trainable_only: bool = False) -> float:
    """max |a - b| over the parameters of two models of one architecture."""
    other = dict(b.named_parameters())
    return max(float((p - other[n]).detach().abs().max()) for n, p in a.named_parameters()
               if p.requires_grad or not trainable_only)


def test_two_ranks_update_as_one_process_reshard_both_ways_and_name_a_killed_rank(
        tiny_llama, make_trajectory, tmp_path) -> None:
    """float64, a frozen KL reference sharded alike, micro-batches of uneven count per rank
    (the spare zero-weight passes run): five updates equal the one-process learner's; the
    2-rank checkpoint loads into one process and continues equally, and a one-process
    state loads into the 2 ranks likewise; a killed rank is named within seconds. The ranks
    allocate as run.allocator says (jemalloc, where it is installed: preloaded into them)."""
    from rollwise.system.preload import jemalloc_library

    cfg = _cfg(share_prompts=False)
    cfg.run.allocator = "jemalloc"
    precision = PrecisionChoice("float32", "float32", "none", EXPLICIT)
    one_model = tiny_llama(torch.float64)
    one, two, two_model = _pair(cfg, one_model)
    try:
        mapped = [b"jemalloc" in Path(f"/proc/{pid}/maps").read_bytes()
                  for pid in two.ranks.pids]
        assert mapped == [jemalloc_library() is not None] * 2
        batches = [_batch(make_trajectory, step) for step in range(K)]
        for batch, (a, b) in zip(batches, _train_both(one, two, batches)):
            assert b["rows_trained"] == a["rows_trained"] == batch.num_rows
        worst, moved = _worst(one_model, two_model), _worst(one_model, tiny_llama(torch.float64))
        assert worst <= THETA_BOUND < moved / 100, (worst, moved)

        # 2 ranks -> 1 process: the optimizer shards (DCP) resharded into whole tensors
        path = save_checkpoint(tmp_path / "checkpoints", two_model, two.state_dict(),
                               {"step": K})
        assert (path / "learner").is_dir() and not list(tmp_path.glob("rollwise-optimizer-*"))
        resumed_model = tiny_llama(torch.float64)
        resumed = build_learner(cfg, _Model(resumed_model), precision)
        learner_state, _ = load_checkpoint(path, resumed_model)
        resumed.load_state_dict(learner_state)
        batch = _batch(make_trajectory, K)
        one.update(batch)
        resumed.update(batch)
        assert _worst(one_model, resumed_model) <= THETA_BOUND * (K + 1) / K

        # 1 process -> 2 ranks: whole optimizer tensors split into the ranks' rows
        with torch.no_grad():
            for p, q in zip(two_model.parameters(), resumed_model.parameters()):
                p.copy_(q)  # the driver's copy, as a resume loads it from a checkpoint
        two.load_state_dict(resumed.state_dict())
        batch = _batch(make_trajectory, K + 1)
        resumed.update(batch)
        two.update(batch)
        two.publish(K + 2)
        assert _worst(two_model, resumed_model) <= THETA_BOUND / K  # one update, equal start

        # a rank killed between calls: the next call names it, quickly
        os.kill(two.ranks.pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(LearnerDied, match=r"learner rank 1 of 2 failed during 'update'"):
            two.update(batch)
        assert time.monotonic() - start < 30
    finally:
        two.close()


def test_split_rows_balances_tokens_and_keeps_groups_whole(make_trajectory) -> None:
    batch = _batch(make_trajectory, 0, groups=6, size=3)
    parts = split_rows(batch, 2)
    assert sorted(torch.cat(parts).tolist()) == list(range(batch.num_rows))
    groups = [set(batch.group_ids[p].tolist()) for p in parts]
    assert not groups[0] & groups[1]  # no group on two ranks
    tokens = [int(batch.attention_mask[p].sum()) for p in parts]
    longest_group = max(int(batch.attention_mask[batch.group_ids == g].sum()) for g in range(6))
    assert abs(tokens[0] - tokens[1]) <= longest_group  # greedy: within one unit
    # fewer groups than ranks: rows are split one by one
    few = split_rows(_batch(make_trajectory, 1, groups=1, size=5), 3)
    assert sorted(len(p) for p in few) == [1, 2, 2]


@pytest.mark.parametrize("settings, message", [
    ({"learner": {"shards": 0}}, "shards"),
    ({"learner": {"shards": 2, "master_dtype": "bfloat16"}}, "learner.master_dtype"),
    ({"learner": {"shards": 2, "optimizer": "adamw8bit"}}, "learner.optimizer"),
    ({"learner": {"shards": 5}, "rollout": {"prompts_per_step": 1, "group_size": 4}},
     "more than the 4 rows"),
    ({"learner": {"shards": 2}, "run": {"device": "cuda"}}, "cuda"),
])
def test_bad_shard_settings_fail_before_the_model_loads(settings, message) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        check_config(validate_config(settings))


def _train_command(root, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rollwise", "train", str(CONFIGS / "tiny_arith.toml"),
            "--set", "run.num_steps=8", "--set", "learner.shards=2", "--set", "eval.every=0",
            "--set", "task.num_eval=100",
            "--set", "run.checkpoint_every=1", "--set", f"run.output_dir={root}",
            "--set", "run.threads=2", *extra]


def _rank_pids(parent: int) -> list[int]:
    """The learner ranks among `parent`'s children (spawned: multiprocessing's spawn_main)."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    return sorted(int(c) for c in children
                  if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())


@pytest.mark.slow
def test_a_killed_rank_stops_the_run_and_resume_continues_exactly(tmp_path) -> None:
    """A rank SIGKILLed mid-run: the driver exits with an error naming the rank, within
    seconds; `--resume` then finishes a run equal to an uninterrupted one (metrics,
    every trajectory once, counters)."""
    from crashtest import compare, read_run

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ref = subprocess.run(_train_command(tmp_path / "ref"), env=env, capture_output=True,
                         text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]
    # it learns: held-out accuracy rises over 8 steps, as the one-process run's does
    # (37.0% -> 47.0% in 3 steps on 200 prompts, docs/scaling.md)
    evals = [r for r in read_run(tmp_path / "ref" / "tiny_arith")[0] if r["kind"] == "eval"]
    assert evals[-1]["eval_accuracy"] > evals[0]["eval_accuracy"] + 0.05, evals
    victim = subprocess.Popen(_train_command(tmp_path / "victim"), env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    metrics = tmp_path / "victim" / "tiny_arith" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and victim.poll() is None:
        if metrics.is_file() and metrics.read_text().count('"train"') >= 2:
            break
        time.sleep(0.02)
    ranks = _rank_pids(victim.pid)
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)
    killed = time.monotonic()
    out, _ = victim.communicate(timeout=120)
    assert victim.returncode != 0 and time.monotonic() - killed < 60
    assert re.search(r"learner rank [01] of 2 failed during '\w+'", out), out[-2000:]
    resumed = subprocess.run([sys.executable, "-m", "rollwise", "train", "--resume",
                              str(tmp_path / "victim" / "tiny_arith")], env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert compare(tmp_path / "victim" / "tiny_arith",
                   read_run(tmp_path / "ref" / "tiny_arith")) == []


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj",
                                                                                "v_proj"]))
    with torch.no_grad():  # lora_B starts at 0: move it, so that A's gradients are not 0
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return peft


# (learner settings, model dtype, LoRA, learner precision, bound on max |dtheta|, and on the
# per-step figures' relative difference)
BF16 = 2.0**-8
# grouped: one process cuts the big groups (micro_batch_tokens 40), a rank runs them whole;
# transformers' float32 RMSNorm turns that float64 reordering into float32-ulp differences
SHARED64 = K * LR * 10 * 2 * (1.2e-7 * 1e3)
VARIANTS = {
    "lora": ({"share_prompts": False}, torch.float64, True, "float32", THETA_BOUND, FIGURE_RTOL),
    "checkpointing": ({"share_prompts": False, "activation_checkpointing": True},
                      torch.float64, False, "float32", THETA_BOUND, FIGURE_RTOL),
    "shared-prompts": ({"share_prompts": True}, torch.float64, False, "float32", SHARED64,
                       1e-5),
    # bfloat16 products: figures to (layers + 2) * sqrt(width) * 2^-8; the weights only to
    # Adam's step size (a bfloat16-rounded gradient can flip a small one's sign)
    "bf16-autocast": ({"share_prompts": False}, torch.float32, False, "bf16-autocast",
                      K * LR * 2, 4 * 32**0.5 * BF16),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_ranks_update_as_one_process_variants(tiny_llama, make_trajectory, variant) -> None:
    settings, dtype, lora, learner_precision, theta_bound, rtol = VARIANTS[variant]
    base = tiny_llama(dtype)
    one_model = _lora(base) if lora else base
    one, two, two_model = _pair(_cfg(**settings), one_model, learner_precision)
    try:
        _train_both(one, two, [_batch(make_trajectory, step) for step in range(K)], rtol)
        worst = _worst(one_model, two_model, trainable_only=True)
        assert worst <= theta_bound, worst
    finally:
        two.close()


@pytest.mark.slow
def test_torchrun_launch_trains_as_the_local_ranks(tmp_path) -> None:
    """`torchrun --nproc-per-node 2 -m rollwise train CONFIG`: rank 0 drives, rank 1 serves
    the learner; every figure of every step equals the run whose driver started its two
    ranks itself."""
    from crashtest import read_run

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    steps = ["--set", "run.num_steps=3"]
    local = subprocess.run(_train_command(tmp_path / "local", *steps), env=env,
                           capture_output=True, text=True, timeout=600)
    assert local.returncode == 0, local.stderr[-2000:]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
              "--master-port", str(_free_port()), "-m", "rollwise"]
    command = _train_command(tmp_path / "torchrun", *steps)
    ran = subprocess.run(launch + command[3:], env=env, capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-2000:])
    a, _, _ = read_run(tmp_path / "local" / "tiny_arith")
    b, _, _ = read_run(tmp_path / "torchrun" / "tiny_arith")
    assert len(a) == len(b) and a == b


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_rank_whose_rows_all_have_zero_advantage_still_runs_with_its_peers(
        tiny_llama, make_trajectory) -> None:
    """TIS on (its old-log-prob pass runs sharded), zero-advantage rows skipped, and one
    rank's whole share at advantage 0: that rank runs zero-weight passes beside its peer
    (the quickstart's case), and the update equals the one-process one."""
    one_model = tiny_llama(torch.float64)
    one, two, two_model = _pair(_cfg({"kl_coef": 0.0}, share_prompts=False), one_model,
                                correction="tis")
    try:
        for step in range(3):
            batch = _batch(make_trajectory, step, groups=2, size=4)
            batch.advantages[batch.group_ids == 1] = 0.0  # one group a rank: one rank idle
            assert [set(batch.group_ids[p].tolist()) for p in split_rows(batch, 2)] in (
                [{0}, {1}], [{1}, {0}])
            ((a, b),) = _train_both(one, two, [batch], keys=("loss", "grad_norm"))
            assert b["rows_skipped_zero_adv"] == a["rows_skipped_zero_adv"] == 4
        assert _worst(one_model, two_model) <= THETA_BOUND
    finally:
        two.close()


@pytest.mark.slow
def test_smollm2_two_ranks_update_as_one_process_float64(make_trajectory) -> None:
    """The real model's shape (SmolLM2-135M, 30 layers, tied embeddings), in float64: five
    updates on 2 ranks equal one process's within the same bound."""
    from rollwise.models import load_policy

    one_model = load_policy("smollm2-135m").model.double()
    # no KL reference and small output-layer chunks: float64 SmolLM2 on 3 processes fits 24 GB
    one, two, two_model = _pair(_cfg({"kl_coef": 0.0}, share_prompts=False, logprob_chunk=64,
                                     skip_zero_advantage=False), one_model)
    try:
        _train_both(one, two, [_batch(make_trajectory, step, groups=2, size=4, vocab=49152)
                               for step in range(K)], keys=("loss", "grad_norm"))
        assert _worst(one_model, two_model) <= THETA_BOUND
    finally:
        two.close()


@pytest.mark.slow
def test_ranks_start_from_a_script_without_a_main_guard(tmp_path) -> None:
    """A user's script that starts learner ranks at module level (no `if __name__ ==
    "__main__"`): the spawned ranks do not run it again (which would start ranks from each
    rank and leave this process waiting forever to hand the first one its arguments)."""
    script = tmp_path / "train_here.py"
    script.write_text(
        "from rollwise.compose.config import validate_config\n"
        "from rollwise.compose.precision import PrecisionChoice\n"
        "from rollwise.distributed.shards import start_local\n"
        "from rollwise.models.tiny import build_model\n"
        "cfg = validate_config({'learner': {'shards': 2}, 'run': {'threads': 1}})\n"
        "how = dict.fromkeys(('rollout', 'learner', 'correction'), 'explicit')\n"
        "ranks = start_local(cfg, build_model(hidden=32, layers=2, heads=2, kv_heads=1),\n"
        "                    PrecisionChoice('float32', 'float32', 'none', how))\n"
        "print('started', len(ranks.ranks.pids))\n"
        "ranks.close()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "started 2" in done.stdout, done.stderr[-2000:]
