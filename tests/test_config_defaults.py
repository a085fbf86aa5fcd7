"""Each default is written once: a component that takes a setting the config also declares
has no default of its own for it, or the config's (read from one place); the sections built
from a component's settings are exactly its fields; name lists are read from their
registries; the keys [schedule] held before it was split load at their new place."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

from rollwise.compose.config import Config, ConfigError, load_config
from rollwise.compose.migrate import MovedKeys

DATA = Path(__file__).resolve().parent / "data"

# (component, the sections whose keys its parameters may repeat, parameter -> key where the
# names differ). A parameter named like a key of those sections (or listed) is compared.
COMPONENTS = {
    "rollwise.engine.native:NativeEngine": (("engine", "speculation"), {
        "max_num_seqs": "engine.batch_size", "step_mode": "engine.decode_step",
        "spec_tokens": "speculation.tokens", "spec_max_tokens": "speculation.max_tokens"}),
    "rollwise.engine:make_engine": (("engine",), {}),
    "rollwise.engine:native_engine": (("engine",), {}),
    "rollwise.engine.hf:HFEngine": (("engine",), {}),
    "rollwise.rollout:RolloutScheduler": (("schedule",), {
        "spec_group": "speculation.group", "spec_reuse": "speculation.reuse",
        "reuse_rule": "speculation.reuse_rule", "lenience": "speculation.lenience"}),
    "rollwise.rollout.trees:TreeSettings": (("tree",), {}),
    "rollwise.rollout.episodes:EpisodeRunner": (("episodes",), {}),
    "rollwise.rollout.remote:RemoteRollout": (("engine",), {
        "concurrency": "engine.batch_size", "sync": "engine.remote_sync",
        "kind": "engine.remote_kind"}),
    "rollwise.rollout.servers:Servers": (("engine",), {
        "timeout_s": "engine.remote_timeout_s", "retries": "engine.remote_retries"}),
    "rollwise.learner:Learner": (("learner", "algorithm"), {}),
    "rollwise.learner.sft:SftSettings": (("sft",), {}),
    "rollwise.control:Controller": (("control", "rollout"), {}),
    "rollwise.control:PosteriorBook": (("control",), {}),
    "rollwise.run.health:HealthCheck": (("health",), {}),
    "rollwise.run.health:step_problems": (("health",), {}),
    "rollwise.rewards.judge:Judge": (("judge",), {}),
    "rollwise.models.settings:TinySettings": (("model.tiny",), {}),
    "rollwise.models.tiny:build_model": (("model.tiny",), {}),
    "rollwise.serve:make_server": (("engine",), {
        "max_num_seqs": "engine.batch_size"}),
}
# 'auto' in the config is settled by compose (compose/precision.py) before a component sees
# it: the components' own dtype or precision is a different thing, the one they are given
RESOLVED = {("rollwise.engine.native:NativeEngine", "dtype"),
            ("rollwise.learner:Learner", "precision"),
            ("rollwise.serve:make_server", "dtype")}


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _import(path: str):
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _pairs():
    """(component, parameter, its default, config key, the config's default) for every
    parameter of COMPONENTS that repeats a config key."""
    cfg = Config()
    for path, (sections, renamed) in COMPONENTS.items():
        target = _import(path)
        if dataclasses.is_dataclass(target):
            params = {f.name: f.default for f in dataclasses.fields(target)}
        else:
            fn = target.__init__ if inspect.isclass(target) else target
            params = {n: p.default for n, p in inspect.signature(fn).parameters.items()}
        for name, default in params.items():
            keys = [renamed[name]] if name in renamed else [
                f"{s}.{name}" for s in sections if name in type(_get(cfg, s)).model_fields]
            for key in keys:
                if (path, name) not in RESOLVED:
                    yield path, name, default, key, _get(cfg, key)


def test_no_component_default_differs_from_the_configs() -> None:
    pairs = list(_pairs())
    assert len(pairs) > 80  # the table reaches the components (a renamed module would not)
    # no default, or None: "the config's" or "the engine's own" (make_server's sizes)
    differ = [f"{path} {name}={default!r} but {key}={value!r}"
              for path, name, default, key, value in pairs
              if default not in (inspect.Parameter.empty, dataclasses.MISSING, None)
              and default != value]
    assert differ == []


def test_the_drifted_defaults_are_the_values_the_runs_used() -> None:
    """The tiny warm start's 350 steps (the config's, which every run passed), 64 rows
    decoded at once (the config's; NativeEngine said 128 when built by hand)."""
    from rollwise.engine.native import NativeEngine
    from rollwise.models.settings import TinySettings

    cfg = Config()
    assert cfg.model.tiny.sft_steps == TinySettings().sft_steps == 350
    native = inspect.signature(NativeEngine.__init__).parameters
    assert cfg.engine.batch_size == native["max_num_seqs"].default == 64
    assert cfg.engine.kv_budget_tokens == native["kv_budget_tokens"].default == 65536


@pytest.mark.parametrize("section, settings", [
    ("tree", "rollwise.rollout.trees:TreeSettings"),
    ("judge", "rollwise.rewards.judge:Judge"),
    ("model.tiny", "rollwise.models.settings:TinySettings"),
    ("sft", "rollwise.learner.sft:SftSettings")])
def test_a_section_built_from_a_components_settings_is_exactly_its_fields(
        section: str, settings: str) -> None:
    cls = _import(settings)
    fields = {f.name: f for f in dataclasses.fields(cls) if "help" in f.metadata}
    model = type(_get(Config(), section))
    assert list(model.model_fields) == list(fields)
    for name, f in fields.items():
        assert model.model_fields[name].description == f.metadata["help"]
        assert model.model_fields[name].default == f.default


def test_name_lists_are_read_from_their_registries() -> None:
    from rollwise.algos.losses import AGGREGATIONS
    from rollwise.engine.step import MODES
    from rollwise.learner.optim import OPTIMIZERS
    from rollwise.rollout.dialects import KINDS
    from rollwise.rollout.scheduler import REUSE_RULES
    from rollwise.rollout.strategy import STRATEGIES
    from rollwise.rollout.trees import MODES as TREE_MODES
    from rollwise.system.runtime import ALLOCATORS

    def names(section: str, key: str) -> tuple:
        return typing.get_args(type(_get(Config(), section)).model_fields[key].annotation)

    assert names("engine", "decode_step") == MODES
    assert names("schedule", "strategy") == tuple(STRATEGIES)
    assert names("speculation", "reuse_rule") == REUSE_RULES
    assert names("tree", "mode") == TREE_MODES
    assert names("learner", "optimizer") == OPTIMIZERS
    assert names("engine", "remote_kind") == KINDS
    assert names("run", "allocator") == ALLOCATORS
    assert names("algorithm", "aggregation") == AGGREGATIONS
    with pytest.raises(ConfigError, match="schedule.strategy"):
        load_config(None, ["schedule.strategy='greedy'"])


def test_the_tree_sections_checks_are_the_components() -> None:
    with pytest.raises(ConfigError, match="latr_lookahead points are token counts"):
        load_config(None, ["tree.latr_lookahead=[0, 4]"])


def test_an_older_runs_schedule_loads_into_the_three_sections() -> None:
    """A config.toml written before [schedule] was split (every key written out), with
    model.dtype = 'bfloat16' beside learner.master_dtype at its default."""
    with pytest.warns(MovedKeys) as notices:
        cfg = load_config(DATA / "config_before_split.toml")
    text = str(notices[0].message)
    for old, new in [("schedule.spec_group", "speculation.group"),
                     ("schedule.tree", "tree.mode"), ("schedule.tree_share", "tree.share"),
                     ("schedule.latr_lookahead", "tree.latr_lookahead"),
                     ("model.dtype", "learner.master_dtype")]:
        assert f"{old} -> {new}" in text
    assert (cfg.speculation.group, cfg.speculation.tokens, cfg.speculation.max_tokens,
            cfg.speculation.reuse_rule, cfg.speculation.lenience) == (True, 3, 8, "coupled", 1.5)
    assert (cfg.tree.mode, cfg.tree.share, cfg.tree.decay_steps, cfg.tree.forced_tokens,
            cfg.tree.latr_lookahead, cfg.tree.entropy_branches,
            cfg.tree.entropy_fork_after) == ("entropy", 0.5, 10, "keep", (8, 16), 4, 6)
    assert (cfg.schedule.mode, cfg.schedule.max_staleness) == ("async", 1)
    assert cfg.learner.master_dtype == "bfloat16"
    assert set(type(cfg.schedule).model_fields) == {
        "strategy", "over_provision", "chunk_tokens", "mode", "max_staleness", "stale_policy"}


def test_an_old_key_set_on_the_command_line_wins_over_the_files_new_key(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[tree]\nmode = "none"\n\n[speculation]\ntokens = 4\n')
    with pytest.warns(MovedKeys, match=r"schedule.tree -> tree.mode \(--set"):
        cfg = load_config(path, ["schedule.tree='latr'", "schedule.spec_tokens=6"])
    assert (cfg.tree.mode, cfg.speculation.tokens) == ("latr", 6)
    path.write_text('[tree]\nmode = "none"\n\n[schedule]\ntree = "latr"\n')
    with pytest.raises(ConfigError, match="old spelling of tree.mode, which is set too"):
        load_config(path)


def test_model_dtype_at_its_old_default_beside_master_dtype_says_nothing(recwarn) -> None:
    cfg = load_config(None, ["model.dtype='float32'", "learner.master_dtype='bfloat16'"])
    assert cfg.learner.master_dtype == "bfloat16"
    assert not [w for w in recwarn if issubclass(w.category, MovedKeys)]


def test_a_config_with_built_sections_pickles() -> None:
    """Ray sends the config to its actors: the sections built from components' settings
    are found by name where they are bound."""
    import pickle

    cfg = load_config(None, ["tree.mode='latr'", "model.tiny.sft_steps=5", "sft.steps=2"])
    assert pickle.loads(pickle.dumps(cfg)) == cfg
