"""What the model wrote: report sections read from the trajectory store, and run comparison.

`completions_section(store_path)`: for a few steps (first, middle, last), a few prompts with
their group's responses, highest and lowest reward first, each with its reward and the
advantage the update used (stored with the trajectory, whatever the estimator).

`write_compare(run_dirs, out)`: one page overlaying held-out accuracy and mean reward of
several runs against step and against wall time.
"""

from __future__ import annotations

import sqlite3
from html import escape
from pathlib import Path
from typing import Any

from rollwise.observe import html, plots
from rollwise.observe.metrics import number, read_metrics
from rollwise.system.atomic import atomic_write_text


def chosen_steps(steps: list[int], count: int = 3) -> list[int]:
    """First, middle and last of the stored steps (fewer when there are fewer).

    >>> chosen_steps([1, 2, 3, 4, 5]), chosen_steps([7]), chosen_steps([])
    ([1, 3, 5], [7], [])
    """
    if len(steps) <= count:
        return list(steps)
    picks = [steps[round(i * (len(steps) - 1) / (count - 1))] for i in range(count)]
    return sorted(set(picks))


def _step_groups(conn: sqlite3.Connection, step: int) -> list[dict[str, Any]]:
    columns = {row[1] for row in conn.execute("PRAGMA table_info(trajectories)")}
    advantage = "t.advantage" if "advantage" in columns else "''"  # older stores: unknown
    rows = conn.execute(
        f"SELECT t.group_idx, s.prompt, s.answer, t.text, t.reward, t.num_tokens, {advantage}"
        " FROM trajectories t JOIN samples s ON s.sample_id = t.sample_id WHERE t.step = ?"
        " ORDER BY t.group_idx, t.traj_idx", (step,)).fetchall()
    groups: dict[int, dict[str, Any]] = {}
    for g, prompt, answer, text, reward, tokens, adv in rows:
        group = groups.setdefault(g, {"prompt": prompt, "answer": answer, "responses": []})
        group["responses"].append((text, float("nan") if reward is None else reward, tokens,
                                   adv))
    return list(groups.values())


def _group_table(group: dict[str, Any], show: int) -> str:
    """One prompt and its `show` highest- and lowest-reward responses."""
    ranked = sorted(group["responses"], key=lambda x: -x[1])
    picked = ranked if len(ranked) <= 2 * show else ranked[:show] + ranked[-show:]
    rows = [{"reward": r, "advantage": "not trained" if a is None else
             round(a, 3) if isinstance(a, float) else a, "tokens": n, "response": text}
            for text, r, n, a in picked]
    return (f'<p class="muted">prompt: <code>{escape(str(group["prompt"])[:400])}</code> '
            f'&middot; answer <code>{escape(str(group["answer"]))}</code></p>'
            + html.table(rows))


def completions_section(store_path: Path, prompts: int = 2, show: int = 2) -> str:
    """HTML: for the chosen steps, `prompts` groups each (those with the widest reward
    spread first), `show` best and worst responses of each. '' without a usable store."""
    if not Path(store_path).is_file():
        return ""
    try:
        conn = sqlite3.connect(f"file:{store_path}?mode=ro", uri=True)
        try:
            steps = [r[0] for r in conn.execute(
                "SELECT DISTINCT step FROM trajectories ORDER BY step")]
            parts = []
            for step in chosen_steps(steps):
                groups = _step_groups(conn, step)
                groups.sort(key=lambda g: -(max(x[1] for x in g["responses"])
                                            - min(x[1] for x in g["responses"])))
                parts.append(f"<h3>step {step}</h3>")
                parts.extend(_group_table(g, show) for g in groups[:prompts])
        finally:
            conn.close()
    except sqlite3.Error:
        return ""
    if not parts:
        return ""
    return ("<h2>Completions</h2><p class=\"muted\">highest and lowest reward of each group; "
            "advantage: the one the update used, from the run's estimator (a token-level "
            "estimator's mean over the response; 'not trained': the allocator left the group "
            "out or the estimator dropped the row)</p>" + "\n".join(parts))


def _series(run_dirs: list[Path], key: str, x_key: str, kind: str) -> plots.Series:
    series: plots.Series = {}
    for run in run_dirs:
        records = [r for r in read_metrics(run, strict=False) if r.get("kind", "train") == kind]
        pts = [(number(r, x_key), number(r, key)) for r in records]
        series[run.name] = [(x, y) for x, y in pts if x is not None and y is not None]
    return series


def write_compare(run_dirs: list[Path], out: Path) -> Path:
    """One HTML page overlaying the runs' accuracy and reward vs step and wall time."""
    run_dirs = [Path(r) for r in run_dirs]
    figures = []
    for key, kind, label in (("eval_accuracy", "eval", "held-out accuracy"),
                             ("reward_mean", "train", "mean reward")):
        for x_key, x_label in (("step", "step"), ("wall_time", "wall time (s)")):
            png = plots.line_plot(_series(run_dirs, key, x_key, kind), x_label, label,
                                  f"{label} vs {x_label}")
            if png is not None:
                figures.append(html.figure(png, f"{label} vs {x_label}"))
    rows = []
    for run in run_dirs:
        evals = [r for r in read_metrics(run, strict=False) if r.get("kind") == "eval"]
        last = evals[-1] if evals else {}
        rows.append({"run": run.name, "steps": last.get("step", ""),
                     "first accuracy": evals[0].get("eval_accuracy", "") if evals else "",
                     "last accuracy": last.get("eval_accuracy", ""),
                     "wall time (s)": last.get("wall_time", "")})
    body = (f"<h1>rollwise: {len(run_dirs)} runs compared</h1>{html.table(rows)}"
            f'<div class="figures">{"".join(figures)}</div>')
    atomic_write_text(out, html.page("rollwise comparison", body))
    return out
