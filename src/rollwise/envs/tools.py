r"""Tool calls in the model's text: the format, the parser, and how tools are described.

Chat templates that take `tools=` (transformers' `apply_chat_template(..., tools=...)`)
render the tool schemas themselves; the call format most of them (Qwen2.5, Hermes) train
on is a JSON object between tags:

    <tool_call>{"name": "calc", "arguments": {"expression": "23 + 45"}}</tool_call>

SmolLM2-135M-Instruct's template ignores `tools=` and has no call format, so rollwise uses
the same tags for every model and describes the tools in the prompt (`describe_tools`). Two
spellings are accepted inside the tags: the JSON object above, and the short call form
that a small model writes more easily, `<tool_call>calc(23 + 45)</tool_call>` (the text
between the parentheses is the tool's first required argument).

A call that cannot be read (no closing tag, bad JSON, no name) is a `malformed` entry: the
environment shows the policy an error message and counts it; it never raises.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL_FORM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\((.*)\)\s*$", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""  # the text between the tags (or {"_arg": ...} for the call form)


def tool_schema(name: str, description: str, params: dict[str, str]) -> dict:
    """An OpenAI-style function schema with string parameters, all required.

    >>> tool_schema("calc", "Evaluate", {"expression": "e.g. 2+3"})["function"]["name"]
    'calc'
    """
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(params), "properties": {
            k: {"type": "string", "description": v} for k, v in params.items()}}}}


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """(the calls in `text`, in order; one message per malformed call).

    >>> calls, bad = parse_tool_calls('a <tool_call>calc(2+3)</tool_call> b '
    ...     '<tool_call>{"name": "calc", "arguments": {"expression": "4"}}</tool_call>')
    >>> [(c.name, c.arguments) for c in calls], bad
    ([('calc', {'_arg': '2+3'}), ('calc', {'expression': '4'})], [])
    >>> parse_tool_calls("<tool_call>calc(1")[1]
    ['tool call without </tool_call>']
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start)
        if end < 0:
            errors.append(f"tool call without {CLOSE}")
            break
        body = text[start + len(OPEN): end].strip()
        pos = end + len(CLOSE)
        call = _parse_body(body)
        if isinstance(call, str):
            errors.append(call)
        else:
            calls.append(call)
    return calls, errors


def _parse_body(body: str) -> ToolCall | str:
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return f"tool call is not valid JSON ({e.msg})"
        name, args = obj.get("name") if isinstance(obj, dict) else None, \
            obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return "tool call arguments are not a JSON object"
        if not isinstance(name, str) or not isinstance(args, dict):
            return 'tool call JSON needs {"name": str, "arguments": {...}}'
        return ToolCall(name, args, body)
    m = _CALL_FORM.match(body)
    if m is None:
        return f"cannot read tool call {body[:40]!r}; write name(argument) or JSON"
    return ToolCall(m.group(1), {"_arg": m.group(2).strip()}, body)


def argument(call: ToolCall, schema: dict) -> dict[str, Any]:
    """The call's arguments by the schema's parameter names (the call form's one argument
    goes to the first required parameter). Raises ValueError naming a missing one."""
    params = schema["function"]["parameters"]
    required = list(params.get("required", []))
    args = dict(call.arguments)
    if "_arg" in args:
        if not required:
            raise ValueError(f"{call.name} takes no arguments")
        args = {required[0]: args.pop("_arg")}
    missing = [p for p in required if p not in args]
    if missing:
        raise ValueError(f"{call.name} needs {', '.join(missing)}")
    return args


def describe_tools(tools: list[dict]) -> str:
    """The prompt text that tells a model without a tool-aware template how to call tools.

    >>> print(describe_tools([tool_schema("calc", "Evaluate arithmetic.", {"expression": ""})]))
    Tools: calc(expression): Evaluate arithmetic.
    Call a tool by writing <tool_call>name(argument)</tool_call>; its result comes back.
    """
    lines = [f"{t['function']['name']}({', '.join(t['function']['parameters']['required'])}): "
             f"{t['function']['description']}" for t in tools]
    return ("Tools: " + "; ".join(lines) + "\nCall a tool by writing "
            f"{OPEN}name(argument){CLOSE}; its result comes back.")
