"""The remote engine against fake vLLM and SGLang servers (engine.remote_kind), written from
their documented request and response shapes (docs/remote.md): each fake checks the fields
a real server needs, answers from a fixed rule of the prompt and the seed, and records
every call. A short training run against each completes with exactly the tokens and
log-probs the fake sent, publishes through the documented weight routes with the published
folder, resumes samples an update aborted, and a malformed answer is an error naming the
server and the route. No vLLM or SGLang runs here."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit

import pytest
import torch
from safetensors.torch import load_file

from rollwise.compose.config import ConfigError, load_config
from rollwise.engine.base import SamplingParams
from rollwise.learner.files import write_weights
from rollwise.models import load_policy
from rollwise.models.tiny import build_tokenizer
from rollwise.pipeline.build import build
from rollwise.replay import TrajectoryStore
from rollwise.rewards import RewardStats
from rollwise.rollout import vllm_worker
from rollwise.rollout.dialects import Ask, check_kind, make_dialect
from rollwise.rollout.remote import RemoteRollout
from rollwise.rollout.servers import RemoteError, Servers
from rollwise.rollout.vllm_worker import VLLMFolderWeights
from rollwise.types import EncodedPrompt, Published, Sample
from runs import records, run_config

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
EOS = 2  # the tiny model's stop token


def rule(prompt: list[int], seed: int, budget: int) -> tuple[list[int], list[float], str]:
    """The fakes' sampler: ids, log-probs and finish reason from the prompt and the seed."""
    length = 2 + (seed + sum(prompt)) % 9
    ids = [3 + (seed + 31 * j + sum(prompt)) % 80 for j in range(min(length, budget))]
    finish = "length" if length >= budget else "stop"
    if finish == "stop":
        ids.append(EOS)
    return ids, [-((seed + j) % 7 + 1) / 8 for j in range(len(ids))], finish


class Fake:
    """An HTTP server on a free port; `routes` maps a path to fn(body, query) -> (status,
    answer); every call is kept in `calls` and every sample sent in `sent`."""

    def __init__(self, routes):
        self.routes, self.calls, self.sent = routes, [], []
        self.abort_next = 0  # the next generate call's samples stop after 2 tokens ('abort')
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the http.server name)
                parts = urlsplit(self.path)
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                body = json.loads(raw) if raw else {}
                fake.calls.append((parts.path, parts.query, body))
                if parts.path not in fake.routes:
                    status, answer = 404, {"detail": "Not Found"}
                else:
                    status, answer = fake.routes[parts.path](body, parse_qs(parts.query))
                data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                path = urlsplit(self.path).path
                status, answer = fake.routes.get("GET " + path, lambda b, q: (
                    404, {"detail": "Not Found"}))({}, {})
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def sample(self, prompt: list[int], seed: int, budget: int):
        ids, lps, finish = rule(prompt, seed, budget)
        if self.abort_next:
            ids, lps, finish = ids[:2], lps[:2], "abort"
        self.sent.append((list(prompt), ids, lps))
        return ids, lps, finish

    def routes_called(self) -> list[str]:
        return [path + (f"?{q}" if q else "") for path, q, _ in self.calls
                if path not in ("/v1/completions", "/generate", "/tokenize")]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def ok(body=None):
    return 200, body if body is not None else {"success": True, "message": "ok"}


def bad(message: str):
    return 400, {"error": {"message": message}}


def folder_loaded(path: str):
    """(status, answer) of a weight load from `path`: the published folder must be there."""
    if not (Path(path) / "model.safetensors").is_file():
        return bad(f"{path} has no model.safetensors")
    return None


def vllm_routes(fake: Fake, malformed: bool = False):
    """vLLM's OpenAI server (completions with token ids) and its development-mode routes:
    the tag of the weights, /tokenize with the tiny tokenizer, token ids checked against
    its vocabulary."""
    tokenizer = build_tokenizer()
    fake.tag = "rollwise-v0"

    def completions(body, query):
        if "logprobs" not in body:  # a one-token request checking the vocabulary
            ok_ids = all(0 <= t < len(tokenizer) for t in body["prompt"])
            return ok({"choices": []}) if ok_ids else bad("token id out of vocabulary")
        if body.get("logprobs") != 0 or body.get("return_tokens_as_token_ids") is not True:
            return bad("expected logprobs: 0 and return_tokens_as_token_ids: true")
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        choices = []
        for i, prompt in enumerate(prompts):
            for j in range(body["n"]):  # vLLM seeds sample j of a prompt with seed + j
                ids, lps, finish = fake.sample(prompt, body["seed"] + j, body["max_tokens"])
                logprobs = {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": lps,
                            "top_logprobs": None, "text_offset": list(range(len(ids)))}
                choices.append({"index": i * body["n"] + j, "text": "",
                                "logprobs": None if malformed else logprobs,
                                "finish_reason": finish, "stop_reason": None})
        fake.abort_next = max(0, fake.abort_next - 1)
        return ok({"id": "cmpl-1", "object": "text_completion", "choices": choices})

    def rpc(body, query):
        if body.get("method") != "rollwise_reload" or len(body.get("args", [])) != 1:
            return bad(f"unexpected collective_rpc {body}")
        return folder_loaded(body["args"][0]) or ok({"results": [{"tensors": 7,
                                                                    "loader": "direct"}]})

    def tag(body, query):
        fake.tag = body["new_version"]
        return ok({"success": True, "new_version": fake.tag})

    def tokenize(body, query):
        ids = tokenizer.encode(body["prompt"], add_special_tokens=body["add_special_tokens"])
        return ok({"count": len(ids), "max_model_len": 512, "tokens": ids})

    return {"/v1/completions": completions, "/collective_rpc": rpc,
            "/pause": lambda b, q: ok({"status": "paused"}),
            "/reset_prefix_cache": lambda b, q: (200, b""),
            "/update_weight_version": tag, "/tokenize": tokenize,
            "/resume": lambda b, q: ok({"status": "resumed"}),
            "GET /health": lambda b, q: (200, {}),
            "GET /is_paused": lambda b, q: ok({"is_paused": False}),
            "GET /weight_info": lambda b, q: ok({"weight_version": fake.tag})}


def sglang_routes(fake: Fake, short: bool = False, load_fails: bool = False):
    """SGLang's native server: batched /generate, the pause/continue and disk-update routes."""

    def generate(body, query):
        params = body["sampling_params"]
        if body.get("return_logprob") is not True or len(params) != len(body["input_ids"]):
            return bad("expected return_logprob: true and one sampling_params per input")
        out = []
        for ids_in, p, rid in zip(body["input_ids"], params, body["rid"], strict=True):
            ids, lps, finish = fake.sample(ids_in, p["sampling_seed"], p["max_new_tokens"])
            out.append({"text": "", "output_ids": ids, "meta_info": {
                "id": rid, "finish_reason": {"type": finish}, "prompt_tokens": len(ids_in),
                "completion_tokens": len(ids),
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}})
        fake.abort_next = max(0, fake.abort_next - 1)
        return ok(out[:-1] if short else out)

    def update(body, query):
        if load_fails:
            return 400, {"success": False, "message": "Failed to get weights iterator"}
        return folder_loaded(body["model_path"]) or ok()

    return {"/generate": generate, "/update_weights_from_disk": update,
            "/pause_generation": lambda b, q: ok(), "/continue_generation": lambda b, q: ok(),
            "GET /health": lambda b, q: (200, {}),
            "GET /get_model_info": lambda b, q: ok({"model_path": "fake"})}


@pytest.fixture
def fakes():
    made: list[Fake] = []

    def make(kind: str, **options) -> Fake:
        fake = Fake({})
        fake.routes = (vllm_routes if kind == "vllm" else sglang_routes)(fake, **options)
        made.append(fake)
        return fake

    yield make
    for fake in made:
        fake.close()


def remote(tmp_path: Path, url: str, kind: str, *extra: str):
    return load_config(CONFIG, [
        f"run.output_dir='{tmp_path}'", "run.num_steps=2", "run.threads=1",
        "rollout.prompts_per_step=3", "rollout.group_size=4", "task.num_eval=4",
        "eval.every=0", "engine.name='remote'", f"engine.remote_urls=['{url}']",
        f"engine.remote_kind='{kind}'", "engine.remote_timeout_s=30",
        # the fakes give no log-probs of the model: vLLM's weight check needs the real one
        # (tests/test_vllm_server.py)
        "engine.remote_verify=false", *extra])


def port(url: str, kind: str, sync: str = "pause") -> RemoteRollout:
    return RemoteRollout(Servers([url], timeout_s=20, retries=0),
                         SamplingParams(n=3, max_tokens=8), lambda ids: "",
                         lambda trajs: RewardStats(0, 0, 0, 0.0), seed=5, sync=sync, kind=kind)


PROMPT = EncodedPrompt(Sample("s", "", ""), [5, 6, 7])
WEIGHT_ROUTES = {
    "vllm": ["/pause?mode=keep", "/collective_rpc", "/reset_prefix_cache",
             "/update_weight_version", "/resume"],
    "sglang": ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_training_run_against_the_fake_keeps_what_it_sent(tmp_path, fakes, kind):
    """Two steps: every trajectory is a sample the fake sent (ids and log-probs as sent),
    each token stamped with the version published before its step, and each version was
    loaded through the documented routes from the folder the trainer wrote."""
    fake = fakes(kind)
    run_config(remote(tmp_path, fake.url, kind), kind)
    store = TrajectoryStore(tmp_path / kind / "trajectories.sqlite")
    try:
        steps = {s: [t for g in store.load_groups(s) for t in g.trajectories] for s in (1, 2)}
    finally:
        store.close()
    sent = {(tuple(p), tuple(i)): lps for p, i, lps in fake.sent}
    for step, trajs in steps.items():
        assert len(trajs) == 12
        for t in trajs:
            assert sent[(tuple(t.prompt_ids), tuple(t.response_ids))] == t.logprobs
            assert t.versions == [step - 1] * len(t.response_ids)
            assert t.finish_reason == ("stop" if t.response_ids[-1] == EOS else "length")
    assert fake.routes_called() == WEIGHT_ROUTES[kind] * 3  # versions 0, 1 and 2
    loads = [body for path, _, body in fake.calls if path in (
        "/collective_rpc", "/update_weights_from_disk")]
    folders = [b["args"][0] if kind == "vllm" else b["model_path"] for b in loads]
    assert [Path(f).name for f in folders] == ["v0", "v1", "v2"]
    if kind == "sglang":
        assert [b["weight_version"] for b in loads] == ["0", "1", "2"]
    else:  # each load tagged, each request salted with the version it was sent under
        assert fake.tag == "rollwise-v2"
        salts = [b["cache_salt"] for p, _, b in fake.calls
                 if p == "/v1/completions" and "logprobs" in b]
        assert salts == ["rollwise-v0"] * 3 + ["rollwise-v1"] * 3
    trains = records(tmp_path / kind, "train")
    assert [r["remote_requests"] for r in trains] == [3, 3]
    assert all(r["remote_weights_load_seconds"] > 0 for r in trains)
    if kind == "vllm":  # each step's load, as the worker's answer named its loader
        assert [r.get("remote_weights_direct_loads") for r in trains] == [1.0, 1.0]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_samples_an_update_aborted_are_sent_again_from_where_they_stopped(fakes, kind):
    """The first answer stops every sample after 2 tokens ('abort', as an update in abort
    mode leaves them); the port sends each again as its prompt plus those tokens, with the
    budget left, and keeps both parts."""
    fake = fakes(kind)
    fake.abort_next = 1
    rollout = port(fake.url, kind, sync="abort")
    try:
        trajs = rollout.run([PROMPT], [3])[0].trajectories
        assert rollout.metrics()["remote_resumed"] == 3
    finally:
        rollout.close()
    first, again = fake.sent[:3], fake.sent[3:]
    assert len(again) == 3
    for t, (_, head, head_lps), (prompt, tail, tail_lps) in zip(trajs, first, again):
        assert prompt == PROMPT.ids + head and t.response_ids == head + tail
        assert t.logprobs == head_lps + tail_lps and t.finish_reason != "abort"
        assert len(t.response_ids) <= 8  # the budget counts the tokens before the abort


@pytest.mark.parametrize("kind,options,match", [
    ("vllm", {"malformed": True}, "malformed answer"),
    ("sglang", {"short": True}, "asked for 3 samples, the server answered 2")])
def test_a_malformed_answer_names_the_server_and_the_route(fakes, kind, options, match):
    fake = fakes(kind, **options)
    rollout = port(fake.url, kind)
    try:
        with pytest.raises(RemoteError, match=match) as e:
            rollout.run([PROMPT], [3])
    finally:
        rollout.close()
    route = "/v1/completions" if kind == "vllm" else "/generate"
    assert f"{fake.url}{route}" in str(e.value)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_priority_stop_ids_and_seeds_reach_the_documented_fields(fakes, kind):
    """A priority and stop ids go out as the servers' `priority` and `stop_token_ids`;
    vLLM gets the group's first seed (it seeds sample k with seed + k), SGLang each
    sample's own `sampling_seed`."""
    fake = fakes(kind)
    servers = Servers([fake.url], timeout_s=20, retries=0)
    sampling = SamplingParams(n=2, max_tokens=8, top_k=0, stop_token_ids=(EOS, 9))
    try:
        answer = make_dialect(kind).generate(servers, Ask([5, 6], [11, 40], [None, None],
                                                          sampling, uid=7, version=3, priority=2))
    finally:
        servers.close()
    body = fake.calls[0][2]
    assert body["priority"] == 2
    options = [body] if kind == "vllm" else body["sampling_params"]
    assert all(o["stop_token_ids"] == [EOS, 9] and o["top_k"] == -1 for o in options)
    seeds = [body["seed"]] if kind == "vllm" else [o["sampling_seed"] for o in options]
    assert seeds == ([11] if kind == "vllm" else [11, 40])
    assert [c.versions == [3] * len(c.token_ids) for c in answer.completions] == [True, True]


def test_a_body_that_is_not_json_names_the_server_and_the_route(fakes):
    fake = fakes("sglang")
    fake.routes["/generate"] = lambda b, q: (200, b"<html>proxy error</html>")
    rollout = port(fake.url, "sglang")
    try:
        with pytest.raises(RemoteError, match="not JSON") as e:
            rollout.run([PROMPT], [3])
    finally:
        rollout.close()
    assert f"{fake.url}/generate" in str(e.value)


def test_a_failed_load_names_the_phase_and_the_server_is_not_left_paused(tmp_path, fakes):
    fake = fakes("sglang", load_fails=True)
    rollout = port(fake.url, "sglang")
    try:
        with pytest.raises(RemoteError, match="phase load") as e:
            rollout.publish(Published(3, str(tmp_path)))
    finally:
        rollout.close()
    assert f"{fake.url}/update_weights_from_disk" in str(e.value)
    assert "Failed to get weights iterator" in str(e.value)
    assert fake.routes_called() == WEIGHT_ROUTES["sglang"]


def test_the_vllm_worker_extension_checks_the_file_before_vllm_reloads_it(tmp_path):
    """What `/collective_rpc` calls on each vLLM worker: the published file checked against
    the checkpoint the server started from (every tensor, its shape, the file whole), then
    loaded (here vLLM's own reload of the folder, asked for: the direct load, which needs
    vLLM, is tests/test_vllm_server.py's); a file that fails is named with the tensor or
    the truncation, and nothing is reloaded."""
    model = load_policy("tiny").model
    write_weights(model, tmp_path / "start", full=True, untied=True)
    write_weights(model, tmp_path / "v1", full=True, untied=True)
    reloaded: list[str] = []
    worker = VLLMFolderWeights()
    worker.model_runner = SimpleNamespace(  # type: ignore[attr-defined]
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path / "start"))),
        reload_weights=lambda weights_path: reloaded.append(weights_path))
    count = len(load_file(str(tmp_path / "v1" / "model.safetensors")))
    said = worker.rollwise_reload(str(tmp_path / "v1"), loader="stock")
    assert said == {"tensors": count, "loader": "stock"}
    with pytest.raises(ValueError, match="'auto' or 'stock'"):
        worker.rollwise_reload(str(tmp_path / "v1"), loader="fast")
    assert reloaded == [str(tmp_path / "v1")]
    write_weights(model, tmp_path / "tied", full=True)
    with pytest.raises(ValueError, match="tensor lm_head.weight is missing"):
        worker.rollwise_reload(str(tmp_path / "tied"))
    file = tmp_path / "v1" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        worker.rollwise_reload(str(tmp_path / "v1"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        worker.rollwise_reload(str(tmp_path / "nothing"))
    assert reloaded == [str(tmp_path / "v1")]


def test_an_untied_publication_writes_the_output_layer_under_its_own_name(tmp_path):
    """Guard for vLLM's reload (which keeps a tied model's start-up head): published
    untied, a tied model's output layer is written as lm_head.weight, equal to the
    embedding; published tied, once."""
    model = load_policy("tiny").model
    write_weights(model, tmp_path / "u", full=True, untied=True)
    write_weights(model, tmp_path / "t", full=True)
    u = load_file(str(tmp_path / "u" / "model.safetensors"))
    t = load_file(str(tmp_path / "t" / "model.safetensors"))
    assert torch.equal(u["lm_head.weight"], u["model.embed_tokens.weight"])
    assert "lm_head.weight" not in t and set(u) - set(t) == {"lm_head.weight"}


def test_the_kind_a_url_serves_is_checked(fakes):
    """engine.remote_kind against what answers: a vLLM URL for SGLang is named as vLLM."""
    fake = fakes("vllm")
    servers = Servers([fake.url], timeout_s=20, retries=0)
    try:
        check_kind(servers, 0, "vllm")
        with pytest.raises(RemoteError, match="remote_kind = 'sglang', but .* is a vllm server"):
            check_kind(servers, 0, "sglang")
    finally:
        servers.close()


def test_remote_kind_is_checked_before_anything_loads(tmp_path):
    with pytest.raises(ConfigError, match="remote_kind"):
        load_config(CONFIG, ["engine.remote_kind='tgi'"])
    with pytest.raises(ConfigError, match="adapter alone"):
        build(remote(tmp_path, "http://127.0.0.1:9", "sglang", "model.lora_rank=4"))


class _Packing(torch.nn.Module):
    """A stand-in for a vLLM linear layer on the CPU: its weight is emptied and a packed
    copy kept when prepared (`keeps=False`, as oneDNN's path), or kept as it is (`keeps`,
    as the plain torch path)."""

    def __init__(self, rows: int, cols: int, keeps: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        self.output_size_per_partition, self.input_size_per_partition = rows, cols
        self.keeps, self.packed = keeps, None
        self.quant_method = self  # vLLM's layers prepare themselves through it

    def process_weights_after_loading(self, layer) -> None:
        if not self.keeps:
            self.packed = self.weight.detach().clone()
            self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def test_the_direct_load_stacks_pads_and_never_leaves_a_weight_on_its_staging_buffer(
        tmp_path):
    """`direct_load` (what the vLLM worker runs once `direct_plan` matched the file to the
    model; tests/test_vllm_server.py proves it inside vLLM): stacked parts by rows in the
    plan's order, a padded vocabulary's extra rows zero, each layer prepared once its
    tensors are in, and a layer that keeps its weight owning it: the staging buffer the
    next layer passes through does not change it."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    t = {name: torch.randn(shape, generator=g) for name, shape in (
        ("q", (4, 3)), ("k", (2, 3)), ("v", (2, 3)), ("o", (3, 4)), ("d", (3, 4)),
        ("e", (5, 3)))}
    save_file(t, str(tmp_path / "model.safetensors"))
    qkv, o, d = _Packing(8, 3), _Packing(3, 4, keeps=True), _Packing(3, 4)
    embed = torch.nn.Module()
    embed.weight = torch.nn.Parameter(torch.full((7, 3), 9.0), requires_grad=False)
    plan = [(qkv, "weight", ["q", "k", "v"]), (o, "weight", ["o"]), (d, "weight", ["d"]),
            (embed, "weight", ["e"])]
    vllm_worker.direct_load(plan, tmp_path / "model.safetensors")
    assert torch.equal(qkv.packed, torch.cat([t["q"], t["k"], t["v"]]))
    assert qkv.weight.numel() == 0 and d.weight.numel() == 0
    assert torch.equal(o.weight, t["o"])  # not overwritten by d's pass through the buffer
    assert torch.equal(d.packed, t["d"])
    assert torch.equal(embed.weight[:5], t["e"]) and not embed.weight[5:].any()
