"""The `file` task: samples loaded from a JSONL file, a Parquet file, or a `datasets` directory.

The format follows the path: ``*.jsonl`` (one JSON object a line, blank lines skipped),
``*.parquet``, or a directory written by ``datasets.Dataset.save_to_disk`` (for a
``DatasetDict``, option `split` picks the part, default "train"). Each row needs a prompt
(`prompt_key`: a string, or a list of ``{"role", "content"}`` chat messages) and an answer
(`answer_key`: a string or a number); other columns go into `Sample.meta`.

A string prompt becomes one user message when chat=True; a chat-message prompt is kept as it
is either way. Without `eval_path`, a seeded shuffle puts `num_eval` rows in eval and up to
`num_train` of the rest in train (`num_train` caps the train set). With `eval_path`, eval is
the first `num_eval` rows of that file and train up to `num_train` rows of `path`, shuffled.
Train rows whose prompt text also appears in eval are dropped, so the splits are disjoint.

Malformed data raises `DatasetError` naming the file and the place: ``data.jsonl:7: missing
key 'answer' (keys present: prompt, question)`` for JSONL (1-based line numbers), ``path: row
12: ...`` for Parquet and `datasets` (0-based row index).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollwise.rewards.verifiers import get_verifier
from rollwise.tasks.base import DEFAULT_SETUP, Task, TaskSetup, as_prompt
from rollwise.tasks.base import prompt_key as prompt_text
from rollwise.types import Prompt, Sample


class DatasetError(ValueError):
    """A data file that cannot be read as task samples; the message names file and place."""


def _check_row(row: Any, prompt_col: str, answer_col: str) -> tuple[Prompt, str]:
    """(prompt, answer) of one row, or TypeError / ValueError saying what is wrong with it."""
    if not isinstance(row, dict):
        raise TypeError(f"expected a JSON object, got {type(row).__name__}")
    for key in (prompt_col, answer_col):
        if key not in row:
            raise ValueError(f"missing key {key!r} (keys present: {', '.join(map(str, row))})")
    prompt, answer = row[prompt_col], row[answer_col]
    messages_ok = isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in prompt
    )
    if not (isinstance(prompt, str) and prompt) and not messages_ok:
        raise TypeError(
            f"{prompt_col!r} must be a non-empty string or a list of "
            f"{{'role': str, 'content': str}} messages, got {_describe(prompt)}"
        )
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TypeError(f"{answer_col!r} must be a string or a number, got {_describe(answer)}")
    return prompt, str(answer)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(place, row) for each non-blank line; place is "path:line"."""
    with path.open("rb") as handle:  # bytes: a bad UTF-8 sequence is named by its line
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DatasetError(f"{path}:{number}: not UTF-8 text (byte {err.start}: "
                                   f"{raw[err.start:err.start + 1]!r})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}:{number}: invalid JSON: {err.msg}") from None
            except RecursionError:
                raise DatasetError(f"{path}:{number}: JSON nested too deeply") from None
            yield f"{path}:{number}", row


def _table_rows(path: Path, split: str, columns: list[str]) -> Iterator[tuple[str, Any]]:
    """(place, row) for a Parquet file or a saved `datasets` directory; place is "path: row i"."""
    if path.is_dir():
        import datasets  # lazy: optional dependency, slow import

        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise DatasetError(f"{path}: no split {split!r} (splits: {', '.join(data)})")
            data = data[split]
        present = list(data.column_names)
        rows: Iterator[Any] = iter(data)
    else:
        import pyarrow.parquet as pq  # lazy: optional dependency

        table = pq.read_table(path)
        present = list(table.column_names)
        rows = iter(table.to_pylist())
    missing = [column for column in columns if column not in present]
    if missing:
        raise DatasetError(f"{path}: no column {missing[0]!r} (columns: {', '.join(present)})")
    for index, row in enumerate(rows):
        yield f"{path}: row {index}", row


def _guarded(rows: Iterator[tuple[str, Any]], path: Path) -> Iterator[tuple[str, Any]]:
    """Rows of a table reader, whose library errors on a damaged file (pyarrow's, datasets')
    become one DatasetError naming the file."""
    try:
        yield from rows
    except DatasetError:
        raise
    except Exception as err:  # noqa: BLE001 - the readers raise many kinds
        raise DatasetError(f"{path}: cannot be read as a table ({type(err).__name__}: "
                           f"{str(err)[:200]})") from None


def load_samples(
    path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer",
    split: str = "train", chat: bool = False, name: str = "file",
) -> list[Sample]:
    """All rows of a JSONL / Parquet / `datasets` file as samples (id "name/row/i").

    Raises DatasetError for a missing or unreadable file and for each malformed row.
    """
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory")
    if path.is_dir() or path.suffix == ".parquet":
        rows = _guarded(_table_rows(path, split, [prompt_key, answer_key]), path)
    elif path.suffix == ".jsonl":
        rows = _jsonl_rows(path)
    else:
        raise DatasetError(
            f"{path}: unknown data format {path.suffix!r}; accepted: a .jsonl file, "
            "a .parquet file, or a directory saved with datasets' save_to_disk"
        )
    samples = []
    for place, row in rows:
        try:
            prompt, answer = _check_row(row, prompt_key, answer_key)
        except (TypeError, ValueError) as err:
            raise DatasetError(f"{place}: {err}") from None
        meta = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
        if isinstance(prompt, str):
            prompt = as_prompt(prompt, chat)
        reference = meta.get("reference") if isinstance(meta.get("reference"), str) else None
        samples.append(Sample(f"{name}/row/{len(samples)}", prompt, answer, reference, meta))
    if not samples:
        raise DatasetError(f"{path}: holds no rows")
    return samples


def build_file(
    setup: TaskSetup = DEFAULT_SETUP,
    *,
    path: str | None = None,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    eval_path: str | None = None,
    verifier: str = "final_number",
    split: str = "train",
) -> Task:
    """A task from a data file; see the module docstring for formats and the split."""
    seed, num_train, num_eval, chat = setup.seed, setup.num_train, setup.num_eval, setup.chat
    if path is None:
        raise ValueError("task 'file' needs path=... (a .jsonl, .parquet or datasets directory)")
    verify = get_verifier(verifier)
    keys = {"prompt_key": prompt_key, "answer_key": answer_key, "split": split, "chat": chat}
    rows = load_samples(path, **keys)
    random.Random(f"file:{seed}").shuffle(rows)
    if eval_path is not None:
        eval_rows = load_samples(eval_path, **keys)[:num_eval]
    else:
        if len(rows) <= num_eval:
            raise DatasetError(
                f"{path}: has {len(rows)} rows, too few to hold out num_eval={num_eval} "
                "and train on the rest; lower num_eval or pass eval_path=..."
            )
        eval_rows, rows = rows[:num_eval], rows[num_eval:]
    held_out = {prompt_text(s.prompt) for s in eval_rows}
    train = [s for s in rows if prompt_text(s.prompt) not in held_out][:num_train]
    for split_name, samples in (("train", train), ("eval", eval_rows)):
        for index, sample in enumerate(samples):
            sample.id = f"file/{split_name}/{index}"
    return Task("file", train, eval_rows, verify)
