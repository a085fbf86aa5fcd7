"""The remote engine against the real vLLM (its CPU build, `make vllm`; `make test-servers`).

One server is started for the module (eager, the tiny model's shape, LoRA enabled) and one
fresh server on other weights gives the reference a reload must reproduce. Checked: a
reload through the worker extension (its direct load) equals a fresh load while vLLM's
stock reload of a tied folder does not; the prefix cache never answers with another
version's KV (and does without the guard); a skipped load, a failed load and a restarted
server each stop the run with an error naming the server; a 2-step run and a LoRA run
are verified at every step; a wrong kind, an unreachable URL and another model are
one-line errors before the first step. Without `.venv-vllm` every test is skipped, saying so.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollwise.compose.config import load_config
from rollwise.engine.base import SamplingParams
from rollwise.learner.files import WeightsPublisher, probe_logprobs, write_weights
from rollwise.models.tiny import build_model, build_tokenizer
from rollwise.rewards import RewardStats
from rollwise.rollout.dialects import Ask, Expect, VLLMDialect, check_kind
from rollwise.rollout.remote import PROBE_BOUNDS, RemoteRollout
from rollwise.rollout.servers import RemoteError, Servers
from rollwise.serve.vllm import VLLMServer, VLLMUnavailable, untie, vllm_python
from rollwise.types import EncodedPrompt, Sample
from runs import records, run_config

try:
    vllm_python()
    MISSING = ""
except VLLMUnavailable as e:
    MISSING = str(e)

pytestmark = [pytest.mark.servers,
              pytest.mark.skipif(bool(MISSING), reason=f"needs vLLM: {MISSING}")]

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
CONTEXT = 1024
TEXT = "Question: what is 17 + 25? Answer: 17 + 25 = 42. The quick brown fox."
TOKENIZER = build_tokenizer()
PROBE = TOKENIZER.encode(TEXT, add_special_tokens=False)
# float32 on both sides, the same kernels: a reload and a fresh load agree to rounding
SAME = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny(seed: int):
    """A tiny model of the run's shape with a context of CONTEXT tokens, weights by seed."""
    return build_model(seed=seed, context=CONTEXT)


def served(model, folder: Path) -> Path:
    """`model` saved as `rollwise serve-vllm` serves it: untied, with its tokenizer."""
    untie(model)
    model.save_pretrained(folder)
    TOKENIZER.save_pretrained(folder)
    return folder


def server(folder: Path, log: Path, **options) -> VLLMServer:
    return VLLMServer(folder, free_port(), eager=True, max_model_len=CONTEXT, kv_gb=1,
                      log=log, **options).start(240)


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def server_a(place):
    """The server the tests load weights into: tiny seed 0 at start, LoRA enabled."""
    s = server(served(tiny(0), place / "a"), place / "a.log", lora_rank=8)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fresh_b(place):
    """The reference: a server started on tiny seed 1. (its probe log-probs, its greedy
    log-probs after LONG)"""
    s = server(served(tiny(1), place / "b"), place / "b.log")
    servers = Servers([s.url], timeout_s=60, retries=0)
    try:
        yield (VLLMDialect().prompt_logprobs(servers, 0, PROBE, 0),
               greedy(VLLMDialect(), servers, LONG, 0))
    finally:
        servers.close()
        s.stop()


LONG = [4 + (7 * i) % 60 for i in range(900)]  # a prompt of 900 tokens


def greedy(dialect: VLLMDialect, servers: Servers, prompt: list[int], version: int):
    """The log-probs of 4 greedy tokens after `prompt`, as the dialect asks for them."""
    ask = Ask(prompt, [0], [None], SamplingParams(temperature=0.0, max_tokens=4,
                                                   ignore_eos=True), 1, version)
    return dialect.generate(servers, ask).completions[0].logprobs


def published(model, root: Path, name: str, untied: bool = True) -> str:
    folder = root / name
    write_weights(model, folder, full=True, untied=untied)
    return str(folder)


def largest(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_a_reload_equals_a_fresh_load_and_a_tied_folder_does_not(server_a, fresh_b, place):
    """Tiny seed 1 loaded into the server started on seed 0 gives the probe's log-probs of a
    server started on seed 1. The extension refuses a tied folder (no lm_head.weight),
    naming the tensor; vLLM's stock reload takes it and keeps the start-up output layer,
    which the log-probs show."""
    servers = Servers([server_a.url], timeout_s=60, retries=0)
    dialect = VLLMDialect()
    before = dialect.prompt_logprobs(servers, 0, PROBE, 0)
    assert largest(before, fresh_b[0]) > 0.05  # the two weights are told apart
    dialect.load(servers, 0, published(tiny(1), place, "b-untied"), 1, "pause")
    assert dialect.take_loaders() == {"direct": 1}  # the direct load, not vLLM's stock one
    assert largest(dialect.prompt_logprobs(servers, 0, PROBE, 1), fresh_b[0]) <= SAME
    assert largest(probe_logprobs(tiny(1), PROBE), fresh_b[0]) <= PROBE_BOUNDS["float32"]

    dialect.load(servers, 0, published(tiny(0), place, "a-untied"), 2, "pause")
    with pytest.raises(RemoteError, match=r"version 3 failed in phase load.*lm_head\.weight"):
        dialect.load(servers, 0, published(tiny(1), place, "b-tied", untied=False), 3, "pause")
    servers.post("/resume", {})
    servers.post("/collective_rpc", {"method": "reload_weights",
                                     "kwargs": {"weights_path": str(place / "b-tied")}})
    servers.post("/reset_prefix_cache", {})
    assert largest(dialect.prompt_logprobs(servers, 0, PROBE, 4), fresh_b[0]) > 0.01
    servers.close()


def adapter(seed: int, root: Path, name: str) -> str:
    """A LoRA adapter (rank 8, random A and B) on tiny seed 0, saved as a run publishes
    one."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(tiny(0), LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                               target_modules=["q_proj", "v_proj", "up_proj"]))
    folder = root / name
    write_weights(model, folder)
    return str(folder)


def prefix_hits(url: str) -> float:
    """vLLM's count of prompt tokens answered from its prefix cache (/metrics)."""
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:prefix_cache_hits_total in /metrics")


@pytest.mark.parametrize("guard", [True, False])
def test_no_request_reuses_a_prefix_cached_under_other_weights(server_a, fresh_b, place, guard):
    """A 900-token prompt, asked twice under one version (the second answered from the
    prefix cache: its hit count grows), then another version loaded (full weights, then a
    LoRA adapter in place of another), then the prompt again: its greedy log-probs are
    those of the new weights with nothing cached (a fresh server; the adapter under a name
    never used). With the guard (a cache reset per load, a salt per version) and, on vLLM
    0.32, without it too: its own reload and adapter load empty the cache, which the
    second case shows (docs/remote.md)."""
    servers = Servers([server_a.url], timeout_s=60, retries=0)
    dialect = VLLMDialect()
    dialect.cache_guard = guard
    dialect.load(servers, 0, published(tiny(0), place, f"a{guard}"), 30, "pause")
    greedy(dialect, servers, LONG, 30)
    hits = prefix_hits(server_a.url)
    greedy(dialect, servers, LONG, 30)
    assert prefix_hits(server_a.url) >= hits + 768  # the cache answers whole 128-token blocks
    dialect.load(servers, 0, published(tiny(1), place, f"b{guard}"), 31, "pause")
    assert largest(greedy(dialect, servers, LONG, 31), fresh_b[1]) <= SAME

    dialect.load(servers, 0, published(tiny(0), place, f"base{guard}"), 32, "pause")
    dialect.load(servers, 0, adapter(1, place, f"x{guard}"), 33, "pause")
    greedy(dialect, servers, LONG, 33)
    y = adapter(2, place, f"y{guard}")
    dialect.load(servers, 0, y, 34, "pause")
    after = greedy(dialect, servers, LONG, 34)
    servers.post("/v1/load_lora_adapter", {"lora_name": f"fresh-{guard}", "lora_path": y},
                 text_ok=True)
    fresh = VLLMDialect()
    fresh.model = f"fresh-{guard}"
    assert largest(after, greedy(fresh, servers, LONG, 34)) <= SAME
    servers.close()


def rollout(url: str, sync: str = "pause") -> RemoteRollout:
    return RemoteRollout(Servers([url], timeout_s=60, retries=1),
                         SamplingParams(temperature=1.0, max_tokens=6), lambda ids: "",
                         lambda trajs: RewardStats(0, 0, 0, 0.0), seed=3, sync=sync,
                         kind="vllm", probe=PROBE)


PROMPT = EncodedPrompt(Sample("s", "", ""), TOKENIZER.encode("12+34="))


def test_a_skipped_load_a_failed_load_and_a_restart_stop_the_run(server_a, place,
                                                                   monkeypatch):
    """Versions 0 and 1 load and verify. Version 2's reload dropped on its way (the tag
    still set): the probe check names the server, the version and the position. A
    truncated file and a file missing a tensor name the server, the version and the phase,
    and no request is sent after a failed load. A version equal to the one before is
    counted unverified (the probe cannot tell them apart). A restarted server (its start-up weights,
    tag 'default') stops the next step, named."""
    model = tiny(0)
    publisher = WeightsPublisher(model, str(place / "pub"), untied=True, probe=PROBE)
    port = rollout(server_a.url)
    port.publish(publisher.publish(0))
    model.load_state_dict(tiny(1).state_dict())
    port.publish(publisher.publish(1))
    assert port.metrics()["remote_weights_verified"] == 1.0
    assert len(port.run([PROMPT], [2])[0].trajectories) == 2

    model.load_state_dict(tiny(2).state_dict())
    post = port.servers.post
    monkeypatch.setattr(port.servers, "post", lambda route, body, **kw: (
        ({"results": [None]}, 0.0) if route == "/collective_rpc" else post(route, body, **kw)))
    with pytest.raises(RemoteError, match=rf"{server_a.url}: weights version 2 fail the "
                       r"check: the probe's log-prob at position \d+"):
        port.publish(publisher.publish(2))
    monkeypatch.undo()
    with pytest.raises(RemoteError, match="no server samples again"):
        port.run([PROMPT], [2])

    handle = publisher.publish(3)
    file = Path(handle.handle.folder("float32")) / "model.safetensors"
    os.truncate(file, file.stat().st_size // 2)
    with pytest.raises(RemoteError, match=rf"{server_a.url}: weight update to version 3 "
                       r"failed in phase load.*truncated"):
        port.publish(handle)
    with pytest.raises(RemoteError, match="no server samples again"):
        port.run([PROMPT], [2])

    handle = publisher.publish(4)
    folder = Path(handle.handle.folder("float32"))
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(RemoteError, match=r"version 4 failed in phase load.*"
                       r"model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        port.publish(handle)

    port.publish(publisher.publish(5))  # the same weights as version 4: not told apart
    assert port.metrics()["remote_weights_unverified"] == 1.0
    model.load_state_dict(tiny(3).state_dict())
    port.publish(publisher.publish(6))  # a good load: the servers are used again
    assert port.metrics()["remote_weights_verified"] == 1.0
    assert len(port.run([PROMPT], [2])[0].trajectories) == 2
    server_a.stop()
    server_a.start(240)
    with pytest.raises(RemoteError, match=rf"{server_a.url} serves weight version 'default', "
                       r"not 'rollwise-v6': it restarted"):
        port.run([PROMPT], [2])
    port.close()
    publisher.close()


def remote(tmp_path: Path, url: str, *extra: str):
    return load_config(CONFIG, [
        f"run.output_dir='{tmp_path}'", "run.num_steps=2", "run.threads=1",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "task.num_eval=4",
        "eval.every=0", "engine.name='remote'", f"engine.remote_urls=['{url}']",
        "engine.remote_kind='vllm'", "engine.remote_timeout_s=60", *extra])


@pytest.mark.parametrize("lora", [0, 8])
def test_a_run_against_vllm_is_verified_at_every_step(server_a, tmp_path, lora):
    """Two steps of the tiny run (full weights, or a LoRA adapter loaded in place after the
    base): every trajectory's tokens carry the version published before its step, every
    load is verified within the float32 bound, and the weights moved."""
    extra = [f"model.lora_rank={lora}"] if lora else []
    run_config(remote(tmp_path, server_a.url, *extra), "run")
    trains = records(tmp_path / "run", "train")
    assert len(trains) == 2
    for r in trains:
        assert r["remote_weights_verified"] + r["remote_weights_unverified"] == 1.0
        assert r["remote_weights_probe_error"] <= PROBE_BOUNDS["float32"]
        assert r["remote_requests"] == 4
        assert 0 < r["weights_probe_seconds"] + r["weights_write_seconds"] < r["publish_seconds"]
    assert trains[-1]["remote_weights_probe_gap"] > 0  # version 2 differs from version 1
    assert sum(r["remote_weights_verified"] for r in trains) >= 1


def test_bad_servers_are_one_line_errors_before_the_first_step(server_a):
    """The wrong kind names what the URL serves; an unreachable URL says so; another
    tokenizer, another vocabulary size and too short a context are each named. A server
    left paused (by a trainer killed inside a load) is resumed by the check."""
    servers = Servers([server_a.url], timeout_s=30, retries=0)
    with pytest.raises(RemoteError, match=r"remote_kind = 'rollwise', but .* is a vllm server"):
        check_kind(servers, 0, "rollwise")
    down = Servers([f"http://127.0.0.1:{free_port()}"], timeout_s=5, retries=0)
    with pytest.raises(RemoteError, match="cannot be reached"):
        check_kind(down, 0, "vllm")
    vocab = len(TOKENIZER)
    dialect = VLLMDialect()
    servers.post("/pause?mode=keep", {})  # as a trainer that died inside a load leaves it
    dialect.check_server(servers, 0, Expect(vocab, TEXT, PROBE, 512))
    assert servers.get(0, "/is_paused") == {"is_paused": False}
    with pytest.raises(RemoteError, match="serves another model: it tokenizes"):
        dialect.check_server(servers, 0, Expect(vocab, TEXT, PROBE[::-1], 512))
    with pytest.raises(RemoteError, match=f"token id {vocab} is refused"):
        dialect.check_server(servers, 0, Expect(vocab + 1, TEXT, PROBE, 512))
    with pytest.raises(RemoteError, match=f"token id {vocab - 1} is accepted"):
        dialect.check_server(servers, 0, Expect(vocab - 1, TEXT, PROBE, 512))
    with pytest.raises(RemoteError, match=f"serves at most {CONTEXT} tokens"):
        dialect.check_server(servers, 0, Expect(vocab, TEXT, PROBE, CONTEXT + 1))
    servers.close()
