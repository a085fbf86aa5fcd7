r"""reasoning-gym tasks: the procedural datasets of the `reasoning-gym` package (pinned 0.1.25).

``task.name = "reasoning_gym"`` with ``task.options = { dataset = "chain_sum", min_terms = 2,
max_terms = 2 }``: every option besides `dataset`, `datasets` and `instruction` is a field of
the dataset's own config class and passes through unchanged (an unknown field is an error
naming the accepted ones). A weighted mixture uses the package's `composite` dataset:
``options = { datasets = { chain_sum = { weight = 2, max_terms = 3 }, leg_counting = {} } }``
(a sub-table holds that dataset's `weight`, default 1, and its config fields).

Splits. Items come from ``create_dataset(name, size=, seed=run seed)`` by index, which is
deterministic. Each item is on exactly one side of a partition decided by a seeded hash of its
question text (the same partition as the built-in tasks, `tasks.base.in_eval_side`): eval keeps
the first `num_eval` eval-side items of the index sequence, train the first `num_train`
train-side ones, so no question is in both even when the generator repeats itself.

Prompt: the question, then `instruction` (default: put the final answer after ``####``).
Verifier: the answer is the text inside the last ``<answer>...</answer>`` or, failing that,
the first line after the last ``####``; it is scored by the dataset's own ``score_answer``
(``reasoning_gym.get_score_answer_fn`` of the item's source dataset), a float in [0, 1] where
some datasets give partial credit (kept in ``Trajectory.scores``; accuracy counts 1.0 only).
A completion without either marker scores 0. ``Sample.meta`` holds the item's metadata and
``Sample.meta["rg_entry"]`` the item as reasoning-gym gave it (what ``score_answer`` reads).
"""

from __future__ import annotations

import dataclasses
import re
from functools import cache
from typing import Any

from rollwise.tasks.base import (
    DEFAULT_SETUP,
    EVAL_FRACTION,
    Task,
    TaskSetup,
    as_prompt,
    in_eval_side,
)
from rollwise.types import Sample

RG_VERSION = "0.1.25"  # the version these adapters are written and tested against
DEFAULT_INSTRUCTION = "Give only the final answer."
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")
_EXTRACT = ("marked", "last_number")
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_MAX_SCAN_FACTOR = 50  # indices scanned per wanted item before the split gives up


def available_datasets() -> list[str]:
    """Names `create_dataset` accepts (the package's registry), sorted."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _config_fields(name: str) -> list[str]:
    from reasoning_gym.factory import DATASETS

    _, config_cls = DATASETS[name]
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]


def _check_name(name: object) -> str:
    from rollwise.registry import unknown_name_error

    names = available_datasets()
    if not isinstance(name, str) or name not in names:
        raise unknown_name_error("reasoning-gym dataset", str(name), names)
    return name


def _check_config(name: str, config: dict[str, Any]) -> dict[str, Any]:
    fields = _config_fields(name)
    for key in config:
        if key not in fields:
            raise ValueError(
                f"option {key!r} is not a field of reasoning-gym dataset {name!r}'s config; "
                f"accepted: {', '.join(fields)}"
            )
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


def make_rg_dataset(seed: int, size: int, dataset: str | None,
                    datasets: dict[str, dict[str, Any]] | None, config: dict[str, Any]):
    """The reasoning-gym dataset object: one named dataset, or `composite` over `datasets`.
    The package checks its configs with `assert`; a failed check becomes a ValueError."""
    try:
        return _make_rg_dataset(seed, size, dataset, datasets, config)
    except (AssertionError, TypeError) as err:
        label = dataset or f"mixture of {', '.join(datasets or {})}"
        raise ValueError(f"task reasoning_gym ({label}): invalid dataset config: "
                         f"{err or type(err).__name__}") from None


def _make_rg_dataset(seed: int, size: int, dataset: str | None,
                     datasets: dict[str, dict[str, Any]] | None, config: dict[str, Any]):
    from reasoning_gym import create_dataset

    if (dataset is None) == (datasets is None):
        raise ValueError("task reasoning_gym: give exactly one of options.dataset = \"<name>\" "
                         "or options.datasets = { <name> = { weight = 1.0, ... }, ... }; "
                         f"available datasets: {', '.join(available_datasets())}")
    if dataset is not None:
        name = _check_name(dataset)
        return create_dataset(name, size=size, seed=seed, **_check_config(name, config))
    if config:
        raise ValueError(f"task reasoning_gym with options.datasets: put dataset config fields "
                         f"inside each dataset's table, not at the top ({sorted(config)})")
    if not isinstance(datasets, dict) or not datasets:
        raise ValueError("option datasets: expected a non-empty table { name = { weight = .. } }")
    from reasoning_gym.composite import CompositeConfig, DatasetSpec

    specs = []
    for name, table in datasets.items():
        table = dict(table or {})
        weight = table.pop("weight", 1.0)
        if not isinstance(weight, (int, float)) or weight <= 0:
            raise ValueError(f"option datasets.{name}.weight={weight!r}: expected a number > 0")
        specs.append(DatasetSpec(_check_name(name), float(weight), _check_config(name, table)))
    return _composite(CompositeConfig(size=size, seed=seed, datasets=specs))


def _composite(config):
    from reasoning_gym.composite import CompositeDataset

    config.validate()
    return CompositeDataset(config)


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_rg_answer(completion: str, extract: str = "marked") -> str | None:
    r"""The model's answer: inside the last <answer> tags, else the first line after the last
    '####', else the whole completion (stripped).

    >>> extract_rg_answer("2 + 3 = 5\n#### 5\nmore"), extract_rg_answer("<answer> 7 </answer>")
    ('5', '7')
    >>> extract_rg_answer(" 5\n")
    '5'
    """
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return tags[-1].strip()
    _, sep, tail = completion.rpartition("####")
    if not sep:
        return _last_number(completion) if extract == "last_number" else completion.strip()
    lines = tail.strip().splitlines()
    return lines[0].strip() if lines else ""


@cache
def _score_fn(name: str):
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(name)


def rg_verifier(completion: str, sample: Sample) -> float:
    """The source dataset's own `score_answer` on the extracted answer (0 without one).

    >>> s = rg_samples(TaskSetup(seed=0, num_train=1, num_eval=1), "chain_sum", None, {})[1][0]
    >>> rg_verifier("#### " + s.answer, s), rg_verifier(s.answer, s), rg_verifier("no", s)
    (1.0, 1.0, 0.0)
    """
    entry = sample.meta["rg_entry"]
    answer = extract_rg_answer(completion, sample.meta.get("rg_extract", "marked"))
    if answer is None:
        return 0.0
    return float(_score_fn(entry["metadata"]["source_dataset"])(answer, entry))


def rg_samples(setup: TaskSetup, dataset: str | None, datasets: dict | None,
               config: dict[str, Any], instruction: str = DEFAULT_INSTRUCTION,
               extract: str = "marked") -> tuple[list[Sample], list[Sample]]:
    """(train, eval) samples; see the module docstring for the split."""
    want = {"eval": setup.num_eval, "train": setup.num_train}
    limit = max(_MAX_SCAN_FACTOR * (want["eval"] + want["train"]), 10_000)
    ds = make_rg_dataset(setup.seed, limit, dataset, datasets, config)
    out: dict[str, list[Sample]] = {"eval": [], "train": []}
    label = dataset or "mix"
    idx = 0
    while len(out["eval"]) < want["eval"] or len(out["train"]) < want["train"]:
        if idx >= limit:
            raise ValueError(
                f"task reasoning_gym ({label}): cannot draw {want['train']} train and "
                f"{want['eval']} eval questions from {limit} items for seed {setup.seed} "
                f"(found {len(out['train'])} and {len(out['eval'])}); widen the dataset config")
        entry = ds[idx]
        idx += 1
        question = str(entry["question"]).strip()
        side = "eval" if in_eval_side(question, setup.seed, EVAL_FRACTION) else "train"
        if len(out[side]) >= want[side]:
            continue
        text = f"{question}\n{instruction}" if instruction else question
        meta = dict(entry.get("metadata") or {})
        meta["rg_extract"] = extract
        meta["rg_entry"] = {"question": entry["question"], "answer": entry["answer"],
                            "metadata": entry.get("metadata") or {}}
        out[side].append(Sample(id=f"reasoning_gym/{side}/{len(out[side])}",
                                prompt=as_prompt(text, setup.chat), answer=str(entry["answer"]),
                                reference=None, meta=meta))
    return out["train"], out["eval"]


def build_reasoning_gym(
    setup: TaskSetup = DEFAULT_SETUP,
    *,
    dataset: str | None = None,
    datasets: dict[str, dict[str, Any]] | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
    extract: str = "marked",
    **config: Any,
) -> Task:
    """A reasoning-gym dataset (or a weighted mixture) as a task; see the module docstring.

    >>> task = build_reasoning_gym(TaskSetup(seed=0, num_train=3, num_eval=2),
    ...                            dataset="chain_sum", min_terms=2, max_terms=2, max_digits=1)
    >>> len(task.train), len(task.eval), task.train[0].id
    (3, 2, 'reasoning_gym/train/0')
    """
    if extract not in _EXTRACT:
        raise ValueError(f"option extract={extract!r}: expected one of {', '.join(_EXTRACT)}")
    train, eval_ = rg_samples(setup, dataset, datasets, config, instruction, extract)
    return Task("reasoning_gym", train, eval_, rg_verifier)
