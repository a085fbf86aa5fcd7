"""Property-based tests (hypothesis): no input makes rollwise fail with anything but a clear
error. Each target runs 100 examples in the default tier and 1,000 under `-m slow`.

Targets: the config loader (random TOML and --set values), the dataset readers (random
bytes, wrong types, missing columns, huge rows, non-UTF-8), every verifier (arbitrary
strings), every advantage estimator and policy loss (random groups, equal rewards, groups
of one, NaN/inf rewards).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollwise.algos import AdvantageInputs, advantage_estimators, policy_losses
from rollwise.algos.advantages import call_estimator
from rollwise.compose.config import Config, ConfigError, flatten, load_config, validate_config
from rollwise.compose.preflight import check_config
from rollwise.rewards import VERIFIERS
from rollwise.tasks import DatasetError, load_samples, make_task
from rollwise.types import Sample

FAST, SLOW = 100, 1000


def twins(strategies: dict, body):
    """(fast test, slow test) running `body` on `strategies` with 100 / 1,000 examples."""
    def make(n: int):
        @settings(max_examples=n, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(**strategies)
        def test(**kw):
            body(**kw)
        return test
    return make(FAST), pytest.mark.slow(make(SLOW))


# -- the config loader -------------------------------------------------------------------

KEYS = sorted(k for k in flatten(Config().model_dump()))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)
value_text = st.one_of(st.text(max_size=30), values.map(lambda v: json.dumps(v)),
                       st.sampled_from(["1e400", "-0", "[1,", "{a=1}", "'x'", "true", "nan",
                                        "inf", '"../x"', "{ correct = 1.0 }"]))
key_text = st.one_of(st.sampled_from(KEYS), st.text(max_size=20),
                     st.sampled_from(KEYS).map(lambda k: k[:-1]))


def _config_or_error(call) -> None:
    try:
        cfg = call()
    except ConfigError:
        return
    assert isinstance(cfg, Config)
    try:
        check_config(cfg)
    except ConfigError:
        pass


def _set_values(pairs):
    _config_or_error(lambda: load_config(None, [f"{k}={v}" for k, v in pairs]))


def _toml_text(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.toml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        _config_or_error(lambda: load_config(path))


def _raw_tree(tree):
    _config_or_error(lambda: validate_config(tree))


sections = st.dictionaries(st.sampled_from(["run", "model", "task", "rollout", "algorithm",
                                            "learner", "eval", "control", "health", "x"]),
                           st.dictionaries(st.sampled_from(sorted({k.split(".")[1] for k in KEYS
                                                                   if "." in k})),
                                           values, max_size=4), max_size=4)

test_config_set_values, test_config_set_values_slow = twins(
    {"pairs": st.lists(st.tuples(key_text, value_text), max_size=4)}, _set_values)
test_config_toml_text, test_config_toml_text_slow = twins(
    {"text": st.one_of(st.text(max_size=200), st.sampled_from(
        ["[run]\nname = 3", "[rollout]\ntemperature = 'hot'", "run = 1", "[[run]]",
         "[eval]\nmax_tokens = -5"]))}, _toml_text)
test_config_raw_tree, test_config_raw_tree_slow = twins({"tree": sections}, _raw_tree)


# -- the dataset readers -----------------------------------------------------------------

def _read(path: Path) -> None:
    try:
        samples = load_samples(path)
    except DatasetError as e:
        assert str(path) in str(e)  # names the file (and the line, for JSONL rows)
        return
    assert samples and all(isinstance(s.answer, str) for s in samples)


def _jsonl_bytes(data: bytes):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.jsonl"
        path.write_bytes(data)
        _read(path)


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(),
                                     st.floats(), st.text(max_size=30)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=6), inner,
                                                                   max_size=3)), max_leaves=6)
rows = st.one_of(
    json_values,
    st.fixed_dictionaries({"prompt": json_values, "answer": json_values}),
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=50),
                           "answer": st.integers() | st.text(max_size=10)}),
    st.fixed_dictionaries({"prompt": st.just("x" * 200_000), "answer": st.just("1")}),
    st.fixed_dictionaries({"prompt": st.lists(st.fixed_dictionaries(
        {"role": st.text(max_size=8), "content": st.text(max_size=20)}), max_size=3),
        "answer": st.just("2")}))


def _jsonl_rows(rows):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
        _read(path)


def _parquet_bytes(data: bytes):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.parquet"
        path.write_bytes(data)
        _read(path)


test_dataset_jsonl_bytes, test_dataset_jsonl_bytes_slow = twins(
    {"data": st.one_of(st.binary(max_size=300), st.just(b'{"prompt": "a", "answer": 1}\n\xff'),
                       st.just(b"[" * 100_000))}, _jsonl_bytes)
test_dataset_jsonl_rows, test_dataset_jsonl_rows_slow = twins(
    {"rows": st.lists(rows, max_size=5)}, _jsonl_rows)
test_dataset_parquet_bytes, test_dataset_parquet_bytes_slow = twins(
    {"data": st.binary(max_size=300).map(lambda b: b"PAR1" + b + b"PAR1")}, _parquet_bytes)


# -- verifiers ---------------------------------------------------------------------------

TASK_VERIFIERS = {name: make_task(name, num_train=4, num_eval=2) for name in
                  ("arith", "arith_chain", "countdown")}
SAMPLES = {name: task.train[0] for name, task in TASK_VERIFIERS.items()}
SAMPLES["plain"] = Sample("p/0", "1+1=", "2")


def _verifiers(text, which, sample_name):
    fn = (VERIFIERS[which] if which in VERIFIERS else TASK_VERIFIERS[which].verifier)
    sample = SAMPLES[which] if which in SAMPLES else SAMPLES[sample_name]
    if which == "countdown":
        sample = SAMPLES["countdown"]
    score = fn(text, sample)
    assert isinstance(score, (int, float)) and math.isfinite(score) and 0.0 <= score <= 1.0


test_verifiers, test_verifiers_slow = twins(
    {"text": st.one_of(st.text(max_size=80), st.text(alphabet="0123456789+-*/=()# .,\n",
                                                     max_size=60),
                       st.sampled_from(["#### 4", "\\boxed{2}", "(((((", "1e999", "9" * 5000])),
     "which": st.sampled_from(sorted(VERIFIERS) + sorted(TASK_VERIFIERS)),
     "sample_name": st.sampled_from(["plain", "arith"])}, _verifiers)


# -- advantage estimators and losses -----------------------------------------------------

reward_values = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-10, 10),
                          st.sampled_from([math.nan, math.inf, -math.inf]))


@st.composite
def batches(draw):
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    n = sum(sizes)
    equal = draw(st.booleans())
    rewards = ([draw(reward_values)] * n if equal else
               draw(st.lists(reward_values, min_size=n, max_size=n)))
    group_ids = [g for g, size in enumerate(sizes) for _ in range(size)]
    t = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(0, t), min_size=n, max_size=n))
    return torch.tensor(rewards), torch.tensor(group_ids), t, torch.tensor(lengths)


def _estimators(batch, name):
    rewards, group_ids, t, lengths = batch
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    gen = torch.Generator().manual_seed(int(lengths.sum()) + t)
    n = rewards.shape[0]
    inputs = AdvantageInputs(mask=mask, lengths=lengths.float(),
                             token_rewards=torch.zeros_like(mask),
                             logprobs=-torch.rand(n, t, generator=gen) * 5 * mask,
                             input_ids=torch.randint(0, 4, (n, t), generator=gen),
                             ref_values=torch.rand(n, generator=gen))
    try:
        adv, _ = call_estimator(advantage_estimators[name], rewards, group_ids, inputs)
    except ValueError as e:
        assert str(e)  # a clear error, e.g. non-finite rewards named
        return
    assert torch.isfinite(adv).all(), (name, rewards, adv)
    assert adv.shape[0] == rewards.shape[0]


def _losses(batch, name, scale):
    rewards, _, t, lengths = batch
    n = rewards.shape[0]
    gen = torch.Generator().manual_seed(int(lengths.sum()))
    logprobs = (-torch.rand(n, t, generator=gen) * scale).requires_grad_()
    old = -torch.rand(n, t, generator=gen) * scale
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    adv = torch.nan_to_num(rewards, nan=0.0, posinf=5.0, neginf=-5.0)
    loss, metrics = policy_losses[name](logprobs, old, adv, mask)
    assert torch.isfinite(loss), (name, loss)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))


test_advantage_estimators, test_advantage_estimators_slow = twins(
    {"batch": batches(), "name": st.sampled_from(sorted(advantage_estimators))}, _estimators)
test_policy_losses, test_policy_losses_slow = twins(
    {"batch": batches(), "name": st.sampled_from(sorted(policy_losses)),
     "scale": st.sampled_from([0.1, 3.0, 60.0])}, _losses)


# -- what the fuzzers found, kept as named regressions -----------------------------------

def test_final_number_of_a_number_past_the_int_string_limit_is_0_not_an_error():
    """Found by test_verifiers: a 5,000-digit completion raised ValueError (Python's
    4,300-digit limit on int(str)), counted as a reward error instead of a wrong answer."""
    assert VERIFIERS["final_number"]("#### " + "9" * 5000, SAMPLES["plain"]) == 0.0


def test_non_finite_rewards_are_a_clear_error_not_nan_advantages():
    """Found by test_advantage_estimators: a NaN reward gave NaN advantages for its group."""
    with pytest.raises(ValueError, match=r"non-finite rewards at rows \[1\]"):
        call_estimator(advantage_estimators["grpo"], torch.tensor([1.0, math.nan]),
                       torch.tensor([0, 0]), {})
