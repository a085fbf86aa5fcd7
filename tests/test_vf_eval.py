"""verifiers' own `vf-eval` against `rollwise serve`: the repository's verifiers package
environments/rollwise_sums (a single-turn taskset and an in-process chat harness) evaluated
end to end against a `rollwise serve --model tiny` subprocess, with no network and no login
(the local `subprocess` runtime, `--no-push`); and the same taskset through rollwise's own
verifiers adapter, scored by its `@vf.reward`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is not installed (the verifiers extra)")

from rollwise.tasks import make_task
from test_remote import ServerProcess, free_port

ENV_DIR = Path(__file__).parents[1] / "environments" / "rollwise_sums"
VF_EVAL = Path(sys.executable).parent / "vf-eval"
TASKS, ROLLOUTS, MAX_TOKENS = 2, 3, 12


@pytest.fixture
def sums(monkeypatch):
    """The rollwise_sums package importable in this process (installed or not)."""
    monkeypatch.syspath_prepend(str(ENV_DIR))
    import rollwise_sums

    return rollwise_sums


def test_rollwise_sums_scores_through_the_adapter(sums) -> None:
    assert sums.parse_answer("23 + 45 = 68\n#### 68 (sure)") == "68"
    assert sums.parse_answer("I think 67, no: 68") == "68"
    assert sums.parse_answer("#### sixty-eight, 68") == "68" and sums.parse_answer("no") is None
    task = make_task("verifiers", seed=0, num_train=20, num_eval=5, env="rollwise_sums:load",
                     size=60)
    s = task.eval[0]
    a, b = (int(x) for x in s.prompt.split("What is ")[1].split("?")[0].split(" + "))
    assert s.answer == str(a + b) and "####" in s.prompt
    assert s.reference == f"{a} + {b} = {a + b}\n#### {a + b}"  # the tiny model's warm start
    assert task.verifier(s.reference, s) == 1.0
    assert task.verifier(f"#### {a + b + 1}", s) == 0.0
    assert task.verifier(f"{a + b} is wrong, the sum is {a + b + 1}", s) == 0.0


@pytest.mark.slow  # 1-4 min on 2 loaded cores: a server start, and vf-eval's own start
def test_vf_eval_against_rollwise_serve(tmp_path) -> None:
    if not VF_EVAL.exists():
        pytest.skip(f"no vf-eval next to {sys.executable}")
    server = ServerProcess(free_port(), tmp_path / "server.log")
    server.start()
    env = {**os.environ, "ROLLWISE_API_KEY": "unused",  # the server was started without one
           "PYTHONPATH": os.pathsep.join([str(ENV_DIR), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(
            [str(VF_EVAL), "rollwise-sums", "-m", "tiny",
             "--client.base-url", f"{server.url}/v1", "--client.api-key-var",
             "ROLLWISE_API_KEY", "-n", str(TASKS), "-r", str(ROLLOUTS),
             "--sampling.max-tokens", str(MAX_TOKENS), "--sampling.temperature", "1.0",
             "--env.agent.runtime.type", "subprocess", "--no-push", "--no-rich",
             "-o", str(tmp_path / "out"), "--run.name", "t"],
            check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    finally:
        server.kill()
    assert done.returncode == 0, done.stderr[-3000:]
    episodes = [json.loads(line) for line in (tmp_path / "out" / "t" / "traces.jsonl")
                .read_text().splitlines()]
    traces = [t for e in episodes for t in e["traces"]]
    # one episode (of one trace) per rollout: ROLLOUTS of each of the first TASKS tasks
    assert len(episodes) == len(traces) == TASKS * ROLLOUTS
    assert sorted(e["task"]["data"]["idx"] for e in episodes) == sorted(
        list(range(TASKS)) * ROLLOUTS)
    for t in traces:
        assert t["ok"] and not t["errors"], t["errors"]
        assert 0.0 <= t["rewards"]["correct"]["score"] <= 1.0
        assert t["metrics"]["formatted"] in (0.0, 1.0)
        # the completion came from the server: sampled tokens, capped by max_tokens
        assert 0 < t["num_output_tokens"] <= MAX_TOKENS
