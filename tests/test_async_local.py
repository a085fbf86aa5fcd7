"""Asynchronous training in one process with staleness >= 1: the native engine keeps its own
copy of the weights, taken on the trainer's thread at a publication and installed between
two steps' rollouts, so an update in progress never reaches tokens being sampled."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from rollwise.compose.config import ConfigError, to_toml
from rollwise.compose.preflight import check_config
from rollwise.engine import NativeEngine, SamplingParams
from rollwise.pipeline.build import build, run_steps
from rollwise.pipeline.loop import train
from rollwise.run.rundir import Run

sys.path.insert(0, str(Path(__file__).parent))
from test_async import assert_same_metrics, records, small

EOS = 2
PROMPTS = [[1, 5, 9, 14], [1, 7, 7, 3, 11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _outputs(engine) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for c in engine.generate(PROMPTS, GREEDY)]


def _step_in_place(model, seed: int) -> None:
    """What an optimizer step does to the tensors the engine would read: changed in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std().clamp(min=1e-3) * 0.5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_its_own_weights_sees_an_update_only_when_published(tiny_llama, dtype):
    model = tiny_llama()
    before = copy.deepcopy(model)
    engine = NativeEngine(model, eos_token_ids=[EOS], dtype=dtype, own_weights=True)
    assert not engine.decoder.shared  # float32 too: a copy, not the parameters
    old = _outputs(engine)
    assert old == _outputs(NativeEngine(before, eos_token_ids=[EOS], dtype=dtype))

    taken = engine.take()  # the trainer's thread, right after an update
    _step_in_place(model, seed=1)  # the next update, while the rollouts still run
    new = _outputs(NativeEngine(copy.deepcopy(model), eos_token_ids=[EOS], dtype=dtype))
    assert new != old  # the update changes what the model generates
    assert _outputs(engine) == old  # ... but not what this engine generates

    engine.publish(1, taken)  # installed between two steps: the weights taken, not today's
    assert _outputs(engine) == old and engine.version == 1
    engine.publish(2)  # taken now: today's weights
    assert _outputs(engine) == new


def test_shared_float32_engine_reads_updates_at_once(tiny_llama):
    """The reason for the copy: without it, a float32 engine reads the parameters."""
    model = tiny_llama()
    engine = NativeEngine(model, eos_token_ids=[EOS])
    assert engine.decoder.shared and engine.take() is None
    old = _outputs(engine)
    _step_in_place(model, seed=1)
    assert _outputs(engine) != old


def _train(cfg, name: str):
    cfg.run.name = name
    root = Path(cfg.run.output_dir) / name
    stages = build(cfg)
    start = [p.detach().clone() for p in stages.policy.model.parameters()]
    run = Run(root, resume=False, config_toml=to_toml(cfg), echo=lambda s: None)
    train(stages, run, cfg.run.num_steps, eval_every=cfg.eval.every, steps=run_steps(cfg))
    return stages, start, records(root)


def test_in_process_async_overlaps_within_the_staleness_bound(tmp_path):
    cfg = small(tmp_path, "schedule.mode='async'", "schedule.max_staleness=1",
                "run.num_steps=4")
    check_config(cfg)  # allowed now: the native engine keeps its own copy
    stages, start, out = _train(cfg, "a1")
    assert not stages.rollout_stage.engine.decoder.shared
    evaluator = stages.evaluator.engine
    assert evaluator.decoder is not stages.rollout_stage.engine.decoder  # its own weights
    trains = [r for r in out if r["kind"] == "train"]
    assert [r["step"] for r in trains] == [1, 2, 3, 4]
    for r in trains:  # step k's rollouts began with version k-2 or k-1, never older
        assert r["step"] - 2 <= r["rollout_started_version"] <= r["step"] - 1 or r["step"] == 1
        assert r["staleness_hist_2"] == r["staleness_hist_3plus"] == 0
        assert r["traj_requested"] == (r["traj_trained"] + r["traj_filtered"]
                                       + r["traj_stale_dropped"])
    # the producer ran ahead: some step trained rollouts one version old
    assert sum(r["staleness_hist_1"] for r in trains) > 0
    moved = [not torch.equal(a, b.detach())
             for a, b in zip(start, stages.policy.model.parameters())]
    assert sum(moved) == len(moved)  # every parameter was trained
    assert len([r for r in out if r["kind"] == "eval"]) == 3  # steps 0, 2, 4


def test_in_process_async_needs_the_native_engine(tmp_path):
    with pytest.raises(ConfigError, match="needs engine.name='native'"):
        check_config(small(tmp_path, "schedule.mode='async'", "schedule.max_staleness=1",
                           "engine.name='hf'"))


def _train_seeing_caches(cfg, name: str, *, release: bool = True):
    """Train `cfg`; the rollout engine's key/value bytes at each update's start, the
    evaluator's after each evaluation, the run's records and the stages."""
    cfg.run.name = name
    stages = build(cfg)
    built_to_release = stages.release_engine_cache
    stages.release_engine_cache &= release
    rollout, evaluator = stages.rollout_stage.engine, stages.evaluator.engine
    at_update, after_eval = [], []
    update, evaluate = stages.learner.update, stages.evaluate

    def spy_update(batch):
        at_update.append(rollout.cache.nbytes())
        return update(batch)

    def spy_eval():
        out = evaluate()
        after_eval.append(evaluator.cache.nbytes())
        return out

    stages.learner.update, stages.evaluate = spy_update, spy_eval
    run = Run(Path(cfg.run.output_dir) / name, resume=False, config_toml=to_toml(cfg),
              echo=lambda s: None)
    train(stages, run, cfg.run.num_steps, eval_every=cfg.eval.every, steps=run_steps(cfg))
    return at_update, after_eval, records(Path(cfg.run.output_dir) / name), built_to_release


def test_idle_engine_caches_are_freed_and_change_nothing(tmp_path):
    """A synchronous update runs with the rollout engine's key/value cache freed (its memory
    is the update's to reuse), and every evaluation frees its engine's cache; the records
    are those of a run that keeps the cache, number for number. In process with staleness
    1 the producer's cache is in use during updates and is kept."""
    kept, _, plain, _ = _train_seeing_caches(small(tmp_path), "kept", release=False)
    freed, evals, released, built = _train_seeing_caches(small(tmp_path), "released")
    assert built and min(kept) > 0 and freed == [0] * len(kept)
    assert evals == [0, 0, 0]  # steps 0, 2, 3
    assert_same_metrics(plain, released)
    busy, _, _, built = _train_seeing_caches(
        small(tmp_path, "schedule.mode='async'", "schedule.max_staleness=1"), "async")
    assert len(busy) == 3 and not built


def test_the_staleness_bound_runs_on_the_producer_before_its_state_is_taken(tmp_path,
                                                                            monkeypatch):
    """Step k trains at version k, so the producer applies the bound itself: what
    'regenerate' rolls out again never runs beside its own rollouts, and the stages' state a
    checkpoint keeps with the batch is taken after it (the controller has seen the
    regenerated groups)."""
    import threading

    from rollwise.pipeline import collect
    from rollwise.pipeline.stages import Stages

    calls = []
    real_split, real_state = collect.split_stale, Stages.own_state

    def split(groups, version, max_staleness):
        calls.append(("bound", threading.current_thread().name, version))
        return real_split(groups, version, max_staleness)

    def state(self):
        calls.append(("state", threading.current_thread().name, None))
        return real_state(self)

    monkeypatch.setattr(collect, "split_stale", split)
    monkeypatch.setattr(Stages, "own_state", state)
    cfg = small(tmp_path, "schedule.mode='async'", "schedule.max_staleness=1",
                "schedule.stale_policy='regenerate'")
    _, _, out = _train(cfg, "bounded")
    producer = [(kind, v) for kind, thread, v in calls if thread == "rollwise-producer"]
    assert producer == [("bound", 0), ("state", None), ("bound", 1), ("state", None),
                        ("bound", 2), ("state", None)]
    assert all(thread == "rollwise-producer" for kind, thread, _ in calls if kind == "bound")
    trains = [r for r in out if r["kind"] == "train"]
    assert [r["stale_groups"] for r in trains] == [0, 0, 0]  # in process: never over S
    assert all("rolled_staleness_hist_0" in r for r in trains)
