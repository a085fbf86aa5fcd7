"""Metric loggers: each gets the records metrics.jsonl gets, offline, inside the run directory;
a missing one names its extra; a failing one is reported once and switched off."""

from __future__ import annotations

import importlib.util
import json
import math
import time

import pytest

from rollwise.observe.loggers import (
    LoggerMissing,
    Loggers,
    check_loggers,
    make_loggers,
    scalars,
)

RECORDS = [
    {"kind": "eval", "step": 0, "eval_accuracy": 0.25, "eval_pass@4": 0.5},
    {"kind": "train", "step": 1, "reward_mean": 0.5, "loss": 0.1, "ok": True, "note": "x"},
    {"kind": "train", "step": 2, "reward_mean": 0.75, "loss": math.nan},
    {"kind": "eval", "step": 2, "eval_accuracy": 0.5, "eval_pass@4": 0.75},
]


class ListSink:
    def __init__(self):
        self.got, self.closed = [], False

    def log(self, values, step):
        self.got.append((step, values))

    def close(self):
        self.closed = True


class BrokenSink(ListSink):
    def log(self, values, step):
        raise OSError(28, "No space left on device")


def test_a_logger_that_is_not_installed_names_its_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(LoggerMissing, match=r"pip install 'rollwise\[wandb\]'"):
        check_loggers(["jsonl", "wandb"])
    check_loggers(["jsonl"])


def test_a_failing_logger_is_reported_once_and_switched_off():
    lines, good, bad = [], ListSink(), BrokenSink()
    loggers = Loggers({"tensorboard": bad, "other": good}, echo=lines.append)
    for r in RECORDS:
        loggers.log(r)
    loggers.close()
    assert len(lines) == 1 and "logger 'tensorboard' failed" in lines[0]
    assert "training goes on" in lines[0] and "tensorboard" not in loggers.sinks
    assert [s for s, _ in good.got] == [0, 1, 2, 2] and good.closed


def test_sinks_get_the_numeric_fields_under_the_metrics_jsonl_names():
    assert scalars(RECORDS[1]) == {"reward_mean": 0.5, "loss": 0.1}
    assert scalars(RECORDS[2]) == {"reward_mean": 0.75}  # NaN left out, as backends refuse it


def _log_all(names, tmp_path):
    loggers = make_loggers(names, tmp_path, "r", {"run": {"seed": 0}}, echo=pytest.fail)
    for r in RECORDS:
        loggers.log(r)
    loggers.close()


def test_tensorboard_event_files_hold_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_all(["jsonl", "tensorboard"], tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.5), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("eval_accuracy")] == [(0, 0.25), (2, 0.5)]


def test_mlflow_logs_to_a_local_file_store(tmp_path):
    pytest.importorskip("mlflow")
    import mlflow

    _log_all(["mlflow"], tmp_path)
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run = client.search_runs([client.get_experiment_by_name("rollwise").experiment_id])[0]
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.75)]
    assert run.data.metrics["eval_pass_at_4"] == 0.75
    assert run.info.status == "FINISHED"


def test_wandb_runs_offline_into_the_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    _log_all(["wandb"], tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # the offline run log is protobuf records; names and JSON values appear in it verbatim.
    # wandb's writer is a separate process: on a loaded machine it may still be flushing.
    wanted = (b"reward_mean", b"eval_accuracy", b"eval_pass@4", b"0.75", b"rollwise")
    deadline = time.monotonic() + 30
    while True:
        data = next(runs[0].glob("run-*.wandb")).read_bytes()
        if all(text in data for text in wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for text in wanted:
        assert text in data, text


def test_trackio_logs_locally(tmp_path, monkeypatch):
    """trackio is stubbed: its import pulls in a web stack; the sink's calls are checked."""
    import sys
    import types

    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)),
                                 log=lambda values, step: calls.append(("log", step, values)),
                                 finish=lambda: calls.append(("finish",)))
    monkeypatch.setitem(sys.modules, "trackio", fake)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setenv("TRACKIO_DIR", "")  # records the original state, restored after
    monkeypatch.delenv("TRACKIO_DIR")
    _log_all(["trackio"], tmp_path)
    import os

    assert os.environ["TRACKIO_DIR"] == str(tmp_path / "trackio")
    assert calls[0] == ("init", {"project": "rollwise", "name": "r",
                                 "config": {"run": {"seed": 0}}})
    assert calls[2] == ("log", 1, {"reward_mean": 0.5, "loss": 0.1}) and calls[-1] == ("finish",)
    calls.clear()  # a resumed run continues the trackio run of its name
    loggers = make_loggers(["trackio"], tmp_path, "r", {}, run_ids={"trackio": "r"})
    assert calls[0][1]["resume"] == "allow" and loggers.run_ids() == {"trackio": "r"}


def test_a_run_feeds_every_metrics_record_to_the_loggers(tmp_path):
    from rollwise.pipeline.build import build
    from rollwise.pipeline.loop import train
    from rollwise.run.rundir import Run
    from test_runsafety import small

    cfg = small(tmp_path, "run.num_steps=2")
    sink = ListSink()
    run = Run(tmp_path / "r", resume=False, echo=lambda s: None,
              loggers=Loggers({"list": sink}))
    train(build(cfg), run, 2)
    lines = [json.loads(x) for x in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert [(s, v) for s, v in sink.got] == [(r["step"], scalars(r)) for r in lines]
    assert sink.closed
