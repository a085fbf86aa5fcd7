"""LLM-as-judge through the real openai client against a fake OpenAI-compatible server
(FastAPI + uvicorn on a free port, fixed grades): parsing, caching, retries, the pool, the
config path, and failing fast at start-up when the judge is unreachable."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("openai")
fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

import rollwise
from rollwise.rewards.judge import Judge, make_judge
from rollwise.rewards.pool import InfraError, RewardPool, RewardSpec
from rollwise.types import Sample, Trajectory

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def judge_server():
    """Grades: 'GRADE: 10' when the response to grade holds 42, 'no idea' when it holds
    NOGRADE, HTTP 500 when it holds BROKEN, else 'GRADE: 3'. Counts requests."""
    app = fastapi.FastAPI()
    seen: list[str] = []

    @app.post("/v1/chat/completions")
    async def complete(body: dict):
        text = body["messages"][-1]["content"]
        seen.append(text)
        response = text.split("Response to grade:\n", 1)[-1]
        if "BROKEN" in response:
            raise fastapi.HTTPException(status_code=500, detail="judge broke")
        reply = "GRADE: 10" if "42" in response else "no idea" if "NOGRADE" in response \
            else "GRADE: 3"
        return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": reply}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1", seen
    server.should_exit = True
    thread.join(timeout=5)


SAMPLE = Sample("q/0", [{"role": "user", "content": "What is 6 * 7?"}], "42", reference="42")


def test_grades_parse_scale_and_cache(judge_server) -> None:
    url, seen = judge_server
    judge = make_judge({"base_url": url, "model": "fake-judge", "retries": 0})
    before = len(seen)
    assert judge("it is 42", SAMPLE) == 1.0
    assert judge("it is 41", SAMPLE) == pytest.approx(0.3)
    unparsed = judge("NOGRADE", SAMPLE)
    assert unparsed == 0.0 and "without a grade" in unparsed.note
    assert "What is 6 * 7?" in seen[-1] and "Reference answer:\n42" in seen[-1]
    sent = len(seen)
    assert judge("it is 42", SAMPLE) == 1.0  # cached: no request
    assert len(seen) == sent and sent - before == 3 and judge.calls == 1 + 3  # + preflight


def test_unreachable_judge_fails_fast_with_its_url() -> None:
    url = f"http://127.0.0.1:{_free_port()}/v1"  # nothing listens there
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"cannot reach {url}"):
        make_judge({"base_url": url, "model": "m", "retries": 3})
    assert time.perf_counter() - start < 10
    with pytest.raises(ValueError, match="needs \\[judge\\] base_url and model"):
        make_judge({"base_url": "", "model": ""})
    with pytest.raises(ValueError, match="must contain \\{response\\}"):
        Judge(url, "m", prompt="{question}")


def test_judge_in_the_pool_and_infra_failures(judge_server) -> None:
    url, _ = judge_server
    judge = make_judge({"base_url": url, "model": "fake-judge", "retries": 1,
                        "timeout_s": 5})
    texts = ["42", "41", "BROKEN"]
    trajs = [Trajectory(SAMPLE, [], [], [], [], "stop", text=t) for t in texts]
    with RewardPool([RewardSpec("judge", judge)], timeout_s=20, num_workers=2) as pool:
        stats = pool.score(trajs)
    assert [t.scores["judge"] for t in trajs] == [1.0, pytest.approx(0.3), 0.0]
    assert stats.num_infra == 1 and stats.num_errors == 0
    assert trajs[2].reward_errors[0].to_text().startswith(
        f"judge: infra: judge at {url} did not answer")
    with pytest.raises(InfraError):
        judge("BROKEN again", SAMPLE)


def test_config_rewards_judge_trains_and_bad_url_stops_before_the_model(judge_server,
                                                                       tmp_path) -> None:
    url, seen = judge_server
    small = ["run.num_steps=1", "run.threads=1", "rollout.prompts_per_step=2",
             "rollout.group_size=2", "rollout.max_tokens=4", "task.num_eval=2", "eval.every=0",
             "eval.before=false", f"run.output_dir='{tmp_path}'"]
    before = len(seen)
    summary = rollwise.train(CONFIG, echo=None, overrides=[
        *small, "task.rewards={correct = 1.0, judge = 0.5}", f"judge.base_url='{url}'",
        "judge.model='fake-judge'"])
    assert summary["steps"] == 1 and len(seen) > before  # the preflight and the step's grades
    bad = f"http://127.0.0.1:{_free_port()}/v1"
    with pytest.raises(ValueError, match=f"cannot reach {bad}"):
        rollwise.train(CONFIG, echo=None, overrides=[
            *small, "task.rewards={judge = 1.0}", f"judge.base_url='{bad}'", "judge.model='m'"])
