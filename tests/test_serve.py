"""`rollwise serve`: the real `openai` client against a live server (tiny model, a free
port): token ids and log-probs equal the engine's own `generate` for the same seed,
streaming equals non-streaming, stop strings, limits and bad input as 4xx (the server keeps
serving), concurrent clients batched, /v1/rollouts and recorded episodes."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import torch

from rollwise.engine import NativeEngine, SamplingParams
from rollwise.models import load_policy
from rollwise.serve import EPISODE_HEADER, Limits, RolloutServer
from rollwise.serve.choices import ChoiceResult
from rollwise.serve.routes_openai import _chat_message
from rollwise.serve.text import TextTracker, parse_tool_calls, render_chat

KEY = "test-key"
LIMITS = Limits(max_body_bytes=20_000, max_tokens=300, max_n=8)


@pytest.fixture(scope="module")
def live():
    """(server, base url, policy, reference engine): a tiny random model served on a free
    port, and a second engine over the same weights for the reference `generate`."""
    torch.set_num_threads(1)
    policy = load_policy("tiny")
    engine = NativeEngine(policy.model, eos_token_ids=policy.stop_ids, max_num_seqs=32)
    server = RolloutServer(policy, engine, name="tiny", api_key=KEY, limits=LIMITS)
    url = server.start()
    reference = NativeEngine(policy.model, eos_token_ids=policy.stop_ids)
    yield server, url, policy, reference
    server.stop()


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live[1] + "/v1", api_key=KEY, max_retries=0, timeout=30)


def _reference(live, prompts, **kw):
    return live[3].generate(prompts, SamplingParams(**kw))


# -- token faithfulness ---------------------------------------------------------------------

def test_models_lists_what_is_served(client):
    (m,) = client.models.list().data
    assert m.id == "tiny" and m.max_model_len == 512 and m.policy_version == 0


def test_completions_equal_engine_generate_for_the_same_seed(live, client):
    _, _, policy, _ = live
    r = client.completions.create(model="tiny", prompt="12+34=", n=3, max_tokens=12, seed=7,
                                  logprobs=0)
    ids = policy.encode("12+34=")
    assert r.prompt_token_ids == ids
    ref = _reference(live, [ids], n=3, max_tokens=12, seed=7)
    assert len({tuple(c.token_ids) for c in r.choices}) == 3  # n samples, not one repeated
    for choice, want in zip(r.choices, ref):
        assert choice.token_ids == want.token_ids
        assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert choice.text == policy.decode(want.token_ids)
        assert choice.finish_reason == want.finish_reason
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in ref)


def test_completions_take_token_id_prompts(live, client):
    ids = [1, 5, 6, 14, 7, 8, 18]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=8, seed=3)
    assert r.prompt_token_ids == ids
    assert r.choices[0].token_ids == _reference(live, [ids], max_tokens=8, seed=3)[0].token_ids


def test_chat_equals_engine_generate_on_the_templated_prompt(live, client):
    _, _, policy, _ = live
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+3=?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=10,
                                       seed=11, logprobs=True)
    ids = render_chat(policy.tokenizer, messages, None)
    assert r.prompt_token_ids == ids
    assert policy.tokenizer.decode(ids) == "<s>system: Add.\nuser: 2+3=?\nassistant: "
    for choice, want in zip(r.choices, _reference(live, [ids], n=2, max_tokens=10, seed=11)):
        assert choice.token_ids == want.token_ids
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(want.logprobs,
                                                                             abs=1e-5)
        assert choice.message.content == policy.decode(want.token_ids)


def test_streaming_gives_the_same_tokens_and_text_as_one_response(client):
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "n": 2,
          "max_tokens": 20, "seed": 5}
    whole = client.chat.completions.create(**kw)
    text, ids, finish = ["", ""], [[], []], [None, None]
    for chunk in client.chat.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}):
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            ids[c.index] += getattr(c, "token_ids", None) or []
            finish[c.index] = c.finish_reason or finish[c.index]
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == whole.usage.completion_tokens
    for k, c in enumerate(whole.choices):
        assert (text[k], ids[k], finish[k]) == (c.message.content, c.token_ids, c.finish_reason)

    plain = client.completions.create(model="tiny", prompt="7*8=", max_tokens=15, seed=2)
    streamed = list(client.completions.create(model="tiny", prompt="7*8=", max_tokens=15,
                                              seed=2, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert [t for c in streamed for t in c.choices[0].token_ids] == plain.choices[0].token_ids


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_trims_text_and_ends_ids_at_the_completing_token(live, client, stream):
    _, _, policy, _ = live
    full = client.completions.create(model="tiny", prompt="9-4=", max_tokens=40, seed=21,
                                     extra_body={"ignore_eos": True})
    text, ids = full.choices[0].text, full.choices[0].token_ids
    stop = text[5:7]  # a two-character stop string the sample contains
    cut = text.find(stop)
    k = next(j for j in range(1, len(ids) + 1) if stop in policy.decode(ids[:j]))
    kw = {"model": "tiny", "prompt": "9-4=", "max_tokens": 40, "seed": 21, "stop": [stop, "@@"],
          "extra_body": {"ignore_eos": True}}
    if stream:
        chunks = list(client.completions.create(**kw, stream=True))
        got_text = "".join(c.choices[0].text for c in chunks)
        got_ids = [t for c in chunks for t in c.choices[0].token_ids]
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw)
        got_text, got_ids, finish = r.choices[0].text, r.choices[0].token_ids, \
            r.choices[0].finish_reason
    assert got_text == text[:cut] and stop not in got_text
    assert got_ids == ids[:k] and finish == "stop"


def test_text_tracker_holds_back_a_possible_stop_string_start(live):
    tok = live[2].tokenizer
    t = TextTracker(tok, ["xyz"])
    t.add(tok("abx", add_special_tokens=False)["input_ids"], [0.0] * 3, [0] * 3)
    assert t.take()[0] == "ab"  # "x" may start "xyz": not shown yet
    t.add(tok("q", add_special_tokens=False)["input_ids"], [0.0], [0])
    assert t.take()[0] == "xq"


# -- tools ----------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate",
          "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]


def test_tool_calls_are_parsed_from_the_hermes_format():
    text = ('Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expr": "2+3"}}'
            '\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert calls[0]["function"] == {"name": "calculator", "arguments": '{"expr": "2+3"}'}
    assert parse_tool_calls('<tool_call>{"name": oops}</tool_call>') == (
        '<tool_call>{"name": oops}</tool_call>', [])  # malformed: left as text
    message, finish = _chat_message(ChoiceResult([], [], [], [], "stop", text), tools=True)
    assert finish == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "calculator"


def test_tools_reach_the_prompt_and_past_calls_render(live, client):
    _, _, policy, _ = live
    messages = [{"role": "user", "content": "2+3"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "c1", "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expr": "2+3"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    plain = client.chat.completions.create(model="tiny", messages=messages[:1], max_tokens=1)
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                       max_tokens=4)
    prompt = policy.tokenizer.decode(r.prompt_token_ids)
    assert "calculator" in prompt and "tool_call" in prompt and "tool: 5" in prompt
    assert len(r.prompt_token_ids) > len(plain.prompt_token_ids)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="tiny", messages=messages[:1], tools=TOOLS,
                                       tool_choice="required")


# -- security, limits, bad input ------------------------------------------------------------

def test_api_key_is_required(live):
    bad = openai.OpenAI(base_url=live[1] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(live[1] + "/v1/completions", json={"model": "tiny", "prompt": "1"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]


def test_bad_requests_get_4xx_with_a_message_and_the_server_keeps_serving(live, client):
    url, auth = live[1], {"Authorization": f"Bearer {KEY}"}

    def post(body, path="/v1/completions", raw=None):
        r = httpx.post(url + path, headers=auth | {"content-type": "application/json"},
                       content=raw if raw is not None else json.dumps(body))
        return r.status_code, r.json()["error"]["message"]

    ok = {"model": "tiny", "prompt": "1+1=", "max_tokens": 4}
    code, msg = post(None, raw=b'{"model": "tiny",')
    assert code == 400 and "malformed JSON" in msg
    code, msg = post(ok | {"temperature": "hot"})
    assert code == 400 and "temperature" in msg
    code, msg = post(ok | {"max_tokens": "10"})
    assert code == 400 and "max_tokens" in msg
    code, msg = post(ok | {"max_tokens": 301})
    assert code == 400 and "limit of 300" in msg
    code, msg = post(ok | {"prompt": "1" * 510, "max_tokens": 10})
    assert code == 400 and "context of 512" in msg
    code, msg = post(ok | {"prompt": [1, 5, 999]})
    assert code == 400 and "999" in msg
    code, msg = post(ok | {"n": 9})
    assert code == 400 and "n=9" in msg
    code, msg = post(ok | {"prompt": "1" * 30_000})
    assert code == 413 and "20000 bytes" in msg
    chunked = httpx.post(url + "/v1/completions", headers=auth,
                         content=(b"x" * 1000 for _ in range(30)))  # no content-length
    assert chunked.status_code == 413
    code, msg = post(ok | {"model": "gpt-4"})
    assert code == 404 and "tiny" in msg
    code, msg = post({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                      "logprobs": True, "top_logprobs": 21}, "/v1/chat/completions")
    assert code == 400 and "top_logprobs" in msg
    code, msg = post({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
                     "/v1/chat/completions")
    assert code == 400 and "wizard" in msg
    with pytest.raises(openai.BadRequestError, match="over this server's limit"):
        client.completions.create(model="tiny", prompt="1", max_tokens=1000)
    r = client.completions.create(model="tiny", prompt="1+1=", max_tokens=4, seed=1)
    assert len(r.choices[0].token_ids) >= 1  # still serving


# -- batching -------------------------------------------------------------------------------

def test_concurrent_openai_clients_are_batched(live):
    server, url, _, _ = live
    clients, tokens = 8, 48
    before = server.engine.stats.forward_passes, server.engine.stats.row_forwards
    barrier, results, errors = threading.Barrier(clients), [None] * clients, []

    def work(i):
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        barrier.wait()
        try:
            if i % 2:
                r = c.chat.completions.create(model="tiny", max_tokens=tokens, seed=i,
                                              messages=[{"role": "user", "content": f"{i}+1"}],
                                              extra_body={"ignore_eos": True})
            else:
                r = c.completions.create(model="tiny", prompt=f"{i}*3=", max_tokens=tokens,
                                         seed=i, extra_body={"ignore_eos": True})
            results[i] = r.choices[0].token_ids
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert all(len(r) == tokens for r in results)
    passes = server.engine.stats.forward_passes - before[0]
    rows = server.engine.stats.row_forwards - before[1]
    # one at a time would take a forward pass per token (plus prefills): 8 x 48 = 384
    print(f"batched: {passes} forward passes, {rows / passes:.1f} rows each")
    assert passes < clients * tokens / 2
    assert rows / passes > 2  # sequences per forward pass


# -- rollouts and recorded episodes ---------------------------------------------------------

def _api(live, method, path, **kw):
    r = httpx.request(method, live[1] + path, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def test_rollouts_submit_poll_and_results_equal_generate(live):
    server, _, policy, _ = live
    messages = [{"role": "user", "content": "4+4"}]
    job = _api(live, "POST", "/v1/rollouts", json={
        "episodes": [{"id": "a", "prompt": "3+5="}, {"id": "b", "messages": messages}],
        "n": 2, "max_tokens": 10, "seed": 5})
    assert job["total"] == 4 and job["status"] in ("running", "completed")
    done = _api(live, "GET", f"/v1/rollouts/{job['id']}", params={"wait": 30})
    assert done["status"] == "completed" and done["done"] == 4
    prompts = [policy.encode("3+5="), render_chat(policy.tokenizer, messages, None)]
    ref = _reference(live, prompts, n=2, max_tokens=10, seed=5)
    for got, want in zip(done["results"], ref):
        assert got["episode_id"] == "ab"[want.prompt_index]
        assert got["prompt_token_ids"] == prompts[want.prompt_index]
        assert got["token_ids"] == want.token_ids
        assert got["logprobs"] == pytest.approx(want.logprobs, abs=1e-5)
        assert got["versions"] == [server.engine.version] * len(want.token_ids)


def test_rollouts_cancel_aborts_running_requests(live):
    server = live[0]
    job = _api(live, "POST", "/v1/rollouts", json={
        "episodes": [{"prompt": "1+2="}, {"prompt": [1, 5, 6]}], "n": 3, "max_tokens": 300,
        "ignore_eos": True})
    view = _api(live, "POST", f"/v1/rollouts/{job['id']}/cancel")
    assert view["status"] == "cancelled" and view["done"] == 6
    assert all(r["finish_reason"] == "abort" and len(r["token_ids"]) < 300
               for r in view["results"])
    assert all(len(r["logprobs"]) == len(r["versions"]) == len(r["token_ids"])
               for r in view["results"])
    assert server.driver.pending == 0
    gone = _api(live, "DELETE", f"/v1/rollouts/{job['id']}")
    assert gone["id"] == job["id"]
    r = httpx.get(live[1] + f"/v1/rollouts/{job['id']}",
                  headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404


def test_published_version_reaches_the_tokens(live):
    server = live[0]
    server.publish(4)
    try:
        job = _api(live, "POST", "/v1/rollouts", json={"episodes": [{"prompt": "2+2="}],
                                                       "max_tokens": 3, "seed": 1})
        done = _api(live, "GET", f"/v1/rollouts/{job['id']}", params={"wait": 30})
        assert done["results"][0]["versions"] == [4] * len(done["results"][0]["token_ids"])
    finally:
        server.publish(0)


def test_calls_with_an_episode_id_are_recorded_token_for_token(live, client):
    first = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "1+1"}], max_tokens=6, seed=1,
        extra_headers={EPISODE_HEADER: "ep-1"})
    history = [{"role": "user", "content": "1+1"},
               {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "and 2+2"}]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=6,
                                            seed=2, extra_body={"episode_id": "ep-1"}, n=2)
    client.completions.create(model="tiny", prompt="5", max_tokens=2)  # no id: not recorded
    listed = _api(live, "GET", "/v1/episodes")["data"]
    assert {"id": "ep-1", "calls": 2} in listed and len(listed) == 1
    calls = _api(live, "DELETE", "/v1/episodes/ep-1")["calls"]
    assert [c["call"] for c in calls] == [0, 1]
    for call, resp in zip(calls, (first, second)):
        assert call["prompt_token_ids"] == resp.prompt_token_ids
        assert [c["token_ids"] for c in call["choices"]] == [c.token_ids for c in resp.choices]
        assert all(len(c["logprobs"]) == len(c["versions"]) == len(c["token_ids"])
                   for c in call["choices"])
    assert calls[1]["messages"] == history
    r = httpx.get(live[1] + "/v1/episodes/ep-1", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404  # collected: gone


# -- what `rollwise serve --model` loads ----------------------------------------------------

def test_a_run_directory_serves_its_latest_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from rollwise.compose.config import to_toml
    from rollwise.pipeline.build import build
    from rollwise.pipeline.loop import train
    from rollwise.run.rundir import Run
    from rollwise.serve import load_served
    from test_runsafety import small

    cfg = small(tmp_path, "run.num_steps=2", "run.checkpoint_every=1", "eval.num_prompts=4")
    root = tmp_path / "run"
    train(build(cfg), Run(root, resume=False, config_toml=to_toml(cfg), echo=lambda s: None),
          2, checkpoint_every=1)
    served = load_served(str(root))
    assert served.name == "run" and served.aliases == ("run@step_2",) and served.version == 2
    saved = load_file(root / "checkpoints" / "step_2" / "model.safetensors")
    params = dict(served.policy.model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in saved.items())
    first = load_served(str(root), step=1)
    assert first.version == 1 and not all(
        torch.equal(dict(first.policy.model.named_parameters())[n], t) for n, t in saved.items())


def test_serve_command_refuses_what_it_cannot_load(tmp_path):
    from typer.testing import CliRunner

    from rollwise.cli import app

    out = CliRunner().invoke(app, ["serve", "--model", str(tmp_path / "nothing")])
    assert out.exit_code == 2 and "neither one of" in out.output


def test_recorded_calls_become_trajectories(live, client):
    from rollwise.serve import as_trajectory
    from rollwise.types import Sample

    r = client.completions.create(model="tiny", prompt="3+3=", max_tokens=5, seed=9,
                                  extra_body={"episode_id": "ep-t"}, logprobs=0)
    (call,) = _api(live, "DELETE", "/v1/episodes/ep-t")["calls"]
    t = as_trajectory(call["choices"][0], Sample(id="s", prompt="3+3=", answer="6"))
    assert t.prompt_ids == r.prompt_token_ids and t.response_ids == r.choices[0].token_ids
    assert t.logprobs == pytest.approx(r.choices[0].logprobs.token_logprobs, abs=0)


def test_an_openai_agent_rolls_out_through_the_server_for_training(tmp_path, teacher_logprobs):
    """The trainer serves its own rollout engine; an agent samples with the openai client
    under episode ids; the trainer collects the calls as trajectories, checks they are what
    the policy sampled (teacher-forced log-probs), updates, publishes, and the next tokens
    carry the new version."""
    from rollwise.pipeline.build import build
    from rollwise.serve import as_trajectory
    from rollwise.types import Group
    from test_runsafety import small

    stages = build(small(tmp_path, "engine.dtype='float32'"))
    server = RolloutServer(stages.policy, stages.engine, name="policy")
    url = server.start()
    try:
        agent = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        samples = stages.task.train[:4]
        for i, s in enumerate(samples):  # the agent: openai calls tagged with an episode id
            agent.completions.create(model="policy", prompt=s.prompt, n=4, max_tokens=16,
                                     temperature=1.0, seed=i, extra_body={"episode_id": s.id})
        groups = []
        for s in samples:  # the trainer: collect, check, score, update
            (call,) = server.episodes.pop(s.id)
            groups.append(Group(s, [as_trajectory(c, s) for c in call["choices"]]))
        trajs = [t for g in groups for t in g.trajectories]
        assert all(t.versions == [0] * len(t.response_ids) for t in trajs)
        completions = [type("C", (), {"prompt_index": i, "token_ids": t.response_ids})
                       for i, t in enumerate(trajs)]
        replayed = teacher_logprobs(stages.model, [t.prompt_ids for t in trajs], completions)
        for t, lp in zip(trajs, replayed):
            assert torch.allclose(lp, torch.tensor(t.logprobs, dtype=torch.float64), atol=1e-4)
        stages.score(groups)
        assert not all(g.zero_variance for g in groups)  # something to learn from
        before = [p.detach().clone() for p in stages.model.parameters()]
        stages.update(stages.advantages(groups))
        assert any(not torch.equal(a, p) for a, p in zip(before, stages.model.parameters()))
        server.publish(1)
        r = agent.completions.create(model="policy", prompt=samples[0].prompt, max_tokens=4,
                                     extra_body={"episode_id": "after"})
        (call,) = server.episodes.pop("after")
        assert call["choices"][0]["versions"] == [1] * len(r.choices[0].token_ids)
    finally:
        server.stop()


def test_fuzzed_bodies_never_get_a_5xx(live):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(
        max_size=8)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
    fields = st.sampled_from(["model", "prompt", "messages", "n", "temperature", "top_p",
                              "max_tokens", "stop", "seed", "logprobs", "tools", "stream",
                              "episodes", "ignore_eos", "top_k"])
    base = {"model": "tiny", "prompt": "1+", "max_tokens": 2,
            "messages": [{"role": "user", "content": "1"}]}
    auth = {"Authorization": f"Bearer {KEY}"}

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/rollouts"]),
           changes=st.dictionaries(fields, values, max_size=3))
    def one(path, changes):
        r = httpx.post(live[1] + path, headers=auth, timeout=30,
                       content=json.dumps(base | changes, allow_nan=True))
        assert r.status_code < 500, r.text

    one()
    r = httpx.post(live[1] + "/v1/completions", headers=auth,
                   json={k: v for k, v in base.items() if k != "messages"})
    assert r.status_code == 200


def test_text_arrives_token_by_token_as_one_decode_gives_it():
    """Streaming decodes only the new ids (with the previous step's as context); on a
    byte-level BPE vocabulary (SmolLM2's) with multi-byte characters split across tokens, the
    text so assembled equals decoding every id at once."""
    from transformers import AutoTokenizer

    from rollwise.models.smollm2 import converted_dir

    tok = AutoTokenizer.from_pretrained(converted_dir())
    text = "Café crème, naïve façade — 東京 🙂 and  spaced   words\n\tend."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(0, len(tok), (200,), generator=gen).tolist()
    for seq in (ids, noise, ids + noise):
        t = TextTracker(tok, [])
        shown = ""
        for i in seq:
            t.add([i], [0.0], [0])
            shown += t.take()[0]
        t.add([], [], [], final=True)
        shown += t.take(final=True)[0]
        assert shown == t.text == t.decode(seq)
