"""Configuration: `Config`, one documented section per concern (sections.py), loaded from
TOML with dotted overrides and written back as TOML.

    cfg = load_config("configs/tiny_arith.toml", overrides=["rollout.temperature=0.7"])

Every field carries its help text where it is declared. Unknown keys and bad values are
errors that name the key, where it came from (the file or `--set`) and what is accepted;
keys of earlier releases are read at their new place, with a notice (migrate.py).
Components never receive this tree: `build.py` unpacks it into plain arguments.

Imports pydantic and the modules beside it: migrate.py and schema.py at once, sections.py
(and with it the components, torch) when `Config` is first used.
"""

from __future__ import annotations

import difflib
import functools
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomllib
from pydantic import BaseModel, Field, ValidationError, create_model

from rollwise.compose.migrate import MovedKeys, MoveError, apply_moves
from rollwise.compose.schema import Section

if TYPE_CHECKING:  # Config is built at run time (config_class): a Section to a checker
    from rollwise.compose.schema import Section as Config

# The sections, in the order of the config's tables.
SECTIONS = ("run", "model", "task", "rollout", "engine", "schedule", "speculation", "tree",
            "episodes", "ray", "algorithm", "learner", "eval", "control", "health", "judge",
            "sft")


@functools.cache
def config_class() -> type[Section]:
    """`Config`, built on first use: its sections read the settings and name lists of the
    components (sections.py), which imports torch; reading a config's keys and its errors
    (the command line's `--help`, `ConfigError`) does not need them."""
    from rollwise.compose import sections

    fields = {name: (cls, Field(default_factory=cls)) for name in SECTIONS
              for cls in [getattr(sections, f"{name.title()}Config")]}
    return create_model("Config", __base__=Section, __module__=__name__,
                        __doc__="The whole configuration: one section per concern.", **fields)


def __getattr__(name: str) -> Any:
    if name == "Config":  # `from rollwise.compose.config import Config`, and unpickling one
        return config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


# Sections whose values are free-form tables (their keys are not checked here).
_FREE_TABLES = {("task", "options"), ("task", "rewards"), ("task", "reward_options"),
                ("algorithm", "advantage_options"), ("control", "allocator_options")}


def _check_keys(raw: dict, model: type[BaseModel], path: tuple[str, ...], source: dict) -> None:
    """Reject unknown keys with the closest valid one, naming where each came from."""
    fields = model.model_fields
    for key, value in raw.items():
        dotted = ".".join(path + (key,))
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            hint = f" (did you mean '{'.'.join(path + (close[0],))}'?)" if close else ""
            where = source.get(dotted) or next(
                (v for k, v in source.items() if k.startswith(dotted + ".")), "config")
            raise ConfigError(
                f"unknown key '{dotted}' in {where}{hint}; "
                f"valid keys here: {', '.join(fields)}"
            )
        sub = fields[key].annotation
        nested = isinstance(sub, type) and issubclass(sub, BaseModel)
        if isinstance(value, dict) and path + (key,) not in _FREE_TABLES and nested:
            _check_keys(value, sub, path + (key,), source)


def parse_value(text: str) -> Any:
    """TOML value syntax for --set (numbers, booleans, lists, quoted strings); else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: '{part}' is a value, not a section")
    node[parts[-1]] = value


def flatten(raw: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in raw.items():
        key = f"{prefix}{k}"
        out[key] = v
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a TOML file (or defaults when `path` is None) and apply `a.b=c` overrides."""
    raw: dict[str, Any] = {}
    source: dict[str, str] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from e
        source = {k: str(path) for k in flatten(raw)}
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got '{item}'")
        key, text = item.split("=", 1)
        key = key.strip()
        _set_dotted(raw, key, parse_value(text.strip()))
        source[key] = f"--set {item}"
    return validate_config(raw, source)


def validate_config(raw: dict, source: dict[str, str] | None = None) -> Config:
    """`raw` (TOML tables; changed in place) as a `Config`; `source`: where each dotted key
    came from, for the messages. Old keys move first, with one notice listing them."""
    source = source or {}
    try:
        notices = apply_moves(raw, source)
    except MoveError as e:
        raise ConfigError(str(e)) from None
    if notices:
        warnings.warn("old config keys read at their new place (write the new spelling):\n  "
                      + "\n  ".join(notices), MovedKeys, stacklevel=3)
    _check_keys(raw, config_class(), (), source)
    try:
        return config_class().model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            dotted = ".".join(str(p) for p in err["loc"])
            where = source.get(dotted, "config")
            lines.append(f"{dotted} = {err.get('input')!r} ({where}): {err['msg']}")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
            "\r": "\\r"}


def _toml_string(text: str) -> str:
    r"""A TOML basic string: quotes, backslashes and control characters escaped.

    >>> print(_toml_string('a "b"\n'))
    "a \"b\"\n"
    """
    def escape(c: str) -> str:
        if c in _ESCAPES:
            return _ESCAPES[c]
        return f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c

    return '"' + "".join(escape(c) for c in text) + '"'


def _toml_key(key: str) -> str:
    """A bare key where TOML allows one, else a quoted one (an import path such as
    `mypkg.rewards:brief` has a dot and a colon, which a bare key cannot hold).

    >>> _toml_key("correct"), _toml_key("mypkg.rewards:brief")
    ('correct', '"mypkg.rewards:brief"')
    """
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_key(str(k))} = {_toml_value(x)}"
                                for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (None values are omitted, as TOML has no null)."""
    out: list[str] = []

    def section(name: str, data: dict) -> None:
        scalars = {k: v for k, v in data.items() if not isinstance(v, dict) or (
            tuple(name.split(".")) + (k,) in _FREE_TABLES)}
        out.append(f"[{name}]")
        out.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items()
                   if v is not None)
        out.append("")
        for k, v in data.items():
            if k not in scalars:
                section(f"{name}.{k}", v)

    for name, data in cfg.model_dump().items():
        section(name, data)
    return "\n".join(out)
