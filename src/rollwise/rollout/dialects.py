"""What the remote rollout port says to each kind of inference server (`engine.remote_kind`):
how a group's generation request is written and its answer read, and how a server is
told to load a folder of weights. One class per kind, the same three methods each:

    generate(servers, ask) -> Answer   one request per group (the samples an update
                                       aborted: sent again from where they stopped)
    load(servers, i, folder, version, sync) -> (phases, seconds)   server i takes a folder
    weights_dtype(servers, i) -> str   the precision to publish server i's weights in

`rollwise`  `rollwise serve`: POST /v1/generate, POST /v1/weights/update (docs/serve.md).
`vllm`      vLLM's OpenAI server: POST /v1/completions with token ids; weights through its
            development-mode routes (/pause, /collective_rpc, /reset_prefix_cache,
            /resume) and `VLLMFolderWeights`, a worker extension the server is started with
            (rollout/vllm_worker.py).
`sglang`    SGLang's native server: POST /generate; /pause_generation,
            /update_weights_from_disk, /continue_generation.

docs/remote.md says which versions' documentation these follow; only fake servers written
from that documentation were run here. An answer that does not have the documented shape
is a RemoteError naming the server and the route (rollout/servers.py wraps the parsers).

Imports the records, the engine's sampling settings and rollout/servers.py.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollwise.engine.base import SamplingParams
from rollwise.rollout.servers import RemoteError, Servers
from rollwise.types import Completion

KINDS = ("rollwise", "vllm", "sglang")
ADAPTER = "rollwise-lora"  # the name a LoRA adapter is loaded and requested under (vLLM)
FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class Ask:
    """One generation request: `prompt` ids, one seed per sample, and per sample the
    tokens an earlier request left (None: start afresh). `version`: the weights the
    servers hold as it is sent (tokens of servers that do not tag them carry it)."""

    prompt: list[int]
    seeds: list[int]
    partial: list[Completion | None]
    sampling: SamplingParams
    uid: int
    version: int
    priority: int | None = None  # lower first, where the server schedules by priority

    @property
    def resumes(self) -> bool:
        return any(p is not None for p in self.partial)

    def done(self, k: int) -> list[int]:
        p = self.partial[k]
        return p.token_ids if p is not None else []


@dataclass
class Answer:
    completions: list[Completion]  # whole samples: the partial tokens, then the new ones
    seconds: float  # round trip
    timings: dict[str, float] | None = None  # the server's queue/prefill/decode seconds
    version: int | None = None  # the version the server reports, if it reports one


@dataclass
class Expect:
    """What a server must serve for a run: the model's vocabulary size, `text` tokenized as
    `ids` (no special tokens), and room for `length` tokens (longest prompt + max_tokens)."""

    vocab: int
    text: str
    ids: list[int]
    length: int


# a route only each kind of server answers (GET), to name what a URL serves
IDENTITY = (("rollwise", "/v1/weights"), ("vllm", "/weight_info"), ("sglang", "/get_model_info"))


def identify(servers: Servers, index: int) -> str | None:
    """The kind of server `index` is (by IDENTITY; None: none of them); a RemoteError
    when it cannot be reached at all."""
    url = servers.urls[index]
    try:
        servers.get(index, "/health", parse=False)
    except RemoteError as e:
        if "answered" not in str(e):  # no HTTP answer at all
            raise RemoteError(f"{url} cannot be reached (GET /health: "
                              f"{str(e).split(': ', 1)[-1]}); start the server first "
                              "(docs/remote.md)") from None
    for kind, route in IDENTITY:
        try:
            servers.get(index, route)
            return kind
        except (RemoteError, ValueError):
            continue
    return None


def check_kind(servers: Servers, index: int, kind: str) -> None:
    """Server `index` is a server of `kind`, or a one-line error naming what it is."""
    found = identify(servers, index)
    if found == kind:
        return
    hint = ""
    if kind == "vllm" and found is None:
        try:
            if isinstance(servers.get(index, "/version").get("version"), str):
                hint = ("; it looks like vLLM without its development routes: start it with "
                        "VLLM_SERVER_DEV_MODE=1 (`rollwise serve-vllm` does)")
        except (RemoteError, ValueError, AttributeError):
            pass
    what = f"a {found} server" if found else "no server rollwise knows"
    raise RemoteError(f"engine.remote_kind = {kind!r}, but {servers.urls[index]} is {what}"
                      f"{hint}")


def make_dialect(kind: str):
    """The dialect named `kind` (one of KINDS)."""
    dialects = {"rollwise": RollwiseDialect, "vllm": VLLMDialect, "sglang": SGLangDialect}
    if kind not in dialects:
        raise ValueError(f"engine.remote_kind: {kind!r} is not one of {', '.join(KINDS)}")
    return dialects[kind]()


def _joined(ask: Ask, k: int, ids: list[int], logprobs: list[float], finish: str) -> Completion:
    """Sample k: its partial tokens followed by the new ones, each new token stamped with
    the version the request was sent under (these servers do not tag tokens)."""
    if len(ids) != len(logprobs):
        raise ValueError(f"{len(ids)} token ids but {len(logprobs)} log-probs")
    if finish not in FINISH:
        raise ValueError(f"unknown finish reason {finish!r}")
    p = ask.partial[k]
    head = p if p is not None else Completion(0, [], [], "abort", [])
    return Completion(0, head.token_ids + [int(t) for t in ids],
                      head.logprobs + [float(x) for x in logprobs], FINISH[finish],
                      head.versions + [ask.version] * len(ids))


def _steps(servers: Servers, index: int, version: int,
           steps: list[tuple[str, str, dict[str, Any]]], finally_step: tuple | None = None,
           answers: bool = False):
    """Run (phase, route, body) in order on server `index`, timing each; a failure names
    the server, the version and the phase, after `finally_step` (the resume) was tried so
    the server is not left paused. ({phase: seconds}, total seconds), and with `answers`
    {phase: answer}."""
    phases: dict[str, float] = {}
    said: dict[str, Any] = {}
    start = time.perf_counter()
    for phase, route, body in steps:
        try:
            said[phase], phases[phase] = servers.post(route, body, first=index, spread=False,
                                                      parse=_succeeded, text_ok=True)
        except RemoteError as e:
            if finally_step is not None and phase != finally_step[0]:
                try:
                    servers.post(finally_step[1], finally_step[2], first=index, spread=False)
                except RemoteError:
                    pass  # the first error is the one worth reporting
            raise RemoteError(f"{servers.urls[index % len(servers.urls)]}: weight update to "
                              f"version {version} failed in phase {phase}: {e}") from None
    if answers:
        return phases, time.perf_counter() - start, said
    return phases, time.perf_counter() - start


def _succeeded(answer: Any) -> Any:
    """SGLang answers control calls with {"success": false, "message"} on failure."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise RemoteError(f"the server said: {answer.get('message') or answer}")
    return answer


class RollwiseDialect:
    """`rollwise serve`: ids, log-probs and per-token versions back; seeds per sample;
    resumed samples continued by the server; one weight-update call with its phases."""

    name = "rollwise"

    def generate(self, servers: Servers, ask: Ask) -> Answer:
        s = ask.sampling
        body: dict[str, Any] = {
            "prompt_token_ids": list(ask.prompt), "n": len(ask.seeds), "seeds": ask.seeds,
            "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "max_tokens": s.max_tokens, "request_id": f"rollwise-{ask.uid}"}
        if ask.priority is not None:
            body["priority"] = ask.priority
        if ask.resumes:
            body["resume"] = [{"token_ids": c.token_ids, "logprobs": c.logprobs,
                               "versions": c.versions} if c is not None else
                              {"token_ids": [], "logprobs": [], "versions": []}
                              for c in ask.partial]
        (completions, version, timings), seconds = servers.post(
            "/v1/generate", body, first=ask.uid, parse=lambda a: self._read(a, len(ask.seeds)))
        return Answer(completions, seconds, timings, version)

    @staticmethod
    def _read(answer: dict[str, Any], n: int):
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise RemoteError(f"asked for {n} samples, the server answered {len(choices)}")
        version = int(answer["version"])
        out = [Completion(0, list(c["token_ids"]), list(c["logprobs"]), c["finish_reason"],
                          list(c.get("versions") or [version] * len(c["token_ids"])))
               for c in choices]
        return out, version, answer.get("timings")

    def check_server(self, servers: Servers, index: int, expect: Expect) -> None:
        check_kind(servers, index, self.name)

    @staticmethod
    def weights_dtype(servers: Servers, index: int) -> str | None:
        """The precision server `index` samples in (GET /v1/weights; float32 when it does
        not say); None when it cannot be asked now."""
        try:
            return str(servers.get(index, "/v1/weights").get("dtype", "float32"))
        except (RemoteError, ValueError, AttributeError):
            return None

    def load(self, servers: Servers, index: int, folder: str, version: int, sync: str):
        body = {"path": folder, "version": version, "mode": sync,
                "timeout_s": servers.timeout_s}
        answer, seconds = servers.post("/v1/weights/update", body, first=index, spread=False)
        phases = {k: float(v) for k, v in (answer.get("phases") or {}).items()}
        return phases, seconds


class VLLMDialect:
    """vLLM's OpenAI server, as `rollwise serve-vllm` starts it (serve/vllm.py). A group is
    one /v1/completions request with `n` and the group's first seed (vLLM seeds sample k
    with seed + k); samples an update aborted go back as one request with a prompt per
    sample (its prompt and tokens so far), each continuation cut at that sample's own
    remaining budget. Every request carries the version's `cache_salt`, so no request
    reuses a prefix cached under other weights, even where the cache reset failed.

    A load: /pause, then `VLLMFolderWeights.rollwise_reload` of the folder through
    /collective_rpc (full weights: the file checked, then loaded directly or by vLLM's own
    `reload_weights`; which one: `take_loaders`) or
    /v1/load_lora_adapter in place (a LoRA adapter, requested under `ADAPTER` from then
    on), /reset_prefix_cache (its answer kept), /update_weight_version (the tag
    `rollwise-v<version>`, read back from /weight_info before and after each step:
    `check_version`), /resume."""

    name = "vllm"
    method = "rollwise_reload"  # VLLMFolderWeights' method, called by /collective_rpc
    cache_guard = True  # reset the prefix cache at each load and salt requests by version

    def __init__(self):
        self.model: str | None = None  # the LoRA adapter's name, once one is loaded
        self.cache_resets_failed = 0  # loads whose prefix-cache reset answered success false
        self._loaders: dict[str, int] = {}  # full-weight loads by the worker's loader
        self._lock = threading.Lock()  # servers load on threads of their own

    def take_loaders(self) -> dict[str, int]:
        """The full-weight loads since the last call, by the loader each worker named
        ('direct', 'stock')."""
        with self._lock:
            out, self._loaders = self._loaders, {}
        return out

    @staticmethod
    def tag(version: int) -> str:
        return f"rollwise-v{version}"

    @staticmethod
    def weights_dtype(servers: Servers, index: int) -> str:
        """The dtype the server runs in (its /server_info, development mode): the
        folder it loads is written in it, so its loader converts nothing; float32 when it
        does not say."""
        try:
            config = str(servers.get(index, "/server_info").get("vllm_config", ""))
        except (RemoteError, ValueError, AttributeError):
            return "float32"
        found = re.search(r"\bdtype=torch\.(\w+)", config)
        return found.group(1) if found else "float32"

    def generate(self, servers: Servers, ask: Ask) -> Answer:
        s = ask.sampling
        n = len(ask.seeds)
        left = [s.max_tokens - len(ask.done(k)) for k in range(n)]
        body: dict[str, Any] = {
            "prompt": ([list(ask.prompt) + ask.done(k) for k in range(n)] if ask.resumes
                       else list(ask.prompt)),
            "n": 1 if ask.resumes else n, "seed": ask.seeds[0], "max_tokens": max(left),
            "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or -1,
            "logprobs": 0, "return_tokens_as_token_ids": True,
            "request_id": f"rollwise-{ask.uid}-{sum(map(len, map(ask.done, range(n))))}"}
        if self.model:
            body["model"] = self.model
        if self.cache_guard:
            body["cache_salt"] = self.tag(ask.version)
        if s.stop_token_ids:
            body["stop_token_ids"] = list(s.stop_token_ids)
        if s.ignore_eos:
            body["ignore_eos"] = True
        if ask.priority is not None:
            body["priority"] = ask.priority
        completions, seconds = servers.post("/v1/completions", body, first=ask.uid,
                                            parse=lambda a: self._read(a, ask, left))
        return Answer(completions, seconds)

    @staticmethod
    def _read(answer: dict[str, Any], ask: Ask, left: list[int]) -> list[Completion]:
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(ask.seeds):
            raise RemoteError(f"asked for {len(ask.seeds)} samples, the server answered "
                              f"{len(choices)}")
        out = []
        for k, c in enumerate(choices):
            lp = c["logprobs"]
            if lp is None:
                raise ValueError("choice without logprobs (the request asks for logprobs: 0)")
            ids = [_token_id(t) for t in lp["tokens"]]
            logprobs, finish = list(lp["token_logprobs"]), c["finish_reason"]
            if len(ids) > left[k]:  # a shared max_tokens: this sample's budget ends sooner
                ids, logprobs, finish = ids[:left[k]], logprobs[:left[k]], "length"
            out.append(_joined(ask, k, ids, logprobs, finish))
        return out

    def load(self, servers: Servers, index: int, folder: str, version: int, sync: str):
        # 'keep' freezes requests in flight (they continue with the new weights), 'abort'
        # returns them with their tokens so far (RemoteRollout sends them again)
        mode = "keep" if sync == "pause" else "abort"
        adapter = (Path(folder) / "adapter_config.json").is_file()
        load = (("load", "/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": folder,
                                                   "load_inplace": True}) if adapter else
                ("load", "/collective_rpc", {"method": self.method, "args": [folder],
                                             "timeout": servers.timeout_s}))
        steps = [("pause", f"/pause?mode={mode}", {}), load]
        if self.cache_guard:
            steps.append(("cache", "/reset_prefix_cache", {}))
        steps += [("tag", "/update_weight_version", {"new_version": self.tag(version)}),
                  ("resume", "/resume", {})]
        phases, seconds, answers = _steps(servers, index, version, steps,
                                          finally_step=steps[-1], answers=True)
        if self.cache_guard and answers.get("cache", {}).get("success") is False:
            self.cache_resets_failed += 1  # requests held by 'keep': the salt still guards
        said = answers.get("load")
        if not adapter and isinstance(said, dict):  # each worker's answer names its loader
            for result in said.get("results") or []:
                if isinstance(result, dict) and isinstance(result.get("loader"), str):
                    with self._lock:
                        self._loaders[result["loader"]] = self._loaders.get(
                            result["loader"], 0) + 1
        if adapter:
            self.model = ADAPTER
        return phases, seconds

    def check_server(self, servers: Servers, index: int, expect: Expect) -> None:
        """Server `index` is vLLM with its development routes, serving the run's model:
        the same tokens for `expect.text`, the same vocabulary (its last id accepted, the
        next refused), room for prompt + max_tokens. A one-line error otherwise."""
        check_kind(servers, index, self.name)
        url = servers.urls[index]
        # a trainer that died inside a load (between /pause and /resume) left it paused;
        # this run publishes its own weights before any request samples
        if servers.get(index, "/is_paused").get("is_paused"):
            servers.post("/resume", {}, first=index, spread=False, text_ok=True)
        said, _ = servers.post("/tokenize", {"prompt": expect.text, "add_special_tokens": False},
                               first=index, spread=False)
        if list(said.get("tokens", [])) != list(expect.ids):
            raise RemoteError(f"{url} serves another model: it tokenizes {expect.text!r} as "
                              f"{said.get('tokens')}, the run's tokenizer as {expect.ids}")
        room = int(said.get("max_model_len") or 0)
        if room < expect.length:
            raise RemoteError(f"{url} serves at most {room} tokens per sequence; the run needs "
                              f"{expect.length} (rollout.max_prompt_tokens + max_tokens): "
                              "start it with a larger --max-model-len")
        for token, fits in ((expect.vocab - 1, True), (expect.vocab, False)):
            body = {"prompt": [token], "max_tokens": 1, "temperature": 0.0}
            try:
                servers.post("/v1/completions", body, first=index, spread=False)
                accepted = True
            except RemoteError as e:
                if "answered 4" not in str(e):
                    raise
                accepted = False
            if accepted != fits:
                raise RemoteError(f"{url} serves another model: token id {token} is "
                                  f"{'refused' if fits else 'accepted'}, the run's vocabulary "
                                  f"has {expect.vocab} ids")

    def check_version(self, servers: Servers, index: int, version: int) -> None:
        """Server `index` holds version `version` or a later one (its tag, /weight_info): a
        restarted server answers its start-up tag and stops the run."""
        tag = servers.get(index, "/weight_info").get("weight_version")
        held = _tagged(tag)
        if held is None or held < version:
            raise RemoteError(f"{servers.urls[index]} serves weight version {tag!r}, not "
                              f"{self.tag(version)!r}: it restarted (or a load did not "
                              "take) and samples from other weights; resume the run")

    def prompt_logprobs(self, servers: Servers, index: int, ids: list[int],
                        version: int) -> list[float]:
        """Server `index`'s log p(ids[i] | ids[:i]), i >= 1 (greedy, one new token; salted
        so no cached prefix answers)."""
        body: dict[str, Any] = {"prompt": list(ids), "max_tokens": 1, "temperature": 0.0,
                                "prompt_logprobs": 0, "cache_salt": f"probe-{self.tag(version)}"
                                f"-{time.monotonic_ns()}"}
        if self.model:
            body["model"] = self.model

        def read(answer):
            rows = answer["choices"][0]["prompt_logprobs"][1:]
            return [float(row[str(t)]["logprob"]) for row, t in zip(rows, ids[1:], strict=True)]

        out, _ = servers.post("/v1/completions", body, first=index, spread=False, parse=read)
        return out


def _tagged(tag: Any) -> int | None:
    """The version of a `rollwise-v<N>` tag (None: another tag)."""
    if isinstance(tag, str) and tag.startswith("rollwise-v") and tag[10:].isdigit():
        return int(tag[10:])
    return None


def _token_id(token: str) -> int:
    """vLLM's `token_id:<id>` (return_tokens_as_token_ids) as the id."""
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise ValueError(f"token {token!r} is not 'token_id:<id>' (the request sets "
                         "return_tokens_as_token_ids)")
    return int(token.removeprefix("token_id:"))


class SGLangDialect:
    """SGLang's native server. A group is one batched /generate request, a copy of the
    prompt per sample with that sample's own `sampling_seed` (one request with `n` would
    give every copy the same seed); a resumed sample's copy carries its tokens so far and
    its remaining budget."""

    name = "sglang"
    check_server = RollwiseDialect.check_server

    @staticmethod
    def weights_dtype(servers: Servers, index: int) -> str:
        """float32: the server's precision is not asked; its loader converts what it reads."""
        return "float32"

    def generate(self, servers: Servers, ask: Ask) -> Answer:
        s = ask.sampling
        params = []
        for k, seed in enumerate(ask.seeds):
            p: dict[str, Any] = {"max_new_tokens": s.max_tokens - len(ask.done(k)),
                                 "temperature": s.temperature, "top_p": s.top_p,
                                 "top_k": s.top_k or -1, "sampling_seed": seed}
            if s.stop_token_ids:
                p["stop_token_ids"] = list(s.stop_token_ids)
            if s.ignore_eos:
                p["ignore_eos"] = True
            params.append(p)
        body: dict[str, Any] = {
            "input_ids": [list(ask.prompt) + ask.done(k) for k in range(len(ask.seeds))],
            "sampling_params": params, "return_logprob": True,
            "rid": [f"rollwise-{ask.uid}-{k}-{len(ask.done(k))}" for k in range(len(ask.seeds))]}
        if ask.priority is not None:
            body["priority"] = ask.priority
        completions, seconds = servers.post("/generate", body, first=ask.uid,
                                            parse=lambda a: self._read(a, ask))
        return Answer(completions, seconds)

    @staticmethod
    def _read(answer: list[dict[str, Any]], ask: Ask) -> list[Completion]:
        if not isinstance(answer, list) or len(answer) != len(ask.seeds):
            got = len(answer) if isinstance(answer, list) else type(answer).__name__
            raise RemoteError(f"asked for {len(ask.seeds)} samples, the server answered {got}")
        out = []
        for k, item in enumerate(answer):
            meta = item["meta_info"]
            triples = meta["output_token_logprobs"]  # [(log-prob, token id, text), ...]
            finish = meta["finish_reason"]
            if not isinstance(finish, dict):
                raise ValueError(f"sample {k} has no finish_reason (it did not finish)")
            out.append(_joined(ask, k, [t[1] for t in triples], [t[0] for t in triples],
                               finish["type"]))
        return out

    def load(self, servers: Servers, index: int, folder: str, version: int, sync: str):
        # 'retract' puts running requests back in the queue (their KV cache recomputed with
        # the new weights after continue_generation); 'abort' returns them with their tokens
        mode = "retract" if sync == "pause" else "abort"
        steps = [("pause", "/pause_generation", {"mode": mode}),
                 ("load", "/update_weights_from_disk",
                  {"model_path": folder, "weight_version": str(version), "flush_cache": True}),
                 ("resume", "/continue_generation", {})]
        return _steps(servers, index, version, steps, finally_step=steps[-1])
