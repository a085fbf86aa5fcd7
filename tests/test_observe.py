"""Observe: metrics JSONL, step lines, progress bar, run and benchmark HTML reports."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from rollwise.observe import (
    MetricsWriter,
    format_step_line,
    progress_bar,
    read_metrics,
    summarize_lengths,
    write_bench_report,
    write_report,
)
from rollwise.replay import TrajectoryStore
from rollwise.types import Group, Sample, Trajectory

# -- metrics -------------------------------------------------------------------------------


def test_metrics_round_trip_converts_scalars(tmp_path):
    w = MetricsWriter(tmp_path)  # a run directory: writes tmp_path/metrics.jsonl
    w.write({"step": np.int64(1), "reward_mean": np.float32(0.5), "tag": "a", "l": (1, 2)})
    w.write({"step": 2, "reward_mean": 0.25, "hist": np.array([1, 2, 3])})
    w.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert recs == [
        {"step": 1, "reward_mean": 0.5, "tag": "a", "l": [1, 2]},
        {"step": 2, "reward_mean": 0.25, "hist": [1, 2, 3]},
    ]
    assert isinstance(recs[0]["step"], int)
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_truncated_last_line_is_tolerated_and_cut_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path)
    w.write({"step": 1})
    w.write({"step": 2})
    w.close()
    with path.open("a") as f:
        f.write('{"step": 3, "rew')  # crash mid-write
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]
    w = MetricsWriter(path)  # resume appends after cutting the partial line
    w.write({"step": 3})
    w.close()
    assert read_metrics(path) == [{"step": 1}, {"step": 2}, {"step": 3}]


def test_bad_middle_line_raises_unless_lenient(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(path)
    assert read_metrics(path, strict=False) == [{"step": 1}, {"step": 2}]


def test_drop_after(tmp_path):
    w = MetricsWriter(tmp_path)
    for s in range(1, 6):
        w.write({"kind": "train", "step": s})
    w.write({"kind": "note"})
    assert w.drop_after(3) == 2
    w.write({"step": 4, "resumed": True})
    w.close()
    steps = [r.get("step") for r in read_metrics(tmp_path)]
    assert steps == [1, 2, 3, None, 4]


def test_summarize_lengths():
    assert summarize_lengths([5, 1, 3, 2, 4]) == {"p50": 3.0, "p90": 4.6, "max": 5, "mean": 3.0}
    assert summarize_lengths([7]) == {"p50": 7.0, "p90": 7.0, "max": 7, "mean": 7.0}
    assert summarize_lengths([])["max"] == 0


# -- progress ------------------------------------------------------------------------------


def test_format_step_line_full_and_partial():
    rec = {
        "step": 3,
        "num_steps": 20,
        "reward_mean": 0.4123,
        "eval_accuracy": 0.375,
        "response_len_p50": 34.0,
        "zero_var_frac": 0.25,
        "time_rollout": 9.81,
        "time_reward": 0.12,
        "time_train": 12.3,
        "rollout_tokens_per_s": 180.4,
    }
    assert format_step_line(rec) == (
        "step 3/20 | reward 0.41 | acc 0.38 | len p50 34 | zero-var 0.25 | "
        "rollout 9.8s reward 0.1s train 12.3s | 180 tok/s"
    )
    line = format_step_line({"step": 7, "zero_var_frac": 0.5, "time_train": 2.0, "x": "y"})
    assert line == "step 7 | zero-var 0.50 | train 2.0s"
    assert format_step_line({"reward_mean": None, "eval_accuracy": "n/a"}) == ""


def test_progress_bar_disabled_by_env_still_counts(monkeypatch):
    monkeypatch.setenv("ROLLWISE_NO_PROGRESS", "1")
    with progress_bar(10, "rollout") as bar:
        bar.advance(3)
        bar.advance()
        bar.set_description("still fine")
    assert not bar.enabled
    assert bar.completed == 4


def test_progress_bar_enabled_advances_rich_task():
    with progress_bar(5, "train", enabled=True) as bar:
        bar.advance(5)
        task = bar._progress.tasks[0]
        assert (task.completed, task.total, task.finished) == (5, 5, True)
    assert bar.enabled


def test_observe_import_stays_light():
    code = "import sys, rollwise.observe; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- run report ----------------------------------------------------------------------------


def _metrics(n_steps: int = 5) -> list[dict]:
    recs = []
    for s in range(1, n_steps + 1):
        recs.append(
            {
                "kind": "train",
                "step": s,
                "num_steps": n_steps,
                "wall_time": 10.0 * s,
                "reward_mean": 0.1 * s,
                "response_len_p50": 30 + s,
                "response_len_p90": 50 + s,
                "response_len_max": 64,
                "time_rollout": 6.0,
                "time_reward": 0.5,
                "time_train": 3.0,
                "time_other": 0.5,
            }
        )
        if s % 2 == 1:
            recs.append(
                {
                    "kind": "eval",
                    "step": s,
                    "wall_time": 10.0 * s + 1,
                    "eval_accuracy": 0.1 + 0.05 * s,
                    "pass_at_k": {"4": 0.3 + 0.05 * s},
                }
            )
    return recs


def _make_run(run_dir, with_extras: bool = True):
    run_dir.mkdir()
    w = MetricsWriter(run_dir)
    for r in _metrics():
        w.write(r)
    w.close()
    if not with_extras:
        return
    summary = {
        "eval_before": {"accuracy": 0.125, "n": 64},
        "eval_after": {"accuracy": 0.4375, "n": 64},
        "train_seconds": 51.5,
        "steps": 5,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "config.toml").write_text('[run]\nname = "<b>demo</b> & co"\n')
    store = TrajectoryStore(run_dir / "trajectories.sqlite")
    sample = Sample(id="s0", prompt="1+1=", answer="2")
    for step, n in ((1, 40), (5, 12)):
        trajs = [
            Trajectory(
                sample,
                [1, 2],
                list(range(n + i)),
                [-0.5] * (n + i),
                [step] * (n + i),
                "stop",
                reward=1.0,
            )
            for i in range(4)
        ]
        store.add_groups(step, [Group(sample, trajs)])
    store.close()


def test_report_full_run_dir(tmp_path):
    run = tmp_path / "demo-run"
    _make_run(run)
    out = write_report(run)
    assert out == run / "report.html"
    page = out.read_text()
    assert "0.125" in page and "0.4375" in page and "51.5" in page
    assert "accuracy 0.125 &rarr; 0.4375" in page
    assert "demo-run" in page
    # (a) vs step, (b) vs wall time, (c) length histogram, (d) time split, (e) eval curve
    assert page.count("<img") == 5
    assert "first vs last step" in page  # the lengths came from the store, not metrics
    assert "&lt;b&gt;demo&lt;/b&gt; &amp; co" in page and "<b>demo</b>" not in page
    assert "<script" not in page and 'src="http' not in page


def test_report_with_only_metrics(tmp_path):
    run = tmp_path / "bare"
    _make_run(run, with_extras=False)
    page = write_report(run).read_text()
    assert page.count("<img") == 5  # lengths fall back to p50/p90/max from metrics
    assert "response length per step (from metrics)" in page
    assert "Config" not in page


def test_report_omits_plots_without_keys(tmp_path):
    run = tmp_path / "sparse"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.2}\n{"step": 2, "rew')
    (run / "summary.json").write_text("{not json")
    (run / "trajectories.sqlite").write_bytes(b"not a database")
    page = write_report(run).read_text()
    assert page.count("<img") == 1  # only reward vs step
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_report(empty).read_text().count("<img") == 0


# -- benchmark report ----------------------------------------------------------------------


def test_bench_report_tables_and_charts(tmp_path):
    bench = {
        "benchmark": "throughput",
        "settings": {"model": "tiny", "rounds": 3},
        "results": [
            {"engine": "hf", "tokens_per_s": 123.4, "makespan_s": 9.5, "ok": True},
            {"engine": "native", "tokens_per_s": 456.7, "makespan_s": 2.25, "ok": True},
        ],
        "notes": [{"x": 1}, {"x": 2, "y": "<i>"}],
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    out = write_bench_report(path)
    assert out == tmp_path / "bench.html"
    page = out.read_text()
    assert page.count("<table") == 4  # top scalars, settings, results, notes
    for text in ("123.4", "456.7", "2.25", "native", "tiny", "&lt;i&gt;"):
        assert text in page
    assert page.count("<img") == 2  # tokens_per_s and makespan_s; "notes" has no name column
    custom = write_bench_report(path, tmp_path / "sub" / "b.html")
    assert custom.exists()


def test_report_plots_off_policy_metrics_of_partial_runs(tmp_path):
    run = tmp_path / "partial"
    run.mkdir()
    w = MetricsWriter(run)
    for r in _metrics():
        w.write(r | ({"offpolicy_token_frac": 0.1 * r["step"], "staleness_mean": 0.5,
                      "correction_ess": 0.9} if r["kind"] == "train" else {}))
    w.close()
    page = write_report(run).read_text()
    assert page.count("<img") == 6 and "off-policy tokens" in page
    on_policy = tmp_path / "on-policy"
    on_policy.mkdir()
    w = MetricsWriter(on_policy)
    for r in _metrics():
        w.write(r | ({"offpolicy_token_frac": 0.0} if r["kind"] == "train" else {}))
    w.close()
    assert "off-policy tokens" not in write_report(on_policy).read_text()  # nothing to show


def test_report_plots_the_requests_of_a_run_against_inference_servers(tmp_path):
    """The per-request traces of a remote run (queue, prefill, decode, round trip, weight
    update) get their figure; a run in process has none of those keys and no such figure."""
    remote = {"remote_queue_seconds": 0.01, "remote_prefill_seconds": 0.02,
              "remote_decode_seconds": 0.3, "remote_http_seconds": 0.35,
              "remote_weights_update_seconds": 0.8}
    pages = {}
    for name, extra in (("remote", remote), ("local", {})):
        run = tmp_path / name
        run.mkdir()
        w = MetricsWriter(run)
        for r in _metrics():
            w.write(r | (extra if r["kind"] == "train" else {}))
        w.close()
        pages[name] = write_report(run).read_text()
    assert "requests on the inference servers" in pages["remote"]
    assert "requests on the inference servers" not in pages["local"]
    assert pages["remote"].count("<img") == pages["local"].count("<img") + 1
