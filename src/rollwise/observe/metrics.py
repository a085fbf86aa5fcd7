"""Metrics as JSON lines: one record per training step (or evaluation) in `metrics.jsonl`.

Each line is flushed as it is written, so a crash loses at most the line being written;
`read_metrics` skips such a truncated final line, and a `MetricsWriter` reopening the file
(a resumed run) cuts it off before appending. `flatten` and `task_table` read the nested
values a record or a summary holds.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def _metrics_path(path: str | Path) -> Path:
    """`path` itself if it names a file, else `path / metrics.jsonl` (a run directory)."""
    p = Path(path)
    return p / METRICS_FILE if p.is_dir() or not p.suffix else p


def to_jsonable(value: Any) -> Any:
    """Convert a metric value to plain JSON types.

    numpy/torch scalars become Python numbers (via `.item()`), arrays and tuples lists,
    dict keys strings; anything else unknown is written as its `str`, so logging never
    crashes a run.

    >>> to_jsonable({"a": (1, 2.5), 3: "x"})
    {'a': [1, 2.5], '3': 'x'}
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if hasattr(value, "item"):
        try:
            return to_jsonable(value.item())
        except (ValueError, RuntimeError):  # more than one element
            pass
    if hasattr(value, "tolist"):
        return to_jsonable(value.tolist())
    if isinstance(value, Path):
        return str(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


class MetricsWriter:
    """Append metric records to a JSONL file, one flushed line per `write`.

    `path` is the file, or a run directory (then `path/metrics.jsonl` is used).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = _metrics_path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _cut_partial_last_line(self.path)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` as one JSON line and sync it to disk."""
        line = json.dumps(to_jsonable(record), ensure_ascii=False)
        self._file.write(line + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())  # on disk before the checkpoint that follows it

    def drop_after(self, step: int) -> int:
        """Remove records whose `step` is > `step` (resume from a checkpoint); return the count."""
        self._file.close()
        records = read_metrics(self.path)
        kept = [r for r in records if not _step_after(r, step)]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        return len(records) - len(kept)

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._file.close()

    def __repr__(self) -> str:
        return f"MetricsWriter({str(self.path)!r})"


def _step_after(record: dict[str, Any], step: int) -> bool:
    s = record.get("step")
    return isinstance(s, (int, float)) and s > step


def _cut_partial_last_line(path: Path) -> None:
    """Truncate a final line without its newline (a crash mid-write) so appends stay valid."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1  # 0 when the whole file is one partial line
    with path.open("r+b") as f:
        f.truncate(cut)


def read_metrics(path: str | Path, strict: bool = True) -> list[dict[str, Any]]:
    """All records of a metrics file (or of `run_dir/metrics.jsonl`); [] if it does not exist.

    A truncated or unparsable *final* line is skipped (a crash mid-write); a bad line
    elsewhere raises ValueError naming the file and line, or is skipped when not `strict`.
    """
    p = _metrics_path(path)
    if not p.exists():
        return []
    lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1 or not strict:
                continue
            raise ValueError(f"{p}:{i + 1}: not a JSON line ({e.msg}): {line[:80]!r}") from e
        if isinstance(record, dict):
            records.append(record)
    return records


def number(record: dict[str, Any], key: str) -> float | None:
    """`record[key]` if it is a real number (not a bool), else None."""
    v = record.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict to dotted keys over its non-dict leaves.

    >>> flatten({"eval_after": {"accuracy": 0.5}, "steps": 3})
    {'eval_after.accuracy': 0.5, 'steps': 3}
    """
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def task_table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows {task, n, pass@1, mean@1, ...} from an evaluation result's ``task/...`` keys
    (one row, "all", when there is a single task).

    >>> task_table({"task/a/n": 2.0, "task/a/pass@1": 0.5, "accuracy": 0.5})
    [{'task': 'a', 'n': 2.0, 'pass@1': 0.5}]
    """
    rows: dict[str, dict[str, Any]] = {}
    for key, value in result.items():
        if key.startswith("task/"):
            label, _, metric = key[5:].rpartition("/")
            rows.setdefault(label, {"task": label})[metric] = value
    if not rows:
        row = {"task": "all", "n": result.get("num_prompts"), "pass@1": result.get("accuracy"),
               "mean@1": result.get("mean_score")}
        row |= {k: v for k, v in result.items() if k.startswith(("pass@", "mean@"))}
        return [row]
    return list(rows.values())


def _percentile(sorted_values: list[int], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of an ascending list."""
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize_lengths(lengths: list[int]) -> dict[str, float]:
    """p50, p90, max and mean of response lengths (all 0 for an empty list).

    >>> summarize_lengths([10, 20, 30, 40, 100])
    {'p50': 30.0, 'p90': 76.0, 'max': 100, 'mean': 40.0}
    """
    if not lengths:
        return {"p50": 0.0, "p90": 0.0, "max": 0, "mean": 0.0}
    s = sorted(lengths)
    return {
        "p50": float(_percentile(s, 0.5)),
        "p90": float(_percentile(s, 0.9)),
        "max": s[-1],
        "mean": sum(s) / len(s),
    }
