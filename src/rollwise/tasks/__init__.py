"""Tasks: prompt sources with their verifiers.

>>> task = make_task("arith", seed=0, num_train=4, num_eval=2)
>>> task.name, len(task.train), len(task.eval), task.train[0].prompt.endswith("=")
('arith', 4, 2, True)

May import: types, registry, rewards, envs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollwise.registry import Registry, options_misfit, options_of
from rollwise.tasks.agents import build_calc_tool, build_guess, build_lookup
from rollwise.tasks.arith import build_arith, build_arith_chain, build_arith_mix
from rollwise.tasks.base import Task, TaskSetup
from rollwise.tasks.code import build_humaneval, build_pycode
from rollwise.tasks.countdown import build_countdown
from rollwise.tasks.files import DatasetError, build_file, load_samples
from rollwise.tasks.rgym import build_reasoning_gym
from rollwise.tasks.vf import build_verifiers

# a builder: (TaskSetup, **its own options) -> Task
TASKS: Registry[Callable[..., Task]] = Registry("task", takes=("setup",))
for _name, _builder in {"arith": build_arith, "arith_chain": build_arith_chain,
                        "arith_mix": build_arith_mix, "countdown": build_countdown,
                        "file": build_file, "reasoning_gym": build_reasoning_gym,
                        "humaneval": build_humaneval, "pycode": build_pycode,
                        "verifiers": build_verifiers}.items():
    TASKS.register(_name)(_builder)
# multi-turn environment tasks (rollwise.tasks.agents; docs/agents.md)
for _name, _builder in {"calc_tool": build_calc_tool, "lookup": build_lookup,
                        "guess": build_guess}.items():
    TASKS.register(_name)(_builder)


def task_options(name: str) -> dict[str, Any]:
    """The task-specific options of task `name` with their defaults.

    >>> task_options("arith")
    {'digits': 2, 'terms': 2, 'ops': '+', 'style': None}
    """
    return options_of(TASKS.get(name), passes=TASKS.takes).defaults


def make_task(
    name: str,
    *,
    seed: int = 0,
    num_train: int = 2000,
    num_eval: int = 200,
    chat: bool = False,
    path: str | None = None,
    **options: Any,
) -> Task:
    """Build the registered task `name`: seeded, disjoint train/eval splits and a verifier.

    `chat` makes each prompt a list of chat messages (instruction models) instead of a plain
    string (the built-in tiny model); `path` is the data file of the "file" task. An unknown
    task or option raises ValueError naming it, the closest accepted name, and the list.

    >>> make_task("arithh")
    Traceback (most recent call last):
    ...
    ValueError: unknown task 'arithh' (did you mean 'arith'?); accepted: arith, arith_chain, arith_mix, calc_tool, countdown, file, guess, humaneval, lookup, pycode, reasoning_gym, verifiers, or "package.module:function"
    """  # noqa: E501 - a doctest's expected message is one line
    builder = TASKS.get(name)
    if path is not None:
        options["path"] = path
    problem = options_misfit(builder, options, passes=TASKS.takes)  # **options: its own check
    if problem:
        raise ValueError(f"task {name!r}: {problem}")
    return builder(TaskSetup(seed, num_train, num_eval, chat), **options)


__all__ = ["TASKS", "DatasetError", "Task", "TaskSetup", "load_samples", "make_task",
           "task_options"]
