"""Multi-turn episodes through the request engine: each turn is one engine request.

    for every episode of every group (concurrently):
        turn k: submit(history ids) -> the policy's tokens (sampled, trained)
                env.step(decoded turn) in a worker thread, while the engine decodes the
                other episodes' turns
                observation -> its tokens (inserted, masked) appended to the history
        until the environment says done, max_turns, or the context is full

A trajectory's `response_ids` is the whole history after the prompt, with `loss_mask`
telling sampled from inserted tokens and `turns` the spans of the policy's turns: the
learner trains on exactly the tokens the engine sampled (nothing is re-tokenized).

Tree rollouts (Tree-GRPO): with `branches` b > 1, a group of n episodes starts as
n / b^depth trees; after each of the first `depth` turns every episode forks into b
(environment copied), and the copies' next requests have identical prompts, which the
engine's prefix sharing computes once. An episode that ends before a fork is copied as is
(the tree's leaves stay n). Each trajectory records its tree.

Prefix reuse: every turn after the first resubmits the history, whose keys/values the
previous turn computed. With `keep_kv` (the default) each turn that may be followed by
another is submitted as a conversation turn: the engine keeps its keys/values when it
finishes and the next turn computes only the observation it appends. Figures:
`prefix_reuse_tokens` counts the reusable history tokens, `kv_reused_tokens` those the
engine actually took from a kept cache (fewer when memory pressure or a publication dropped
it), `prefix_shared_requests` the requests submitted with a prompt identical to a
concurrent one (tree forks: computed once by the engine's prefix sharing).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from rollwise.engine.base import RequestEngine, SamplingParams
from rollwise.engine.sampling import derive_seed
from rollwise.envs.base import Env, StepResult
from rollwise.envs.render import TurnRenderer
from rollwise.rollout.figures import RolloutFigures
from rollwise.types import CORRECT, Completion, EncodedPrompt, Group, RewardIssue, Trajectory


@dataclass
class EpisodeFigures:
    """Episode counters of one round; they add like `RolloutFigures`."""

    episodes: int = 0
    turns: int = 0
    successes: int = 0
    malformed_calls: int = 0  # tool calls (or moves) the environment could not read
    env_errors: int = 0  # environments that raised or overran their time limit
    env_seconds: float = 0.0  # time spent in env.step (overlapped with decoding)
    prefix_reuse_tokens: int = 0  # history tokens resubmitted: reusable from the last turn
    prompt_tokens: int = 0  # prompt tokens of every turn's request
    prefix_shared_requests: int = 0  # requests whose prompt equals a concurrent one's
    prefill_tokens: int = 0  # prompt tokens the engine actually computed
    kv_reused_tokens: int = 0  # history tokens whose keys/values the engine kept from a turn
    truncated_context: int = 0  # episodes ended because the context was full

    def __add__(self, other: EpisodeFigures) -> EpisodeFigures:
        return EpisodeFigures(**{n: getattr(self, n) + getattr(other, n)
                                 for n in self.__dataclass_fields__})

    def metrics(self) -> dict[str, float]:
        n = max(self.episodes, 1)
        return {"episode_turns_mean": self.turns / n, "episode_success": self.successes / n,
                "malformed_calls": float(self.malformed_calls),
                "env_errors": float(self.env_errors), "env_seconds": self.env_seconds,
                "prefix_reuse_tokens": float(self.prefix_reuse_tokens),
                "prefix_reuse_frac": self.prefix_reuse_tokens / max(self.prompt_tokens, 1),
                "prefix_shared_requests": float(self.prefix_shared_requests),
                "kv_reused_tokens": float(self.kv_reused_tokens),
                "kv_reuse_frac": self.kv_reused_tokens / max(self.prompt_tokens, 1),
                "episode_prefill_tokens": float(self.prefill_tokens)}


@dataclass
class _Episode:
    group: int
    tree: int
    env: Env
    prompt: list[int]  # [P] the first prompt
    seed: int
    response: list[int] = field(default_factory=list)  # [T] everything after the prompt
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_states: list[str] = field(default_factory=list)
    state: str = ""  # the state the next turn acts in
    last: Completion | None = None
    success: bool = False
    error: str = ""
    finished: bool = False

    @property
    def history(self) -> list[int]:
        return self.prompt + self.response


class EpisodeRunner:
    """Runs groups of episodes through `engine` (any `RequestEngine`); `make_env()` gives
    a fresh environment per episode. `params.max_tokens` is each turn's budget;
    `max_context` bounds a whole episode's tokens (prompt + all turns)."""

    def __init__(self, engine: RequestEngine, params: SamplingParams, make_env: Callable[[], Env],
                 renderer: TurnRenderer, decode: Callable[[list[int]], str], *,
                 max_turns: int = 4, max_context: int = 2048, env_timeout_s: float = 10.0,
                 branches: int = 1, depth: int = 1, keep_kv: bool = True, seed: int = 0,
                 env_workers: int = 4):
        if branches < 1 or depth < 0:
            raise ValueError(f"branches must be >= 1 and depth >= 0, got {branches}, {depth}")
        self.engine, self.params, self.make_env = engine, replace(params, n=1), make_env
        self.group_size = params.n
        self.renderer, self.decode, self.max_turns = renderer, decode, max_turns
        self.max_context, self.env_timeout_s = max_context, env_timeout_s
        self.branches, self.depth, self.seed = branches, depth if branches > 1 else 0, seed
        self.env_workers, self.keep_kv = env_workers, keep_kv
        self._round = 0

    @property
    def version(self) -> int:
        return self.engine.version

    def publish(self, version: int) -> None:
        self.engine.publish(version)

    def roots(self, n: int) -> int:
        """Trees per group of n episodes (n itself without branching)."""
        leaves = self.branches ** self.depth
        if n % leaves:
            raise ValueError(f"a group of {n} episodes cannot be trees of "
                             f"{self.branches}^{self.depth} = {leaves} leaves; make the group "
                             f"size a multiple of {leaves}")
        return n // leaves

    def run(self, prompts: list[EncodedPrompt], sizes: list[int] | None = None,
            params: SamplingParams | None = None,
            ) -> tuple[list[Group], RolloutFigures, EpisodeFigures]:
        """Groups for `prompts` (`sizes[i]` episodes of prompt i), in order; with the round's
        engine figures and episode figures."""
        params = replace(params, n=1) if params is not None else self.params
        sizes = sizes or [self.group_size] * len(prompts)
        self._round += 1
        episodes: list[_Episode] = []
        for g, (p, n) in enumerate(zip(prompts, sizes, strict=True)):
            for t in range(self.roots(n)):
                env = self.make_env()
                ep = _Episode(g, t, env, list(p.ids),
                              derive_seed(self.seed, self._round * 1_000_003 + len(episodes)))
                first = p.sample.prompt
                ep.state = first if isinstance(first, str) else first[-1]["content"]
                try:
                    env.reset(p.sample)
                except Exception as e:  # noqa: BLE001 -- an env failure ends its episode
                    ep.error, ep.finished = f"env: reset raised {type(e).__name__}: {e}", True
                episodes.append(ep)
        figures, counts = self._loop(episodes, params)
        groups = [Group(sample=p.sample, trajectories=[]) for p in prompts]
        for ep in episodes:
            groups[ep.group].trajectories.append(self._trajectory(ep, prompts[ep.group]))
        counts.episodes = len(episodes)
        counts.successes = sum(ep.success for ep in episodes)
        counts.turns = sum(len(ep.turns) for ep in episodes)
        trajs = [t for g in groups for t in g.trajectories]
        figures.trained_tokens = sum(sum(t.sampled_mask) for t in trajs)
        figures.lengths = [t.num_tokens for t in trajs]
        return groups, figures, counts

    def _loop(self, episodes: list[_Episode], params: SamplingParams,
              ) -> tuple[RolloutFigures, EpisodeFigures]:
        counts = EpisodeFigures()
        before = replace(self.engine.stats)
        start = time.perf_counter()
        by_rid: dict[int, _Episode] = {}
        acting: dict[int, tuple[_Episode, Future, float]] = {}  # id(ep) -> env step running
        pool = ThreadPoolExecutor(self.env_workers, thread_name_prefix="rollwise-env")
        try:
            self._submit_all([e for e in episodes if not e.finished], params, by_rid, counts)
            while by_rid or acting:
                if by_rid:
                    for c in self.engine.step():
                        ep = by_rid.pop(c.request_id)
                        self._record_turn(ep, c)
                        action = self.decode(c.token_ids)
                        acting[id(ep)] = (ep, pool.submit(self._timed_step, ep.env, action),
                                          time.perf_counter())
                else:
                    time.sleep(0.0005)  # only environments are working
                ready = []
                for key, (ep, fut, began) in list(acting.items()):
                    overdue = time.perf_counter() - began > self.env_timeout_s
                    if fut.done() or overdue:
                        del acting[key]
                        ready.append((ep, fut, overdue and not fut.done()))
                nxt = []
                for ep, fut, overdue in ready:
                    nxt += self._after_step(ep, fut, overdue, counts, episodes)
                self._submit_all(nxt, params, by_rid, counts)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        s = self.engine.stats
        counts.prefill_tokens = s.prefill_tokens - before.prefill_tokens
        counts.kv_reused_tokens = s.reused_tokens - before.reused_tokens
        return RolloutFigures(
            makespan_s=time.perf_counter() - start,
            generated_tokens=s.generated_tokens - before.generated_tokens,
            forward_passes=s.forward_passes - before.forward_passes,
            row_forwards=s.row_forwards - before.row_forwards), counts

    @staticmethod
    def _timed_step(env: Env, action: str) -> tuple[StepResult, float]:
        began = time.perf_counter()
        return env.step(action), time.perf_counter() - began

    def _record_turn(self, ep: _Episode, c: Completion) -> None:
        begin = len(ep.response)
        ep.response += c.token_ids
        ep.logprobs += c.logprobs
        ep.versions += c.versions or [self.version] * len(c.token_ids)
        ep.mask += [1] * len(c.token_ids)
        ep.turns.append((begin, len(ep.response)))
        ep.turn_states.append(ep.state)
        ep.last = c

    def _after_step(self, ep: _Episode, fut: Future, overdue: bool, counts: EpisodeFigures,
                    episodes: list[_Episode]) -> list[_Episode]:
        """Apply an environment step; the episodes (this one and its forks) to submit next."""
        if overdue:
            ep.error = f"env: step overran its time limit of {self.env_timeout_s}s"
        else:
            try:
                result, seconds = fut.result()
                counts.env_seconds += seconds
            except Exception as e:  # noqa: BLE001 -- an env failure ends its episode
                ep.error = f"env: step raised {type(e).__name__}: {e}"
        if ep.error:
            counts.env_errors += 1
            ep.turn_rewards.append(0.0)
            ep.finished = True
            return []
        counts.malformed_calls += int(result.info.get("malformed", 0))
        ep.turn_rewards.append(float(result.reward))
        ep.success = bool(result.info.get("success", ep.success))
        if result.done or len(ep.turns) >= self.max_turns:
            ep.finished = True
        else:
            obs = self.renderer.observation_ids(result.observation, ep.last.token_ids)
            if len(ep.history) + len(obs) + self.params.max_tokens + 1 > self.max_context:
                counts.truncated_context += 1
                ep.finished = True
            else:
                ep.response += obs
                ep.logprobs += [0.0] * len(obs)
                ep.versions += [ep.versions[-1] if ep.versions else self.version] * len(obs)
                ep.mask += [0] * len(obs)
                ep.state = str(result.info.get("state", result.observation))
        forks = self._fork(ep, episodes)
        return [] if ep.finished else [ep, *forks]

    def _fork(self, ep: _Episode, episodes: list[_Episode]) -> list[_Episode]:
        """Tree rollouts: after turn k <= depth, b - 1 copies that go on (and fork again at
        later turns); an episode that ended at turn k is copied b^(depth - k + 1) - 1 times
        as finished leaves, so every tree keeps b^depth leaves."""
        k = len(ep.turns)
        if self.branches == 1 or k > self.depth:
            return []
        copies = self.branches ** (self.depth - k + 1) - 1 if ep.finished else self.branches - 1
        forks = []
        for _ in range(copies):
            twin = copy.copy(ep)
            for name in ("response", "logprobs", "versions", "mask", "turns", "turn_rewards",
                         "turn_states"):
                setattr(twin, name, list(getattr(ep, name)))
            if not ep.finished:
                try:  # the environment's own clone() where it has one, else a deep copy
                    clone = getattr(ep.env, "clone", None)
                    twin.env = clone() if clone is not None else copy.deepcopy(ep.env)
                except Exception as e:  # noqa: BLE001 -- the copy's episode ends instead
                    twin.error = f"env: cannot copy for a tree branch: {type(e).__name__}: {e}"
                    twin.finished = True
            twin.seed = derive_seed(ep.seed, 7919 + len(episodes))
            episodes.append(twin)
            forks.append(twin)
        return [] if ep.finished else [f for f in forks if not f.finished]

    def _submit_all(self, eps: list[_Episode], params: SamplingParams,
                    by_rid: dict[int, _Episode], counts: EpisodeFigures) -> None:
        seen: dict[tuple[int, ...], int] = {}
        for ep in eps:
            ids = ep.history
            key = tuple(ids)
            if key in seen:
                counts.prefix_shared_requests += 1
            seen[key] = 1
            counts.prompt_tokens += len(ids)
            if ep.turns:  # everything but the last observation was in the last request
                counts.prefix_reuse_tokens += len(ep.prompt) + ep.turns[-1][1]
            budget = min(params.max_tokens, self.max_context - len(ids) - 1)
            if budget < 1:  # a first prompt longer than max_episode_tokens
                counts.truncated_context += 1
                ep.finished = True
                continue
            # the last allowed turn has no successor to keep its keys/values for
            more = self.keep_kv and len(ep.turns) + 1 < self.max_turns
            rid = self.engine.submit(ids, replace(params, max_tokens=budget),
                                     seed=derive_seed(ep.seed, len(ep.turns)), tag=ep.group,
                                     keep_kv=more)
            by_rid[rid] = ep

    def _trajectory(self, ep: _Episode, prompt: EncodedPrompt) -> Trajectory:
        reward = sum(ep.turn_rewards) if not ep.error else 0.0
        last = ep.last.finish_reason if ep.last is not None else "abort"
        t = Trajectory(sample=prompt.sample, prompt_ids=list(ep.prompt),
                       response_ids=list(ep.response), logprobs=list(ep.logprobs),
                       versions=list(ep.versions), finish_reason=last,
                       text=self.decode(ep.response), loss_mask=list(ep.mask),
                       turns=list(ep.turns),
                       turn_rewards=([0.0] * len(ep.turn_rewards) if ep.error
                                     else list(ep.turn_rewards)),
                       turn_states=list(ep.turn_states), tree=ep.tree)
        t.reward = reward
        t.scores = {CORRECT: float(ep.success and not ep.error), "env": reward}
        t.reward_errors = [RewardIssue("error", "env", ep.error.removeprefix("env: "))
                           ] if ep.error else []
        return t


def keep_env_rewards(trajectories: list[Trajectory]) -> Any:
    """The scorer of episode rollouts: the environment already scored them (the episode
    runner set reward, scores and errors); returns the reward pool's counts record."""
    from rollwise.rewards.pool import RewardStats

    errors = sum(bool(t.reward_errors) for t in trajectories)
    return RewardStats(len(trajectories), errors, 0, 0.0)
