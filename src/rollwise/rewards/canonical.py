"""Canonical values: how the candidate process's return values cross to the sandbox runner.
A prefix text with every value tagged and every length given: exact built-in types only
(`encode`), rebuilt as genuine objects by a strict parser (`decode`), so an ``__eq__`` that
always agrees or an int subclass never reaches the tests.

Standard library only, and not even ``typing`` (start-up time): the sandbox loads this
module's compiled code from its stdin as ``rollwise.rewards.canonical`` beside the runner.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_DICT_LIKE = ("OrderedDict", "Counter", "defaultdict")  # compare equal to dicts in Python
_SEQUENCES = {list: "l", tuple: "t", set: "S", frozenset: "z"}
_BUILD = {"l": list, "t": tuple, "S": set, "z": frozenset}


def encode(value: Any, depth: int = 0) -> str:
    """`value` as canonical text; TypeError for anything but exact built-in values.

    >>> encode([1, (2.5, "a"), {None: True}])
    'l3:i1;t2:f2.5;s1:ad1:NT'
    """
    if depth > 200:
        raise ValueError("value nested too deeply")
    kind = type(value)
    if value is None:
        return "N"
    if kind is bool:
        return "T" if value else "F"
    if kind is int:
        return f"i{value};"
    if kind is float:
        return f"f{value!r};"
    if kind is complex:
        return f"c{value.real!r},{value.imag!r};"
    if kind is str:
        return f"s{len(value)}:{value}"
    if kind is bytes:
        return f"b{len(value) * 2}:{value.hex()}"
    tag = _SEQUENCES.get(kind)
    if tag:
        return f"{tag}{len(value)}:" + "".join(encode(v, depth + 1) for v in value)
    if kind is dict or (issubclass(kind, dict) and kind.__module__ == "collections"
                        and kind.__name__ in _DICT_LIKE):
        items = dict.items(value)
        return f"d{len(items)}:" + "".join(encode(k, depth + 1) + encode(v, depth + 1)
                                            for k, v in items)
    raise TypeError(f"a {kind.__name__} is not a plain built-in value (int, float, str, "
                    f"bytes, bool, None, list, tuple, dict, set)")


def decode(text: str) -> Any:
    """The genuine value of canonical text from `encode`; ValueError for anything else.

    >>> decode('l3:i1;t2:fnan;s1:ad1:NT')
    [1, (nan, 'a'), {None: True}]
    """
    if type(text) is not str:
        raise ValueError("canonical values are text")
    value, end = _parse(text, 0, 0)
    if end != len(text):
        raise ValueError("trailing data after a canonical value")
    return value


def _upto(text: str, start: int, stop: str) -> tuple[str, int]:
    end = text.find(stop, start)
    if end < 0 or end - start > 5000:
        raise ValueError("malformed canonical value")
    return text[start:end], end + 1


def _count(text: str, start: int) -> tuple[int, int]:
    digits, end = _upto(text, start, ":")
    if not digits.isdigit() or not digits.isascii() or len(digits) > 9:
        raise ValueError("malformed length")
    return int(digits), end


def _parse(text: str, at: int, depth: int) -> tuple[Any, int]:
    if depth > 200 or at >= len(text):
        raise ValueError("malformed canonical value")
    tag, at = text[at], at + 1
    if tag in "NTF":
        return {"N": None, "T": True, "F": False}[tag], at
    if tag == "i":
        digits, at = _upto(text, at, ";")
        if not digits.lstrip("-").isdigit() or not digits.isascii():
            raise ValueError("malformed int")
        return int(digits), at
    if tag == "f":
        number, at = _upto(text, at, ";")
        return float(number), at
    if tag == "c":
        number, at = _upto(text, at, ";")
        real, _, imag = number.partition(",")
        return complex(float(real), float(imag)), at
    if tag in "sb":
        n, at = _count(text, at)
        if at + n > len(text):
            raise ValueError("truncated canonical value")
        chunk = text[at:at + n]
        return (chunk if tag == "s" else bytes.fromhex(chunk)), at + n
    if tag in _BUILD or tag == "d":
        n, at = _count(text, at)
        items = []
        for _ in range(2 * n if tag == "d" else n):
            item, at = _parse(text, at, depth + 1)
            items.append(item)
        if tag == "d":
            return dict(zip(items[::2], items[1::2])), at
        return _BUILD[tag](items), at
    raise ValueError(f"unknown canonical tag {tag!r}")
