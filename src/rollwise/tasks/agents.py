"""The environment tasks: prompts whose rollouts are multi-turn episodes.

    calc_tool   arithmetic questions (the `arith` task's); the calculator tool is optional
    lookup      the sum of two people's secret numbers: needs two `lookup` calls
    guess       guess the number in [1, high] with higher/lower feedback (a game)

Each returns a `Task` whose `env` makes one environment per episode. For `guess` the
prompt is the same for every secret ("guess 1-8:" for the built-in tiny model): held-out
"prompts" are fresh episodes (secrets drawn with the eval seed), since no prompt can reveal
the secret.
"""

from __future__ import annotations

import random
from functools import partial

from rollwise.envs.calc import CalcEnv, LookupEnv
from rollwise.envs.guess import GuessEnv
from rollwise.envs.tools import describe_tools
from rollwise.rewards.verifiers import final_number
from rollwise.tasks.arith import build_arith
from rollwise.tasks.base import DEFAULT_SETUP, Task, TaskSetup, as_prompt, draw_split
from rollwise.types import Sample

NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")


def build_calc_tool(setup: TaskSetup = DEFAULT_SETUP, digits: int = 2, terms: int = 3,
                    ops: str = "+-", max_calls: int = 3) -> Task:
    """`arith` questions (instruct style: answer after ####) with the calculator described
    in the prompt; reward 1 for the right final answer, with or without the tool."""
    base = build_arith(setup, digits=digits, terms=terms, ops=ops, style="instruct")
    tools = describe_tools(CalcEnv.tools)
    for s in base.train + base.eval:
        text = s.prompt if isinstance(s.prompt, str) else s.prompt[-1]["content"]
        s.prompt = as_prompt(f"{text}\n{tools}", setup.chat)
    return Task("calc_tool", base.train, base.eval, final_number,
                env=partial(CalcEnv, final_number, max_calls))


def build_lookup(setup: TaskSetup = DEFAULT_SETUP, max_calls: int = 4) -> Task:
    """'What is the sum of the secret numbers of A and B?' with secrets in [10, 99] known
    only to the `lookup` tool: a solved episode has made (at least) two calls."""
    tools = describe_tools(LookupEnv.tools)

    def draw(rng: random.Random) -> Sample:
        a, b = rng.sample(NAMES, 2)
        secrets = {a: rng.randint(10, 99), b: rng.randint(10, 99)}
        text = (f"{a} and {b} each have a secret number. What is the sum of the secret "
                f"numbers of {a} and {b}? Put the final answer after ####.\n{tools}")
        return Sample(id="", prompt=text, answer=str(sum(secrets.values())),
                      meta={"secrets": secrets})

    train, eval_ = draw_split(draw, name="lookup", setup=setup, unique=False)
    return Task("lookup", train, eval_, final_number, env=partial(LookupEnv, final_number,
                                                                   max_calls))


def build_guess(setup: TaskSetup = DEFAULT_SETUP, high: int = 16, max_guesses: int = 5,
                consistent_bonus: float = 0.1) -> Task:
    """Guess a secret in [1, high] within `max_guesses` guesses (rollwise.envs.guess)."""
    text = (f"I am thinking of a number from 1 to {high}. Guess it: reply with one number. "
            "I will tell you higher or lower.") if setup.chat else f"guess 1-{high}:"

    def split(side: str, count: int) -> list[Sample]:
        # reference: a uniform first guess (the built-in tiny model's warm start learns
        # the move format from it; the secret is unknowable from the prompt)
        rng = random.Random(f"guess:{setup.seed}:{side}")
        return [Sample(id=f"guess/{side}/{i}", prompt=as_prompt(text, setup.chat),
                       answer=str(secret), reference=str(rng.randint(1, high)),
                       meta={"secret": secret, "high": high})
                for i, secret in enumerate(rng.randint(1, high) for _ in range(count))]

    def verifier(completion: str, sample: Sample) -> float:  # a one-guess episode
        return final_number(completion, sample)

    return Task("guess", split("train", setup.num_train), split("eval", setup.num_eval),
                verifier, env=partial(GuessEnv, max_guesses, consistent_bonus))
