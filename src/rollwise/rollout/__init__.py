"""The rollout stage: prompts in, groups of trajectories out.

`RolloutScheduler` (scheduler.py) runs the seed papers' strategies on the native engine:
sync, continuous, partial (APRIL), context (Seer), with grouped speculative decoding (Seer)
and speculative reuse (SPEC-RL); docs/rollout.md. `generate_groups` is the plain path for
engines without the request-level API (HF `generate`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rollwise.engine.base import Engine, SamplingParams
from rollwise.rollout.scheduler import STRATEGIES, RolloutScheduler, StepReport
from rollwise.types import Group, Sample, Trajectory

__all__ = ["STRATEGIES", "RolloutScheduler", "StepReport", "generate_groups",
           "summarize_rollout"]


def generate_groups(engine: Engine, prompts: list[tuple[Sample, list[int]]],
                    params: SamplingParams, decode: Callable[[list[int]], str]) -> list[Group]:
    """`params.n` trajectories per (sample, prompt ids), each tagged with the engine's version."""
    start = time.perf_counter()
    completions = engine.generate([ids for _, ids in prompts], params)
    seconds = time.perf_counter() - start
    groups = [Group(sample=s, trajectories=[]) for s, _ in prompts]
    for c in completions:
        sample, ids = prompts[c.prompt_index]
        groups[c.prompt_index].trajectories.append(Trajectory(
            sample=sample, prompt_ids=list(ids), response_ids=c.token_ids, logprobs=c.logprobs,
            versions=[engine.version] * len(c.token_ids), finish_reason=c.finish_reason,
            text=decode(c.token_ids), timings={"rollout": seconds},
        ))
    return groups


def summarize_rollout(infos: list[dict]) -> dict[str, float]:
    """One step's scheduler figures (over its rollout rounds) for the metrics record."""
    def total(key: str) -> float:
        return sum(i[key] for i in infos)

    trained = total("trained_tokens")
    verifies = total("spec_verifies")
    out = {
        "rollout_makespan_s": total("makespan_s"), "rollout_tail_s": total("tail_time_s"),
        "rollout_forward_passes": total("forward_passes"),
        "rollout_generated_tokens": total("generated_tokens"),
        "offpolicy_token_frac": sum(i["offpolicy_token_frac"] * i["trained_tokens"]
                                    for i in infos) / max(trained, 1),
        "staleness_mean": sum(i["staleness_mean"] * len(i["lengths"]) for i in infos)
        / max(sum(len(i["lengths"]) for i in infos), 1),
        "staleness_max": max(i["staleness_max"] for i in infos),
        "stale_dropped": total("stale_dropped"), "pool_groups": infos[-1]["pool_groups"],
    }
    if verifies:
        out["spec_accepted_len"] = 1.0 + total("spec_accepted") / verifies
    return out
