"""rollwise-sums: a single-turn `verifiers` 0.4.0 taskset and an in-process chat harness.

The taskset asks "What is A + B? Put the final answer after ####." (the quickstart's
question); its one reward, `correct`, is 1 when the reply's answer equals A + B. The answer
is the integer after the last "####", or the reply's last integer when it has no "####"
(the quickstart's rule); the metric `formatted` records whether "####" was used.

Two ways in:

- `vf-eval rollwise-sums ...`: verifiers resolves the taskset id to this package (installed,
  or on PYTHONPATH) and uses what `__all__` exports: `SumsTaskset`, and `ChatHarness`, which
  asks the model once from inside the eval's own process instead of launching verifiers'
  chat program (that program is installed by `uv` from the network on first use).
- rollwise: `task.name = "verifiers"`, `task.options = { env = "rollwise_sums:load" }`.

Imports: verifiers.v1 and httpx only.
"""

from __future__ import annotations

import random
import re

import httpx
import verifiers.v1 as vf
from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.runtimes import ProgramResult, Runtime

__all__ = ["ChatHarness", "SumsTaskset", "load"]

QUESTION = "What is {a} + {b}? Put the final answer after ####."
_INT = re.compile(r"-?\d+")


def parse_answer(reply: str) -> str | None:
    """The integer after the last "####", else the reply's last integer, else None.

    >>> parse_answer("23 + 45 = 68\\n#### 68"), parse_answer("it is 68."), parse_answer("no")
    ('68', '68', None)
    """
    if "####" in reply:
        found = _INT.findall(reply.rsplit("####", 1)[1])
        return found[0] if found else None
    found = _INT.findall(reply)
    return found[-1] if found else None


class SumsData(vf.TaskData):
    answer: str = ""
    reference: str = ""
    """A worked response (rollwise warm-starts its tiny model on it; nothing else reads it)."""


class SumsTask(vf.Task[SumsData]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(parse_answer(trace.last_reply) == task.answer)

    @vf.metric
    async def formatted(self, trace) -> float:
        return float("####" in trace.last_reply)


class SumsConfig(vf.TasksetConfig):
    size: int = 2000
    """How many problems load() yields."""
    digits: int = 2
    """Digits of each operand."""
    data_seed: int = 0
    """Seed of the operands (not `seed`: rollwise passes its own run seed by that name)."""


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self):
        rng = random.Random(self.config.data_seed)
        low, high = 10 ** (self.config.digits - 1), 10 ** self.config.digits - 1
        for _ in range(self.config.size):
            a, b = rng.randint(low, high), rng.randint(low, high)
            yield SumsTask(SumsData(prompt=QUESTION.format(a=a, b=b), answer=str(a + b),
                                    reference=f"{a} + {b} = {a + b}\n#### {a + b}"))


class ChatHarnessConfig(HarnessConfig):
    timeout: float = 600.0
    """Seconds one model call may take."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """One chat completion per task, sent from this process to the rollout's interception
    endpoint (which records it in the trace and forwards it to the eval's model)."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: ModelContext, trace, runtime: Runtime, endpoint: str,
                     secret: str, mcp_urls: dict[str, str], data) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
            {"role": m.role, "content": vf.types.content_text(m.content)} for m in prompt or []]
        async with httpx.AsyncClient(timeout=self.config.timeout) as client:
            reply = await client.post(f"{endpoint.rstrip('/')}/chat/completions",
                                      headers={"Authorization": f"Bearer {secret}"},
                                      json={"model": ctx.model, "messages": messages})
        # The interception has already recorded the exchange; a failed call is the result.
        ok = reply.status_code < 400
        return ProgramResult(0 if ok else 1, reply.text if ok else "", "" if ok else reply.text)


def load(**options) -> SumsTaskset:
    """The taskset for rollwise's verifiers adapter (`env = "rollwise_sums:load"`); options
    are `SumsConfig` fields (size, digits, data_seed)."""
    return SumsTaskset(SumsConfig(**options))
