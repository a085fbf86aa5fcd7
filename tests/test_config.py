"""Config: unknown keys and bad values are errors that say where and what; TOML round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from rollwise.compose.config import Config, ConfigError, load_config, to_toml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_without_a_file() -> None:
    cfg = load_config()
    assert cfg == Config()
    assert cfg.rollout.temperature == 1.0
    # precision is chosen per machine unless set (rollwise.compose.precision)
    assert (cfg.engine.dtype, cfg.learner.precision, cfg.algorithm.correction) == ("auto",) * 3


def test_typo_key_in_file_names_key_file_and_suggestion(tmp_path: Path) -> None:
    path = _write(tmp_path, "[rollout]\ntemprature = 0.7\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "'rollout.temprature'" in msg
    assert str(path) in msg
    assert "did you mean 'rollout.temperature'?" in msg


def test_typo_section_in_file_names_section_and_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[rolout]\ntemperature = 0.7\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "'rolout'" in msg and str(path) in msg and "did you mean 'rollout'?" in msg


def test_typo_key_in_override_names_set() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.temprature=0.5"])
    msg = str(err.value)
    assert "'rollout.temprature'" in msg
    assert "--set rollout.temprature=0.5" in msg
    assert "did you mean 'rollout.temperature'?" in msg


def test_typo_section_in_override_names_set() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rolout.temperature=0.5"])
    msg = str(err.value)
    assert "did you mean 'rollout'?" in msg
    assert "--set" in msg


@pytest.mark.parametrize("override, key, given", [
    ("rollout.temperature=-1", "rollout.temperature", "-1"),
    ('learner.precision="fp8"', "learner.precision", "'fp8'"),
    ("learner.precision=fp8", "learner.precision", "'fp8'"),
    ("rollout.top_p=1.5", "rollout.top_p", "1.5"),
    ("algorithm.aggregation=sum", "algorithm.aggregation", "'sum'"),
])
def test_bad_override_value_names_key_value_and_set(override: str, key: str, given: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    msg = str(err.value)
    assert f"{key} = {given}" in msg
    assert f"--set {override}" in msg


def test_bad_value_in_file_names_key_value_and_file(tmp_path: Path) -> None:
    path = _write(tmp_path, '[learner]\nprecision = "fp8"\n\n[rollout]\ntemperature = -1\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"learner.precision = 'fp8' ({path})" in msg
    assert f"rollout.temperature = -1 ({path})" in msg  # every bad value is reported
    assert "float32" in msg and "bf16-autocast" in msg  # what would be accepted


def test_overrides_parse_toml_values() -> None:
    cfg = load_config(None, [
        "rollout.max_tokens=12",  # int
        "learner.lr=3e-4",  # float
        "run.overwrite=true",  # bool
        'model.lora_targets=["q_proj", "v_proj"]',  # list
        "learner.betas=[0.8, 0.95]",  # list -> tuple
        "run.name=my_run",  # bare string
        "task.path=/data/train.jsonl",  # bare string that is not TOML
        'run.device="cuda:1"',  # quoted string
        "task.options={digits = 3, ops = '+-'}",  # inline table (free-form)
        "model.lora_alpha=8",  # int into a float field
    ])
    assert cfg.rollout.max_tokens == 12 and isinstance(cfg.rollout.max_tokens, int)
    assert cfg.learner.lr == 3e-4
    assert cfg.run.overwrite is True
    assert cfg.model.lora_targets == ["q_proj", "v_proj"]
    assert cfg.learner.betas == (0.8, 0.95)
    assert cfg.run.name == "my_run"
    assert cfg.task.path == "/data/train.jsonl"
    assert cfg.run.device == "cuda:1"
    assert cfg.task.options == {"digits": 3, "ops": "+-"}
    assert cfg.model.lora_alpha == 8.0


def test_overrides_win_over_file_and_keep_other_file_values(tmp_path: Path) -> None:
    path = _write(tmp_path, "[rollout]\ntemperature = 0.5\ngroup_size = 4\n")
    cfg = load_config(path, ["rollout.temperature=0.9"])
    assert cfg.rollout.temperature == 0.9 and cfg.rollout.group_size == 4


def test_override_without_equals_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--set expects key=value, got 'rollout.temperature'"):
        load_config(None, ["rollout.temperature"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = _write(tmp_path, "[rollout\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_free_form_tables_accept_any_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, "[task]\noptions = { anything = 1 }\nrewards = { correct = 1.0, "
                            "format = 0.25 }\n")
    cfg = load_config(path)
    assert cfg.task.options == {"anything": 1}
    assert cfg.task.rewards == {"correct": 1.0, "format": 0.25}


@pytest.mark.parametrize("overrides", [
    [],
    ["task.options={digits = 3, ops = '+-*', weights = [0.5, 1.5], nested = {a = 1}}",
     'run.name="we\\"ird \\\\ name"', "eval.max_tokens=5", "learner.betas=[0.8, 0.95]",
     "learner.lr=1e-05", "task.rewards={correct = 1.0, format = 0.1}", "model.lora_rank=8",
     "run.output_dir=C:/runs", "algorithm.aggregation=seq-mean-token-sum-norm"],
    # regression: import-path keys were written bare (`{ mypkg.r:f = 1.0 }`, not TOML)
    ["task.rewards={correct = 1.0, 'mypkg.rewards:brief' = 0.5, 'a b' = 1.0}",
     "task.reward_options={'mypkg.rewards:cap' = { 'x.y' = 1, limit = 6 }}",
     "algorithm.advantage_options={ 'k:1' = 2 }", "judge.prompt='line 1\nline \t2 \u0001'"],
])
def test_to_toml_round_trips(tmp_path: Path, overrides: list[str]) -> None:
    cfg = load_config(None, overrides)
    text = to_toml(cfg)
    again = load_config(_write(tmp_path, text))
    assert again == cfg
    assert to_toml(again) == text


@pytest.mark.parametrize("name", ["tiny_arith.toml", "quickstart.toml"])
def test_shipped_configs_load_and_round_trip(tmp_path: Path, name: str) -> None:
    cfg = load_config(CONFIGS / name)
    assert cfg.run.name == name.removesuffix(".toml")
    assert load_config(_write(tmp_path, to_toml(cfg))) == cfg


@pytest.mark.parametrize("name", ["tiny_arith.toml", "quickstart.toml"])
def test_shipped_config_values_are_the_files_values(name: str) -> None:
    # every value written in the file is the value loaded (the files change; this stays true)
    raw = tomllib.loads((CONFIGS / name).read_text())
    cfg = load_config(CONFIGS / name).model_dump()

    def check(written: dict, loaded: dict, where: str) -> None:
        for key, value in written.items():
            got = loaded[key]
            if isinstance(value, dict) and where + key not in ("task.options", "task.rewards"):
                check(value, got, f"{where}{key}.")
            else:
                assert (list(got) if isinstance(got, tuple) else got) == value, where + key

    check(raw, cfg, "")


def test_removed_dynamic_sampling_keys_name_the_allocator_that_replaces_them():
    """filter_zero_variance / max_refill_rounds were a second DAPO dynamic sampling beside the
    'dynamic' allocator: set, they are an error naming it; at their no-op values (every
    config.toml written before) they still load."""
    for key in ("algorithm.filter_zero_variance=true", "algorithm.max_refill_rounds=2"):
        with pytest.raises(ConfigError, match=rf"{key.split('=')[0]} = .* \(--set {key}\) "
                           r"was removed: .*control.allocator = 'dynamic'"):
            load_config(None, [key])
    cfg = load_config(None, ["algorithm.filter_zero_variance=false",
                             "algorithm.max_refill_rounds=0"])
    assert cfg.control.allocator == "uniform" and "refill" not in to_toml(cfg)
