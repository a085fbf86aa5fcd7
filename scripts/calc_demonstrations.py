"""Write demonstrations of the calculator task (calc_tool) for the [sft] warm start.

    python scripts/calc_demonstrations.py configs/agent_calc.toml data/calc_tool_demos.jsonl 64

One episode per training sample of the config's task (its own seed, options and split;
held-out prompts are never used): the question, an assistant turn calling the calculator
in the short call form, the environment's own observation (the calc environment runs the
call), and the final answer after ####. Each line is {"messages": [...]} as
rollwise.learner.sft reads it.
"""

from __future__ import annotations

import json
import re
import sys

from rollwise.compose.config import load_config
from rollwise.compose.parts import build_task
from rollwise.tasks.base import prompt_key

QUESTION = re.compile(r"What is (.+?)\? Put the final answer")


def demonstration(task, sample) -> dict:
    """The messages of one solved episode, the observation written by the environment."""
    env = task.env()
    question = env.reset(sample)
    call = f"<tool_call>calc({QUESTION.search(question).group(1)})</tool_call>"
    observation = env.step(call).observation
    answer = f"#### {sample.answer}"
    if not env.step(answer).info.get("success"):
        raise AssertionError(f"{sample.id}: the demonstrated answer is not accepted")
    prompt = sample.prompt if isinstance(sample.prompt, list) else [
        {"role": "user", "content": sample.prompt}]
    return {"messages": [*prompt, {"role": "assistant", "content": call},
                         {"role": "tool", "content": observation},
                         {"role": "assistant", "content": answer}]}


def main(config: str, out: str, count: int) -> None:
    task = build_task(load_config(config))
    held_out = {prompt_key(s.prompt) for s in task.eval}
    samples = [s for s in task.train if prompt_key(s.prompt) not in held_out][:count]
    with open(out, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(demonstration(task, s)) + "\n")
    print(f"{len(samples)} demonstrations of {task.name} -> {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 64)
