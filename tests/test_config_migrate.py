"""Keys of earlier releases: each old key of the table of moves is read at its new place
with a notice naming it, an older run's config.toml loads to the Config of its new
spelling, and allocator options are checked by name with a did-you-mean."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from rollwise.compose.config import Config, ConfigError, load_config
from rollwise.compose.migrate import MOVES, Move, MovedKeys
from rollwise.compose.preflight import check_config

OLD_RUN = Path(__file__).resolve().parent / "data" / "config_before_sections.toml"

# the older run's non-default settings, in the new spelling
NEW_SPELLING = """
[run]
name = "older"
backend = "ray"

[rollout]
group_size = 4
max_tokens = 16

[engine]
kv_budget_tokens = 4096
decode_step = "eager"
batch_size = 32
dtype = "float32"

[schedule]
strategy = "partial+context"
over_provision = 1.5
chunk_tokens = 8
mode = "async"
max_staleness = 2
stale_policy = "regenerate"

[speculation]
group = true
tokens = 3
reuse_rule = "coupled"

[episodes]
max_turns = 3
max_tokens = 512
env_timeout_s = 5.0
tree_branches = 2
keep_kv = false

[ray]
address = "10.0.0.5:6379"
num_workers = 2
worker_cpus = 2.0

[control]
allocator = "dars"
allocator_options = { first_n = 0, max_n = 16, schedule = "hw", std = true }
explore = 0.25

[learner]
share_prompts = true  # the old run set it; the default is "auto" now
"""


def _value(cfg: Config, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def _field(dotted: str):
    section, key = dotted.split(".")[:2]
    return type(getattr(Config(), section)).model_fields[key]


def _other(move: Move):
    """A valid value of the old key other than its default."""
    if move.new.startswith("control.allocator_options."):
        old = move.default
    else:
        field = _field(move.new)
        old = field.default
        choices = typing.get_args(field.annotation)
        if typing.get_origin(field.annotation) is typing.Literal:
            return next(c for c in choices if c != old)
    if isinstance(old, bool):
        return not old
    if isinstance(old, (int, float)) and move.new.startswith("control."):
        return old + 1
    if isinstance(old, (int, float)):  # the first the section takes (bounds: share <= 1)
        section, key = move.new.split(".")[:2]
        cls = type(getattr(Config(), section))
        for value in (old + 1, old / 2):
            try:
                cls(**{key: value})
                return value
            except ValueError:
                pass
    if isinstance(old, tuple):
        return tuple(n + 1 for n in old)
    return {"et": "hw", "native": "hf", None: "10.0.0.5:6379"}[old]


def _toml(value) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(map(_toml, value)) + "]"
    return repr(value).lower() if isinstance(value, bool) else repr(value)


@pytest.mark.parametrize("move", [m for m in MOVES if m.new], ids=str)
def test_each_old_key_is_read_at_its_new_place_with_a_notice(move: Move) -> None:
    value = _other(move)
    condition = [f"{move.when[0]}={_toml(move.when[1][0])}"] if move.when else []
    with pytest.warns(MovedKeys, match=rf"{move.old} -> {move.new} \(--set"):
        cfg = load_config(None, [*condition, f"{move.old}={_toml(value)}"])
    assert _value(cfg, move.new) == value


@pytest.mark.parametrize("move", [m for m in MOVES if m.when], ids=str)
def test_a_condition_key_left_out_is_at_a_default_no_condition_names(move: Move) -> None:
    assert _value(Config(), move.when[0]) not in move.when[1]


def test_an_older_runs_config_loads_to_the_config_of_its_new_spelling(tmp_path: Path) -> None:
    new = tmp_path / "config.toml"
    new.write_text(NEW_SPELLING)
    with pytest.warns(MovedKeys) as notices:
        old = load_config(OLD_RUN)
    text = str(notices[0].message)
    assert "run.max_staleness -> schedule.max_staleness" in text
    # each bound applied in its own setting: the async driver's is the one kept
    assert "rollout.max_staleness = 3" in text and "read from run.max_staleness" in text
    # another allocator's option did nothing: dropped, and said so
    assert "control.vcrl_kappa = 0.5" in text and "dropped" in text
    assert old == load_config(new)


def test_an_old_key_beside_its_new_spelling_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"rollout.engine \(--set rollout.engine='hf'\) is "
                       r"the old spelling of engine.name, which is set too"):
        load_config(None, ["engine.name='hf'", "rollout.engine='hf'"])


def test_an_old_option_of_another_allocator_is_dropped_with_a_notice_unless_default() -> None:
    with pytest.warns(MovedKeys) as notices:
        cfg = load_config(None, ["control.gdro_bins=4", "control.dars_max_n=16"])
    assert cfg.control.allocator_options == {}
    text = str(notices[0].message)
    assert "control.dars_max_n = 16" in text and "dropped" in text and "gdro_bins" not in text


def test_a_misspelled_allocator_option_names_the_closest_one() -> None:
    cfg = load_config(None, ["control.allocator='dars'", "control.allocator_options={max_m = 8}"])
    with pytest.raises(ConfigError, match=r"control.allocator_options: allocator 'dars': no "
                       r"option 'max_m' \(did you mean 'max_n'\?\); its options: first_n, "
                       r"max_n, schedule, std"):
        check_config(cfg)


def test_an_option_of_another_allocator_is_an_error() -> None:
    cfg = load_config(None, ["control.allocator='uniform'",
                             "control.allocator_options={max_rounds = 2}"])
    with pytest.raises(ConfigError, match=r"allocator 'uniform': no option 'max_rounds'; it "
                       r"takes no options; 'max_rounds' is an option of 'dynamic'"):
        check_config(cfg)
