"""`rollwise bench async` (bench/overlap.py, bench/servers.py): the figures of a row from
step records, the pairs each asynchronous variant is measured against, the in-process
asynchronous variant listed with the build's reason, and (slow) the remote variants against
a `rollwise serve` process the bench starts and stops: the same trajectories as in process.
Also the asynchronous driver's publication handoff (pipeline/asyncloop.py), which those
remote variants exercise."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollwise.bench import overlap
from rollwise.bench.servers import serve_command
from rollwise.pipeline.stages import Stages
from rollwise.types import Published

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
SMALL = ["run.threads=1", "rollout.prompts_per_step=4", "task.num_eval=24"]


def record(wall: float, train: float, rollout: float, trained: int = 8) -> dict:
    return {"wall_time": wall, "time_train": train, "time_rollout": rollout,
            "time_reward": 0.0, "publish_seconds": 0.5, "staleness_hist_0": trained,
            "traj_trained": trained, "traj_filtered": 0, "traj_stale_dropped": 0,
            "step_tokens": 10}


def test_learner_busy_is_train_over_the_steps_wall_time():
    # steps of 10, 4 and 5 s (the run's clock); the first is the warm-up
    rows = [record(10.0, 9.0, 1.0), record(14.0, 2.0, 1.0), record(19.0, 4.0, 2.0)]
    fig = overlap.step_figures(rows, warmup=1)
    assert fig["per_step_s"] == [4.0, 5.0] and fig["step_s"] == 4.5
    assert fig["learner_busy"] == pytest.approx((2.0 / 4 + 4.0 / 5) / 2)
    assert fig["train_s"] == pytest.approx(3.0 + 0.5)  # train + publish medians
    assert fig["trajectories"] == 24 and fig["tokens"] == 30 and fig["measured_steps"] == 2
    assert fig["staleness_max"] == 0 and fig["stale_frac"] == 0


def test_staleness_max_is_the_oldest_trained_trajectory_of_the_measured_steps():
    rows = [record(1.0, 1.0, 1.0) | {"staleness_hist_2": 1},  # warm-up: left out
            record(2.0, 1.0, 1.0, trained=6) | {"staleness_hist_1": 2, "staleness_hist_0": 4},
            record(3.0, 1.0, 1.0, trained=4) | {"staleness_hist_1": 4, "staleness_hist_0": 0}]
    fig = overlap.step_figures(rows, warmup=1)
    assert fig["staleness_max"] == 1 and fig["stale_frac"] == pytest.approx((2 / 6 + 1) / 2)
    assert overlap.step_figures([record(1.0, 1.0, 1.0) | {"staleness_hist_3plus": 1}],
                                warmup=0)["staleness_max"] == 3


def test_each_async_variant_is_measured_against_its_own_placements_sync():
    def row(name, step, rollout, train, acc):
        return {"variant": name, "step_s": step, "rollout_s": rollout, "train_s": train,
                "learner_busy": train / step, "accuracy": acc}

    out = overlap.derived([row("local-sync", 4.0, 1.0, 3.0, 0.5),
                           row("remote-sync", 6.0, 2.0, 4.0, 0.5),
                           row("remote-async-1", 5.0, 3.0, 4.0, 0.45)])
    assert out["remote-async-1_over_larger_stage"] == pytest.approx(5.0 / 4.0)
    assert out["remote-async-1_accuracy_minus_sync"] == pytest.approx(-0.05)
    assert "ray_overhead" not in out and "local-async-1_over_larger_stage" not in out
    assert set(overlap.PAIRS) <= set(overlap.VARIANTS)
    assert all(v in overlap.VARIANTS for v in overlap.PAIRS.values())


def test_serve_command_follows_the_config_and_refuses_int8():
    cfg = SimpleNamespace(model=SimpleNamespace(name="tiny"), run=SimpleNamespace(threads=1),
                          engine=SimpleNamespace(batch_size=32, kv_budget_tokens=4096))
    cmd = serve_command(cfg, 8123, "bfloat16")
    assert cmd[cmd.index("--model") + 1] == "tiny" and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--threads") + 1] == "1"
    assert cmd[cmd.index("--max-num-seqs") + 1] == "32"
    with pytest.raises(ValueError, match="int8"):
        serve_command(cfg, 8123, "int8")


def test_in_process_async_trains_beside_the_sync_row():
    """One process, S = 1 (the engine on its own copy of the weights): both variants train
    the same number of trajectories; the asynchronous one trains one-version-old tokens
    and gets its overlap figures against the synchronous row."""
    names = ("local-sync", "local-async-1")
    data = overlap.run([CONFIG], variants={n: overlap.VARIANTS[n] for n in names}, steps=2,
                       warmup=1, extra=SMALL)
    (result,) = data["results"]
    sync, late = result["variants"]
    assert (sync["variant"], late["variant"]) == names and not result["refused"]
    for row in (sync, late):
        assert row["steps"] == 2 and row["trajectories"] == 2 * 4 * 8 and row["tokens"] > 0
        assert 0 < row["learner_busy"] <= 1 and 0 <= row["accuracy"] <= 1
    assert sync["stale_frac"] == 0 and late["stale_frac"] > 0
    assert sync["staleness_max"] == 0 and late["staleness_max"] == 1
    assert result["derived"]["local-async-1_over_larger_stage"] > 0


def listening(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


@pytest.mark.slow
def test_remote_variants_train_the_in_process_trajectories(monkeypatch):
    urls = []
    real = overlap.train_variant

    def spy(cfg, name, warmup):  # the server each remote variant trained against
        urls.extend(cfg.engine.remote_urls)
        return real(cfg, name, warmup)

    monkeypatch.setattr(overlap, "train_variant", spy)
    names = ("local-sync", "remote-sync", "remote-async-1")
    data = overlap.run([CONFIG], variants={n: overlap.VARIANTS[n] for n in names}, steps=3,
                       warmup=1, extra=SMALL)
    (result,) = data["results"]
    by = {r["variant"]: r for r in result["variants"]}
    assert set(by) == set(names) and not result["refused"]
    # the same seeds and weights: the server samples what the in-process engine samples
    assert by["remote-sync"]["tokens"] == by["local-sync"]["tokens"]
    assert by["remote-sync"]["accuracy"] == by["local-sync"]["accuracy"]
    assert by["remote-async-1"]["trajectories"] == by["remote-sync"]["trajectories"] == 96
    assert by["remote-async-1"]["staleness_max"] <= 1
    assert by["remote-sync"]["server_dtype"] == "float32"
    assert "remote-async-1_over_larger_stage" in result["derived"]
    assert len(urls) == 2 and not any(listening(u) for u in urls)  # each server stopped


def test_the_rollout_side_loads_published_weights_when_the_producer_activates_them():
    """The learner's thread publishes and stages (`Stages.publish(v, activate=False)`), the
    producer activates the latest staged version; the trainer's next publication waits
    while an activation runs (it would replace the folder being loaded)."""
    calls, loading, release = [], threading.Event(), threading.Event()

    class Rollout:
        version = 0

        def stage(self, weights):
            calls.append(("stage", weights.version))

        def activate(self, version):
            loading.set()
            release.wait(10)
            calls.append(("load", version))

    class Trainer:
        def publish(self, version):
            calls.append(("write", version))
            return Published(version, f"v{version}", 1)

    stages = SimpleNamespace(rollout_stage=Rollout(), learner=Trainer(),
                             _publishing=threading.Lock(), _staged=None)
    for v in (1, 2):  # what loop.learn does, twice before the producer activates
        Stages.publish(stages, v, activate=False)
    assert calls == [("write", 1), ("stage", 1), ("write", 2), ("stage", 2)]
    producer = threading.Thread(target=Stages.activate, args=(stages,))
    producer.start()
    assert loading.wait(10)
    writer = threading.Thread(target=Stages.publish, args=(stages, 3, False))
    writer.start()  # the next publication replaces the folder being read: it waits
    time.sleep(0.2)
    assert calls[-1] == ("stage", 2)
    release.set()
    producer.join(10)
    writer.join(10)
    assert calls[4:] == [("load", 2), ("write", 3), ("stage", 3)]  # latest wins
    assert Stages.activate(stages) > 0.0 and calls[-1] == ("load", 3)
    assert Stages.activate(stages) == 0.0  # nothing left behind
