"""`rollwise serve`'s weight protocol: POST /v1/weights/update loads a folder of safetensors
(full weights or a LoRA adapter) in place, the greedy output becomes the new model's, the
version moves and the tokens carry it (a request spanning an update shows both versions);
a bad folder or an update out of time is an error naming its phase, and the server serves on
with its old weights and version."""

from __future__ import annotations

import time

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
    assert set(out["phases"]) >= {"pause_s", "load_s", "resume_s"}
    after = served_greedy(url, ids)
    assert after["choices"][0]["token_ids"] == want and after["version"] == 3
    assert after["choices"][0]["versions"] == [3] * 16
    assert httpx.get(url + "/v1/weights", headers=AUTH).json() == {"version": 3, "updating": False}
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


def test_an_update_out_of_time_fails_within_it(served, tmp_path, monkeypatch):
    url, policy, server = served
    ids = policy.encode(PROMPT)
    before = served_greedy(url, ids)["choices"][0]["token_ids"]
    build_model(seed=1).save_pretrained(tmp_path / "w")
    stage = WeightStore.stage

    def slow_reads(self, folder):
        staged = stage(self, folder)

        def slow(read):
            return lambda: (time.sleep(0.05), read())[1]
        staged.writes = [(name, slow(read)) for name, read in staged.writes]
        return staged

    monkeypatch.setattr(WeightStore, "stage", slow_reads)  # ~40 tensors x 50 ms
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
