"""A calculator tool (safe, ast-based evaluation), the tool-using environment base, and the
two tool environments that ship: `calc` (arithmetic questions, the calculator optional)
and `lookup` (the answer needs two tool calls: two secret numbers, then their sum).

The calculator never calls `eval`: the expression is parsed with `ast` and only numbers,
+ - * / // % ** (small exponents), unary signs, parentheses and abs/min/max/round are
evaluated; anything else is an error message for the policy.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any, ClassVar

from rollwise.envs.base import StepResult
from rollwise.envs.tools import argument, parse_tool_calls, tool_schema
from rollwise.rewards.verifiers import final_number
from rollwise.types import Sample

MAX_EXPRESSION = 200  # characters
MAX_MAGNITUDE = 10**18
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCS: dict[str, Callable] = {"abs": abs, "min": min, "max": max, "round": round}


class CalcError(ValueError):
    """An expression the calculator refuses, with the reason (shown to the policy)."""


def safe_eval(expression: str) -> int | float:
    """The value of an arithmetic expression, evaluated from its syntax tree.

    >>> safe_eval("23 + 45 * 2"), safe_eval("(7 - 10) ** 2"), safe_eval("max(3, 2) / 2")
    (113, 9, 1.5)
    >>> safe_eval("__import__('os')")
    Traceback (most recent call last):
    ...
    rollwise.envs.calc.CalcError: not allowed: calling '__import__' (only abs, min, max, round)
    """
    if len(expression) > MAX_EXPRESSION:
        raise CalcError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalcError(f"cannot parse {expression.strip()[:40]!r}: {e.msg}") from None
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise CalcError("exponent or base too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise CalcError("result out of range")
        return value
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else type(node.func).__name__
        if name not in _FUNCS or node.keywords or not node.args:
            raise CalcError(f"not allowed: calling {name!r} (only abs, min, max, round)")
        return _FUNCS[name](*[_eval(a) for a in node.args])
    if isinstance(node, ast.Name):
        raise CalcError(f"not allowed: the name {node.id!r}")
    raise CalcError(f"not allowed: {type(node).__name__}")


def format_number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"


class ToolEnv:
    """Base of question-answering environments with tools. Each turn either calls tools
    (their results are the next observation) or answers (the episode ends, reward 1 when
    the task's verifier accepts the answer). A malformed or failing call is an observation
    with the error, counted in info["malformed"]; `max_calls` bounds the calls per episode.

    Subclasses set `tools` and implement `call(name, arguments) -> str`."""

    tools: ClassVar[list[dict]] = []

    def __init__(self, verifier: Callable[[str, Sample], float] = final_number,
                 max_calls: int = 4):
        self.verifier, self.max_calls = verifier, max_calls
        self.sample: Sample | None = None
        self.calls = 0

    def reset(self, sample: Sample) -> str:
        self.sample, self.calls = sample, 0
        return sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        assert self.sample is not None, "step before reset"
        calls, errors = parse_tool_calls(action)
        if not calls and not errors:  # an answer
            ok = self.verifier(action, self.sample) >= 1.0
            return StepResult("", float(ok), True, {"success": ok, "tool_calls": self.calls})
        lines = [f"error: {e}" for e in errors]
        schemas = {t["function"]["name"]: t for t in self.tools}
        for c in calls:
            if self.calls >= self.max_calls:
                lines.append(f"error: at most {self.max_calls} tool calls; answer now")
                errors.append("too many calls")
                break
            self.calls += 1
            if c.name not in schemas:
                errors.append(f"unknown tool {c.name}")
                lines.append(f"error: unknown tool {c.name!r}; tools: {', '.join(schemas)}")
                continue
            try:
                lines.append(f"{c.name}({c.arguments.get('_arg', c.raw)})"
                             f" = {self.call(c.name, argument(c, schemas[c.name]))}")
            except ValueError as e:  # CalcError, a missing argument, an unknown key
                errors.append(str(e))
                lines.append(f"error: {e}")
        return StepResult("\n".join(lines), 0.0, False,
                          {"malformed": len(errors), "state": f"calls={self.calls}"})


class CalcEnv(ToolEnv):
    """Arithmetic questions with a calculator the policy may call:
    `<tool_call>calc(23 + 45)</tool_call>` -> "calc(23 + 45) = 68"."""

    tools: ClassVar[list[dict]] = [tool_schema("calc", "Evaluate an arithmetic expression.",
                         {"expression": "e.g. 23 + 45 * 2"})]

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        return format_number(safe_eval(str(arguments["expression"])))


class LookupEnv(ToolEnv):
    """Two people each hold a secret number (in `sample.meta["secrets"]`, not in the
    prompt); the question asks for their sum, so the answer needs two `lookup` calls
    (`calc` is there too)."""

    tools: ClassVar[list[dict]] = [
        tool_schema("lookup", "The secret number of a person.", {"name": "a name"}),
        *CalcEnv.tools]

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        if name == "calc":
            return CalcEnv.call(self, name, arguments)  # type: ignore[arg-type]
        secrets = self.sample.meta["secrets"]
        who = str(arguments["name"]).strip().strip("'\"").lower()
        if who not in secrets:
            raise ValueError(f"no one called {who!r}; ask about {', '.join(sorted(secrets))}")
        return str(secrets[who])
