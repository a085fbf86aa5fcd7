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

This is the one reader of tool calls: environments use `parse_tool_calls`, and the
server (rollwise.serve.text) turns the same `find_tool_calls` spans into OpenAI
`tool_calls`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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


class CallSpan(NamedTuple):
    start: int  # where the opening tag begins in the text
    end: int  # just after the closing tag (the text's end when there is none)
    call: ToolCall | None  # None: malformed
    error: str  # why it is malformed ("" for a call)
    closed: bool  # False: the text ended inside the call


def find_tool_calls(text: str) -> list[CallSpan]:
    """Every `<tool_call>` span in `text`, in order, read or with the reason it cannot be.

    >>> [(s.call.name, s.closed) for s in find_tool_calls('x <tool_call>f(1)</tool_call>')]
    [('f', True)]
    """
    spans: list[CallSpan] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start)
        closed = end >= 0
        body = text[start + len(OPEN): end if closed else len(text)].strip()
        pos = end + len(CLOSE) if closed else len(text)
        call = parse_call(body)
        spans.append(CallSpan(start, pos, call, "", closed) if isinstance(call, ToolCall)
                     else CallSpan(start, pos, None, call, closed))
    return spans


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
    for span in find_tool_calls(text):
        if not span.closed:
            errors.append(f"tool call without {CLOSE}")
        elif span.call is None:
            errors.append(span.error)
        else:
            calls.append(span.call)
    return calls, errors


def parse_call(body: str) -> ToolCall | str:
    """One call's text (between the tags, or a whole reply): the call, or why it is not
    one. JSON takes "arguments" (or Llama 3's "parameters"), as an object or a JSON
    string of one."""
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return f"tool call is not valid JSON ({e.msg})"
        if not isinstance(obj, dict):
            return 'tool call JSON needs {"name": str, "arguments": {...}}'
        name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
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
