"""The two ports of `Stages`: where rollouts run and where the policy trains.

A placement is a choice of one object per port; `Stages` calls the same methods whatever
the choice, so the drivers never ask where anything runs.

    port       in this process                  on Ray (rollwise.distributed)
    rollout    rollout.RolloutStage              RayRollout: rollout workers + a reward actor
    trainer    learner.Learner                   RayTrainer: a learner actor

With learner.shards = N the trainer is `distributed.shards.ShardedTrainer` over N ranks
(processes this one starts, Ray actors, or torchrun's processes): the same port, its
publication the driver's copy of the weights, which the ranks bring to the new version.

Inference servers in other processes are one more placement (engine.name = 'remote',
docs/remote.md): `rollout.RemoteRollout` sends each group to a server, and the trainer is
the learner in this process as `learner.FileTrainer`, whose publications are folders of
weights the servers load by version.

Weights flow one way, by version, in three phases every placement implements:

    phase      who, when                        in process          Ray             servers
    publish    trainer, after an update         (nothing: shared)   object store    folder
    stage      rollout side, trainer's thread,  engine's own copy   reference kept  folders
               while no update runs             (or nothing)                        resolved
    activate   rollout side, at a step          engine installs     workers load    servers
               boundary                         it                  at next request load it

`trainer.publish(v)` returns a `Published` record; `rollout.stage(it)` takes the rollout
side's copy or handle of it, while tokens keep the active version; `rollout.activate(v)`
makes v the version of every later token. Versions only move forward: staging or
activating an older one is refused, and a stage that fails keeps the active version;
both raise `types.PublishError` naming the placement and the phase (`types.WeightSlots`
keeps the two slots for every port). `rollout.publish(it)` is stage then activate at once.
The synchronous driver activates right after staging; the asynchronous one stages on the
trainer's thread and activates on the producer's, before a step's rollouts
(`Stages.publish`, `Stages.activate`).

The driver keeps its own copy of the policy for evaluation and checkpoints;
`trainer.sync_into(model)` brings it to the latest published version (nothing to do in
one process, where it is the trained model).
"""

from __future__ import annotations

from typing import Any, Protocol

from rollwise.rewards import RewardStats
from rollwise.types import Batch, EncodedPrompt, Group, Published


class RolloutPort(Protocol):
    """Encoded prompts in, groups of scored trajectories out."""

    @property
    def version(self) -> int:
        """The policy version new tokens are sampled with."""
        ...

    def run(self, prompts: list[EncodedPrompt], sizes: list[int]) -> list[Group]:
        """Groups for `prompts` (`sizes[i]` samples for prompt i); scoring may start early."""
        ...

    def score(self, groups: list[Group]) -> RewardStats:
        """Every trajectory of `groups` scored (in place); the counts of how it went."""
        ...

    def metrics(self) -> dict[str, float]:
        """This step's rollout figures; resets."""
        ...

    def stage(self, weights: Published) -> None:
        """Take the rollout side's copy or handle of `weights` (the trainer's thread, no
        update running); later tokens keep the active version. PublishError when it fails
        or `weights` is older than the active version."""
        ...

    def activate(self, version: int) -> None:
        """At a step boundary: later tokens are sampled with the staged weights, which
        carry `version`. PublishError when `version` is older or not the one staged."""
        ...

    def publish(self, weights: Published) -> None:
        """`stage(weights)` then `activate(weights.version)`."""
        ...

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps between steps (partial pools, group numbering), or None."""
        ...

    def load_state_dict(self, state: dict[str, Any] | None) -> None: ...

    def close(self) -> None:
        """Release what the port holds (threads, processes, actors); idempotent."""
        ...


class TrainerPort(Protocol):
    """Batches in, updated weights out."""

    def update(self, batch: Batch) -> dict[str, float]:
        """One update (all of its epochs) on `batch`; its figures."""
        ...

    def reference_kl(self, batch: Batch) -> Any:
        """[N, L] per-token KL of the behaviour policy against the reference (KL in reward)."""
        ...

    def publish(self, version: int) -> Published:
        """The current weights made available to the rollout side as `version`."""
        ...

    def sync_into(self, model: Any) -> int | None:
        """Copy the latest published weights into `model` (the driver's policy) when it
        holds an older version; the version loaded, or None when nothing changed."""
        ...

    def state_dict(self) -> dict:
        """The optimizer and schedule state a checkpoint keeps (the weights are the model's)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore `state`; the weights are those of the driver's model, loaded before."""
        ...

    def close(self) -> None: ...
