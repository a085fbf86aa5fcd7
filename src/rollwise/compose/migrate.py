"""Keys of earlier releases, in one table of moves: each old key is read at its new place
(with a one-line notice naming the new key) or refused with what replaces it. Config files
written before, such as the config.toml of an older run directory, keep loading.

    >>> raw = {"rollout": {"engine": "hf"}}
    >>> apply_moves(raw, {"rollout.engine": "a.toml"}), raw
    (['rollout.engine -> engine.name (a.toml)'], {'rollout': {}, 'engine': {'name': 'hf'}})

Imports nothing of rollwise: `config.py` runs the table on the raw TOML before validation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class MovedKeys(UserWarning):
    """Old keys were read at their new place; the message names each new key."""


@dataclass(frozen=True)
class Move:
    """`old` (a dotted key) is read as `new`. `when`: a (dotted key, values) condition under
    which the old key had an effect; otherwise it is dropped (with a notice unless it holds
    `default`, its old default), since it did nothing. `new` None: the key was removed, its
    value must be `default` (the no-op that older runs saved) and `why` says what replaces
    it. A `when` key that is absent holds its default, which no condition names. Without
    `when`, a `default` names the no-op both spellings shared (a key that lived beside its
    new spelling): the old key at it is dropped quietly, and otherwise it wins over the new
    key at it."""

    old: str
    new: str | None
    when: tuple[str, tuple] | None = None
    default: Any = None
    why: str = ""

    def __str__(self) -> str:
        return f"{self.old} -> {self.new}"


_DYNAMIC = ("DAPO's dynamic sampling is one mechanism now: control.allocator = 'dynamic' "
            "(drops zero-variance groups and rolls out more prompts, up to "
            "control.allocator_options.max_rounds rounds in all; max_rounds = 1 only drops); "
            "docs/allocation.md")

_ENGINE = [Move(f"rollout.{old}", f"engine.{new}") for old, new in (
    ("engine", "name"), ("kv_budget_tokens", "kv_budget_tokens"),
    ("decode_step", "decode_step"), ("batch_size", "batch_size"), ("dtype", "dtype"))]
# [schedule] held four concerns once; the speculation and tree keys have sections of their own
_SPECULATION = {"spec_group": "group", "spec_reuse": "reuse", "spec_tokens": "tokens",
                "spec_max_tokens": "max_tokens", "reuse_rule": "reuse_rule",
                "lenience": "lenience"}
_TREE = {"tree": "mode", "tree_share": "share", "tree_decay_steps": "decay_steps",
         "tree_forced_tokens": "forced_tokens", **{k: k for k in (
             "latr_threshold", "latr_margin", "latr_lookahead", "latr_similarity",
             "entropy_branches", "entropy_fork_after")}}
_SPLIT = [Move(f"schedule.{old}", f"speculation.{new}") for old, new in _SPECULATION.items()] \
    + [Move(f"schedule.{old}", f"tree.{new}") for old, new in _TREE.items()]
_SCHEDULE = [Move(f"rollout.{k}", f"schedule.{k}") for k in (
    "strategy", "over_provision", "chunk_tokens")] + [
    Move(f"rollout.{k}", f"speculation.{_SPECULATION[k]}") for k in (
        "spec_group", "spec_reuse", "spec_tokens", "reuse_rule", "lenience")] + [
    Move(f"run.{k}", f"schedule.{k}") for k in ("mode", "stale_policy")]
# model.dtype and learner.master_dtype both set the trained weights' dtype; the learner's
# key is the one left. A full config.toml of an older run holds both: model.dtype at
# "float32" did nothing, and "bfloat16" loaded the model (so the weights) in bfloat16.
_MASTER = [Move("model.dtype", "learner.master_dtype", default="float32")]
_EPISODES = [Move(f"rollout.{old}", f"episodes.{new}") for old, new in (
    ("max_turns", "max_turns"), ("max_episode_tokens", "max_tokens"),
    ("env_timeout_s", "env_timeout_s"), ("tree_branches", "tree_branches"),
    ("tree_depth", "tree_depth"), ("keep_kv", "keep_kv"))]
_RAY = [Move("run.ray_address", "ray.address"), Move("rollout.num_workers", "ray.num_workers"),
        Move("rollout.worker_cpus", "ray.worker_cpus")]
# Each bound applied only in its own setting; the async driver's first, as it is the one a
# trained trajectory meets last.
_STALENESS = [
    Move("run.max_staleness", "schedule.max_staleness", ("schedule.mode", ("async",)), 1),
    Move("rollout.max_staleness", "schedule.max_staleness",
         ("schedule.strategy", ("partial", "partial+context")), 4)]
# The allocators' options: flat control keys once, each read by one allocator only.
_ALLOCATOR_OPTIONS = {
    "dynamic": [("max_rounds", "max_rounds", 3)],
    "thompson": [("thompson_candidates", "candidates", 2.0)],
    "pilot_commit": [("pilot_n", "pilot_n", 2), ("pilot_factor", "pilot_factor", 2.0),
                     ("commit_n", "commit_n", 0), ("band_low", "band_low", 0.125),
                     ("band_high", "band_high", 0.75)],
    "dars": [("dars_first_n", "first_n", 0), ("dars_max_n", "max_n", 32),
             ("dars_schedule", "schedule", "et"), ("dars_std", "std", True)],
    "vcrl": [("vcrl_kappa", "kappa", 0.3), ("vcrl_bank_frac", "bank_frac", 0.5),
             ("vcrl_momentum", "momentum", 0.9), ("vcrl_bank_size", "bank_size", 0)],
    "gdro": [("gdro_bins", "bins", 4), ("gdro_hysteresis", "hysteresis", 0.05),
             ("gdro_min_n", "min_n", 2), ("gdro_max_n", "max_n", 32)],
}
_CONTROL = [Move(f"control.{old}", f"control.allocator_options.{new}",
                 ("control.allocator", (allocator,)), default)
            for allocator, options in _ALLOCATOR_OPTIONS.items()
            for old, new, default in options]
_REMOVED = [Move("algorithm.filter_zero_variance", None, default=False, why=_DYNAMIC),
            Move("algorithm.max_refill_rounds", None, default=0, why=_DYNAMIC)]

# Plain moves first: the conditions of the others read the new places.
MOVES: list[Move] = _ENGINE + _SCHEDULE + _SPLIT + _EPISODES + _RAY + _MASTER + _STALENESS \
    + _CONTROL + _REMOVED


class MoveError(ValueError):
    """An old key that cannot be read: removed, or given beside its new spelling."""


def _table(raw: dict, dotted: str, create: bool = False) -> tuple[dict | None, str]:
    """The table holding `dotted` (None when there is none) and the key's last part."""
    *path, key = dotted.split(".")
    node: Any = raw
    for part in path:
        if not isinstance(node, dict) or (part not in node and not create):
            return None, key
        node = node.setdefault(part, {})
    return (node if isinstance(node, dict) else None), key


def _get(raw: dict, dotted: str) -> tuple[bool, Any]:
    """(whether `dotted` is set, its value)."""
    table, key = _table(raw, dotted)
    return (True, table[key]) if table is not None and key in table else (False, None)


def _move(raw: dict, source: dict[str, str], move: Move, moved: dict[str, str]) -> str | None:
    """Apply one move to its old key, present in `raw`; the notice to give, or None.
    `moved`: new key -> old key of the earlier moves (the first move to a key wins)."""
    where = source.get(move.old, "config")
    table, key = _table(raw, move.old)
    value = table.pop(key)  # type: ignore[union-attr]
    if move.new is None:
        if value != move.default:
            raise MoveError(f"{move.old} = {value!r} ({where}) was removed: {move.why}")
        return None
    if move.when is not None and _get(raw, move.when[0])[1] not in move.when[1]:
        if value == move.default:
            return None
        return (f"{move.old} = {value!r} ({where}) applied only when {move.when[0]} is "
                f"{' or '.join(map(repr, move.when[1]))}: dropped")
    if move.new in moved:
        return (f"{move.old} = {value!r} ({where}) dropped: {move.new} is read from "
                f"{moved[move.new]}")
    is_set, current = _get(raw, move.new)
    if is_set:
        override = where.startswith("--set") and not source.get(move.new, "").startswith("--set")
        shared = move.when is None and move.default is not None
        if shared and value == move.default:
            return None  # the old key did nothing; the new one decides
        if not override and not (shared and current == move.default):
            raise MoveError(f"{move.old} ({where}) is the old spelling of {move.new}, which "
                            f"is set too ({source.get(move.new, 'config')}); keep only "
                            f"{move.new}")
    table, key = _table(raw, move.new, create=True)
    if table is None:
        raise MoveError(f"{move.new.rsplit('.', 1)[0]} is a value, not a section; it should "
                        f"hold {key} (moved from {move.old})")
    table[key] = value
    source[move.new] = source.pop(move.old, where)
    moved[move.new] = move.old
    return f"{move} ({where})"


def apply_moves(raw: dict, source: dict[str, str]) -> list[str]:
    """Move every old key of `raw` to its new place (and its origin in `source`, the dotted
    key -> file or --set map); the notices, one line each. A MoveError for a removed key
    set to something other than its no-op, or an old key beside its new spelling."""
    notices: list[str] = []
    moved: dict[str, str] = {}
    for move in MOVES:
        if _get(raw, move.old)[0]:
            notices.append(_move(raw, source, move, moved) or "")
    return [n for n in notices if n]
