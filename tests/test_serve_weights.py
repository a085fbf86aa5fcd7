"""`rollwise serve`'s weight protocol: POST /v1/weights/update loads a folder of safetensors
(full weights or a LoRA adapter) in place, the greedy output becomes the new model's, the
version moves and the tokens carry it (a request spanning an update shows both versions);
a bad folder or an update out of time is an error naming its phase, and the server serves on
with its old weights and version."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from rollwise.engine import NativeEngine, SamplingParams
from rollwise.models.tiny import build_model
from rollwise.serve.weights import WeightStore
from test_serve_tokens import AUTH, KEY, in_background, post, tiny_server

PROMPT = "12+34="


@pytest.fixture
def served():
    """(base url, policy, server): a fresh tiny server per test (updates change it)."""
    with tiny_server(api_key=KEY) as running:
        yield running


def greedy_of(model, ids: list[int], n: int = 16) -> list[int]:
    engine = NativeEngine(model, eos_token_ids=[2])
    return engine.generate([ids], SamplingParams(temperature=0, max_tokens=n,
                                                 ignore_eos=True))[0].token_ids


def served_greedy(url: str, ids: list[int], n: int = 16) -> dict:
    r = post(url, "/v1/generate", {"prompt_token_ids": ids, "temperature": 0, "max_tokens": n,
                                   "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def update(url: str, **body) -> httpx.Response:
    return post(url, "/v1/weights/update", body)


def test_full_weights_replace_the_model_and_move_the_version(served, tmp_path):
    url, policy, _ = served
    ids = policy.encode(PROMPT)
    other = build_model(seed=1)
    other.save_pretrained(tmp_path / "w1")
    want = greedy_of(other, ids)
    assert served_greedy(url, ids)["choices"][0]["token_ids"] != want
    r = update(url, path=str(tmp_path / "w1"), version=3)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["version"] == 3 and out["aborted"] == 0
    assert set(out["phases"]) >= {"pause_s", "load_s", "write_s", "publish_s", "resume_s"}
    after = served_greedy(url, ids)
    assert after["choices"][0]["token_ids"] == want and after["version"] == 3
    assert after["choices"][0]["versions"] == [3] * 16
    assert httpx.get(url + "/v1/weights", headers=AUTH).json() == {
        "version": 3, "updating": False, "dtype": "float32"}
    assert httpx.get(url + "/version", headers=AUTH).json()["version"] == 3


def test_a_request_spanning_an_update_carries_both_versions(served, tmp_path):
    url, policy, _ = served
    build_model(seed=2).save_pretrained(tmp_path / "w")
    worker, box = in_background(url, {"prompt_token_ids": policy.encode("1+"),
                                       "max_tokens": 400, "ignore_eos": True, "seeds": [4]})
    assert update(url, path=str(tmp_path / "w"), version=1).status_code == 200
    worker.join(60)
    (choice,) = box["r"].json()["choices"]
    versions = choice["versions"]
    assert choice["finish_reason"] == "length" and len(versions) == 400
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)


def test_abort_mode_returns_the_running_requests_partial(served, tmp_path):
    url, policy, _ = served
    build_model(seed=2).save_pretrained(tmp_path / "w")
    worker, box = in_background(url, {"prompt_token_ids": policy.encode("1+"),
                                       "max_tokens": 400, "ignore_eos": True})
    r = update(url, path=str(tmp_path / "w"), version=1, mode="abort")
    worker.join(60)
    assert r.status_code == 200 and r.json()["aborted"] == 1
    (choice,) = box["r"].json()["choices"]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 400
    assert set(choice["versions"]) == {0}


def test_a_lora_adapter_is_merged_into_the_base_weights(served, tmp_path):
    from peft import LoraConfig, get_peft_model

    url, policy, _ = served
    ids = policy.encode(PROMPT)
    base = build_model()  # the same weights as the served tiny model
    torch.manual_seed(5)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                           target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(4.0)  # a visible change
    peft.save_pretrained(tmp_path / "lora")
    want = greedy_of(peft.merge_and_unload(), ids)
    before = served_greedy(url, ids)["choices"][0]["token_ids"]
    assert want != before
    assert update(url, path=str(tmp_path / "lora"), version=1).status_code == 200
    assert served_greedy(url, ids)["choices"][0]["token_ids"] == want
    build_model().save_pretrained(tmp_path / "base")
    assert update(url, path=str(tmp_path / "base"), version=2).status_code == 200
    assert served_greedy(url, ids)["choices"][0]["token_ids"] == before


def test_a_bad_folder_is_an_error_naming_the_phase_and_nothing_changes(served, tmp_path):
    url, policy, _ = served
    ids = policy.encode(PROMPT)
    before = served_greedy(url, ids)["choices"][0]["token_ids"]
    (tmp_path / "empty").mkdir()
    build_model(hidden=64).save_pretrained(tmp_path / "small")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"not safetensors")
    for name, tensors in (("stranger", {"not.a.weight": torch.zeros(2)}),
                          ("partial", {"model.norm.weight": torch.ones(128)})):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors")
    cases = [(tmp_path / "nowhere", "not a folder"), (tmp_path / "empty", "model.safetensors"),
             (tmp_path / "small", "shape"), (tmp_path / "junk", "cannot be read"),
             (tmp_path / "stranger", "'not.a.weight' is not a weight"),
             (tmp_path / "partial", "lacks")]
    for path, named in cases:
        r = update(url, path=str(path), version=1)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "phase load" in message and named in message and "still serving version 0" in message
        assert r.json()["error"]["phase"] == "load"
    r = update(url, path=str(tmp_path / "small"), version=1, mode="sideways")
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]
    after = served_greedy(url, ids)
    assert after["choices"][0]["token_ids"] == before and after["version"] == 0


def slow_reads(monkeypatch) -> None:
    """Every tensor an update writes read 50 ms late (the tiny model: ~40 tensors)."""
    stage = WeightStore.stage

    def slowed(self, folder):
        staged = stage(self, folder)
        staged.writes = [(name, lambda read=read: (time.sleep(0.05), read())[1])
                         for name, read in staged.writes]
        return staged
    monkeypatch.setattr(WeightStore, "stage", slowed)


def test_an_update_out_of_time_fails_within_it(served, tmp_path, monkeypatch):
    url, policy, server = served
    ids = policy.encode(PROMPT)
    before = served_greedy(url, ids)["choices"][0]["token_ids"]
    build_model(seed=1).save_pretrained(tmp_path / "w")
    slow_reads(monkeypatch)
    start = time.monotonic()
    r = update(url, path=str(tmp_path / "w"), version=1, timeout_s=0.5)
    assert time.monotonic() - start < 2.0
    assert r.status_code == 504 and "phase load: timed out" in r.json()["error"]["message"]
    after = served_greedy(url, ids)  # the tensors written before the time-out were put back
    assert after["choices"][0]["token_ids"] == before and after["version"] == 0

    monkeypatch.setattr(WeightStore, "stage", lambda self, folder: time.sleep(1.5))
    start = time.monotonic()
    r = update(url, path=str(tmp_path / "w"), version=1, timeout_s=0.3)
    assert time.monotonic() - start < 1.2 and r.status_code == 504
    assert server.engine.version == 0


# -- publications in the server's precision (learner/files.py, rollout/remote.py) -----------

@pytest.fixture
def served_bf16():
    """(base url, policy, server): a tiny server whose engine samples in bfloat16 (its
    model stays float32; the engine keeps a converted copy)."""
    from rollwise.models import load_policy
    from rollwise.serve import RolloutServer

    torch.set_num_threads(1)
    policy = load_policy("tiny")
    engine = NativeEngine(policy.model, eos_token_ids=policy.stop_ids, max_num_seqs=8,
                          dtype="bfloat16")
    server = RolloutServer(policy, engine, name="tiny", api_key=KEY)
    try:
        yield server.start(), policy, server
    finally:
        server.stop()


def publish_twice(url: str, model) -> dict:
    """`model` published as a remote run publishes (version 0 when the run is built, 1
    after its first update), each loaded through the remote rollout port: what version 1
    was written as (the dtypes, the files' tensor dtypes, the bytes)."""
    from rollwise.learner.files import WeightsPublisher
    from rollwise.rewards import RewardStats
    from rollwise.rollout.remote import RemoteRollout
    from rollwise.rollout.servers import Servers

    servers = Servers([url], timeout_s=30, retries=0)
    servers.client.headers.update(AUTH)
    port = RemoteRollout(servers, SamplingParams(), lambda ids: "",
                         lambda trajs: RewardStats(0, 0, 0, 0.0), seed=0)
    publisher = WeightsPublisher(model)
    try:
        port.publish(publisher.publish(0))
        second = publisher.publish(1)
        port.publish(second)
        return {"written": sorted(second.handle.folders), "nbytes": second.nbytes,
                "files": file_dtypes(str(second.handle))}
    finally:
        port.close()
        publisher.close()


def file_dtypes(folder: str) -> set[str]:
    import json
    import struct
    from pathlib import Path

    raw = (Path(folder) / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def greedy_in(model, ids: list[int], dtype: str, n: int = 16) -> list[int]:
    engine = NativeEngine(model, eos_token_ids=[2], max_num_seqs=8, dtype=dtype)
    return engine.generate([ids], SamplingParams(temperature=0, max_tokens=n,
                                                 ignore_eos=True))[0].token_ids


def test_a_bfloat16_server_gets_bfloat16_weights_and_the_in_process_tokens(served_bf16):
    url, policy, _ = served_bf16
    ids = policy.encode(PROMPT)
    other = build_model(seed=1)
    want = greedy_in(other, ids, "bfloat16", 24)
    assert served_greedy(url, ids, 24)["choices"][0]["token_ids"] != want
    out = publish_twice(url, other)
    assert out["written"] == ["bfloat16"] and out["files"] == {"BF16"}
    after = served_greedy(url, ids, 24)
    assert after["version"] == 1 and after["choices"][0]["token_ids"] == want  # bit for bit
    f32 = sum(t.numel() * 4 for n, t in other.state_dict().items() if n != "lm_head.weight")
    assert out["nbytes"] == f32 // 2
    assert all(p.dtype == torch.float32 for p in other.parameters())  # the trainer's own


def test_a_float32_server_still_gets_float32_weights(served):
    url, policy, _ = served
    ids = policy.encode(PROMPT)
    other = build_model(seed=1)
    want = greedy_in(other, ids, "float32", 24)
    out = publish_twice(url, other)
    assert out["written"] == ["float32"] and out["files"] == {"F32"}
    after = served_greedy(url, ids, 24)
    assert after["version"] == 1 and after["choices"][0]["token_ids"] == want


def test_the_bfloat16_folder_is_half_the_float32_one(tmp_path):
    from rollwise.learner.files import WeightsPublisher

    model = build_model(seed=1)
    publisher = WeightsPublisher(model, str(tmp_path))
    try:
        first = publisher.publish(0)
        sizes = {d: (Path(first.handle.folder(d)) / "model.safetensors").stat().st_size
                 for d in ("float32", "bfloat16")}
        assert first.nbytes == 2 * first.handle.nbytes["bfloat16"]
        assert abs(2 * sizes["bfloat16"] - sizes["float32"]) < 2 * 8192  # headers aside
        assert sizes["bfloat16"] < 0.51 * sizes["float32"]
        later = publisher.publish(1)  # written in what was asked for last: both
        assert later.nbytes == first.nbytes * 3 // 2 and len(later.handle.folders) == 2
    finally:
        publisher.close()


def test_a_bfloat16_server_out_of_time_serves_on_and_wants_full_weights(served_bf16, tmp_path,
                                                                        monkeypatch):
    """The engine samples from its own copy: a full update that fails part-way keeps no
    copy of the old values, the server serves the old tokens and version, an adapter is
    refused until full weights load."""
    url, policy, server = served_bf16
    ids = policy.encode(PROMPT)
    before = served_greedy(url, ids)["choices"][0]["token_ids"]
    build_model(seed=1).save_pretrained(tmp_path / "w")
    stage = WeightStore.stage
    slow_reads(monkeypatch)
    r = update(url, path=str(tmp_path / "w"), version=1, timeout_s=0.5)
    assert r.status_code == 504 and "serves on from its copy" in r.json()["error"]["message"]
    after = served_greedy(url, ids)
    assert after["choices"][0]["token_ids"] == before and after["version"] == 0
    assert server.weights.torn
    monkeypatch.setattr(WeightStore, "stage", stage)
    (tmp_path / "a").mkdir()
    out, inp = policy.model.model.layers[0].self_attn.q_proj.weight.shape
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    save_file({name + "A.weight": torch.zeros(4, inp), name + "B.weight": torch.zeros(out, 4)},
              tmp_path / "a" / "adapter_model.safetensors")
    (tmp_path / "a" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    r = update(url, path=str(tmp_path / "a"), version=2)
    assert r.status_code == 409 and "full weights first" in r.json()["error"]["message"]
    r = update(url, path=str(tmp_path / "w"), version=3)
    assert r.status_code == 200 and not server.weights.torn
    assert served_greedy(url, ids)["choices"][0]["token_ids"] == greedy_in(
        build_model(seed=1), ids, "bfloat16")


def test_lora_publications_hold_the_adapter_alone_after_the_first_and_stay_float32(tmp_path):
    from peft import LoraConfig, get_peft_model

    from rollwise.learner.files import WeightsPublisher

    peft = get_peft_model(build_model(), LoraConfig(r=4, lora_alpha=8,
                                                    target_modules=["q_proj", "v_proj"]))
    publisher = WeightsPublisher(peft, str(tmp_path))
    try:
        first = publisher.publish(0)
        assert first.handle.folder("bfloat16") == str(first.handle)  # float32 base, once
        assert file_dtypes(str(first.handle)) == {"F32"}
        later = publisher.publish(1)
        files = sorted(p.name for p in Path(later.handle.folder("bfloat16")).iterdir())
        assert files == ["adapter_config.json", "adapter_model.safetensors"]
        lora = sum(p.numel() * 4 for n, p in peft.named_parameters() if "lora_" in n)
        assert later.nbytes == lora < first.nbytes // 50
    finally:
        publisher.close()


@pytest.mark.parametrize("extra", [{}, {"bias": "lora_only"}, {"use_dora": True}])
def test_the_adapter_is_written_as_peft_saves_it(extra):
    """The adapter's tensors, picked from its parameters, are peft's own
    get_peft_model_state_dict: the same names, the same values (also with LoRA biases and
    DoRA, which go through peft's function: DoRA's magnitude vectors are named otherwise)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from rollwise.learner.files import adapter_tensors

    peft = get_peft_model(build_model(), LoraConfig(r=4, lora_alpha=8, **extra,
                                                    target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.normal_()  # lora_B starts at zero: make every tensor tell
    want, got = get_peft_model_state_dict(peft), adapter_tensors(peft)
    assert sorted(got) == sorted(want) and len(got) > 0
    assert all(torch.equal(got[k], want[k]) for k in want)
