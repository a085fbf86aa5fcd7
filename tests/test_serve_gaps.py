"""What clients of `rollwise serve` hit beyond token faithfulness: fields the server does not
implement are a 400 naming them, streamed tool calls work with the openai SDK's stream
helper, /metrics is Prometheus text whose counters move, `x-api-key` authenticates,
`--served-model-name` names the model, and the tiny model with a longer context holds a
chat with tools."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollwise.models import load_policy
from rollwise.serve import make_server
from test_serve_tokens import tiny_server

KEY = "gap-key"
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def served():
    with tiny_server(api_key=KEY) as (url, _, server):
        yield url, server


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=30)


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 3}
COMPLETION = {"model": "tiny", "prompt": "1+1=", "max_tokens": 3}


@pytest.mark.parametrize("field, value", [
    ("min_p", 0.05), ("repetition_penalty", 1.1), ("min_tokens", 2),
    ("response_format", {"type": "json_object"}), ("prompt_logprobs", 1),
    ("guided_choice", ["a", "b"]), ("presence_penalty", 0.5), ("logit_bias", {"5": 1.0}),
    ("functions", [{"name": "f"}])])
def test_fields_the_server_does_not_implement_are_refused_by_name(served, field, value):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        r = httpx.post(served[0] + path, json=body | {field: value},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert field in error["message"] and error["param"] == field


def test_neutral_values_and_what_is_implemented_are_accepted(client):
    r = client.chat.completions.create(
        model="tiny", messages=CHAT["messages"], max_tokens=3, seed=1, user="u",
        response_format={"type": "text"},
        extra_body={"min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0,
                    "stop_token_ids": [5], "top_k": 4})
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=2,
                                       logprobs=True, top_logprobs=21)


def test_streamed_tool_calls_work_with_the_sdk_stream_helper(client, monkeypatch):
    import rollwise.serve.routes_openai as routes

    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    monkeypatch.setattr(routes, "parse_tool_calls", lambda text: (None, [call]))
    with client.chat.completions.stream(model="tiny", messages=CHAT["messages"],
                                        tools=TOOLS, max_tokens=4, seed=2) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    (got,) = choice.message.tool_calls
    assert got.id == "call_1" and got.function.name == "add"
    assert got.function.arguments == '{"a": 1, "b": 2}'


def test_metrics_are_prometheus_text_and_move(served, client):
    url = served[0]

    def scrape() -> dict:
        r = httpx.get(url + "/metrics", headers={"x-api-key": KEY})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(r.text) for s in fam.samples}

    before = scrape()
    client.completions.create(model="tiny", prompt="1+", max_tokens=5, seed=3)
    after = scrape()
    key = ("rollwise_requests_total", (("route", "/v1/completions"), ("status", "200")))
    assert after[key] == before.get(key, 0) + 1
    assert after[("rollwise_generation_tokens_total", ())] > before[
        ("rollwise_generation_tokens_total", ())]
    assert after[("rollwise_prompt_tokens_total", ())] > 0
    for name in ("rollwise_requests_running", "rollwise_requests_waiting",
                 "rollwise_kv_cache_usage_ratio", "rollwise_weight_version"):
        assert (name, ()) in after
    assert ("rollwise_weight_update_seconds_count", ()) in after


def test_x_api_key_authenticates_like_a_bearer_token(served):
    url = served[0]
    assert httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "wrong"}).status_code == 401
    assert httpx.get(url + "/v1/models").status_code == 401


def test_served_model_name_and_the_model_route():
    named = make_server("tiny", served_model_name="my-policy")
    try:
        client = openai.OpenAI(base_url=named.start() + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["my-policy"]
        assert client.models.retrieve("my-policy").id == "my-policy"
        assert client.models.retrieve("tiny").id == "my-policy"  # its own name, accepted
        for name in ("my-policy", "tiny"):
            r = client.completions.create(model=name, prompt="1", max_tokens=2)
            assert r.model == "my-policy"
        with pytest.raises(openai.NotFoundError, match="my-policy"):
            client.models.retrieve("gpt-4")
    finally:
        named.stop()


def test_the_tiny_model_with_a_longer_context_holds_a_chat_with_tools():
    server = make_server("tiny", tiny_context=2048)
    try:
        client = openai.OpenAI(base_url=server.start() + "/v1", api_key="x", max_retries=0)
        assert client.models.list().data[0].max_model_len == 2048
        r = client.chat.completions.create(model="tiny", messages=CHAT["messages"],
                                           tools=TOOLS, max_tokens=150, seed=1)
        assert len(r.prompt_token_ids) + 150 > 512  # over the default context
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    finally:
        server.stop()
    assert load_policy("tiny").max_context == 512  # the default is unchanged


def test_null_fields_count_as_not_sent_and_the_cli_checks_tiny_context(served):
    r = httpx.post(served[0] + "/v1/completions", json=COMPLETION | {
        "prompt_logprobs": None, "guided_json": None, "user": "someone"},
        headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    from typer.testing import CliRunner

    from rollwise.cli import app

    out = CliRunner().invoke(app, ["serve", "--model", "smollm2-135m", "--tiny-context", "2048"])
    assert out.exit_code == 2 and "applies to model 'tiny'" in out.output
