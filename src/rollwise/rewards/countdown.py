"""The countdown verifier: does an arithmetic expression over the given numbers hit the target?

The expression is evaluated by walking its `ast` with a whitelist (integers, + - * /,
parentheses), never with `eval`, so a completion cannot run code. Division is exact
(`fractions.Fraction`), so "6 / 4 * 2" equals 3 with no rounding.
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from fractions import Fraction

from rollwise.types import Sample

_ALLOWED_CHARS = re.compile(r"[\d\s+\-*/()]+")
_MAX_EXPRESSION_CHARS = 200
_BINARY_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def extract_expression(completion: str) -> str:
    """The candidate expression: after the last "####", else the last non-empty line.

    A trailing "= target" (or a leading "target =") is dropped; "×" and "÷" become "*" and "/".

    >>> extract_expression("I try...\\n#### (3 + 5) * 7 - 2 = 54")
    '(3 + 5) * 7 - 2'
    >>> extract_expression("first idea\\n54 = 7 * 8 - 2\\n")
    '7 * 8 - 2'
    """
    _, sep, tail = completion.rpartition("####")
    text = tail if sep else completion
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = (lines[0] if sep else lines[-1]) if lines else ""
    line = line.replace("×", "*").replace("÷", "/").strip(" .`$")
    # Of "lhs = rhs", keep the side carrying the arithmetic (the longer one).
    return max((part.strip() for part in line.split("=")), key=len)


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Evaluate a whitelisted expression tree exactly; collects the literals into `used`."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        return _BINARY_OPS[type(node.op)](left, right)  # ZeroDivisionError on x / 0
    raise ValueError(f"disallowed syntax: {type(node).__name__}")


def check_countdown(expression: str, numbers: list[int], target: int) -> tuple[bool, str]:
    """Whether `expression` uses only `numbers` (each at most once) and equals `target`.

    Returns (ok, reason) where reason says what failed, for debugging and tests.

    >>> check_countdown("(3 + 5) * 7 - 2", [2, 3, 5, 7], 54)
    (True, 'ok')
    >>> check_countdown("7 * 7 + 5", [2, 3, 5, 7], 54)
    (False, 'number 7 used 2 times, allowed 1')
    """
    if not expression or len(expression) > _MAX_EXPRESSION_CHARS:
        return False, f"empty or longer than {_MAX_EXPRESSION_CHARS} characters"
    if not _ALLOWED_CHARS.fullmatch(expression):
        return False, "characters other than digits, spaces, + - * / ( )"
    try:
        tree = ast.parse(expression, mode="eval")
        used: list[int] = []
        value = _evaluate(tree, used)
    except ZeroDivisionError:
        return False, "division by zero"
    except (SyntaxError, ValueError) as err:
        return False, f"not an arithmetic expression: {err}"
    allowed = Counter(numbers)
    for number, count in Counter(used).items():
        if count > allowed[number]:
            return False, f"number {number} used {count} times, allowed {allowed[number]}"
    if abs(value - target) > Fraction(1, 10**6):  # exact: no float overflow on huge values
        return False, f"evaluates to {value}, not {target}"
    return True, "ok"


def countdown_verifier(completion: str, sample: Sample) -> float:
    """1.0 when the completion's expression uses only `sample.meta["numbers"]` (each at most
    once) with + - * / and equals the target `sample.answer` (within 1e-6), else 0.0.

    >>> s = Sample(id="countdown/eval/0", prompt="...", answer="54", meta={"numbers": [2, 3, 5, 7]})
    >>> countdown_verifier("#### (3 + 5) * 7 - 2", s), countdown_verifier("(3+5)*7-2 = 54", s)
    (1.0, 1.0)
    >>> countdown_verifier("#### 7 * 7 + 5", s), countdown_verifier("__import__('os')", s)
    (0.0, 0.0)
    """
    ok, _ = check_countdown(extract_expression(completion), sample.meta["numbers"],
                            int(sample.answer))
    return 1.0 if ok else 0.0
