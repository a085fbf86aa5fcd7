"""Environments written for the `verifiers` package (the pinned extra, verifiers==0.4.0).

``task.name = "verifiers"`` with ``task.options = { env = "package.module:load", ... }``:
`load(**the other options)` returns a ``verifiers.v1`` `Taskset` (or an object with a
``taskset`` attribute, such as a `vf.Env`). Each task's `data.prompt` (and
`data.system_prompt`) becomes a rollwise prompt; its ``answer`` field, when it has one,
becomes `Sample.answer`, and its ``reference`` field (a whole worked response) becomes
`Sample.reference`, which the tiny model is warm-started on (without one it never sees the
task's format and scores 0). Splits: each prompt text is on one side of the seeded hash
partition the built-in tasks use; eval takes the first `num_eval` eval-side tasks in the
taskset's order, train the first `num_train` train-side ones (an infinite taskset is read
until both are full, at most 50 x their sum).

Scoring: the completion becomes a one-turn `Trace` (the prompt as user message, the
completion as the sampled assistant message) and the task's own `score` runs on it without a
runtime, as verifiers' offline scoring does: every ``@vf.reward`` of the task, weighted as
declared, summed (`Trace.reward`); the per-reward values are kept in the note.

Supported: single-turn tasks whose rewards, metrics and plugged judges do not need a
runtime (a box). Not supported: multi-turn harnesses, tools, user simulators, runtime-based
rewards (verifiers skips them when scoring without a runtime: they contribute nothing), and
cross-agent `Env.finalize` judgement.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

from rollwise.rewards.pool import Scored
from rollwise.tasks.base import DEFAULT_SETUP, EVAL_FRACTION, Task, TaskSetup, in_eval_side
from rollwise.types import Sample

VF_VERSION = "0.4.0"


def _load(env: str, options: dict[str, Any]):
    if not isinstance(env, str) or ":" not in env:
        raise ValueError(f"option env={env!r}: expected \"package.module:function\" returning "
                         "a verifiers Taskset")
    module_name, _, attr = env.partition(":")
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise ValueError(f"task verifiers needs the extra: pip install 'rollwise[verifiers]' "
                         f"(verifiers=={VF_VERSION}): {err}") from None
    try:
        loader = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"option env={env!r}: {type(err).__name__}: {err}") from None
    made = loader(**options)
    taskset = getattr(made, "taskset", made)
    if not isinstance(taskset, vf.Taskset):
        raise ValueError(  # noqa: TRY004 - a config error, reported like the others
            f"option env={env!r}: returned {type(made).__name__}, not a verifiers "
            f"Taskset (verifiers {VF_VERSION}: verifiers.v1.Taskset)")
    return taskset


def _messages(data) -> list[dict[str, str]]:
    from verifiers.v1.types import content_text  # type: ignore[attr-defined]

    out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*out, {"role": "user", "content": data.prompt}]
    return [*out, *({"role": m.role, "content": content_text(m.content)}
                    for m in data.prompt or [])]


def _score(completion: str, sample: Sample, *, tasks: dict[str, Any]) -> float:
    from verifiers.v1 import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import AssistantMessage, UserMessage

    task = tasks[sample.id]
    prompt = task.data.prompt_text
    trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                 hash=task.hash),
                  state=state_cls(type(task))(),
                  agent=AgentInfo(config=AgentConfig(), name="rollwise"),
                  nodes=[MessageNode(message=UserMessage(content=prompt)),
                         MessageNode(parent=0, message=AssistantMessage(content=completion),
                                     sampled=True)])
    asyncio.run(task.score(trace))
    parts = {k: round(v.value, 4) for k, v in trace.rewards.items() if v is not None}
    return Scored(trace.reward, f"verifiers rewards {parts}")


def build_verifiers(setup: TaskSetup = DEFAULT_SETUP, *, env: str = "", **options: Any) -> Task:
    """A verifiers Taskset as a rollwise task; see the module docstring."""
    from functools import partial

    from rollwise.tasks.base import as_prompt

    taskset = _load(env, options)
    want = {"eval": setup.num_eval, "train": setup.num_train}
    out: dict[str, list[Sample]] = {"eval": [], "train": []}
    tasks: dict[str, Any] = {}
    limit = 50 * (want["eval"] + want["train"]) + 100
    for seen, task in enumerate(taskset):
        if all(len(out[k]) >= want[k] for k in out) or seen >= limit:
            break
        messages = _messages(task.data)
        key = "\n".join(m["content"] for m in messages)
        side = "eval" if in_eval_side(key, setup.seed, EVAL_FRACTION) else "train"
        if len(out[side]) >= want[side]:
            continue
        sid = f"verifiers/{side}/{len(out[side])}"
        prompt = messages if setup.chat else as_prompt(key, False)
        answer = getattr(task.data, "answer", "")
        reference = getattr(task.data, "reference", None)
        out[side].append(Sample(id=sid, prompt=prompt, answer=str(answer or ""),
                                reference=str(reference) if reference else None,
                                meta={"vf_idx": task.data.idx, "vf_key": task.key}))
        tasks[sid] = task
    if len(out["train"]) < min(want["train"], 1) or len(out["eval"]) < min(want["eval"], 1):
        raise ValueError(f"task verifiers ({env}): the taskset gave {len(out['train'])} train "
                         f"and {len(out['eval'])} eval tasks; it needs at least one of each")
    return Task("verifiers", out["train"], out["eval"], partial(_score, tasks=tasks),
                info={"verifiers": {"version": VF_VERSION, "env": env}})
