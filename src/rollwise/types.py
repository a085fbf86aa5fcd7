"""The typed records that flow through rollwise, one stage to the next.

Data flows one way: a `Sample` (a task instance) becomes a `Group` of `Trajectory`s (its
rollouts, each made from an engine's `Completion`), the trajectories are scored in place, and
the learner receives a `Batch` of padded tensors built from the groups. No stage passes
string-keyed dictionaries of tensors.

`Trajectory` and `Group` also have a plain-data form (`to_plain` / `from_plain`: lists,
dicts, numbers, text) that a checkpoint keeps: the asynchronous driver's batches collected
ahead of training. `Published`, `WeightSlots` and `PublishError` carry the weight-publication
protocol of pipeline/ports.py (publish, stage, activate). Imports nothing of rollwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:  # the records stay importable without torch (tasks, rewards, observe)
    from collections.abc import Callable, Mapping

    import torch

FinishReason = Literal["stop", "length", "abort"]

# The reward term whose score 1 means solved: the task's own verifier (accuracy counts it).
CORRECT = "correct"

# A chat prompt is a list of {"role": ..., "content": ...} messages.
Prompt = str | list[dict[str, str]]

IssueKind = Literal["error", "timeout", "infra", "note"]


@dataclass(frozen=True)
class RewardIssue:
    """Something that happened while one reward term scored one trajectory: an `error`
    (the term raised, returned a non-number, or took its worker down), a `timeout`, an
    `infra` failure (not the completion's fault; the trajectory is masked), or a `note` (a
    remark that came with a valid score, e.g. "2 of 5 tests passed"; not a failure).

    Stored (trajectories.sqlite) as one line of text, the form runs have always written:

    >>> RewardIssue("infra", "correct", "sandbox did not start").to_text()
    'correct: infra: sandbox did not start'
    >>> RewardIssue.from_text("format: timeout after 5s")
    RewardIssue(kind='timeout', term='format', message='timeout after 5s')
    """

    kind: IssueKind
    term: str  # the reward term's name (its key in Trajectory.scores)
    message: str  # what happened; a timeout's reads "timeout after Xs"

    @property
    def failed(self) -> bool:
        """A failed call (counted in the step's reward figures); a note is not one."""
        return self.kind != "note"

    def to_text(self) -> str:
        """The stored form: "term: message" for an error or a timeout, "term: infra:
        message" and "term: note: message" for the other two."""
        tag = f"{self.kind}: " if self.kind in ("infra", "note") else ""
        return f"{self.term}: {tag}{self.message}"

    @classmethod
    def from_text(cls, text: str) -> RewardIssue:
        """The issue `to_text` wrote (the kind read back from the text's tag)."""
        term, _, rest = text.partition(": ")
        for kind in ("infra", "note"):
            if rest.startswith(f"{kind}: "):
                return cls(kind, term, rest.removeprefix(f"{kind}: "))
        return cls("timeout" if rest.startswith("timeout after ") else "error", term, rest)


@dataclass
class Sample:
    """One task instance: what the policy is asked and what the verifier checks against."""

    id: str  # stable within a task and split, e.g. "arith/train/17"
    prompt: Prompt  # plain text, or chat messages for chat models
    answer: str  # reference final answer the verifier compares with, e.g. "68"
    reference: str | None = None  # a full reference response (used for warm-start SFT)
    meta: dict[str, Any] = field(default_factory=dict)  # task-specific, e.g. {"terms": 3}


class EncodedPrompt(NamedTuple):
    """A sample with its prompt's token ids (chat template applied): what rollouts start from.
    A tuple so `for sample, ids in prompts` reads as before."""

    sample: Sample
    ids: list[int]  # [P] prompt tokens


@dataclass
class Completion:
    """What an engine returns for one sequence (the engine contract, engine/base.py)."""

    prompt_index: int  # which prompt of the call this answers
    token_ids: list[int]  # [T] sampled tokens, the stop token included when one was sampled
    logprobs: list[float]  # [T] log-prob of each token under the distribution it was sampled from
    finish_reason: FinishReason  # "stop" | "length" | "abort"
    versions: list[int] = field(default_factory=list)  # [T] policy version that sampled each
    request_id: int = -1  # the engine's id for the request (native engine)
    # Filled only when SamplingParams asks (top_logprobs > 0, entropy): per token, the k most
    # likely (id, log-prob) and the entropy of the model's temperature-1, untruncated distribution
    top_logprobs: list[list[tuple[int, float]]] | None = None
    entropies: list[float] | None = None

    def age(self, version: int) -> int:
        """Policy versions between the oldest token and `version` (0 without tokens)."""
        return age(self.versions, version)


def age(versions: list[int], version: int) -> int:
    """How many versions the oldest of `versions` lags `version`: the one definition of a
    response's staleness (0 for a response without tokens)."""
    return version - min(versions) if versions else 0


@dataclass
class Trajectory:
    """One rollout of one prompt: tokens, how they were sampled, and how they scored."""

    sample: Sample
    prompt_ids: list[int]  # [P] prompt tokens, chat template already applied
    response_ids: list[int]  # [T] sampled tokens (EOS included when it was sampled)
    logprobs: list[float]  # [T] log π_behaviour(response_ids[t] | prefix) at sampling time
    versions: list[int]  # [T] policy version that sampled each response token
    finish_reason: FinishReason  # "stop" (EOS/stop token), "length" (max_tokens), "abort"
    text: str = ""  # decoded response (filled at the edge, by the rollout stage)
    reward: float = 0.0  # scalar reward used for advantages: sum of weight x score
    scores: dict[str, float] = field(default_factory=dict)  # reward term name -> its score
    reward_errors: list[RewardIssue] = field(default_factory=list)  # what happened while
    # the terms scored it (failures and notes)
    advantage: float | None = None  # the advantage the update used (a token-level
    # estimator's: the mean over the sampled tokens); None where it was not trained on
    timings: dict[str, float] = field(default_factory=dict)  # seconds, e.g.
    # {"rollout": .., "reward": ..}
    # Multi-turn episodes (docs/agents.md): `response_ids` holds every token after the
    # prompt, the policy's turns and the environment's observations between them, in order.
    # A single-turn rollout is the one-turn case: loss_mask None (every token sampled).
    loss_mask: list[int] | None = None  # [T] 1 sampled by the policy (trained), 0 inserted
    # by the environment (masked out of the loss; its logprobs are 0, versions the turn's)
    turns: list[tuple[int, int]] = field(default_factory=list)  # [K] (start, end) of each
    # policy turn's tokens in response_ids; [] for a single-turn rollout
    turn_rewards: list[float] = field(default_factory=list)  # [K] env reward after turn k
    turn_states: list[str] = field(default_factory=list)  # [K] env state each turn acted in
    # (GiGPO's anchor states: equal strings are the same state)
    tree: int = 0  # Tree-GRPO: which tree of its group the trajectory is a leaf of

    @property
    def num_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def sampled_mask(self) -> list[int]:
        """[T] 1 where the policy sampled the token (all of a single-turn response)."""
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.response_ids)

    @property
    def num_turns(self) -> int:
        return max(1, len(self.turns))

    def age(self, version: int) -> int:
        """Policy versions between this trajectory's oldest token and `version` (its
        staleness when trained at `version`; 0 without tokens)."""
        return age(self.versions, version)

    @property
    def correct(self) -> bool:
        """Solved: the task verifier's term (`CORRECT`) scored 1 (False where not scored)."""
        return self.scores.get(CORRECT, 0.0) >= 1.0

    @property
    def reward_info(self) -> dict[str, Any]:
        """Scores and issues as one JSON object (the trajectory store's column): each issue
        as its `RewardIssue.to_text` line under "errors"."""
        return {**self.scores, "errors": [e.to_text() for e in self.reward_errors]}

    @staticmethod
    def split_reward_info(info: dict[str, Any]) -> tuple[dict[str, float], list[RewardIssue]]:
        """(scores, issues) of a stored `reward_info` object."""
        return ({k: v for k, v in info.items() if k != "errors"},
                [RewardIssue.from_text(e) for e in info.get("errors", [])])

    @classmethod
    def from_completion(cls, prompt: EncodedPrompt, c: Completion,
                        decode: Callable[[list[int]], str], version: int,
                        timings: dict[str, float]) -> Trajectory:
        """The one Completion -> Trajectory conversion. An engine that does not tag tokens
        with versions (HF `generate`) sampled all of them with `version`, the weights it holds."""
        return cls(sample=prompt.sample, prompt_ids=list(prompt.ids), response_ids=c.token_ids,
                   logprobs=c.logprobs, versions=c.versions or [version] * len(c.token_ids),
                   finish_reason=c.finish_reason, text=decode(c.token_ids), timings=timings)

    def to_plain(self) -> dict[str, Any]:
        """Every field as plain data (a copy): the sample by its id (a resumed run takes it
        from the task's prompts, so its meta need not be JSON), each issue as [kind, term,
        message], turns as [start, end]. Python floats, so JSON keeps log-probs exactly."""
        out = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        out["sample"] = self.sample.id
        out["reward_errors"] = [[e.kind, e.term, e.message] for e in self.reward_errors]
        return out

    @classmethod
    def from_plain(cls, data: Mapping[str, Any], sample: Sample) -> Trajectory:
        """The trajectory `to_plain` wrote, of `sample` (the one its id names); fields
        absent from `data` (written before they existed) take their defaults."""
        return cls(**{**data, "sample": sample,
                      "reward_errors": [RewardIssue(*e) for e in data.get("reward_errors", [])],
                      "turns": [(a, b) for a, b in data.get("turns", [])]})


def _plain(value: Any) -> Any:
    """A copy made of lists, dicts and scalars (tuples become lists, as JSON has them)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        if not any(isinstance(v, list | tuple | dict) for v in value):
            return list(value)  # token ids, log-probs, versions: flat, copied at once
        return [_plain(v) for v in value]
    return value


@dataclass
class Group:
    """The rollouts of one prompt; GRPO-family advantages are computed within a group."""

    sample: Sample
    trajectories: list[Trajectory]

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def zero_variance(self) -> bool:
        """All rewards equal: every advantage is zero and the group teaches nothing."""
        r = self.rewards
        return max(r) - min(r) < 1e-9 if r else True

    def to_plain(self) -> dict[str, Any]:
        """The group as plain data (`Trajectory.to_plain`; the sample by its id)."""
        return {"sample": self.sample.id,
                "trajectories": [t.to_plain() for t in self.trajectories]}

    @classmethod
    def from_plain(cls, data: Mapping[str, Any], samples: Mapping[str, Sample]) -> Group:
        """The group `to_plain` wrote; `samples`: every sample it may name, by id."""
        def sample(sid: str) -> Sample:
            if sid not in samples:
                raise ValueError(f"sample {sid!r} is not among the task's prompts (did the "
                                 "task change since the checkpoint?)")
            return samples[sid]

        return cls(sample(data["sample"]),
                   [Trajectory.from_plain(t, sample(t["sample"])) for t in data["trajectories"]])


@dataclass
class Batch:
    """Right-padded tensors for the learner. N rows (trajectories), L = max prompt+response length.

    Position t of `input_ids` is predicted by position t-1; `loss_mask[t]` is 1 where
    `input_ids[t]` is a response token whose log-prob enters the loss.
    """

    input_ids: torch.Tensor  # [N, L] long, prompt then response then padding
    attention_mask: torch.Tensor  # [N, L] long, 1 for real tokens
    loss_mask: torch.Tensor  # [N, L] float, 1 on response tokens
    old_logprobs: torch.Tensor  # [N, L] float, behaviour log-probs on response tokens, else 0
    advantages: torch.Tensor  # [N] float (outcome-level estimators: one per trajectory) or
    # [N, L] float (token-level estimators: per position, 0 off the response); see
    # `token_advantages` for the one shape every consumer can broadcast
    group_ids: torch.Tensor  # [N] long, which group each row belongs to
    versions: torch.Tensor  # [N, L] long, policy version per response token, else -1

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def token_advantages(self) -> torch.Tensor:
        """[N, 1] or [N, L]: the advantages broadcastable against [N, L] per-token values."""
        return self.advantages[:, None] if self.advantages.dim() == 1 else self.advantages


@dataclass(frozen=True)
class Published:
    """The weights of one policy version as a trainer published them for the rollout side.
    `handle` is None when the rollout side reads the trainer's own tensors (one process);
    else what a rollout worker loads them from (a Ray object reference), `nbytes` in size;
    `seconds`: the trainer's phases of making it (files: probe, gather, convert, write)."""

    version: int
    handle: Any = None
    nbytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict, compare=False)


class LearnerDied(RuntimeError):
    """A learner placed in other processes (a Ray actor, or one of its ranks) is gone: the
    run stops; its last checkpoint is intact."""


class PublishError(RuntimeError):
    """A publication the rollout side could not stage, or refused to activate: names the
    placement, the phase ('stage' or 'activate') and the version. The rollout side keeps
    the version it had active."""

    def __init__(self, placement: str, phase: str, version: int, reason: str):
        super().__init__(f"{placement}: {phase} of weights version {version} failed: "
                         f"{reason}; the rollout side keeps its active version")
        self.placement, self.phase, self.version = placement, phase, version


class WeightSlots:
    """The rollout side's two slots of published weights (pipeline/ports.py's protocol):
    `active`, whose version new tokens carry, and `staged`, taken for the next step
    boundary. Versions only move forward: staging or activating one older than the active
    version is refused; the same version again is allowed (a resumed run, a warm start).
    Each rollout port fills in what staging takes and what activation installs."""

    def __init__(self, placement: str, version: int):
        self.placement = placement
        self.active: Published = Published(version)
        self.staged: Published | None = None

    def stage(self, weights: Published, take: Callable[[Published], Published]) -> None:
        """`take(weights)` (the rollout side's copy or handle) kept as the staged weights,
        replacing any not activated yet; a failure keeps the slots as they were."""
        self._forward("stage", weights.version)
        try:
            taken = take(weights)
        except PublishError:
            raise
        except Exception as e:
            raise PublishError(self.placement, "stage", weights.version,
                               f"{type(e).__name__}: {e}") from e
        self.staged = taken

    def activate(self, version: int, install: Callable[[Published], None]) -> None:
        """The staged weights of `version` installed by `install` and made active; refused
        (PublishError) when `version` is older than the active one or not the one staged.
        `install`'s own errors (a server that could not load) pass through as they are."""
        self._forward("activate", version)
        staged = self.staged
        if staged is None or staged.version != version:
            had = "nothing" if staged is None else f"version {staged.version}"
            raise PublishError(self.placement, "activate", version,
                               f"it is not the version staged ({had} is)")
        install(staged)
        self.active, self.staged = staged, None

    def _forward(self, phase: str, version: int) -> None:
        if version < self.active.version:
            raise PublishError(self.placement, phase, version,
                               f"older than the active version {self.active.version} "
                               "(versions only move forward)")
