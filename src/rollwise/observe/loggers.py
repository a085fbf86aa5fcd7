"""Metric sinks besides `metrics.jsonl`: TensorBoard, W&B (offline), MLflow (local), trackio.

Every sink gets the same records as `metrics.jsonl`, under the same names (docs/metrics.md):
the numeric fields of each record, at x = its `step`. Each backend is an optional extra
(`pip install 'rollwise[tensorboard]'` ...) imported only when named in `run.loggers`, and
each writes inside the run directory, never to the network:

    tensorboard  runs/<name>/tensorboard/   (torch.utils.tensorboard event files)
    wandb        runs/<name>/wandb/         (mode "offline"; `wandb sync` uploads it later)
    mlflow       runs/<name>/mlruns/        (a file store; `mlflow ui --backend-store-uri`)
    trackio      runs/<name>/trackio/       (its local database, TRACKIO_DIR)

Why a failing sink is dropped instead of stopping the run: a full disk under the
TensorBoard folder or a broken W&B install is not a reason to lose hours of training. The
first failure is reported once and that sink is switched off; the others go on.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# logger name -> (module that must be importable, extra that installs it)
EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
          "mlflow": ("mlflow", "mlflow"), "trackio": ("trackio", "trackio")}


class LoggerMissing(ValueError):
    """A logger named in run.loggers is not installed."""


def check_loggers(names: list[str]) -> None:
    """Raise LoggerMissing naming the extra of the first logger that is not installed."""
    for name in names:
        if name == "jsonl":
            continue
        if name not in EXTRAS:
            raise LoggerMissing(f"run.loggers: unknown logger '{name}'; known: jsonl, "
                                f"{', '.join(EXTRAS)}")
        module, extra = EXTRAS[name]
        if importlib.util.find_spec(module) is None:
            raise LoggerMissing(f"run.loggers: '{name}' is not installed; install it with "
                                f"pip install 'rollwise[{extra}]'")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numeric fields of a record (not `step`), as floats.

    >>> scalars({"kind": "train", "step": 3, "reward_mean": 0.5, "ok": True, "x": "a"})
    {'reward_mean': 0.5}
    """
    out = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[k] = float(v)
    return out


class TensorBoardSink:
    def __init__(self, root: Path, run_name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(root / "tensorboard"))

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, root: Path, run_name: str, config: dict):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project="rollwise", name=run_name, dir=str(root), config=config,
                              mode="offline", reinit="create_new")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


_MLFLOW_BAD = re.compile(r"[^0-9A-Za-z_\-. /]")


class MlflowSink:
    """MLflow refuses '@' in metric names: `eval_pass@4` is logged as `eval_pass_at_4`."""

    def __init__(self, root: Path, run_name: str, config: dict):
        # The file store keeps a run self-contained and needs no database packages; MLflow
        # 3 asks for this opt-in to use it.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        import mlflow

        self.client = mlflow.MlflowClient(tracking_uri=(root / "mlruns").resolve().as_uri())
        experiment = self.client.get_experiment_by_name("rollwise")
        exp_id = (experiment.experiment_id if experiment is not None
                  else self.client.create_experiment("rollwise"))
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_BAD.sub("_", k.replace("@", "_at_")), v, now, step)
                   for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioSink:
    def __init__(self, root: Path, run_name: str, config: dict):
        os.environ.setdefault("TRACKIO_DIR", str(root / "trackio"))
        import trackio

        self.trackio = trackio
        trackio.init(project="rollwise", name=run_name, config=config)

    def log(self, values: dict[str, float], step: int) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


SINKS: dict[str, Callable[..., Any]] = {"tensorboard": TensorBoardSink, "wandb": WandbSink,
                                        "mlflow": MlflowSink, "trackio": TrackioSink}


class Loggers:
    """The run's extra sinks; a sink that raises is reported once and switched off."""

    def __init__(self, sinks: dict[str, Any], echo: Callable[[str], None] = print):
        self.sinks = dict(sinks)
        self.echo = echo
        self.failed: dict[str, str] = {}

    def _drop(self, name: str, err: BaseException) -> None:
        self.sinks.pop(name, None)
        self.failed[name] = f"{type(err).__name__}: {err}"
        self.echo(f"logger '{name}' failed ({self.failed[name]}); it is switched off and "
                  "training goes on (metrics.jsonl has every record)")

    def log(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, (int, float)):
            return
        values = scalars(record)
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(values, int(step))
            except Exception as err:  # noqa: BLE001 - any sink failure: report, drop, go on
                self._drop(name, err)

    def close(self) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001
                self._drop(name, err)
        self.sinks.clear()


def make_loggers(names: list[str], root: Path, run_name: str, config: dict,
                 echo: Callable[[str], None] = print) -> Loggers:
    """The sinks named in run.loggers (jsonl is the run's own metrics.jsonl). A sink that
    fails to start is reported and left out, like one that fails later."""
    check_loggers(names)
    loggers = Loggers({}, echo)
    for name in dict.fromkeys(names):
        if name == "jsonl":
            continue
        try:
            loggers.sinks[name] = SINKS[name](Path(root), run_name, config)
        except Exception as err:  # noqa: BLE001
            loggers._drop(name, err)
    return loggers
