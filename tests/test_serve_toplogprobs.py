"""Top log-probs through `rollwise serve`: chat `top_logprobs: k` and legacy completions
`logprobs: k` with the `openai` client, streamed and whole, and /v1/generate's
`top_logprobs` (with abort and resume). The candidates are checked against a direct forward
of the tiny model: log_softmax of its logits at each response position."""

from __future__ import annotations

import openai
import pytest
import torch

from test_serve_tokens import KEY, in_background, post, tiny_server

MESSAGES = [{"role": "user", "content": "12+7="}]
# Both sides compute float32 logits with different kernels (the engine's cached decode vs one
# full forward). Each logit ends a chain of 8 blocks (4 layers x attention and MLP) whose
# longest dot product has 384 terms, so its rounding error is at most about 8 * 384 * eps
# relative to the logit scale (the tiny model's logits stay below 1 in magnitude): 3.7e-4.
# The top candidates of the untrained model are ~1e-2 apart, far wider than this.
TOL = 8 * 384 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def served():
    """(base url, policy, {token text: id})."""
    with tiny_server(api_key=KEY) as (url, policy, _):
        tok = policy.tokenizer
        ids = {tok.decode([i], skip_special_tokens=False,
                          clean_up_tokenization_spaces=False): i for i in range(len(tok))}
        assert len(ids) == len(tok)  # every token spells differently: texts name ids
        yield url, policy, ids


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def forward(policy, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[T, V] log_softmax of the model's logits at each response position."""
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(tokens) - 1], -1)


def check_candidates(ref: torch.Tensor, rows: list[list[tuple[int, float]]], k: int) -> None:
    """Each row holds k (id, log-prob), most likely first, equal to the reference's top k."""
    assert len(rows) == len(ref)
    for t, row in enumerate(rows):
        values = [v for _, v in row]
        assert len(row) == k and values == sorted(values, reverse=True)
        want = torch.topk(ref[t], k).values
        assert torch.allclose(torch.tensor(values), want, atol=TOL, rtol=0)
        for tid, v in row:  # each candidate is the id it names (ties within TOL may swap)
            assert abs(ref[t, tid].item() - v) <= TOL


def chat_rows(content, ids: dict[str, int]) -> list[list[tuple[int, float]]]:
    return [[(ids[c.token], c.logprob) for c in tok.top_logprobs] for tok in content]


def test_chat_top_logprobs_equal_a_direct_forward(served, client):
    _, policy, ids = served
    for temperature in (0.0, 1.0, 0.5):
        r = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=8, temperature=temperature, seed=3,
            logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
        choice = r.choices[0]
        content = choice.logprobs.content
        assert [ids[c.token] for c in content] == choice.token_ids
        for c in content:
            assert all(top.bytes == list(top.token.encode()) for top in c.top_logprobs)
        ref = forward(policy, r.prompt_token_ids, choice.token_ids)
        check_candidates(ref, chat_rows(content, ids), 3)
        sampled = [(c.logprob, {t.token: t.logprob for t in c.top_logprobs}.get(c.token))
                   for c in content]
        if temperature == 0:  # greedy: the sampled token is the first candidate
            assert all(c.token == c.top_logprobs[0].token for c in content)
        if temperature in (0.0, 1.0):  # sampled from the raw distribution: the same number
            assert all(abs(lp - top) <= TOL for lp, top in sampled if top is not None)
        else:  # sampled at 0.5: its log-prob is under the sharpened distribution, not raw
            assert all(lp > top + 1e-3 for lp, top in sampled if top is not None)
        assert any(top is not None for _, top in sampled)


def test_streamed_chat_and_completions_give_the_same_values(served, client):
    ids = served[2]
    kw = {"model": "tiny", "max_tokens": 10, "seed": 5, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=4,
                                           **kw).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(messages=MESSAGES, logprobs=True,
                                                top_logprobs=4, stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert len(streamed) == len(whole) == 10
    # one request alone on the engine both times: the same computation, the same numbers
    assert chat_rows(streamed, ids) == chat_rows(whole, ids)
    one = client.completions.create(prompt="3*4=", logprobs=2, **kw).choices[0].logprobs
    tops = []
    for chunk in client.completions.create(prompt="3*4=", logprobs=2, stream=True, **kw):
        if chunk.choices[0].logprobs:
            tops += chunk.choices[0].logprobs.top_logprobs
    assert len(tops) == len(one.tokens) == 10
    assert tops == one.top_logprobs


def test_legacy_completions_logprobs_k_format(served, client):
    _, policy, ids = served
    r = client.completions.create(model="tiny", prompt="3*4=", max_tokens=6, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert [ids[t] for t in lp.tokens] == r.choices[0].token_ids
    rows = []
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert isinstance(top, dict) and len(top) == 2
        best = max(top, key=top.get)
        assert best == token and abs(top[best] - value) <= TOL  # greedy: the first candidate
        rows.append(sorted(((ids[t], v) for t, v in top.items()), key=lambda p: -p[1]))
    check_candidates(forward(policy, r.prompt_token_ids, r.choices[0].token_ids), rows, 2)
    plain = client.completions.create(model="tiny", prompt="3*4=", max_tokens=2, logprobs=0)
    assert plain.choices[0].logprobs.top_logprobs is None


def test_a_stop_string_cuts_the_candidates_with_the_ids(served, client):
    kw = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
          "logprobs": True, "top_logprobs": 2, "extra_body": {"ignore_eos": True}}
    free = client.chat.completions.create(**kw).choices[0]
    stop = free.message.content[4]
    for stream in (False, True):
        if stream:
            content = []
            for chunk in client.chat.completions.create(stop=[stop], stream=True, **kw):
                if chunk.choices and chunk.choices[0].logprobs:
                    content += chunk.choices[0].logprobs.content
        else:
            content = client.chat.completions.create(stop=[stop], **kw).choices[0].logprobs.content
        n = free.message.content.index(stop) + 1  # one character per token here
        assert [c.token for c in content] == [c.token for c in free.logprobs.content[:n]]
        assert all(len(c.top_logprobs) == 2 for c in content)


def test_over_the_limit_and_without_logprobs_are_400s_naming_the_field(client):
    for field, call in (
            ("top_logprobs", lambda: client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=21)),
            ("top_logprobs", lambda: client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=2, top_logprobs=2)),
            ("logprobs", lambda: client.completions.create(
                model="tiny", prompt="1", max_tokens=2, logprobs=21))):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert field in e.value.message and e.value.body["param"] == field
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                        logprobs=True, top_logprobs=20)
    assert all(len(c.top_logprobs) == 20 for c in ok.choices[0].logprobs.content)


def test_generate_top_logprobs_through_abort_and_resume(served):
    url, policy, _ = served
    prompt = policy.encode("1+1=")
    body = {"prompt_token_ids": prompt, "seeds": [21], "max_tokens": 300, "ignore_eos": True,
            "top_logprobs": 3}
    whole = post(url, "/v1/generate", body).json()["choices"][0]
    assert len(whole["top_logprobs"]) == 300
    ref = forward(policy, prompt, whole["token_ids"][:20])
    check_candidates(ref, whole["top_logprobs"][:20], 3)
    worker, box = in_background(url, body | {"request_id": "top-1"})
    assert post(url, "/v1/abort", {"request_id": "top-1"}).json() == {"aborted": 1}
    worker.join(30)
    part = box["r"].json()["choices"][0]
    assert part["finish_reason"] == "abort"
    assert 0 < len(part["top_logprobs"]) == len(part["token_ids"]) < 300
    missing = post(url, "/v1/generate", body | {"resume": [
        {k: part[k] for k in ("token_ids", "logprobs", "versions")}]})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "resume"
    resumed = post(url, "/v1/generate", body | {"resume": [
        {k: part[k] for k in ("token_ids", "logprobs", "versions", "top_logprobs")}]}).json()
    got = resumed["choices"][0]
    assert got["token_ids"] == whole["token_ids"]
    assert len(got["top_logprobs"]) == 300
    for row, want in zip(got["top_logprobs"], whole["top_logprobs"]):
        assert [i for i, _ in row] == [i for i, _ in want]
        assert [v for _, v in row] == pytest.approx([v for _, v in want], abs=1e-5)
    assert "top_logprobs" not in post(url, "/v1/generate", {
        "prompt_token_ids": prompt, "max_tokens": 2}).json()["choices"][0]
