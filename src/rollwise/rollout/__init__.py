"""The rollout stage: prompts in, groups of trajectories out, through any `Engine`.

For now one synchronous batch per step; scheduling strategies (partial rollouts,
sibling-aware scheduling, speculation) plug in here without touching the driver.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rollwise.engine.base import Engine, SamplingParams
from rollwise.types import Group, Sample, Trajectory


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
