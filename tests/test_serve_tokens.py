"""`rollwise serve`'s token routes, as a trainer in another process drives them: /v1/generate
gives exactly the engine's own samples for the same seeds (ids, log-probs, versions), an
abort returns the partial samples and resuming them finishes them as if never stopped,
/tokenize and /detokenize round-trip."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import torch

from rollwise.engine import NativeEngine, SamplingParams
from rollwise.engine.sampling import derive_seed
from rollwise.models import load_policy
from rollwise.serve import RolloutServer

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


@contextmanager
def tiny_server(**kw):
    """(base url, policy, server): the untrained tiny model served on a free port."""
    torch.set_num_threads(1)
    policy = load_policy("tiny")
    engine = NativeEngine(policy.model, eos_token_ids=policy.stop_ids, max_num_seqs=8)
    server = RolloutServer(policy, engine, name="tiny", **kw)
    try:
        yield server.start(), policy, server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served():
    """(base url, policy, reference engine over the same weights)."""
    with tiny_server(api_key=KEY) as (url, policy, _):
        yield url, policy, NativeEngine(policy.model, eos_token_ids=policy.stop_ids)


def post(url: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=timeout)


def generated(url: str) -> int:
    return httpx.get(url + "/v1/stats", headers=AUTH).json()["engine"]["generated_tokens"]


def in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """POST /v1/generate from a thread, once the engine has sampled a few of its tokens:
    (the thread, a dict whose "r" is the response once the thread ends)."""
    box: dict = {}
    before = generated(url)
    worker = threading.Thread(target=lambda: box.update(r=post(url, "/v1/generate", body)))
    worker.start()
    deadline = time.monotonic() + 30
    while generated(url) < before + 5:
        assert time.monotonic() < deadline, "no tokens generated"
        time.sleep(0.005)
    return worker, box


def test_generate_with_seeds_is_the_engines_own_sampling(served):
    url, policy, reference = served
    ids = policy.encode("12+34=")
    want = reference.generate([ids], SamplingParams(n=3, max_tokens=16, seed=7))
    seeds = [derive_seed(7, k) for k in range(3)]
    r = post(url, "/v1/generate", {"prompt_token_ids": ids, "n": 3, "seeds": seeds,
                                   "max_tokens": 16})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["version"] == 0 and out["request_id"].startswith("gen-")
    for k, (choice, c) in enumerate(zip(out["choices"], want)):
        assert choice["index"] == k and choice["token_ids"] == c.token_ids
        assert choice["logprobs"] == pytest.approx(c.logprobs, abs=1e-5)
        assert choice["versions"] == [0] * len(c.token_ids)
        assert choice["finish_reason"] == c.finish_reason
    assert set(out["timings"]) == {"queue_s", "prefill_s", "decode_s"}
    assert all(v >= 0 for v in out["timings"].values())
    same = post(url, "/v1/generate", {"prompt_token_ids": ids, "n": 3, "seed": 7,
                                      "max_tokens": 16}).json()  # one base seed: the same
    assert [c["token_ids"] for c in same["choices"]] == [c.token_ids for c in want]


def test_generate_sampling_settings_and_stop_token_ids(served):
    url, policy, reference = served
    ids = policy.encode("7*8=")
    seed = derive_seed(3, 0)
    free = reference.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True,
                                                    seed=3))[0].token_ids
    for stop in (free[0], next(t for t in free if t != free[0])):  # the first token too
        r = post(url, "/v1/generate", {"prompt_token_ids": ids, "max_tokens": 12,
                                       "stop_token_ids": [stop], "seeds": [seed]}).json()
        (choice,) = r["choices"]
        assert choice["token_ids"] == free[: free.index(stop) + 1]
        assert choice["finish_reason"] == "stop"
    r = post(url, "/v1/generate", {"prompt_token_ids": ids, "max_tokens": 1, "seeds": [seed]})
    assert r.json()["choices"][0]["token_ids"] == free[:1]
    want = reference.generate([ids], SamplingParams(top_k=3, top_p=0.9, temperature=0.7,
                                                    max_tokens=10, seed=5))[0]
    r = post(url, "/v1/generate", {"prompt_token_ids": ids, "top_k": 3, "top_p": 0.9,
                                   "temperature": 0.7, "max_tokens": 10,
                                   "seeds": [derive_seed(5, 0)]}).json()
    assert r["choices"][0]["token_ids"] == want.token_ids
    greedy = reference.generate([ids], SamplingParams(temperature=0, max_tokens=6))[0]
    r = post(url, "/v1/generate", {"prompt_token_ids": ids, "temperature": 0,
                                   "max_tokens": 6}).json()
    assert r["choices"][0]["token_ids"] == greedy.token_ids


def test_abort_returns_partial_samples_and_resume_finishes_them(served):
    url, policy, _ = served
    ids = policy.encode("1+1=")
    seeds = [11, 12]
    whole = post(url, "/v1/generate", {"prompt_token_ids": ids, "n": 2, "seeds": seeds,
                                       "max_tokens": 300, "ignore_eos": True}).json()
    body = {"prompt_token_ids": ids, "n": 2, "seeds": seeds, "max_tokens": 300,
            "ignore_eos": True, "request_id": "job-1"}
    worker, box = in_background(url, body)
    assert post(url, "/v1/abort", {"request_id": "job-1"}).json() == {"aborted": 2}
    worker.join(30)
    out = box["r"].json()
    assert out["request_id"] == "job-1"
    parts = out["choices"]
    for part, full in zip(parts, whole["choices"]):
        assert part["finish_reason"] == "abort"
        assert 0 < len(part["token_ids"]) < 300
        assert part["token_ids"] == full["token_ids"][: len(part["token_ids"])]
    resumed = post(url, "/v1/generate", body | {
        "request_id": "job-2", "resume": [{k: p[k] for k in ("token_ids", "logprobs", "versions")}
                                          for p in parts]}).json()
    for r, full in zip(resumed["choices"], whole["choices"]):
        assert r["token_ids"] == full["token_ids"] and r["finish_reason"] == "length"
        assert r["logprobs"] == pytest.approx(full["logprobs"], abs=1e-5)
    assert post(url, "/v1/abort", {"request_id": "job-2"}).json() == {"aborted": 0}


def test_generate_refuses_what_it_cannot_do_with_the_field_named(served):
    url, policy, _ = served
    ids = policy.encode("1+")
    cases = [({"n": 2, "seeds": [1]}, "seeds"), ({"min_p": 0.1}, "min_p"),
             ({"prompt_token_ids": [1, 999]}, "999"), ({"max_tokens": 600}, "context"),
             ({"resume": [{"token_ids": [5], "logprobs": []}]}, "resume"),
             ({"guided_choice": ["a"]}, "guided_choice"), ({"temperature": "hot"}, "temperature")]
    for extra, named in cases:
        r = post(url, "/v1/generate", {"prompt_token_ids": ids, "max_tokens": 4} | extra)
        assert r.status_code == 400, (extra, r.text)
        assert named in r.json()["error"]["message"], (extra, r.text)
    r = post(url, "/v1/generate", {"prompt_token_ids": ids, "max_tokens": 4, "model": "gpt"})
    assert r.status_code == 404
    assert post(url, "/v1/abort", {"id": "x"}).status_code == 400


def test_tokenize_and_detokenize_round_trip(served):
    url, policy, _ = served
    text = "12+34=46"
    r = post(url, "/tokenize", {"text": text}).json()
    assert r["tokens"] == policy.encode(text) and r["count"] == len(r["tokens"])
    assert post(url, "/detokenize", {"tokens": r["tokens"]}).json() == {"text": text}
    chat = post(url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert policy.decode(chat["tokens"]).endswith("assistant: ")
    assert post(url, "/tokenize", {"text": "a", "messages": []}).status_code == 400
    assert post(url, "/detokenize", {"tokens": [10**6]}).status_code == 400
