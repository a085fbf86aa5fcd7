"""The run report: one self-contained `report.html` (inline CSS, plots as base64 PNG).

Inputs, all inside the run directory and all optional except that an empty page is dull:
`metrics.jsonl` (records with "kind": "train" — the default when "kind" is absent — or
"eval"), `summary.json`, `config.toml` and `trajectories.sqlite`. A missing file or key
omits what depends on it; nothing in the inputs can make the report fail.

Metric keys read: step, wall_time (seconds since training start), reward_mean,
reward_terms and reward_term_errors ({term: value} tables), eval_accuracy, pass_at_k (a
number, or {k: value}), rollouts, response_len_{p50,p90,max,mean}, time_rollout,
time_reward, time_train, time_other.
"""

from __future__ import annotations

import json
import sqlite3
from html import escape
from pathlib import Path
from typing import Any

from rollwise.observe import html, plots
from rollwise.observe.completions import completions_section
from rollwise.observe.metrics import METRICS_FILE, flatten, number, read_metrics, task_table
from rollwise.replay import TrajectoryStore
from rollwise.system.atomic import atomic_write_text

TIME_KEYS = ("time_rollout", "time_reward", "time_train", "time_other")
LENGTH_KEYS = ("response_len_p50", "response_len_p90", "response_len_max", "response_len_mean")
STORE_FILE = "trajectories.sqlite"


def write_report(run_dir: Path) -> Path:
    """Write `run_dir/report.html` from what the run directory holds; return its path."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / METRICS_FILE, strict=False)
    train = [r for r in records if r.get("kind", "train") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    summary = _load_json(run_dir / "summary.json")
    name = _run_name(run_dir, summary)

    body = [_header(name, summary, train)]
    figures = run_figures(run_dir, train, evals)
    if figures:
        body.append('<h2>Plots</h2><div class="figures">')
        body.extend(html.figure(png, caption) for caption, png in figures)
        body.append("</div>")
    evaluated = [(k, summary[k]) for k in ("eval_before", "eval_after")
                 if isinstance(summary.get(k), dict)]
    if evaluated:
        rows = [{"when": k.removeprefix("eval_"), **row} for k, result in evaluated
                for row in task_table(result)]
        body.append("<h2>Evaluation (pass@1 greedy, mean@k, unbiased pass@k, by task)</h2>"
                    f"{html.table(rows)}")
    body.append(_terms_table(train))
    body.append(completions_section(run_dir / STORE_FILE))
    if train:
        last = {k: v for k, v in train[-1].items() if number(train[-1], k) is not None}
        body.append(f"<h2>Last training step</h2>{html.kv_table(last)}")
    config = run_dir / "config.toml"
    if config.is_file():
        text = config.read_text(encoding="utf-8", errors="replace")
        body.append(f"<h2>Config</h2><pre>{escape(text)}</pre>")

    out = run_dir / "report.html"
    atomic_write_text(out, html.page(f"rollwise run {name}", "\n".join(body)))
    return out


def _load_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _run_name(run_dir: Path, summary: dict[str, Any]) -> str:
    for key in ("run_name", "name"):
        if isinstance(summary.get(key), str):
            return summary[key]
    return run_dir.resolve().name


def _header(name: str, summary: dict[str, Any], train: list[dict[str, Any]]) -> str:
    """Title, the headline figures, and every summary value."""
    flat = flatten(summary)
    headline = []
    before, after = number(flat, "eval_before.accuracy"), number(flat, "eval_after.accuracy")
    if before is not None or after is not None:
        b = "?" if before is None else html.fmt_value(before)
        a = "?" if after is None else html.fmt_value(after)
        headline.append(f"accuracy {b} &rarr; {a}")
    secs = number(flat, "train_seconds")
    if secs is not None:
        headline.append(f"train {html.fmt_value(float(secs))} s")
    steps = number(flat, "steps")
    if steps is None:
        steps = max((number(r, "step") or 0 for r in train), default=None)
    if steps is not None:
        headline.append(f"{int(steps)} steps")
    failed = sum(number(flat, k) or 0 for k in ("reward_errors", "reward_timeouts",
                                                 "reward_infra"))
    if failed:
        headline.append(f"{int(failed)} reward calls failed (scored 0 or masked)")
    parts = [f"<h1>{escape(name)}</h1>"]
    if headline:
        parts.append(f'<div class="headline">{" &middot; ".join(headline)}</div>')
    shown = {k: v for k, v in flat.items() if not isinstance(v, list) or len(str(v)) < 200}
    if shown:
        parts.append(f"<h2>Summary</h2>{html.kv_table(shown)}")
    return "\n".join(parts)


def _points(records: list[dict[str, Any]], x_key: str, y_key: str) -> list[tuple[float, float]]:
    """(x, y) of records holding both as numbers; the last record wins on a repeated x."""
    pts: dict[float, float] = {}
    for r in records:
        x, y = number(r, x_key), number(r, y_key)
        if x is not None and y is not None:
            pts[x] = y
    return list(pts.items())


def run_figures(
    run_dir: Path, train: list[dict[str, Any]], evals: list[dict[str, Any]]
) -> list[tuple[str, str]]:
    """(caption, base64 PNG) of every plot the inputs allow, in report order."""
    everything = train + evals
    candidates = []
    for x_key, x_label in (("step", "step"), ("wall_time", "wall time (s)")):
        candidates.append(
            (
                f"reward mean and eval accuracy vs {x_label}",
                plots.line_plot(
                    {
                        "reward mean": _points(train, x_key, "reward_mean"),
                        "eval accuracy": _points(everything, x_key, "eval_accuracy"),
                    },
                    x_label,
                    "value",
                    f"reward and accuracy vs {x_label}",
                ),
            )
        )
    candidates.append(_terms_figure(train))
    candidates.append(_length_figure(run_dir, train))
    candidates.append(_time_figure(train))
    candidates.append(_offpolicy_figure(train))
    candidates.append(_capacity_figure(train))
    candidates.append(_requests_figure(train))
    candidates.extend(_eval_figures(evals))
    return [(caption, png) for caption, png in candidates if png is not None]


def _term_rows(train: list[dict[str, Any]], key: str) -> list[tuple[float, dict]]:
    """(step, the record's `key` table) of the records that hold one."""
    return [(r["step"], r[key]) for r in train
            if number(r, "step") is not None and isinstance(r.get(key), dict)]


def _terms_figure(train: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Each reward term's mean score (before its weight) per step."""
    series: plots.Series = {}
    for step, terms in _term_rows(train, "reward_terms"):
        for name in terms:
            if number(terms, name) is not None:
                series.setdefault(name, []).append((step, terms[name]))
    if not series:
        return "reward terms", None
    return ("mean score of each reward term per step (before its weight)",
            plots.line_plot(series, "step", "score", "reward terms"))


def _terms_table(train: list[dict[str, Any]]) -> str:
    """Each reward term: its mean score at the first and last step, its failed calls."""
    means = _term_rows(train, "reward_terms")
    if not means:
        return ""
    failed: dict[str, float] = {}
    for _, errors in _term_rows(train, "reward_term_errors"):
        for name in errors:
            failed[name] = failed.get(name, 0) + (number(errors, name) or 0)
    (first_step, first), (last_step, last) = means[0], means[-1]
    rows = [{"term": name, f"mean score, step {int(first_step)}": first.get(name, ""),
             f"mean score, step {int(last_step)}": last.get(name, ""),
             "failed calls (all steps)": int(failed.get(name, 0))}
            for name in dict.fromkeys([*first, *last])]
    return f"<h2>Reward terms</h2>{html.table(rows)}"


def _length_figure(run_dir: Path, train: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Histogram of response lengths at the first vs last step (store), else p50/p90/max."""
    lengths = _store_lengths(run_dir / STORE_FILE)
    if lengths:
        png = plots.histograms(lengths, "response length (tokens)", "response lengths")
        return "response-length distribution, first vs last step", png
    series = {k.removeprefix("response_len_"): _points(train, "step", k) for k in LENGTH_KEYS}
    png = plots.line_plot(series, "step", "tokens", "response length per step")
    return "response length per step (from metrics)", png


def _store_lengths(path: Path) -> dict[str, list[int]]:
    """{"step N": lengths} for the first and last stored steps; {} without a usable store."""
    if not path.is_file():
        return {}
    try:
        store = TrajectoryStore(path)
        try:
            steps = store.steps()
            chosen = sorted({steps[0], steps[-1]}) if steps else []
            return {f"step {s}": store.response_lengths(s) for s in chosen}
        finally:
            store.close()
    except (sqlite3.Error, ValueError):
        return {}


def _time_figure(train: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Stacked bars of the per-step time split."""
    rows = [r for r in train if number(r, "step") is not None]
    if not any(number(r, k) is not None for r in rows for k in TIME_KEYS):
        return "time split per step", None
    xs = [number(r, "step") for r in rows]
    parts = {
        k.removeprefix("time_"): [number(r, k) or 0.0 for r in rows]
        for k in TIME_KEYS
        if any(number(r, k) is not None for r in rows)
    }
    return "time split per step", plots.stacked_bars(xs, parts, "step", "seconds", "time per step")


def _offpolicy_figure(train: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Partial rollouts and corrections: off-policy token share, staleness, IS weights."""
    keys = {"off-policy token fraction": "offpolicy_token_frac",
            "staleness (mean versions)": "staleness_mean",
            "correction ESS": "correction_ess",
            "correction clipped frac": "correction_clipped_frac",
            "spec accepted len / 10": "spec_accepted_len"}
    series = {}
    for label, key in keys.items():
        pts = _points(train, "step", key)
        if pts:
            series[label] = [(x, y / 10) for x, y in pts] if key == "spec_accepted_len" else pts
    if not series or not any(y for pts in series.values() for _, y in pts):
        return "off-policy tokens and their correction", None
    return ("off-policy tokens (partial rollouts) and their correction",
            plots.line_plot(series, "step", "value", "off-policy tokens and correction"))


REQUEST_KEYS = {"queued": "remote_queue_seconds", "prefill": "remote_prefill_seconds",
                "decode": "remote_decode_seconds", "round trip": "remote_http_seconds",
                "slowest round trip": "remote_http_seconds_max",
                "weight update": "remote_weights_update_seconds"}


def _requests_figure(train: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Runs against inference servers: each step's mean seconds per request in the server's
    queue, prefill and decode, the HTTP round trip, and the weight update."""
    caption = "requests on the inference servers (mean seconds per request, per step)"
    series = {label: pts for label, key in REQUEST_KEYS.items()
              if (pts := _points(train, "step", key))}
    if not series:
        return caption, None
    return caption, plots.line_plot(series, "step", "seconds", "requests per step")


def _capacity_figure(train: list[dict[str, Any]]) -> tuple[str, str | None]:
    """ECHO-2's capacity view: busy fractions, supply against demand, staleness."""
    keys = {"learner busy frac": "learner_busy_time_frac",
            "rollout busy frac": "rollout_busy_time_frac",
            "supply / demand": None, "stale (>=1 version) frac": None}
    series = {}
    for label, key in keys.items():
        if key is not None:
            pts = _points(train, "step", key)
        elif label.startswith("supply"):
            pts = [(r["step"], r["rollout_supply_per_s"] / r["rollout_demand_per_s"])
                   for r in train if number(r, "rollout_demand_per_s")
                   and number(r, "rollout_supply_per_s") is not None]
        else:
            pts = [(r["step"], sum(r.get(f"staleness_hist_{k}", 0) for k in ("1", "2", "3plus"))
                    / max(r.get("traj_trained", 0), 1))
                   for r in train if "staleness_hist_0" in r]
        if pts:
            series[label] = pts
    if not series:
        return "capacity", None
    caption = ("capacity (ECHO-2): learner and rollout busy fractions, rollout supply over "
               "learner demand, stale share")
    return caption, plots.line_plot(series, "step", "value", "capacity")


def _pass_at_k_series(evals: list[dict[str, Any]], x_key: str) -> plots.Series:
    """pass@k curves: `pass_at_k` is a number (k from the record's "k") or {k: value}."""
    series: plots.Series = {}
    for r in evals:
        x, p = number(r, x_key), r.get("pass_at_k")
        if x is None:
            continue
        if isinstance(p, dict):
            items = [(k, v) for k, v in p.items() if number(p, k) is not None]
        elif number(r, "pass_at_k") is not None:
            items = [(r.get("k", "k"), p)]
        else:
            items = []
        for k, v in items:
            series.setdefault(f"pass@{k}", []).append((x, v))
    return series


def _eval_figures(evals: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """Eval curves (accuracy and pass@k) vs step, and vs rollouts when recorded."""
    out = []
    for x_key, x_label in (("step", "step"), ("rollouts", "rollouts")):
        if x_key == "rollouts" and not any(number(r, "rollouts") is not None for r in evals):
            continue
        series = {"accuracy": _points(evals, x_key, "eval_accuracy")}
        series.update(_pass_at_k_series(evals, x_key))
        png = plots.line_plot(series, x_label, "accuracy", f"evaluation vs {x_label}")
        out.append((f"evaluation curve vs {x_label}", png))
    return out
