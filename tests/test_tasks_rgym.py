"""reasoning-gym tasks: pass-through config, mixtures, seeded disjoint splits, the package's
own score_answer as the verifier, clear errors."""

from __future__ import annotations

import pytest

from rollwise.rewards import RewardPool, RewardSpec
from rollwise.tasks import make_task
from rollwise.types import Sample, Trajectory

pytest.importorskip("reasoning_gym")


def _rg(seed=0, num_train=300, num_eval=60, **options):
    return make_task("reasoning_gym", seed=seed, num_train=num_train, num_eval=num_eval,
                     chat=True, **options)


def test_config_fields_pass_through_and_split_is_disjoint_and_seeded() -> None:
    task = _rg(dataset="chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    assert len(task.train) == 300 and len(task.eval) == 60
    for s in task.train + task.eval:
        entry = s.meta["rg_entry"]
        assert entry["metadata"]["num_terms"] == 2  # the config field reached the generator
        a, op, b = entry["metadata"]["expression"].split()
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9 and op in "+-"
        assert int(s.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    # 1-digit two-term sums: only 200 distinct questions, so the generator repeats itself and
    # only the text partition keeps the splits apart
    train_q = {s.prompt[0]["content"] for s in task.train}
    eval_q = {s.prompt[0]["content"] for s in task.eval}
    assert not train_q & eval_q
    again = _rg(dataset="chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    assert [s.prompt for s in again.train] == [s.prompt for s in task.train]
    assert [s.prompt for s in again.eval] == [s.prompt for s in task.eval]
    other = _rg(seed=1, dataset="chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    assert [s.prompt for s in other.train] != [s.prompt for s in task.train]
    # a smaller split is a prefix of a larger one (eval unchanged by more train)
    more = _rg(num_train=400, dataset="chain_sum", min_terms=2, max_terms=2, min_digits=1,
               max_digits=1)
    assert [s.prompt for s in more.eval] == [s.prompt for s in task.eval]
    assert [s.prompt for s in more.train[:300]] == [s.prompt for s in task.train]


def test_verifier_is_score_answer_with_partial_credit() -> None:
    task = _rg(num_train=5, num_eval=5, dataset="number_sorting", min_numbers=3, max_numbers=3)
    s = task.eval[0]
    gold = s.answer
    assert task.verifier(f"<answer>{gold}</answer>", s) == 1.0
    assert task.verifier(f"blah\n#### {gold}", s) == 1.0
    assert task.verifier("#### []", s) == 0.0
    # the package's own scorer, on the same extracted answer
    from reasoning_gym import get_score_answer_fn

    score = get_score_answer_fn("number_sorting")
    assert task.verifier("<answer>['1']</answer>", s) == score("['1']", s.meta["rg_entry"])
    # the base class's partial credit: the gold answer inside a longer answer scores
    # len(gold) / len(answer), kept as a float in (0, 1)
    cs = _rg(num_train=2, num_eval=2, dataset="chain_sum").eval[0]
    partial = task.verifier(f"#### {cs.answer} ok", cs)
    assert partial == pytest.approx(len(cs.answer) / len(f"{cs.answer} ok"))


def test_last_number_extraction_and_pool_records_partial_credit() -> None:
    task = _rg(num_train=2, num_eval=4, dataset="chain_sum", min_terms=2, max_terms=2,
               extract="last_number")
    s = task.eval[0]
    texts = [f"so it is {s.answer}.", "no number here", f"#### {s.answer} ok", "7 + 1 = 8 no 99"]
    trajs = [Trajectory(s, [], [], [], [], "stop", text=t) for t in texts]
    with RewardPool([RewardSpec("correct", task.verifier)], timeout_s=10, num_workers=1) as pool:
        pool.score(trajs)
    rewards = [t.scores["correct"] for t in trajs]
    assert rewards[0] == 1.0 and rewards[1] == 0.0
    assert 0.0 < rewards[2] < 1.0  # partial credit crosses the worker pipe as a float
    assert rewards[3] == float(s.answer == "99")


def test_weighted_mixture_uses_composite() -> None:
    task = _rg(num_train=400, num_eval=10, datasets={
        "chain_sum": {"weight": 3, "max_terms": 2},
        "leg_counting": {"weight": 1, "min_animals": 1, "max_animals": 2},
    })
    sources = [s.meta["source_dataset"] for s in task.train]
    share = sources.count("chain_sum") / len(sources)
    # 400 draws of a 3:1 mixture: share 0.75, sd 0.022; 5 sd either side
    assert 0.64 < share < 0.86 and set(sources) == {"chain_sum", "leg_counting"}
    for s in task.train[:50]:  # each item is scored by its own dataset's scorer
        assert task.verifier(f"#### {s.answer}", s) == 1.0


@pytest.mark.parametrize("options, expected", [
    ({"dataset": "arithmetic"}, "unknown reasoning-gym dataset 'arithmetic'"),
    ({"dataset": "chain_sum", "max_term": 2}, "accepted: min_terms, max_terms"),
    ({}, "give exactly one of options.dataset"),
    ({"datasets": {"chain_sum": {"weight": 0}}}, "weight=0"),
    ({"dataset": "chain_sum", "extract": "first"}, "option extract='first'"),
    ({"dataset": "leg_counting", "max_animals": 1}, "max_animals must be >= min_animals"),
])
def test_bad_options_are_clear(options, expected) -> None:
    with pytest.raises(ValueError, match=None) as err:
        _rg(num_train=2, num_eval=2, **options)
    assert expected in str(err.value)
    if "unknown reasoning-gym dataset" in expected:
        assert "chain_sum" in str(err.value) and "leg_counting" in str(err.value)


def test_plain_prompts_for_the_tiny_model() -> None:
    task = make_task("reasoning_gym", seed=0, num_train=2, num_eval=2, chat=False,
                     dataset="leg_counting", instruction="")
    assert isinstance(task.train[0].prompt, str) and task.train[0].prompt.endswith("?")
    assert isinstance(task.train[0], Sample)
