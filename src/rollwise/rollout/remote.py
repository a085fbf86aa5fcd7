"""The rollout port over inference servers in other processes (`rollwise serve`, vLLM or
SGLang: `engine.remote_kind`; docs/remote.md).

Token ids go out, token ids with their log-probs, policy versions and finish reasons come
back: one request per group, the step's groups spread over the servers in turn. Each
sample carries the seed the in-process scheduler would give it (the same group numbering
and `derive_seed`), so with the same weights a remote run on `rollwise serve` samples
exactly what a local one samples (vLLM and SGLang take the seeds but sample their own way).
The driver scores each group as its answer arrives (`ScoreAhead`, as the in-process stage
does). Weights arrive as folders the trainer wrote (`Published.handle`); `publish` has
every server load one. A handle with a `folder(dtype)` method (learner/files.py's
`Publication`) is asked for each server's folder in the precision that server samples in
(the dialect's `weights_dtype`, asked once per server), so a bfloat16 server loads half
the bytes; a plain path is loaded by every server as it is.

Imports the engine's sampling settings and seeds, the reward counts, the rollout figures
and the records; HTTP lives in rollout/servers.py, each kind of server's requests and
answers in rollout/dialects.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from rollwise.engine.base import ENGINE_ROWS, SamplingParams
from rollwise.engine.sampling import derive_seed
from rollwise.rewards.pool import RewardStats
from rollwise.rollout.dialects import Ask, Expect, make_dialect
from rollwise.rollout.figures import RolloutFigures
from rollwise.rollout.scoring import ScoreAhead, Scorer
from rollwise.rollout.servers import RemoteError, Servers
from rollwise.types import Completion, EncodedPrompt, Group, Published, Trajectory, WeightSlots

PLACEMENT = "remote servers"  # how publication errors name this placement
TIMINGS = ("queue_s", "prefill_s", "decode_s")  # a server's per-request timings, if it gives them
RESUMES = 8  # times one group is sent again after a weight update aborted it ('abort' mode)
# The largest |log-prob difference| at one probe position between a server holding version v
# and the trainer's float32 forward of v, by the server's precision. float32: both sides
# round at u = 2^-24 and differ only in the order of their sums (~30 layers, a 50k-way
# softmax): 10^3-10^4 u, and the bound is ~10x what docs/remote.md measured (8.3e-5 SmolLM2,
# 2.4e-4 tiny). Half precisions store every activation rounded (u = 2^-8 bfloat16, 2^-11
# float16), which dominates: SmolLM2 served in bfloat16 by vLLM was 0.23-0.62 from float32
# (~160 u) and 0.54 from torch's own bfloat16 forward; the bound is 256 u. So a
# half-precision server's loads are verified only when an update moves some log-prob by
# more than 2 x 256 u (most SmolLM2 updates do not: counted unverified).
PROBE_BOUNDS = {"float32": 2e-3, "bfloat16": 256 * 2.0**-8, "float16": 256 * 2.0**-11}


@dataclass
class _Calls:
    """The requests of a step: their round trips and the servers' own timings."""

    http_s: list[float] = field(default_factory=list)
    timings: dict[str, list[float]] = field(default_factory=dict)
    resumed: int = 0  # samples sent again after an update aborted them

    def add(self, seconds: float, timings: dict[str, float] | None) -> None:
        self.http_s.append(seconds)
        for k in TIMINGS:
            if timings and k in timings:
                self.timings.setdefault(k, []).append(float(timings[k]))

    def metrics(self) -> dict[str, float]:
        """Per-request figures of the step: the count, the mean and longest round trip,
        the mean seconds queued, prefilling and decoding on the server."""
        if not self.http_s:
            return {}
        out = {"remote_requests": len(self.http_s), "remote_resumed": self.resumed,
               "remote_http_seconds": sum(self.http_s) / len(self.http_s),
               "remote_http_seconds_max": max(self.http_s)}
        return out | {f"remote_{k.removesuffix('_s')}_seconds": sum(v) / len(v)
                      for k, v in self.timings.items()}


class RemoteRollout:
    """The rollout port over `servers`. `seed`: the run's (the samples' seeds derive from
    it and the group numbers); `sync`: how a server takes new weights ('pause' or 'abort');
    `concurrency`: groups in flight at once (the servers batch what arrives together);
    `kind`: what the servers are ('rollwise', 'vllm', 'sglang': rollout/dialects.py)."""

    def __init__(self, servers: Servers, sampling: SamplingParams,
                 decode: Callable[[list[int]], str], scorer: Scorer, *, seed: int,
                 sync: str = "pause", concurrency: int = ENGINE_ROWS, version: int = 0,
                 kind: str = "rollwise", probe: list[int] | None = None):
        self.servers, self.sampling, self.decode = servers, sampling, decode
        self.seed, self.sync = seed, sync
        self.dialect = make_dialect(kind)
        self._ahead = ScoreAhead(scorer)
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="rollwise-remote")
        self._lock = threading.Lock()
        self._uid = 0  # the next group number
        self.slots = WeightSlots(PLACEMENT, version)  # the publication protocol
        self._folders_staged: list[str] = []  # the staged version's folder per server
        self._figures: list[RolloutFigures] = []
        self._calls = _Calls()
        self._load_s = 0.0  # the last weight update's round trip (the slowest server's)
        self._dtypes: list[str | None] = [None] * len(servers.urls)  # each server's, once known
        self._phases: dict[str, float] = {}  # and its phases, as the servers timed them
        # the servers' log-probs of `probe` checked against the trainer's after each load
        # (dialects that answer prompt log-probs: vLLM); the previous version's kept
        self.probe = probe if hasattr(self.dialect, "prompt_logprobs") else None
        self._probe_before: list[float] | None = None
        self._checks: dict[str, float] = {}
        self._broken: str | None = None  # why the last weight load failed, until one succeeds

    @property
    def version(self) -> int:
        return self.slots.active.version

    def run(self, prompts: list[EncodedPrompt], sizes: list[int]) -> list[Group]:
        """One request per group, in flight together; each group starts scoring when its
        answer arrives. A server that fails for good stops the step with its error."""
        with self._lock:
            first = self._uid
            self._uid += len(prompts)
        self.check_versions()
        start = time.perf_counter()
        futures: dict[Future, int] = {
            self._pool.submit(self._group, p, n, first + i): i
            for i, (p, n) in enumerate(zip(prompts, sizes, strict=True))}
        groups: list[Group] = [None] * len(prompts)  # type: ignore[list-item]
        done_times: list[float] = []
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                if f.exception() is not None:
                    for rest in pending:
                        rest.cancel()
                    raise f.exception()  # type: ignore[misc]
                group, seconds = f.result()
                groups[futures[f]] = group
                arrived = time.perf_counter() - start
                for t in group.trajectories:  # as the in-process scheduler records it
                    t.timings["rollout_done"] = arrived
                done_times += [arrived] * len(group.trajectories)
                self._calls.add(*seconds)
                self._ahead.start(group)
        makespan = time.perf_counter() - start
        self.check_versions()
        tokens = sum(len(t.response_ids) for g in groups for t in g.trajectories)
        self._figures.append(RolloutFigures.of_returned(groups, self.version, makespan,
                                                        done_times, generated_tokens=tokens))
        return groups

    def _group(self, prompt: EncodedPrompt, n: int, uid: int):
        """The group numbered `uid` (its samples' seeds as the in-process scheduler's),
        sent again for the samples a weight update aborted, from where they stopped.
        (the group, (round-trip seconds, the server's timings))."""
        seeds = [derive_seed(self.seed, uid * 1024 + k) for k in range(n)]
        done: list[Completion | None] = [None] * n
        version, seconds, timings = self.version, 0.0, None
        todo = list(range(n))
        for _ in range(RESUMES + 1):
            sent = self.version  # tokens of servers that do not tag them carry it
            answer = self.dialect.generate(self.servers, Ask(
                list(prompt.ids), [seeds[k] for k in todo], [done[k] for k in todo],
                self.sampling, uid, sent))
            seconds, timings = seconds + answer.seconds, answer.timings
            if answer.version is not None and answer.version < sent:  # not the run's policy
                raise RemoteError(f"POST /v1/generate: a server of {', '.join(self.servers.urls)}"
                                  f" samples with version {answer.version}, older than the "
                                  f"{sent} it loaded: it restarted; resume the run")
            version = sent if answer.version is None else answer.version
            for k, c in zip(todo, answer.completions, strict=True):
                done[k] = c
            todo = [k for k in range(n) if done[k].finish_reason == "abort"]  # type: ignore[union-attr]
            if not todo:
                break
            with self._lock:
                self._calls.resumed += len(todo)
        else:
            raise RemoteError(f"group {uid} was aborted by weight updates {RESUMES + 1} times")
        group = Group(sample=prompt.sample, trajectories=[
            Trajectory.from_completion(prompt, c, self.decode, version, {})
            for c in done if c is not None])
        return group, (seconds, timings)

    def score(self, groups: list[Group]) -> RewardStats:
        """Every trajectory of `groups` scored: those scored as they arrived collected,
        the rest scored now."""
        return self._ahead.collect(groups)

    def metrics(self) -> dict[str, float]:
        """The rollout figures of this step's rounds (forward passes are the servers'
        own: left out), the requests' timings, retries and the last weight update (its
        round trip and its phases on the slowest server); resets."""
        rounds, self._figures = self._figures, []
        calls, self._calls = self._calls, _Calls()
        load, self._load_s = self._load_s, 0.0
        phases, self._phases = self._phases, {}
        checks, self._checks = self._checks, {}
        out = sum(rounds, RolloutFigures()).metrics() if rounds else {}
        out.pop("rollout_forward_passes", None)
        # the round trip under its own name: publish_seconds holds it already (publish
        # waits for the servers), so weights_load_seconds would count it twice
        return out | calls.metrics() | phases | checks | {
            "remote_retries": self.servers.take_retries(), "remote_weights_update_seconds": load}

    def stage(self, weights: Published) -> None:
        """The folder each server will load (`weights.handle`: the trainer's folders,
        written in the precision each server samples in, a dtype first asked written now),
        on the trainer's thread; the servers load nothing yet."""
        self.slots.stage(weights, self._resolve)

    def _resolve(self, weights: Published) -> Published:
        if weights.handle is None:
            raise RemoteError("the trainer published no weights folder for the servers "
                              "(engine.name='remote' needs the trainer that writes one)")
        self._folders_staged = self._folders(weights.handle)
        return weights

    def activate(self, version: int) -> None:
        """Every server loads the staged folder as `version` (all at once; in-flight
        requests paused or aborted: `sync`); the first failure stops the run with the
        server's message, naming it and the phase."""
        self.slots.activate(version, self._load)

    def _load(self, weights: Published) -> None:
        """Every server loads the staged folders (and, with a probe, is checked); after a
        failure no server is sent requests again until a load succeeds."""
        self._broken = "a weight load did not finish"
        try:
            self._load_all(weights)
        except RemoteError as e:
            self._broken = str(e)
            raise
        self._broken = None

    def _load_all(self, weights: Published) -> None:
        folders = self._folders_staged
        # threads of its own: generate calls in flight (asynchronous driver) may hold the pool
        with ThreadPoolExecutor(len(self.servers.urls)) as pool:
            answers = list(pool.map(lambda i: self.dialect.load(
                self.servers, i, folders[i], weights.version, self.sync),
                range(len(self.servers.urls))))
        phases: dict[str, float] = {}
        for named, _ in answers:  # the slowest server's seconds in each phase it names
            for k, v in named.items():
                name = f"remote_weights_{k.removesuffix('_s')}_seconds"
                phases[name] = max(phases.get(name, 0.0), float(v))
        taken = getattr(self.dialect, "take_loaders", dict)()  # vLLM: its workers' loaders
        for loader, count in taken.items():
            phases[f"remote_weights_{loader}_loads"] = float(count)
        with self._lock:
            self._load_s = max(self._load_s, max(seconds for _, seconds in answers))
            self._phases = phases
        if self.probe:
            self._verify(weights)

    def check_servers(self, expect: Expect) -> None:
        """Before the first step: every server reachable, of the kind configured, serving
        the run's model (rollout/dialects.py `check_server`); a one-line error otherwise."""
        for i in range(len(self.servers.urls)):
            self.dialect.check_server(self.servers, i, expect)

    def check_versions(self) -> None:
        """No weight load failed since the last that succeeded, and every server still
        holds the active version or a later one (dialects that tag loads: vLLM); a
        restarted server stops the run, named."""
        if self._broken is not None:
            raise RemoteError(f"{self._broken}; no server samples again before a weight "
                              "load succeeds (the run stops; resume it)")
        check = getattr(self.dialect, "check_version", None)
        if check is not None:
            for i in range(len(self.servers.urls)):
                check(self.servers, i, self.version)

    def _verify(self, weights: Published) -> None:
        """Each server's log-probs of the probe against the trainer's for this version,
        within the bound of the server's precision (PROBE_BOUNDS). Where the trainer's own
        log-probs of this version and the previous differ by no more than twice the bound,
        the check cannot tell them apart: the load is counted unverified. A server past
        the bound stops the run, naming it, the version and the first position past it."""
        want = getattr(weights.handle, "probe", None)
        if want is None:
            raise RemoteError("the trainer published no probe log-probs to check the "
                              "servers' weights against")
        start = time.perf_counter()
        before, self._probe_before = self._probe_before, want
        gap = (max(abs(a - b) for a, b in zip(want, before, strict=True))
               if before is not None else float("inf"))
        worst, bound = 0.0, 0.0
        for i, dtype in enumerate(self.weights_dtypes()):
            b = PROBE_BOUNDS.get(dtype or "float32", PROBE_BOUNDS["bfloat16"])
            bound = max(bound, b)
            got = self.dialect.prompt_logprobs(self.servers, i, self.probe, weights.version)
            errors = [abs(a - c) for a, c in zip(got, want, strict=True)]
            past = next((p for p, e in enumerate(errors) if e > b), None)
            if past is not None:
                raise RemoteError(
                    f"{self.servers.urls[i]}: weights version {weights.version} fail the check: "
                    f"the probe's log-prob at position {past + 1} is {got[past]:.5f} on the "
                    f"server and {want[past]:.5f} in the trainer (|difference| "
                    f"{errors[past]:.3g} > {b:g}, the bound for {dtype or 'float32'})")
            worst = max(worst, max(errors, default=0.0))
        verified = gap > 2 * bound
        with self._lock:
            self._checks = {"remote_weights_verified": float(verified),
                            "remote_weights_unverified": float(not verified),
                            "remote_weights_probe_error": worst,
                            "remote_weights_check_seconds": time.perf_counter() - start}
            if before is not None:  # the first load has no version before it to tell from
                self._checks["remote_weights_probe_gap"] = gap

    def publish(self, weights: Published) -> None:
        """Stage and activate at once (no step runs in between)."""
        self.stage(weights)
        self.activate(weights.version)

    def _folders(self, handle) -> list[str]:
        """The folder each server loads: the handle's folder in the precision the server
        samples in (asked until it answers; unknown: float32, which any server rounds),
        or the handle's one path."""
        folder = getattr(handle, "folder", None)
        if folder is None:
            return [str(handle)] * len(self.servers.urls)
        return [folder(dtype) for dtype in self.weights_dtypes()]

    def weights_dtypes(self) -> list[str | None]:
        """The precision each server samples in (None: it does not say), asked once."""
        for i, known in enumerate(self._dtypes):
            if known is None:
                self._dtypes[i] = self.dialect.weights_dtype(self.servers, i)
        return list(self._dtypes)

    def state_dict(self) -> dict[str, Any] | None:
        """The next group number (the samples' seeds derive from it)."""
        with self._lock:
            return {"uid": self._uid}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self._uid = state["uid"]

    def close(self) -> None:
        self._ahead.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.servers.close()

