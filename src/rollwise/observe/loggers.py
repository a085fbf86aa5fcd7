"""Metric sinks besides `metrics.jsonl`: TensorBoard, W&B (offline), MLflow (local), trackio.

Every sink gets the same records as `metrics.jsonl`, under the same names (docs/metrics.md):
the numeric fields of each record, at x = its `step`. Each backend is an optional extra
(`pip install 'rollwise[tensorboard]'` ...) imported only when named in `run.loggers`, and
each writes inside the run directory, never to the network:

    tensorboard  runs/<name>/tensorboard/   (torch.utils.tensorboard event files)
    wandb        runs/<name>/wandb/         (mode "offline"; `wandb sync` uploads it later)
    mlflow       runs/<name>/mlruns/        (a file store; `mlflow ui --backend-store-uri`,
                                             with the full `mlflow` package)
    trackio      runs/<name>/trackio/       (its local database, TRACKIO_DIR)

Why a failing sink is dropped instead of stopping the run: a full disk under the
TensorBoard folder or a broken W&B install is not a reason to lose hours of training. The
first failure is reported once and that sink is switched off; the others go on.

A resumed run continues the logger runs it started (W&B run id, MLflow run id, trackio run
name; kept in the run directory's run.json), so one run directory is one logger run.
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

from rollwise.observe.metrics import flatten

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


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numeric fields of a record (not `step`), as floats; a table of numbers
    (the per-term `reward_terms`) gives one field per entry, named `table/entry`.

    >>> scalars({"kind": "train", "step": 3, "reward_mean": 0.5, "ok": True, "x": "a",
    ...          "reward_terms": {"correct": 0.25, "mypkg:brief": 1}})
    {'reward_mean': 0.5, 'reward_terms/correct': 0.25, 'reward_terms/mypkg:brief': 1.0}
    """
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(scalars(v, f"{prefix}{k}/"))
            continue
        if (k == "step" and not prefix) or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[prefix + k] = float(v)
    return out


class TensorBoardSink:
    """Event files in one folder: a resumed run adds its own file to the same folder."""

    run_id = None

    def __init__(self, root: Path, run_name: str, config: dict, run_id: str | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(root / "tensorboard"))

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """An offline run; a resumed run logs under the same run id (in a folder of its own:
    `wandb sync` uploads both into one run)."""

    def __init__(self, root: Path, run_name: str, config: dict, run_id: str | None = None):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project="rollwise", name=run_name, dir=str(root), config=config,
                              mode="offline", reinit="create_new", id=run_id,
                              resume="allow" if run_id else None)
        self.run_id = self.run.id

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


_MLFLOW_BAD = re.compile(r"[^0-9A-Za-z_\-. /]")


def _mlflow_name(key: str) -> str:
    return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))


class MlflowSink:
    """MLflow refuses '@' in metric names: `eval_pass@4` is logged as `eval_pass_at_4`. The
    config is logged as params (dotted keys); a resumed run continues its MLflow run,
    logging params it did not have and, as tags `config_change.<key>`, the values
    `--allow-changes` changed (MLflow params cannot change)."""

    def __init__(self, root: Path, run_name: str, config: dict, run_id: str | None = None):
        # The file store keeps a run self-contained and needs no database packages; MLflow
        # 3 asks for this opt-in to use it.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        import mlflow

        self.client = mlflow.MlflowClient(tracking_uri=(root / "mlruns").resolve().as_uri())
        logged: dict[str, str] = {}
        try:
            run = self.client.get_run(run_id) if run_id else None
        except mlflow.exceptions.MlflowException:  # its store is gone: start another
            run = None
        if run is not None:
            self.run_id = run.info.run_id
            logged = dict(run.data.params)
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name("rollwise")
            exp_id = (experiment.experiment_id if experiment is not None
                      else self.client.create_experiment("rollwise"))
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self._log_params(config, logged)

    def _log_params(self, config: dict, logged: dict[str, str]) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        values = {_mlflow_name(k): str(v)[:MAX_PARAM_VAL_LENGTH]
                  for k, v in flatten(config).items()}
        params = [Param(k, v) for k, v in values.items() if k not in logged]
        tags = [RunTag(f"config_change.{k}", f"{logged[k]} -> {v}")
                for k, v in values.items() if k in logged and logged[k] != v]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i: i + MAX_PARAMS_TAGS_PER_BATCH])
        for i in range(0, len(tags), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=tags[i: i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_name(k), v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioSink:
    """A local trackio run; a resumed run continues the run of its name."""

    def __init__(self, root: Path, run_name: str, config: dict, run_id: str | None = None):
        os.environ.setdefault("TRACKIO_DIR", str(root / "trackio"))
        import trackio

        self.trackio = trackio
        trackio.init(project="rollwise", name=run_name, config=config,
                     **({"resume": "allow"} if run_id else {}))
        self.run_id = run_name

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

    def run_ids(self) -> dict[str, str]:
        """{logger: the id of its run} for the loggers that have one (kept in run.json, so
        that a resumed run continues the same logger runs)."""
        return {name: sink.run_id for name, sink in self.sinks.items()
                if getattr(sink, "run_id", None)}

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
                 echo: Callable[[str], None] = print,
                 run_ids: dict[str, str] | None = None) -> Loggers:
    """The sinks named in run.loggers (jsonl is the run's own metrics.jsonl). A sink that
    fails to start is reported and left out, like one that fails later. `run_ids`: the
    ids of the logger runs a resumed run continues (`Loggers.run_ids` of its first start)."""
    check_loggers(names)
    loggers = Loggers({}, echo)
    for name in dict.fromkeys(names):
        if name == "jsonl":
            continue
        try:
            loggers.sinks[name] = SINKS[name](Path(root), run_name, config,
                                              (run_ids or {}).get(name))
        except Exception as err:  # noqa: BLE001
            loggers._drop(name, err)
    return loggers
