"""Multi-turn episodes through the native engine (tiny model): the trajectory layout
(sampled vs inserted tokens, turn spans), environments that fail or overrun, the overlap
of environment steps with decoding, tree rollouts sharing prefixes, and token faithfulness
(the learner's log-prob path reproduces the engine's log-probs of every sampled token)."""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import pytest
import torch

from rollwise.engine import NativeEngine, SamplingParams
from rollwise.envs.base import StepResult
from rollwise.envs.render import TurnRenderer
from rollwise.learner.batch import collate
from rollwise.learner.logprobs import token_logprobs
from rollwise.models.tiny import build_tokenizer
from rollwise.rollout.episodes import EpisodeRunner
from rollwise.types import EncodedPrompt, Sample

STOPS = [2, 3, 5, 7, 11, 13]  # ~7% stop chance per token: turn lengths vary


class ScriptedEnv:
    """Observation "ok K" after turn K, reward 0.25 a step, done after `done_after` steps;
    optionally raises at step `raise_at` or sleeps `sleep` seconds a step."""

    tools: ClassVar[list[dict]] = []

    def __init__(self, done_after=9, raise_at=0, sleep=0.0, malformed=0):
        self.done_after, self.raise_at, self.sleep, self.malformed = (
            done_after, raise_at, sleep, malformed)
        self.k = 0
        self.busy = threading.Event() if sleep else None  # (None: deep-copyable)

    def reset(self, sample):
        self.k = 0
        return "go"

    def step(self, action):
        self.k += 1
        if self.k == self.raise_at:
            raise RuntimeError("boom")
        if self.busy is not None:
            self.busy.set()
            time.sleep(self.sleep)
            self.busy.clear()
        return StepResult(f"ok {self.k}", 0.25, self.k >= self.done_after,
                          {"state": f"t{self.k}", "malformed": self.malformed})


@pytest.fixture
def model(tiny_llama):
    m = tiny_llama()
    with torch.no_grad():
        m.model.norm.weight.mul_(4.0)
    return m


def _runner(model, make_env, **kw) -> tuple[EpisodeRunner, NativeEngine]:
    tok = build_tokenizer()
    engine = NativeEngine(model, eos_token_ids=[2])
    params = SamplingParams(n=kw.pop("n", 2), temperature=1.0, max_tokens=kw.pop("max_tokens", 12),
                            stop_token_ids=STOPS)
    renderer = TurnRenderer(tok, chat=False, stop_ids=STOPS)
    return EpisodeRunner(engine, params, make_env, renderer, tok.decode, **kw), engine


def _prompts(k: int) -> list[EncodedPrompt]:
    return [EncodedPrompt(Sample(id=f"p{i}", prompt="go", answer=""), [1, 20 + i, 30 + i, 40])
            for i in range(k)]


def test_trajectory_layout_sampled_and_inserted_tokens(model):
    runner, _ = _runner(model, lambda: ScriptedEnv(done_after=9, malformed=1), max_turns=3,
                        seed=1)
    groups, figures, counts = runner.run(_prompts(3))
    renderer = runner.renderer
    assert [len(g.trajectories) for g in groups] == [2, 2, 2]
    for g in groups:
        for t in g.trajectories:
            assert len(t.turns) == 3 and t.turn_rewards == [0.25] * 3
            assert t.turn_states == ["go", "t1", "t2"] and t.reward == pytest.approx(0.75)
            T = len(t.response_ids)
            assert len(t.loss_mask) == len(t.logprobs) == len(t.versions) == T
            cursor = 0
            for k, (a, b) in enumerate(t.turns):
                assert all(t.loss_mask[a:b]) and a == cursor
                if k < 2:  # the observation after turn k: exactly the renderer's tokens
                    obs = renderer.observation_ids(f"ok {k + 1}", t.response_ids[a:b])
                    assert t.response_ids[b: b + len(obs)] == obs
                    assert t.loss_mask[b: b + len(obs)] == [0] * len(obs)
                    assert t.logprobs[b: b + len(obs)] == [0.0] * len(obs)
                    cursor = b + len(obs)
            assert t.turns[-1][1] == T  # the last turn ends the trajectory
    assert counts.episodes == 6 and counts.turns == 18 and counts.malformed_calls == 18
    # every turn after the first resubmits the history: prompt + response before the obs
    assert counts.prefix_reuse_tokens == sum(
        2 * len(t.prompt_ids) + t.turns[0][1] + t.turns[1][1]
        for g in groups for t in g.trajectories)
    assert figures.trained_tokens == sum(sum(t.loss_mask) for g in groups for t in g.trajectories)


def test_episode_ends_when_env_says_done(model):
    runner, _ = _runner(model, lambda: ScriptedEnv(done_after=2), max_turns=5)
    groups, _, counts = runner.run(_prompts(2))
    assert {len(t.turns) for g in groups for t in g.trajectories} == {2}
    assert counts.turns == 8


def test_env_that_raises_or_overruns_ends_its_episode_with_reward_zero(model):
    made = []

    def make():
        env = ScriptedEnv(done_after=9, raise_at=2 if len(made) == 0 else 0,
                          sleep=1.5 if len(made) == 1 else 0.0)
        made.append(env)
        return env

    runner, _ = _runner(model, make, max_turns=3, env_timeout_s=0.3)
    start = time.perf_counter()
    groups, _, counts = runner.run(_prompts(2))
    assert time.perf_counter() - start < 1.5  # the overrunning step was not waited for
    trajs = [t for g in groups for t in g.trajectories]
    raised, slow = trajs[0], trajs[1]
    assert raised.reward == 0.0 and "RuntimeError: boom" in raised.reward_errors[0].message
    assert len(raised.turns) == 2 and raised.scores["correct"] == 0.0
    assert slow.reward == 0.0 and "time limit" in slow.reward_errors[0].message
    assert counts.env_errors == 2
    assert all(t.reward == pytest.approx(0.75) and not t.reward_errors for t in trajs[2:])


def test_env_steps_overlap_with_other_episodes_decoding(model):
    """While one episode's (slow) environment step runs, the engine keeps stepping the
    other episodes' turns."""
    envs = []

    def make():
        envs.append(ScriptedEnv(done_after=9, sleep=0.2 if not envs else 0.0))
        return envs[-1]

    runner, engine = _runner(model, make, max_turns=3, max_tokens=16)
    during = []
    step = engine.step

    def counting_step(**kw):
        during.append(envs[0].busy.is_set())
        return step(**kw)

    engine.step = counting_step
    runner.run(_prompts(4))
    assert sum(during) >= 3  # engine steps taken while episode 0's environment worked


def test_tree_rollouts_branch_at_turn_boundaries_and_share_prefixes(model):
    runner, _engine = _runner(model, lambda: ScriptedEnv(done_after=9), max_turns=3, n=4,
                             branches=2, depth=1)
    groups, _, counts = runner.run(_prompts(2))
    for g in groups:
        trajs = g.trajectories
        assert sorted(t.tree for t in trajs) == [0, 0, 1, 1]
        for tree in (0, 1):
            a, b = [t for t in trajs if t.tree == tree]
            first = a.turns[1][0]  # turn 1 and its observation are shared
            assert a.response_ids[:first] == b.response_ids[:first]
            assert a.turns[0] == b.turns[0]
        t0 = next(t for t in trajs if t.tree == 0)
        t1 = next(t for t in trajs if t.tree == 1)
        assert t0.response_ids[: t0.turns[0][1]] != t1.response_ids[: t1.turns[0][1]]
    # identical prompts: a group's 2 roots (turn 1) and each tree's 2 leaves (turn 2)
    assert counts.episodes == 8 and counts.prefix_shared_requests == 2 + 4
    # and the engine computes each shared prompt once
    assert counts.prefill_tokens < counts.prompt_tokens
    with pytest.raises(ValueError, match="multiple of 2"):
        runner.run(_prompts(1), sizes=[3])


def test_context_limit_ends_episodes(model):
    runner, _engine = _runner(model, lambda: ScriptedEnv(done_after=9), max_turns=8,
                             max_context=40, max_tokens=12)
    groups, _, counts = runner.run(_prompts(2))
    for g in groups:
        for t in g.trajectories:
            assert len(t.prompt_ids) + len(t.response_ids) <= 40
    assert counts.truncated_context >= 1
    short, _ = _runner(model, lambda: ScriptedEnv(), max_context=4)  # no room for a turn
    groups, _, counts = short.run(_prompts(1))
    assert counts.truncated_context == 2 and groups[0].trajectories[0].response_ids == []


def test_kept_kv_computes_only_the_new_tokens_of_each_turn(model):
    """keep_kv (the default): each later turn takes the history's keys/values from the
    previous turn (all but its last sampled token, never fed back) and computes only the
    rest; the episodes are the same tokens as with a full prefill of every turn, and their
    log-probs differ by float32 rounding only (see tests/test_kv_reuse.py)."""
    kept, _ = _runner(model, lambda: ScriptedEnv(done_after=9), max_turns=3, seed=3)
    plain, _ = _runner(model, lambda: ScriptedEnv(done_after=9), max_turns=3, seed=3,
                       keep_kv=False)
    (g1, _, c1), (g2, _, c2) = kept.run(_prompts(3)), plain.run(_prompts(3))
    t1 = [t for g in g1 for t in g.trajectories]
    t2 = [t for g in g2 for t in g.trajectories]
    assert [t.response_ids for t in t1] == [t.response_ids for t in t2]
    assert max(abs(a - b) for x, y in zip(t1, t2) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4
    resubmitted = c1.turns - c1.episodes  # every turn after an episode's first
    assert c1.kv_reused_tokens == c1.prefix_reuse_tokens - resubmitted > 0
    # without it every turn's prompt is computed (but a group's shared 4-token first one)
    assert c2.kv_reused_tokens == 0
    assert c2.prefill_tokens == c2.prompt_tokens - 4 * c2.prefix_shared_requests
    assert c1.prefill_tokens == c2.prefill_tokens - c1.kv_reused_tokens


@pytest.mark.parametrize("share_prompts", [True, False])
def test_token_faithfulness_learner_logprobs_match_engine(model, share_prompts):
    """Every sampled token of every multi-turn trajectory, replayed through the learner's
    log-prob path on the collated batch, gets the engine's log-prob (float32: 1e-4);
    env tokens are not in the loss."""
    runner, _ = _runner(model, lambda: ScriptedEnv(done_after=9), max_turns=3, n=4,
                        max_tokens=16)
    groups, _, _ = runner.run(_prompts(3))
    trajs = [t for g in groups for t in g.trajectories]
    batch = collate(trajs, torch.zeros(len(trajs)), torch.zeros(len(trajs), dtype=torch.long),
                    pad_id=0)
    assert 0 < batch.num_response_tokens < int(batch.attention_mask.sum()) - 4 * len(trajs)
    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask,
                            share_prompts=share_prompts)
    m = batch.loss_mask.bool()
    assert int(m.sum()) == sum(sum(t.loss_mask) for t in trajs)
    assert torch.allclose(lp[m], batch.old_logprobs[m], atol=1e-4, rtol=0)


def test_trajectory_store_keeps_the_episode_layout(model):
    from rollwise.replay import TrajectoryStore

    runner, _ = _runner(model, lambda: ScriptedEnv(done_after=9), max_turns=3, n=2,
                        branches=2, depth=1)
    groups, _, _ = runner.run(_prompts(2))
    store = TrajectoryStore(":memory:")
    store.add_groups(1, groups)
    back = store.load_groups(1)
    for g, h in zip(groups, back, strict=True):
        for t, u in zip(g.trajectories, h.trajectories, strict=True):
            assert (u.loss_mask, u.turns, u.turn_rewards, u.turn_states, u.tree) == (
                t.loss_mask, t.turns, t.turn_rewards, t.turn_states, t.tree)
            assert u.response_ids == t.response_ids and u.reward == t.reward
    assert store.delete_after(0) == 4 and store.load_groups(1) == []


def test_bench_episodes_command_counts_what_the_kept_cache_saves(tmp_path):
    """`rollwise bench episodes` (tiny guess game, float32): both sides roll out the same
    episodes; the kept side computes fewer prompt tokens, by exactly what it took from the
    kept caches, and the JSON and page are written."""
    import json

    from typer.testing import CliRunner

    from rollwise.cli import app

    out = tmp_path / "episodes.json"
    result = CliRunner().invoke(app, [
        "bench", "episodes", "--rounds", "2", "--prompts", "2", "--json", str(out),
        "--set", "rollout.group_size=4", "--set", "task.num_train=16"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    kept, plain = data["sides"]
    assert (kept["side"], plain["side"]) == ("kept", "recomputed")
    assert data["same_episodes"] == "16/16" and kept["turns"] == plain["turns"]
    assert kept["prompt_tokens"] == plain["prompt_tokens"] and plain["kv_reused_tokens"] == 0
    # at most the history less each turn's last token; fewer where a group's episodes made
    # the same moves (identical next prompts share one prefix, and one kept cache)
    assert (0 < kept["kv_reused_tokens"]
            <= kept["reusable_tokens"] - (kept["turns"] - kept["episodes"]))
    assert kept["prefill_tokens"] == plain["prefill_tokens"] - kept["kv_reused_tokens"]
    assert out.with_suffix(".html").is_file()
