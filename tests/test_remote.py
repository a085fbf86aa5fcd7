"""Training against an inference server in another process (engine.name = 'remote'): a
`rollwise serve --model tiny` subprocess on a free port. The same metrics as the same
config in process, the server's version following the trainer, a server killed mid-run
(a clear error, no hang) and the run resumed once it is back."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from rollwise.bench.servers import free_port, wait_ready
from rollwise.compose.config import ConfigError, load_config
from rollwise.engine.base import SamplingParams
from rollwise.learner.files import write_weights
from rollwise.models import load_policy
from rollwise.pipeline.build import build
from rollwise.replay import TrajectoryStore
from rollwise.rewards import RewardStats
from rollwise.rollout.remote import RemoteRollout
from rollwise.rollout.servers import RemoteError, Servers
from rollwise.types import EncodedPrompt, Published, Sample
from runs import records, run_config

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
TIMING = ("time", "seconds", "_per_s", "makespan", "tail_s", "publish", "eta", "peak_rss",
          "cuda_max_allocated")
ROUTES = ("/version", "/v1/generate", "/v1/weights/update")


class ServerProcess:
    """`rollwise serve --model tiny` in a subprocess on `port`."""

    def __init__(self, port: int, log: Path):
        self.port, self.log = port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollwise", "serve", "--model", "tiny", "--port",
             str(self.port), "--threads", "1"], stdout=out, stderr=subprocess.STDOUT)
        wait_ready(self.url, self.proc, self.log, timeout_s)

    def missing_route(self) -> str | None:
        """The first route of the protocol this server does not have (404), or None."""
        for route in ROUTES:
            call = httpx.get if route == "/version" else httpx.post
            r = call(self.url + route, **({} if call is httpx.get else {"json": {}}),
                     timeout=10)
            if r.status_code in (404, 405):
                return route
        return None

    def version(self) -> int:
        return int(httpx.get(self.url + "/version", timeout=10).json()["version"])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(free_port(), tmp_path_factory.mktemp("serve") / "server.log")
    proc.start()
    try:
        missing = proc.missing_route()
        if missing is not None:
            pytest.skip(f"`rollwise serve` has no {missing} route yet (the server side of "
                        "issue 27)")
        yield proc
    finally:
        proc.kill()


def small(tmp_path: Path, *extra: str):
    return load_config(CONFIG, [f"run.output_dir='{tmp_path}'", "run.num_steps=2",
                                "run.threads=1", "rollout.prompts_per_step=4",
                                "task.num_eval=24", "eval.every=2", *extra])


def remote(tmp_path: Path, url: str, *extra: str):
    return small(tmp_path, "engine.name='remote'", f"engine.remote_urls=['{url}']",
                 "engine.remote_timeout_s=30", *extra)


def trajectories(root: Path, step: int) -> list[tuple]:
    """(prompt, response ids, reward, log-probs) of each trajectory of `step`."""
    store = TrajectoryStore(root / "trajectories.sqlite")
    try:
        return [(t.sample.id, t.response_ids, t.reward, t.logprobs)
                for g in store.load_groups(step) for t in g.trajectories]
    finally:
        store.close()


def same(x, y) -> bool:
    """Equal; figures computed from log-probs to float32 rounding (a server batches the
    requests as they arrive, and a product's last bits depend on the rows beside it)."""
    if isinstance(x, float) or isinstance(y, float):
        return y == pytest.approx(x, rel=1e-4, abs=1e-6)
    return x == y


def test_remote_matches_in_process_and_the_server_follows_the_trainer(tmp_path, server):
    """A 2-step run against the server: every non-timing figure as in process (rewards,
    losses, lengths, evaluations), and after the publication of step k the server samples
    with version k."""
    run_config(small(tmp_path), "local")
    cfg = remote(tmp_path, server.url)
    stages = build(cfg)
    assert server.version() == 0  # the driver's weights, loaded as version 0
    seen = []
    activate = stages.rollout_stage.activate

    def activate_and_ask(version: int) -> None:
        activate(version)
        seen.append((version, server.version()))

    stages.rollout_stage.activate = activate_and_ask
    run_config(cfg, "remote", stages=stages)
    assert seen == [(1, 1), (2, 2)]
    a, b = records(tmp_path / "local"), records(tmp_path / "remote")
    assert [r["kind"] for r in a] == [r["kind"] for r in b]
    for x, y in zip(a, b):
        keys = {k for k in set(x) & set(y) if not any(t in k for t in TIMING)}
        differ = {k: (x[k], y[k]) for k in keys if not same(x[k], y[k])}
        assert not differ, (x["kind"], x["step"], differ)
    for step in (1, 2):  # token for token, each with its reward
        local, there = (trajectories(tmp_path / name, step) for name in ("local", "remote"))
        assert [t[:3] for t in local] == [t[:3] for t in there]
        flat = [[lp for t in side for lp in t[3]] for side in (local, there)]
        assert flat[1] == pytest.approx(flat[0], abs=1e-5)
    trains = records(tmp_path / "remote", "train")
    assert all(r["remote_requests"] == 4 and r["remote_retries"] == 0 for r in trains)
    assert all(r["weights_bytes"] > 0 and r["remote_http_seconds"] > 0 for r in trains)
    # the trainer's part of the sync timed apart, within the whole
    assert all(0 < r["weights_write_seconds"] < r["publish_seconds"] for r in trains)


def test_async_against_a_server_rolls_out_ahead_within_the_bound(tmp_path, server):
    """The server holds its own copy of the weights, so the next step's rollouts run there
    while this step trains: with max_staleness 1 no trained token lags more than one
    version, nothing is lost, and the run ends at the last version."""
    cfg = remote(tmp_path, server.url, "schedule.mode='async'", "schedule.max_staleness=1",
                 "run.num_steps=3", "eval.every=0")
    run_config(cfg, "async")
    trains = records(tmp_path / "async", "train")
    assert [r["step"] for r in trains] == [1, 2, 3]
    assert all(r["staleness_hist_2"] == r["staleness_hist_3plus"] == 0 for r in trains)
    assert all(r["step"] - 1 - r["rollout_started_version"] <= 1 for r in trains)
    assert any(r["step"] - 1 - r["rollout_started_version"] == 1 for r in trains[1:])
    assert all(r["traj_requested"] == r["traj_trained"] + r["traj_filtered"]
               + r["traj_stale_dropped"] for r in trains)
    assert server.version() == 3


def test_an_update_in_abort_mode_cuts_samples_that_are_sent_again_to_finish(tmp_path, server):
    """Weights loaded with mode 'abort' while a group generates: its samples stop, come
    back partial and are sent again from where they stopped, ending with tokens of both
    versions and every sample whole."""
    write_weights(load_policy("tiny").model, tmp_path / "w")
    port = RemoteRollout(Servers([server.url], timeout_s=60, retries=0),
                         SamplingParams(n=4, max_tokens=300), lambda ids: "",
                         lambda trajs: RewardStats(0, 0, 0, 0.0), seed=1, sync="abort")
    before = server.version()
    out: list = []
    thread = threading.Thread(target=lambda: out.append(port.run(
        [EncodedPrompt(Sample("s", "", ""), [5, 6, 7])], [4])))
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/v1/stats", timeout=5).json()["pending"] == 0:
            assert time.monotonic() < deadline and thread.is_alive(), "never generating"
            time.sleep(0.01)
        port.publish(Published(before + 1, str(tmp_path / "w")))
        thread.join(60)
        trajs = out[0][0].trajectories
        assert all(t.finish_reason != "abort" for t in trajs)
        assert all(t.finish_reason == "stop" or len(t.response_ids) == 300 for t in trajs)
        assert any(set(t.versions) == {before, before + 1} for t in trajs)
        assert port.metrics()["remote_resumed"] >= 1
    finally:
        port.close()


def test_a_bad_weights_folder_names_the_server_and_the_phase(tmp_path, server):
    servers = Servers([server.url], timeout_s=10, retries=0)
    port = RemoteRollout(servers, SamplingParams(), lambda ids: "", lambda trajs: None, seed=0)
    try:
        with pytest.raises(RemoteError, match="load") as e:
            port.publish(Published(5, str(tmp_path / "nothing-here")))
        assert server.url in str(e.value) and "/v1/weights/update" in str(e.value), e.value
        assert server.version() != 5
    finally:
        port.close()


def test_unreachable_servers_fail_fast_naming_each_one():
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    servers = Servers(urls, timeout_s=5, retries=2, backoff_s=0.05)
    start = time.monotonic()
    with pytest.raises(RemoteError, match="POST /v1/generate failed 3 time") as e:
        servers.post("/v1/generate", {"prompt_token_ids": [1]})
    assert time.monotonic() - start < 5
    assert all(u in str(e.value) for u in urls) and "ConnectError" in str(e.value)
    servers.close()


def test_remote_settings_are_checked_before_anything_loads(tmp_path):
    with pytest.raises(ConfigError, match="engine.remote_urls"):
        build(small(tmp_path, "engine.name='remote'"))
    with pytest.raises(ConfigError, match="request engine in this process"):
        build(remote(tmp_path, "http://127.0.0.1:9", "schedule.strategy='partial'"))
    with pytest.raises(ConfigError, match="not an http"):
        build(small(tmp_path, "engine.name='remote'", "engine.remote_urls=['127.0.0.1:9']"))


def test_a_killed_server_stops_the_run_clearly_and_resume_finishes_it(tmp_path, server):
    """The server killed before step 3's rollouts: the run stops with an error naming it
    within the time-out; restarted, the run resumes from its step-2 checkpoint and ends
    with every step once."""
    cfg = remote(tmp_path, server.url, "run.num_steps=4", "eval.every=0",
                 "run.checkpoint_every=2", "engine.remote_timeout_s=20")
    cfg.run.name = "killed"
    stages = build(cfg)
    select = stages.select
    killed = []

    def kill_then_select():
        if stages.rollout_stage.version == 2 and not killed:
            server.kill()
            killed.append(time.monotonic())
        return select()

    stages.select = kill_then_select
    with pytest.raises(RemoteError) as e:
        run_config(cfg, "killed", stages=stages)
    assert killed and time.monotonic() - killed[0] < 20, e.value
    assert server.url in str(e.value) and "/v1/generate" in str(e.value), e.value
    root = tmp_path / "killed"
    assert [r["step"] for r in records(root, "train")] == [1, 2]
    server.start()
    summary = run_config(cfg, "killed", resume=True)
    assert summary["steps"] == 4
    assert [r["step"] for r in records(root, "train")] == [1, 2, 3, 4]
    assert server.version() == 4


def test_a_busy_server_is_asked_again_and_a_refusal_is_not():
    """409 (a weight update already running: a trainer resumed while its server still
    loads) and 429 are "not now": sent again after the backoff; a 400 is final at once."""
    import http.server
    import json as jsonlib
    import threading

    answers = [409, 429, 200, 400]
    seen: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            code = answers[len(seen)]
            seen.append(code)
            body = jsonlib.dumps({"ok": True} if code == 200 else {"message": f"no {code}"})
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    servers = Servers([f"http://127.0.0.1:{httpd.server_address[1]}"], timeout_s=5,
                      retries=3, backoff_s=0.01)
    try:
        answer, _ = servers.post("/v1/weights/update", {"path": "x"})
        assert answer == {"ok": True} and seen == [409, 429, 200] and servers.retried == 2
        with pytest.raises(RemoteError, match="answered 400: no 400"):
            servers.post("/v1/weights/update", {"path": "x"})
        assert seen == [409, 429, 200, 400]  # not sent again
    finally:
        servers.close()
        httpd.shutdown()


@pytest.mark.slow  # `make test` stays within 8 minutes on 2 cores
def test_bench_sync_times_each_phase_and_a_bfloat16_server_loads_half_the_bytes(tmp_path):
    """`rollwise bench sync` on the tiny model: a bfloat16 server asked for its precision
    gets bfloat16 files, half the float32 ones; every phase timed; the server's greedy
    tokens equal the in-process bfloat16 engine's after the last sync."""
    from rollwise.bench import sync

    cfg = small(tmp_path, "engine.batch_size=8")
    data = sync.run(cfg, dtypes=["bfloat16"], file_dtypes=["server", "float32"], syncs=1,
                    log_dir=tmp_path)
    by = {v["file_dtype"]: v for v in data["variants"]}
    assert set(by) == {"bfloat16", "float32"}
    assert by["float32"]["bytes"] == pytest.approx(2 * by["bfloat16"]["bytes"], rel=0.01)
    for v in by.values():
        assert v["greedy_match"] and v["syncs"] == 1 and len(v["rows"]) == 2
        assert all(r["server_write_s"] > 0 and r["server_publish_s"] > 0
                   and r["total_s"] > r["trainer_s"] for r in v["rows"])
    assert [r["version"] for v in data["variants"] for r in v["rows"]] == list(range(1, 5))
