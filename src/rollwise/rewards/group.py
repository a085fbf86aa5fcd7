"""Group reward terms: fn(trajectories of one group, **options) -> one score per trajectory.

Some rewards need the whole group: test-time RL on unlabelled prompts scores a rollout by
how its answer relates to its siblings' answers (majority vote, DARE), and DAPO's overlong
shaping needs the token count, which a text verifier never sees. Each term is a plain
function; `apply_group_rewards` adds `weight * score` to each trajectory's reward and records
the score in `scores[name]`, after the per-trajectory verifiers have run.

Answers for the test-time terms are the last number after the last "####" (or in the whole
completion), so they suit the arithmetic and GSM8K-style tasks; a completion without a
number has no answer and scores 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rollwise.registry import Registry, import_object, is_import_path
from rollwise.rewards.verifiers import after_marker, last_number
from rollwise.types import Group, Trajectory

GroupReward = Callable[..., list[float]]
GROUP_REWARDS: Registry[GroupReward] = Registry("group reward", takes=("trajectories",),
                                                  options=True)
_register = GROUP_REWARDS.register
_MARK = "__rollwise_group_reward__"


def group_reward(fn: GroupReward) -> GroupReward:
    """Mark `fn(trajectories, **options) -> list[float]` as a group reward term. A function
    named by import path in `task.rewards`, or passed to `rollwise.train(rewards=...)`, is
    a per-completion verifier unless it carries this mark (docs/extending.md)."""
    setattr(fn, _MARK, True)
    return fn


def is_group_term(term: str | Callable) -> bool:
    """Whether a `task.rewards` name (or a function) is a group term rather than a verifier:
    a registered group term, or a marked function (by import path or passed directly)."""
    if callable(term):
        return bool(getattr(term, _MARK, False))
    if term in GROUP_REWARDS:
        return True
    if not is_import_path(term):
        return False
    try:
        return is_group_term(import_object(term, GROUP_REWARDS.kind))
    except ValueError:  # reported by the verifier registry, which then tries the path
        return False


def answer_of(text: str) -> str | None:
    """The final numeric answer of a completion, as a canonical string, or None.

    >>> answer_of("23 + 45 = 68\\n#### 68.0"), answer_of("68;78#78"), answer_of("no idea")
    ('68', '78', None)
    """
    value = last_number(after_marker(text))
    return None if value is None else str(value)


def uncertainty_of(trajectory: Trajectory) -> float:
    """Mean of -log pi_behaviour over the response tokens: a one-sample estimate of the mean
    token entropy (E[-log p] = H), available without another forward pass."""
    lp = trajectory.logprobs
    return -sum(lp) / len(lp) if lp else 0.0


def majority_vote_scores(answers: Sequence[str | None]) -> list[float]:
    """TTRL majority vote (Zuo et al., arXiv 2504.16084): r_i = 1[answer_i = mode].

    Ties go to the answer seen first; rollouts without an answer score 0.

    >>> majority_vote_scores(["3", "4", "3", None])
    [1.0, 0.0, 1.0, 0.0]
    """
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return [0.0] * len(answers)
    top = max(counts.values())
    mode = next(a for a in answers if a is not None and counts[a] == top)
    return [float(a == mode) for a in answers]


def _dare_round(answers: list[str], unc: list[float], alpha: float, eps: float
                ) -> tuple[dict[str, float], dict[str, float]]:
    """(p_hat per answer, bonus per answer) over the given rollouts (all with an answer)."""
    m = len(answers)
    n = Counter(answers)
    u = {a: sum(x for b, x in zip(answers, unc) if b == a) / n[a] for a in n}
    mass = {a: n[a] / (u[a] + eps) for a in n}
    total = sum(mass.values())
    p_hat = {a: mass[a] / total for a in n}
    lo, hi = min(u.values()), max(u.values())
    u_norm = {a: (u[a] - lo) / (hi - lo) if hi > lo else 0.0 for a in n}
    bonus = {a: alpha * (1 - n[a] / m) * (1 - u_norm[a]) for a in n}
    return p_hat, bonus


def dare_scores(answers: Sequence[str | None], uncertainty: Sequence[float], *,
                alpha: float = 0.5, tau: float = 0.0, eps: float = 1e-6) -> list[float]:
    """DARE, distribution-aware reward estimation for test-time RL (arXiv 2601.21804;
    docs/algorithms.md). Over the M rollouts with an answer:

        n(a) = count of a;  u(a) = mean uncertainty of the rollouts answering a
        p(a) = [n(a) / (u(a) + eps)] / sum_b n(b) / (u(b) + eps)
        b(a) = (1 - n(a) / M) (1 - u~(a)),  u~ = u min-max normalised over the answers
        r_i = p(a_i) + alpha b(a_i)

    Pruning: answers with p(a) < tau get 0; p, n, u and b are recomputed on the surviving
    rollouts (M included). Rollouts without an answer score 0.

    >>> [round(x, 3) for x in dare_scores(["1", "1", "2"], [0.5, 0.5, 0.5], alpha=0.0)]
    [0.667, 0.667, 0.333]
    """
    idx = [i for i, a in enumerate(answers) if a is not None]
    out = [0.0] * len(answers)
    if not idx:
        return out
    ans = [answers[i] for i in idx]
    unc = [float(uncertainty[i]) for i in idx]
    p_hat, bonus = _dare_round(ans, unc, alpha, eps)
    if tau > 0:
        keep = [j for j, a in enumerate(ans) if p_hat[a] >= tau]
        idx, ans, unc = [idx[j] for j in keep], [ans[j] for j in keep], [unc[j] for j in keep]
        if not idx:
            return out
        p_hat, bonus = _dare_round(ans, unc, alpha, eps)
    for i, a in zip(idx, ans):
        out[i] = p_hat[a] + bonus[a]
    return out


@_register("majority_vote")
def majority_vote(trajectories: list[Trajectory]) -> list[float]:
    """Majority-vote reward of a group of rollouts of one unlabelled prompt."""
    return majority_vote_scores([answer_of(t.text) for t in trajectories])


@_register("dare")
def dare(trajectories: list[Trajectory], *, alpha: float = 0.5, tau: float = 0.0,
         eps: float = 1e-6) -> list[float]:
    """DARE reward of a group (uncertainty: mean -log pi_behaviour per response token)."""
    return dare_scores([answer_of(t.text) for t in trajectories],
                       [uncertainty_of(t) for t in trajectories], alpha=alpha, tau=tau, eps=eps)


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO soft overlong punishment (arXiv 2503.14476), with L_max = max_tokens and
    L_cache = buffer:  0 if L <= L_max - L_cache;  (L_max - L_cache - L) / L_cache up to
    L_max;  -1 beyond.

    >>> [overlong_penalty(n, 20, 4) for n in (16, 18, 20, 21)]
    [0.0, -0.5, -1.0, -1.0]
    """
    if buffer <= 0 or length <= max_tokens - buffer:
        return 0.0
    if length > max_tokens:
        return -1.0
    return (max_tokens - buffer - length) / buffer


@_register("overlong")
def overlong(trajectories: list[Trajectory], *, max_tokens: int, buffer: int) -> list[float]:
    """DAPO overlong shaping of each rollout's token count (see `overlong_penalty`)."""
    return [overlong_penalty(t.num_tokens, max_tokens, buffer) for t in trajectories]


@dataclass
class GroupTerm:
    """One group reward term in the reward: reward += weight * fn(group, **options)."""

    name: str
    fn: GroupReward
    weight: float = 1.0
    options: dict = field(default_factory=dict)


def get_group_reward(name: str) -> GroupReward:
    return GROUP_REWARDS.get(name)


def apply_group_rewards(groups: list[Group], terms: list[GroupTerm]) -> None:
    """Add each term's weighted score to the rewards of every group, in place."""
    for group in groups:
        for term in terms:
            scores = term.fn(group.trajectories, **term.options)
            for traj, score in zip(group.trajectories, scores, strict=True):
                traj.reward += term.weight * score
                traj.scores[term.name] = score
