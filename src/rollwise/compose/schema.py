"""The base of every config section, and the two ways a section takes what a component
declares: `section_of` builds a whole section from a component's settings dataclass (its
fields' defaults, bounds and help text), `default_of` reads one default from a component's
signature. Either way a default is written once, where the component is.

Imports pydantic only.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def section_of(name: str, module: str, settings: type, doc: str,
               checks: bool = False) -> type[Section]:
    """A config section called `name`, to be bound to that name in `module` (so that a
    config pickles, as Ray sends it to its actors), built from a component's settings
    dataclass: one key per field that carries help text (`metadata["help"]`), with its
    type, default and bounds (the rest of its metadata: ge, gt, le, lt, min_length).
    `checks`: a validated section is
    also passed through the dataclass once, so the component's own checks (`__post_init__`)
    run at load time, naming the key (for settings that are always built, unlike a judge's,
    which only a run that names it builds)."""
    hints = typing.get_type_hints(settings)
    keys: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        if "help" not in f.metadata:
            continue
        bounds = {k: v for k, v in f.metadata.items() if k != "help"}
        default = ({"default_factory": f.default_factory}
                   if f.default_factory is not dataclasses.MISSING else {"default": f.default})
        keys[f.name] = (hints[f.name], Field(**default, description=f.metadata["help"],
                                             **bounds))

    def component_checks(section):
        settings(**{k: getattr(section, k) for k in keys})
        return section

    validators = {"component_checks": model_validator(mode="after")(component_checks)}
    return create_model(name, __base__=Section, __doc__=doc, __module__=module,
                        __validators__=validators if checks else None, **keys)


def default_of(function, name: str) -> Any:
    """A component's own default for its argument `name` (the one place it is written)."""
    return inspect.signature(function).parameters[name].default
