"""One registry idiom for every name -> thing table (algorithms, verifiers, group reward
terms, tasks, allocators), and users' own code by import path.

A registry maps names to callables like a read-only dict. `get(name)` also accepts
"package.module:attribute", imported on first use, so a user trains with their own reward
function, verifier, task or estimator without forking rollwise (docs/extending.md). Every
failure is one ValueError that names the problem: an unknown name (with the closest
registered one), a module that does not import, a missing attribute, or a signature that
cannot take the arguments rollwise passes.

    >>> r = Registry("verifier", takes=("text", "sample"))
    >>> _ = r.register("exact")(lambda text, sample: float(text == sample.answer))
    >>> r.get("exakt")
    Traceback (most recent call last):
    ...
    ValueError: unknown verifier 'exakt' (did you mean 'exact'?); accepted: exact, or "package.module:function"
"""  # noqa: E501 - a doctest's expected message is one line

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def is_import_path(name: str) -> bool:
    """'package.module:attribute' (a registry name never has a colon)."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr.isidentifier())


def unknown_name_error(kind: str, name: str, accepted: list[str]) -> ValueError:
    """A ValueError naming the unknown `name`, the close match if any, and what is accepted.

    >>> str(unknown_name_error("task", "arithh", ["arith", "countdown"]))
    "unknown task 'arithh' (did you mean 'arith'?); accepted: arith, countdown"
    """
    close = difflib.get_close_matches(name, accepted, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(f"unknown {kind} {name!r}{hint}; accepted: {', '.join(sorted(accepted))}")


@dataclass(frozen=True)
class Options:
    """The keyword options a callable takes: `defaults` maps each option's name to its
    default (`REQUIRED` when it has none), in signature order; `open` when it also takes
    **kwargs, so any option."""

    defaults: dict[str, Any]
    open: bool = False

    def takes(self, name: str) -> bool:
        return self.open or name in self.defaults

    def pick(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of `options` it takes."""
        return {k: v for k, v in options.items() if self.takes(k)}


REQUIRED = inspect.Parameter.empty


def options_of(fn: Callable, *, passes: tuple[str, ...] = (),
               inputs: tuple[str, ...] = ()) -> Options:
    """The one reading of a signature for options: the keywords `fn` takes after the
    `passes` positional arguments rollwise gives it, `inputs` (keywords rollwise fills
    itself) left out. A builtin without a signature is trusted to take anything.

    >>> o = options_of(lambda x, *, k=1, **kw: x, passes=("x",)); o.defaults, o.open
    ({'k': 1}, True)
    >>> options_of(lambda x, *, k=1: x).pick({"k": 2, "other": 3})
    {'k': 2}
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return Options({}, open=True)
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    positional = [p for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    taken = {p.name for p in positional[: len(passes)]} | set(inputs)
    return Options({p.name: p.default for p in params
                    if p.kind in keyword and p.name not in taken},
                   open=any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params))


def options_misfit(fn: Callable, options: Mapping[str, Any], *, passes: tuple[str, ...] = (),
                   inputs: tuple[str, ...] = ()) -> str | None:
    """Why `fn` cannot take the keyword `options` (a config's options table), or None;
    `passes` and `inputs` as in `options_of`. Wrong: an option it has no parameter for
    (with the closest one it has), an option naming an input, or a parameter without a
    default that no option fills.

    >>> def term(trajectories, *, limit: int, scale: float = 1.0): ...
    >>> options_misfit(term, {"limt": 6}, passes=("trajectories",))
    "no option 'limt' (did you mean 'limit'?); its options: limit, scale"
    >>> options_misfit(term, {}, passes=("trajectories",))
    "option 'limit' has no default and is not set; its options: limit, scale"
    """
    spec = options_of(fn, passes=passes, inputs=inputs)
    own = list(spec.defaults)
    listed = f"; its options: {', '.join(own)}" if own else "; it takes no options"
    for option in options:
        if option in inputs:
            return f"option {option!r} is an input rollwise passes itself, not an option"
        if not spec.takes(option):
            close = difflib.get_close_matches(option, own, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"no option {option!r}{hint}{listed}"
    for name, default in spec.defaults.items():
        if default is REQUIRED and name not in options:
            return f"option {name!r} has no default and is not set{listed}"
    return None


def import_object(path: str, kind: str) -> Callable:
    """The callable at "package.module:attribute"; a ValueError naming what failed."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own code failing
        raise ValueError(f"{kind} {path!r}: cannot import {module_name!r} "
                         f"({type(e).__name__}: {e})") from e
    thing = getattr(module, attr, None)
    if thing is None:
        raise ValueError(f"{kind} {path!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(thing):  # one error type for every way a path fails: ValueError
        raise ValueError(f"{kind} {path!r} is a {type(thing).__name__}, "  # noqa: TRY004
                         "not a function or class")
    return thing


class Registry(Mapping[str, T], Generic[T]):
    """Names -> callables of one `kind`. `takes`: the positional arguments rollwise passes
    to each (checked for code loaded by import path); `keywords`: keyword arguments it
    passes besides (e.g. a task builder's seed and split sizes); `options`: whether the
    config gives each its own options besides (a parameter without a default is then one
    to set there, checked with `options_misfit`, not a misfit); `check`: what else this
    kind requires of a callable (a reason, or None), applied when one is registered (a
    ValueError at import) and when one is imported by path."""

    def __init__(self, kind: str, *, takes: tuple[str, ...] = (),
                 keywords: tuple[str, ...] = (), options: bool = False,
                 check: Callable[[Callable], str | None] | None = None):
        self.kind, self.takes, self.keywords = kind, takes, keywords
        self.options, self.check = options, check
        self._items: dict[str, T] = {}
        self._imported: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `@registry.register("ppo")` adds the function under `name`."""
        def add(thing: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            problem = self.check(thing) if self.check is not None else None
            if problem:
                raise ValueError(f"{self.kind} {name!r}: {problem}")
            self._items[name] = thing
            return thing

        return add

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def knows(self, name: str) -> bool:
        """Registered, or an import path (`get` then imports and checks it)."""
        return name in self._items or is_import_path(name)

    def get(self, name: str) -> T:  # type: ignore[override]
        """The registered `name`, or the object at "package.module:attribute"."""
        if name in self._items:
            return self._items[name]
        if not is_import_path(name):
            error = unknown_name_error(self.kind, name, list(self._items))
            raise ValueError(f'{error}, or "package.module:function"')
        if name not in self._imported:
            self._imported[name] = self._load(name)
        return self._imported[name]

    def _load(self, path: str) -> T:
        thing = import_object(path, self.kind)
        problem = self.misfit(thing)
        if problem:
            raise ValueError(f"{self.kind} {path!r}: {problem}")
        return thing

    def misfit(self, fn: Callable) -> str | None:
        """Why `fn` cannot be called the way rollwise calls this kind, or None."""
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins without a signature: trust them
            return None
        bind = signature.bind_partial if self.options else signature.bind
        try:
            bind(*self.takes, **dict.fromkeys(self.keywords))
        except TypeError as e:
            wanted = ", ".join([*self.takes, *(f"{k}=" for k in self.keywords)])
            return f"signature {signature} cannot take ({wanted}): {e}"
        return self.check(fn) if self.check is not None else None
