"""The synchronous GRPO driver. Each line names a stage; the stages come from `build.py`.

    for each step:
        select prompts -> roll out groups -> score -> filter -> advantages -> update -> publish
        (the allocator sees each round's scores and may ask for another round: docs/allocation.md)
        (while the filter leaves fewer groups than a batch, select and roll out more: at
        most `stages.refill_rounds` times; DAPO's dynamic sampling)
    evaluate before and after (and every N steps); checkpoint every N steps and on Ctrl-C.
"""

from __future__ import annotations

from rollwise.build import Stages
from rollwise.rundir import Run, defer_interrupt


def train(stages: Stages, run: Run, num_steps: int, *, eval_every: int = 0,
          eval_before: bool = True, checkpoint_every: int = 0) -> dict:
    start = run.resume(stages)  # 0 for a new run, else the step of the last checkpoint
    if start == 0 and eval_before:
        run.record_eval(0, stages.evaluate(), before=True)
    try:
        with run.progress(start, num_steps):
            for step in range(start, num_steps):
                train_step(stages, run, step, num_steps)
                if eval_every and (step + 1) % eval_every == 0 and step + 1 < num_steps:
                    run.record_eval(step + 1, stages.evaluate())
                if checkpoint_every and (step + 1) % checkpoint_every == 0:
                    run.checkpoint(step + 1, stages)
    except KeyboardInterrupt:
        run.interrupted(stages)
        raise
    run.checkpoint(num_steps, stages)
    run.record_eval(num_steps, stages.evaluate(), after=True)
    return run.finish()


def train_step(stages: Stages, run: Run, step: int, num_steps: int) -> dict:
    """One training step (`step` counts from 0); its metrics record. Benchmarks drive it."""
    timer = run.timer()
    with timer("rollout"):
        groups = stages.rollout(stages.select())
    with timer("reward"):
        reward_stats = stages.score(groups)
    while requests := stages.observe(groups):  # the allocator may ask for more
        with timer("rollout"):
            groups = stages.rollout(requests)
        with timer("reward"):
            reward_stats = reward_stats + stages.score(groups)
    groups, chosen = stages.allocation()  # all groups of the step; those to train on
    kept = stages.filter(chosen)
    for _ in range(stages.refill_rounds):
        if len(kept) >= stages.batch_groups:
            break
        with timer("rollout"):
            more = stages.rollout(stages.select())
        with timer("reward"):
            reward_stats = reward_stats + stages.score(more)
        groups, kept = groups + more, kept + stages.filter(more)
    kept = kept[: stages.batch_groups]
    with defer_interrupt():  # Ctrl-C waits until the update is recorded
        with timer("train"):
            update = stages.update(stages.advantages(kept)) if kept else {}
        stages.publish(step + 1)
        return run.record_step(step + 1, num_steps, groups, kept, reward_stats, update,
                               timer, control=stages.control_metrics())
