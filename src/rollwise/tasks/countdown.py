r"""Countdown: combine the given numbers with + - * / to reach a target.

Instances are solvable by construction: draw 3-4 numbers, combine them in a random order with
random operations into one expression, and take its value as the target. Intermediate values
stay positive integers (a "-" puts the larger operand first, "/" is used only when exact), and
the target lies in [1, max_target]. Solutions may use each number at most once, and need not
use all of them.

Styles (default "instruct" when chat=True, else "plain"):

- "instruct": prompt ``Using the numbers [3, 5, 7, 2], write an expression that equals 54.
  Use + - * / and each number at most once. Put the final expression after ####.``;
  reference ``"(3 + 5) * 7 - 2 = 54\n#### (3 + 5) * 7 - 2"``.
- "plain" (char-level model): prompt ``"3,5,7,2=54:"``; reference ``"(3+5)*7-2"``.

answer = the target as a string; meta = {"numbers": [...], "expression": reference expression}.
The verifier is `rollwise.rewards.countdown.countdown_verifier`.
"""

from __future__ import annotations

import random
from functools import partial

from rollwise.rewards.countdown import countdown_verifier
from rollwise.tasks.base import DEFAULT_SETUP, Task, TaskSetup, draw_split
from rollwise.types import Sample

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_LEAF = 3


def _combine(left: tuple[int, str, int], op: str, right: tuple[int, str, int], spaced: bool
             ) -> tuple[int, str, int] | None:
    """(value, text, precedence) of `left op right`, or None when it would leave the
    positive integers. Parenthesizes only where precedence or associativity requires."""
    (a, a_text, a_prec), (b, b_text, b_prec) = left, right
    if op == "-" and a == b or op == "/" and a % b:
        return None
    if op == "-" and a < b:
        return _combine(right, op, left, spaced)
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a // max(b, 1)}[op]
    prec = _PRECEDENCE[op]
    if a_prec < prec:
        a_text = f"({a_text})"
    if b_prec < prec or (b_prec == prec and op in "-/"):
        b_text = f"({b_text})"
    text = f"{a_text} {op} {b_text}" if spaced else f"{a_text}{op}{b_text}"
    return value, text, prec


def construct(rng: random.Random, count: int, max_value: int, max_target: int, spaced: bool
              ) -> tuple[list[int], int, str]:
    """Draw `count` numbers and a random expression over all of them; (numbers, target, text).

    >>> numbers, target, text = construct(random.Random(0), 4, 20, 500, spaced=True)
    >>> from rollwise.rewards.countdown import check_countdown
    >>> check_countdown(text, numbers, target)
    (True, 'ok')
    """
    while True:
        numbers = [rng.randint(1, max_value) for _ in range(count)]
        items = [(n, str(n), _LEAF) for n in numbers]
        while len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            combined = _combine(items[i], rng.choice("+-*/"), items[j], spaced)
            if combined is None:
                continue  # e.g. an inexact division; draw another pair and op
            items = [item for k, item in enumerate(items) if k not in (i, j)] + [combined]
        target, text, _ = items[0]
        if 1 <= target <= max_target:
            rng.shuffle(numbers)
            return numbers, target, text


def _draw(rng: random.Random, min_numbers: int, max_numbers: int, max_value: int,
          max_target: int, style: str) -> Sample:
    count = rng.randint(min_numbers, max_numbers)
    numbers, target, expr = construct(rng, count, max_value, max_target, style == "instruct")
    if style == "plain":
        text, reference = ",".join(map(str, numbers)) + f"={target}:", expr
    else:
        text = (
            f"Using the numbers {numbers}, write an expression that equals {target}. "
            "Use + - * / and each number at most once. Put the final expression after ####."
        )
        reference = f"{expr} = {target}\n#### {expr}"
    meta = {"numbers": numbers, "expression": expr}
    return Sample(id="", prompt=text, answer=str(target), reference=reference, meta=meta)


def build_countdown(
    setup: TaskSetup = DEFAULT_SETUP,
    *,
    min_numbers: int = 3,
    max_numbers: int = 4,
    max_value: int = 20,
    max_target: int = 500,
    style: str | None = None,
) -> Task:
    """Countdown instances with min_numbers..max_numbers numbers from 1..max_value.

    >>> task = build_countdown(TaskSetup(seed=0, num_train=2, num_eval=2))
    >>> [task.verifier(s.reference, s) for s in task.train + task.eval]
    [1.0, 1.0, 1.0, 1.0]
    """
    if not (isinstance(min_numbers, int) and isinstance(max_numbers, int)
            and 2 <= min_numbers <= max_numbers <= 8):
        raise ValueError(
            f"options min_numbers={min_numbers!r}, max_numbers={max_numbers!r}: "
            "expected integers with 2 <= min_numbers <= max_numbers <= 8"
        )
    if not isinstance(max_value, int) or max_value < 2:
        raise ValueError(f"option max_value={max_value!r}: expected an integer >= 2")
    if not isinstance(max_target, int) or max_target < 1:
        raise ValueError(f"option max_target={max_target!r}: expected an integer >= 1")
    style = setup.prompt_style(style)
    draw = partial(_draw, min_numbers=min_numbers, max_numbers=max_numbers,
                   max_value=max_value, max_target=max_target, style=style)
    train, eval_ = draw_split(
        draw, name="countdown", setup=setup,
        unique=True,
    )
    return Task("countdown", train, eval_, countdown_verifier)
