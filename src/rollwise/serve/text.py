"""The text edge of the server: chat messages -> prompt ids, sampled ids -> text with stop
strings, and tool calls parsed back out of the text.

Tool calls use the Hermes format that most open chat templates with tools emit
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), read by the environments' own
parser (rollwise.envs.tools); a reply that is one bare JSON object with "name" and
"arguments" (or "parameters", Llama 3's form) is read as a call too.
A template that does not mention `tools` (SmolLM2's, the tiny model's) gets the tool
signatures in a system message that asks for that same format.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from rollwise.envs.tools import ToolCall, find_tool_calls, parse_call

# For tokenizers without a chat template (the tiny model): roles and contents, one per line,
# in characters the tiny model's vocabulary spells.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400: the message says what and why."""


def message_text(content: Any, where: str) -> str:
    """An OpenAI message `content` (a string, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}: only text content parts are supported, got {kind!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where}: content must be a string or a list of text parts")


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as templates expect them (a dict), from OpenAI's JSON string."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _tool_call_text(call: dict) -> str:
    fn = call.get("function") or {}
    body = {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments", {}))}
    return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"


def tool_preamble(tools: list[dict]) -> str:
    """The system text that offers `tools` to a model whose template has no tool support."""
    lines = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    return ("You can call these functions (JSON signatures, one per line):\n<tools>\n"
            f"{lines}\n</tools>\nTo call one, reply with a JSON object naming it and its "
            "arguments between tags:\n<tool_call>\n"
            '{"name": "function_name", "arguments": {"arg": "value"}}\n</tool_call>')


def normalise_messages(messages: list[dict], native_tools: bool) -> list[dict]:
    """OpenAI chat messages as chat templates read them: text content, tool-call arguments
    as dicts; for a template without tool support, assistant tool calls as Hermes text."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role' string")
        role = m["role"]
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{i}].role {role!r} is not one of system, developer, "
                             "user, assistant, tool")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": message_text(m.get("content"), f"messages[{i}]")}
        calls = m.get("tool_calls") or []
        if calls and role == "assistant":
            if native_tools:
                msg["tool_calls"] = [
                    {"id": c.get("id"), "type": "function",
                     "function": {"name": (c.get("function") or {}).get("name"),
                                  "arguments": _arguments((c.get("function") or {}).get(
                                      "arguments", {}))}} for c in calls]
            else:
                msg["content"] = "\n".join([msg["content"]] * bool(msg["content"])
                                           + [_tool_call_text(c) for c in calls])
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name") is not None:
            msg["name"] = m["name"]
        out.append(msg)
    return out


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None,
                template: str | None = None) -> list[int]:
    """Prompt ids of `messages` (and `tools`) through the chat template (`template`, default
    the tokenizer's own), the generation prompt appended."""
    template = template or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
    native = "tools" in template
    msgs = normalise_messages(messages, native)
    if not msgs:
        raise BadRequest("messages must not be empty")
    kwargs: dict[str, Any] = {}
    if tools:
        if native:
            kwargs["tools"] = tools
        else:
            preamble = tool_preamble(tools)
            if msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + preamble}
            else:
                msgs.insert(0, {"role": "system", "content": preamble})
    try:
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            chat_template=template, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template's own refusal (e.g. role order)
        raise BadRequest(f"the chat template rejected the messages: {e}") from None
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content left, OpenAI `tool_calls`) from a reply; malformed calls (and the short
    `name(argument)` form environments accept, which names no parameter) stay in the
    content. A call the reply ended inside counts when its JSON is complete (generation
    stopped at the closing tag).

    >>> content, calls = parse_tool_calls(
    ...     'ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    >>> content, calls[0]["function"]
    ('ok', {'name': 'add', 'arguments': '{"a": 1}'})
    """
    calls, kept, last = [], [], 0
    for span in find_tool_calls(text):
        if span.call is None or "_arg" in span.call.arguments:
            continue
        kept.append(text[last: span.start])
        last = span.end
        calls.append(_openai_call(span.call))
    if not calls:
        body = text.strip()
        call = parse_call(body) if body.startswith("{") else None
        return (None, [_openai_call(call)]) if isinstance(call, ToolCall) else (text, [])
    kept.append(text[last:])
    content = "".join(kept).strip()
    return content or None, calls


def _openai_call(call: ToolCall) -> dict:
    return {"id": f"call_{secrets.token_hex(8)}", "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}


@dataclass
class TextTracker:
    """Sampled ids in, text out, as the ids arrive: what may be shown so far (held back
    while it could still be the start of a stop string or an unfinished UTF-8 character)
    and where a stop string ends the reply (the ids then end at the token that completed
    it; the text is cut before the stop string)."""

    tokenizer: Any
    stop: list[str]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    shown: int = 0  # characters handed out
    given: int = 0  # ids handed out with them
    stopped: bool = False  # a stop string matched
    text: str = ""  # the text so far (cut at the stop string once one matched)
    _context: int = 0  # ids decoded again only as context for the next ones
    _read: int = 0  # ids whose text is in `text`

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def _extend(self, final: bool = False) -> None:
        """Append the text of the ids past `_read`, decoded after the previous step's ids
        (tokenizers that drop a leading space or join bytes across tokens then give what
        decoding everything gives) without decoding the whole reply again per token. An
        unfinished UTF-8 character waits for its next bytes, unless `final`."""
        before = self.decode(self.ids[self._context:self._read])
        after = self.decode(self.ids[self._context:])
        if final or (len(after) > len(before) and not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self._context, self._read = self._read, len(self.ids)

    def add(self, ids: list[int], logprobs: list[float], versions: list[int],
            final: bool = False) -> None:
        """Take newly sampled ids; `final`: they are the last (flush held bytes)."""
        if self.stopped:
            return
        start, seen = len(self.ids), len(self.text)
        self.ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self._extend(final)
        longest = max((len(s) for s in self.stop), default=0)
        hit = self._first_stop(self.text, max(0, seen - longest + 1))
        if hit is None:
            return
        pos, s = hit
        k = len(self.ids)
        for j in range(start + 1, len(self.ids)):  # the token that completed it
            if s in self.decode(self.ids[:j]):
                k = j
                break
        del self.ids[k:], self.logprobs[k:], self.versions[k:]
        self.text, self.stopped = self.text[:pos], True

    def _first_stop(self, text: str, start: int = 0) -> tuple[int, str] | None:
        found = [(i, s) for s in self.stop if s and (i := text.find(s, start)) >= 0]
        return min(found) if found else None

    def take(self, final: bool = False) -> tuple[str, list[int], list[float]]:
        """(new text, the ids behind it, their log-probs) since the last take; `final`
        releases what was held back."""
        end = len(self.text)
        if not final and not self.stopped:
            if self.text.endswith("\ufffd"):
                end -= 1
            hold = max((n for s in self.stop for n in range(1, min(len(s), end + 1))
                        if self.text[:end].endswith(s[:n])), default=0)
            end -= hold
        if end <= self.shown and not final:
            return "", [], []
        delta = self.text[self.shown:end]
        ids, lps = self.ids[self.given:], self.logprobs[self.given:]
        self.shown, self.given = max(self.shown, end), len(self.ids)
        return delta, ids, lps
