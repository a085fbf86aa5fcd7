r"""Integer arithmetic tasks: `arith` (a fixed number of terms) and `arith_chain` (long-tailed).

Evaluation is strictly left to right, with no operator precedence: "2+3*4" means (2+3)*4 = 20.
Results may be negative when "-" is among the ops. A number of d digits is drawn uniformly
from [10^(d-1), 10^d - 1] (from [0, 9] for d = 1).

Two prompt styles (default "instruct" when chat=True, else "plain"):

- "instruct", for instruction models: prompt ``What is 23 + 45 - 10? Put the final answer
  after ####.``; reference one line per operation then the answer,
  ``"23 + 45 = 68\n68 - 10 = 58\n#### 58"``; answer ``"58"``.
- "plain", for the built-in char-level model (no chat template): prompt ``"23+45-10="``;
  reference = the running values after each operation (from the 2nd term on) joined by ";",
  then "#" and the final value: ``"23+45=" -> "68#68"``, ``"23+45+10=" -> "68;78#78"``.
  Its characters: digits and ``+-*=;#``.

`arith_chain` is the long-tail workload of docs/rollout.md (B2): prompts ``a1+a2+...+ak=`` with
k = min(2 + Geometric(p), max_terms), Geometric counting failures before the first success,
so P(k >= 2 + n) = (1 - p)^n. Each number has between 1 and `digits` digits. The reference
has the same grammar as plain arith, so response length grows with k and is long-tailed
across prompts. meta = {"terms": k, "digits": digits} for both tasks.
"""

from __future__ import annotations

import math
import random
from functools import partial

from rollwise.rewards.verifiers import final_number
from rollwise.tasks.base import DEFAULT_SETUP, Task, TaskSetup, draw_split
from rollwise.types import Sample

_OPS = "+-*"


def _apply(left: int, op: str, right: int) -> int:
    return left + right if op == "+" else left - right if op == "-" else left * right


def running_values(numbers: list[int], ops: list[str]) -> list[int]:
    """Values after each operation, evaluated left to right (no precedence).

    >>> running_values([2, 3, 4], ["+", "*"])
    [5, 20]
    """
    values, acc = [], numbers[0]
    for op, number in zip(ops, numbers[1:]):
        acc = _apply(acc, op, number)
        values.append(acc)
    return values


def arith_sample(numbers: list[int], ops: list[str], style: str, meta: dict) -> Sample:
    r"""The sample for `numbers` combined by `ops` (id and chat wrapping are added later).

    >>> s = arith_sample([23, 45, 10], ["+", "+"], "plain", {})
    >>> s.prompt, s.answer, s.reference
    ('23+45+10=', '78', '68;78#78')
    >>> arith_sample([23, 45], ["+"], "instruct", {}).reference
    '23 + 45 = 68\n#### 68'
    """
    values = running_values(numbers, ops)
    final = str(values[-1])
    if style == "plain":
        text = "".join(f"{n}{op}" for n, op in zip(numbers, ops)) + f"{numbers[-1]}="
        reference = ";".join(map(str, values)) + f"#{final}"
    else:
        expression = " ".join(f"{n} {op}" for n, op in zip(numbers, ops)) + f" {numbers[-1]}"
        text = f"What is {expression}? Put the final answer after ####."
        lefts = [numbers[0], *values[:-1]]
        steps = [f"{a} {op} {b} = {v}" for a, op, b, v in zip(lefts, ops, numbers[1:], values)]
        reference = "\n".join(steps) + f"\n#### {final}"
    return Sample(id="", prompt=text, answer=final, reference=reference, meta=dict(meta))


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _check_common(digits: int, ops: str, style: str | None, setup: TaskSetup) -> str:
    """Validate shared options; returns the resolved style."""
    if not isinstance(digits, int) or not 1 <= digits <= 12:
        raise ValueError(f"option digits={digits!r}: expected an integer from 1 to 12")
    if not isinstance(ops, str) or not ops or set(ops) - set(_OPS):
        raise ValueError(f"option ops={ops!r}: expected a non-empty string of {_OPS!r}")
    return setup.prompt_style(style)


def _draw_arith(rng: random.Random, digits: int, terms: int, ops: str, style: str) -> Sample:
    numbers = [_number(rng, digits) for _ in range(terms)]
    chosen = [rng.choice(ops) for _ in range(terms - 1)]
    return arith_sample(numbers, chosen, style, {"terms": terms, "digits": digits})


def build_arith(
    setup: TaskSetup = DEFAULT_SETUP,
    *,
    digits: int = 2,
    terms: int = 2,
    ops: str = "+",
    style: str | None = None,
) -> Task:
    """Integer arithmetic with `terms` numbers of `digits` digits and ops drawn from `ops`.

    >>> task = build_arith(TaskSetup(seed=0, num_train=3, num_eval=2), terms=3)
    >>> [s.id for s in task.train], len(task.eval[0].prompt)
    (['arith/train/0', 'arith/train/1', 'arith/train/2'], 9)
    """
    style = _check_common(digits, ops, style, setup)
    if not isinstance(terms, int) or not 2 <= terms <= 64:
        raise ValueError(f"option terms={terms!r}: expected an integer from 2 to 64")
    draw = partial(_draw_arith, digits=digits, terms=terms, ops=ops, style=style)
    train, eval_ = draw_split(
        draw, name="arith", setup=setup,
        unique=True,  # every prompt is equally likely, so avoiding repeats keeps the shape
    )
    return Task("arith", train, eval_, final_number)


def chain_length(rng: random.Random, p: float, max_terms: int) -> int:
    """k = min(2 + Geometric(p), max_terms), Geometric = failures before the first success."""
    if p >= 1.0:
        return 2
    failures = int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
    return min(2 + failures, max_terms)


def _draw_chain(
    rng: random.Random, p: float, max_terms: int, digits: int, ops: str, style: str
) -> Sample:
    terms = chain_length(rng, p, max_terms)
    numbers = [_number(rng, rng.randint(1, digits)) for _ in range(terms)]
    chosen = [rng.choice(ops) for _ in range(terms - 1)]
    return arith_sample(numbers, chosen, style, {"terms": terms, "digits": digits})


def build_arith_chain(
    setup: TaskSetup = DEFAULT_SETUP,
    *,
    p: float = 0.35,
    max_terms: int = 24,
    digits: int = 1,
    ops: str = "+",
    style: str | None = None,
) -> Task:
    """ArithChain: long-tailed number of terms, reference = running values (module docstring).

    >>> task = build_arith_chain(TaskSetup(seed=1, num_train=4, num_eval=1))
    >>> s = task.train[0]
    >>> s.meta["terms"] == s.prompt.count("+") + 1, s.reference.endswith("#" + s.answer)
    (True, True)
    """
    style = _check_common(digits, ops, style, setup)
    if not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
        raise ValueError(f"option p={p!r}: expected a probability in (0, 1]")
    if not isinstance(max_terms, int) or not 2 <= max_terms <= 256:
        raise ValueError(f"option max_terms={max_terms!r}: expected an integer from 2 to 256")
    draw = partial(_draw_chain, p=p, max_terms=max_terms, digits=digits, ops=ops, style=style)
    train, eval_ = draw_split(
        draw, name="arith_chain", setup=setup,
        unique=False,  # short chains have few distinct prompts; deduping would thin them out
    )
    return Task("arith_chain", train, eval_, final_number)


def _parse_level(level: str) -> tuple[int, int]:
    """'2x3' -> (digits 2, terms 3)."""
    try:
        digits, terms = (int(x) for x in str(level).lower().split("x"))
    except ValueError:
        raise ValueError(f"level {level!r}: expected 'DxT' (digits x terms), e.g. '2x3'") from None
    if not 1 <= digits <= 12 or not 2 <= terms <= 64:
        raise ValueError(f"level {level!r}: digits must be 1-12 and terms 2-64")
    return digits, terms


def _draw_mix(rng: random.Random, levels: list[tuple[int, int]], ops: str, style: str) -> Sample:
    digits, terms = rng.choice(levels)
    return _draw_arith(rng, digits, terms, ops, style)


def build_arith_mix(
    setup: TaskSetup = DEFAULT_SETUP,
    *,
    levels: tuple[str, ...] = ("1x2", "2x2", "3x3"),
    ops: str = "+",
    style: str | None = None,
) -> Task:
    """Mixed difficulty: each prompt is plain arith at a level drawn uniformly from `levels`
    ('DxT' = T numbers of D digits), so easy, medium and hard prompts share one task (for
    benchmarking rollout allocation, docs/allocation.md). meta = {"terms", "digits"}.

    >>> task = build_arith_mix(TaskSetup(seed=0, num_train=30, num_eval=3), levels=("1x2", "3x3"))
    >>> sorted({(s.meta["digits"], s.meta["terms"]) for s in task.train})
    [(1, 2), (3, 3)]
    """
    parsed = [_parse_level(level) for level in levels]
    style = _check_common(max(d for d, _ in parsed), ops, style, setup)
    if not parsed:
        raise ValueError("option levels=(): give at least one level, e.g. ['1x2', '2x2']")
    draw = partial(_draw_mix, levels=parsed, ops=ops, style=style)
    train, eval_ = draw_split(
        draw, name="arith_mix", setup=setup,
        unique=True,
    )
    return Task("arith_mix", train, eval_, final_number)
