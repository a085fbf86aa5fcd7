r"""Verifiers: plain functions ``(completion, sample) -> float`` that score one completion.

Each is narrow and side-effect free; batching, time limits and parallelism live in
`rewards.pool`, not here. They never import torch or know about models.

Answer formats they understand (the grammars the tasks in `rollwise.tasks` produce):

- instruct style: free text ending in ``#### <number>``, e.g. ``"23 + 45 = 68\n#### 68"``;
- plain style (the tiny char-level model): running values then ``#<final>``, e.g. ``"68;78#78"``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from fractions import Fraction

from rollwise.registry import Registry, unknown_name_error
from rollwise.rewards.countdown import countdown_verifier
from rollwise.types import Sample

Verifier = Callable[[str, Sample], float]

# An integer or decimal, with optional thousands separators ("1,234.5"). A leading minus counts
# only when it is not a binary minus: "45-22" holds 45 and 22, "= -22" and "#-22" hold -22.
_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_INSTRUCT_FORMAT = re.compile(r"####\s*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_PLAIN_FORMAT = re.compile(r"#-?\d+(?:\.\d+)?\s*$")


def last_number(text: str) -> Fraction | None:
    """The last number in `text` as an exact fraction, or None when there is none.

    >>> last_number("the answer is 67, no wait 1,234.50")
    Fraction(2469, 2)
    >>> last_number("68;78#-78"), last_number("no digits")
    (Fraction(-78, 1), None)
    """
    matches = _NUMBER.findall(text)
    return Fraction(matches[-1].replace(",", "")) if matches else None


def final_number(completion: str, sample: Sample) -> float:
    """1.0 when the last number in the completion equals the sample's numeric answer, else 0.0.

    Thousands separators are ignored and "68.0" equals 68. Raises ValueError when the sample's
    answer holds no number (a data problem the reward pool records, not a wrong completion).

    >>> s = Sample(id="arith/eval/0", prompt="23+45=", answer="68")
    >>> final_number("23 + 45 = 68\\n#### 68", s), final_number("67, no wait 68.0", s)
    (1.0, 1.0)
    >>> final_number("68 is it? no, 69", s), final_number("", s)
    (0.0, 0.0)
    """
    gold = last_number(sample.answer)
    if gold is None:
        raise ValueError(f"sample {sample.id!r}: answer {sample.answer!r} holds no number")
    try:
        found = last_number(completion)
    except ValueError:  # a number past Python's int-string limit (4300 digits): not the answer
        return 0.0
    return 1.0 if found == gold else 0.0


def after_marker(completion: str, marker: str = "####") -> str:
    """The text after the last `marker`, or the whole completion when the marker is absent.

    >>> after_marker("work...\\n#### 42"), after_marker("just 42")
    (' 42', 'just 42')
    """
    _, sep, tail = completion.rpartition(marker)
    return tail if sep else completion


def math_verify_match(completion: str, sample: Sample) -> float:
    r"""1.0 when the completion's answer is mathematically equal to the sample's (math-verify).

    The prediction is the text after the last "####" if present, else the whole completion.
    math-verify's own time limit uses SIGALRM, which only works in the main thread; in a worker
    thread it is switched off and the reward pool's time limit applies instead.

    >>> s = Sample(id="m/0", prompt="What is 1/2?", answer="\\frac{1}{2}")
    >>> math_verify_match("so it is 0.5", s), math_verify_match("#### 2/4", s)
    (1.0, 1.0)
    >>> math_verify_match("#### 0.25", s)
    0.0
    """
    from math_verify import parse, verify  # lazy: sympy import costs ~1 s

    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(sample.answer, parsing_timeout=limit)
    if not gold:
        gold = parse(f"${sample.answer}$", parsing_timeout=limit)
    pred = parse(after_marker(completion), parsing_timeout=limit)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=limit) else 0.0


def format_reward(completion: str, sample: Sample) -> float:
    """1.0 when the completion states a final answer in a format the tasks use, else 0.0.

    Accepted: ``#### <number>`` anywhere (instruct style) or ``#<number>`` at the very end
    (plain style). The number's value is not checked.

    >>> s = Sample(id="arith/eval/0", prompt="23+45=", answer="68")
    >>> format_reward("so\\n#### 67", s), format_reward("68;78#78", s), format_reward("68", s)
    (1.0, 1.0, 0.0)
    """
    del sample  # the format does not depend on the sample
    ok = _INSTRUCT_FORMAT.search(completion) or _PLAIN_FORMAT.search(completion)
    return 1.0 if ok else 0.0


VERIFIERS: Registry[Verifier] = Registry("verifier", takes=("completion", "sample"))
for _name, _fn in {"final_number": final_number, "math_verify": math_verify_match,
                   "format": format_reward, "countdown": countdown_verifier}.items():
    VERIFIERS.register(_name)(_fn)

__all__ = ["VERIFIERS", "Verifier", "get_verifier", "unknown_name_error"]


def get_verifier(name: str) -> Verifier:
    """The registered verifier called `name` (or at "package.module:function");
    ValueError with a suggestion when unknown.

    >>> get_verifier("final_number") is final_number
    True
    """
    return VERIFIERS.get(name)
