"""The code sandbox: correct code passes, resource attacks are contained, and the machine, the
run and the reward pool are untouched. Every case runs under each isolation level that works
on this machine (bwrap, unshare, landlock, rlimits; the level is in the test id);
`test_detection_falls_back` hides bwrap, unshare and the kernel layers so the fallback path is
taken whatever the machine has. tests/test_sandbox_hostile.py has the adversarial suite."""

from __future__ import annotations

import os
import resource
import socket
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from rollwise.rewards import sandbox as sb
from rollwise.rewards.pool import InfraError, RewardPool, RewardSpec
from rollwise.rewards.sandbox import SandboxLimits, detect_isolation, execute, run_tests
from rollwise.types import Sample, Trajectory

REPO = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(cpu_s=1, wall_s=3.0, memory_mb=512, output_kb=64, processes=8)
TESTS = "def check(candidate):\n" + "".join(
    f"    assert candidate({i}) == {i + 1}\n" for i in range(4))
ROOT = os.geteuid() == 0
SECRET = "rollwise-fake-secret-7d41"


def _levels() -> list:
    works = [lvl for lvl in sb.ISOLATION_LEVELS if _works(lvl)]
    return [pytest.param(lvl, id=lvl) for lvl in works]


def _works(level: str) -> bool:
    try:
        detect_isolation(level)
    except RuntimeError:
        return False
    return True


LEVELS = _levels()


def _contained(level: str) -> bool:
    """Whether this level stops same-user harm (files, signals, /proc): bwrap, unshare and
    landlock do; limits alone do only when running as root (the code drops to nobody);
    docs/rewards.md has the table. Network: every level but rlimits."""
    return level in sb.SECURITY_BOUNDARY or ROOT


def _sandbox_processes() -> list[psutil.Process]:
    """Live processes whose environment points into a sandbox directory of this process's
    temporary folder (each pytest-xdist worker has its own: tests/conftest.py)."""
    found = []
    mine = os.path.join(os.path.realpath(tempfile.gettempdir()), "rollwise-sbx-")
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("HOME", "").startswith(mine):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def _run(code: str, level: str, limits: SandboxLimits = LIMITS):
    start = time.perf_counter()
    result = run_tests(code, TESTS, "f", limits, isolation=level)
    return result, time.perf_counter() - start


@pytest.mark.parametrize("level", LEVELS)
def test_correct_and_partial_code(level) -> None:
    ok, _ = _run("def f(x):\n    return x + 1\n", level)
    assert (ok.status, ok.passed, ok.total, ok.score) == ("ok", 4, 4, 1.0)
    half, _ = _run("def f(x):\n    return x + 1 if x < 2 else 0\n", level)
    assert (half.passed, half.total, half.status) == (2, 4, "failed")
    assert "AssertionError" in half.reason
    bad, _ = _run("def f(x) return\n", level)
    assert (bad.status, bad.score) == ("load_error", 0.0) and "SyntaxError" in bad.reason
    # a loop in test 3 of 4 keeps the two passes before it (honest partial credit)
    loop, seconds = _run("def f(x):\n    while x >= 2: pass\n    return x + 1\n", level)
    assert (loop.passed, loop.total) == (2, 4) and loop.status in ("cpu_limit", "timeout")
    assert seconds < LIMITS.wall_s + 2


HOSTILE = {
    "infinite_loop": "def f(x):\n    while True:\n        pass\n",
    "fork_bomb": ("import os\ndef f(x):\n    while True:\n        try:\n            os.fork()\n"
                  "        except OSError:\n            pass\n"),
    "allocate_50gb": "def f(x):\n    block = bytearray(50 * 2**30)\n    return x + 1\n",
    "print_100mb": "import sys\ndef f(x):\n    sys.stdout.write('x' * 100_000_000)\n"
                   "    return x + 1\n",
}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_resource_attacks_are_contained(case, level) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result, seconds = _run(HOSTILE[case], level)
    assert result.score == 0.0 and result.reason, result
    # a fork bomb's process may also be killed by the kernel (signal 9 before its CPU limit,
    # e.g. when its children exhaust memory): contained all the same
    expected = {"infinite_loop": ("cpu_limit", "timeout"),
                "fork_bomb": ("cpu_limit", "timeout", "crashed"),
                "allocate_50gb": ("failed",), "print_100mb": ("output_limit",)}[case]
    assert result.status in expected, result
    if case == "allocate_50gb":
        assert "MemoryError" in result.reason
    if case == "print_100mb":
        assert len(result.output) <= LIMITS.output_kb * 1024
    assert seconds < LIMITS.wall_s + 2  # killed on time
    time.sleep(0.2)
    assert _sandbox_processes() == []  # nothing left behind (the fork bomb's children too)
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown_kb < 64 * 1024  # this process never held the 100 MB or the 50 GB


@pytest.mark.parametrize("level", LEVELS)
def test_writes_outside_the_workdir_fail(level, tmp_path) -> None:
    if not _contained(level):
        pytest.skip("without bwrap, writes as the same user are not stopped (docs/rewards.md)")
    home_file = Path.home() / "rollwise_sandbox_pwned.txt"
    repo_file = REPO / "rollwise_sandbox_pwned.txt"
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    code = (
        "import os, shutil\n"
        "def f(x):\n"
        "    hits = 0\n"
        "    try:  # bwrap hides the home directory behind a tmpfs: a write may land there\n"
        f"        open({str(home_file)!r}, 'w').write('pwned')\n"
        "    except OSError:\n"
        "        pass\n"
        f"    for path in ({str(repo_file)!r},):\n"
        "        try:\n"
        "            open(path, 'w').write('pwned')\n"
        "            hits += 1\n"
        "        except OSError:\n"
        "            pass\n"
        f"    for path in ({str(victim)!r}, {str(REPO / 'pyproject.toml')!r}):\n"
        "        try:\n"
        "            os.remove(path)\n"
        "            hits += 1\n"
        "        except OSError:\n"
        "            pass\n"
        f"    shutil.rmtree({str(tmp_path)!r}, ignore_errors=True)\n"
        "    open('scratch.txt', 'w').write('fine')  # its own directory is writable\n"
        "    return x + 1 if hits == 0 else -1\n"
    )
    result, _ = _run(code, level)
    assert not home_file.exists() and not repo_file.exists()
    assert victim.read_text() == "precious" and (REPO / "pyproject.toml").exists()
    # the honest outcome: every write outside was refused, so the code's own logic passes
    assert result.score == 1.0, result


@pytest.mark.parametrize("level", LEVELS)
def test_secrets_signals_and_network_stay_out(level, monkeypatch) -> None:
    if not _contained(level):
        pytest.skip("without bwrap, same-user /proc reads and signals are not stopped")
    monkeypatch.setenv("ROLLWISE_FAKE_SECRET", SECRET)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    me = os.getpid()
    code = (
        "import os, signal, socket\n"
        "def f(x):\n"
        "    found = os.environ.get('ROLLWISE_FAKE_SECRET', '')\n"
        f"    for pid in ({me}, os.getppid(), 1):\n"
        "        try:\n"
        "            found += open(f'/proc/{pid}/environ').read()\n"
        "        except OSError:\n"
        "            pass\n"
        f"    if {SECRET!r} in found:\n"
        "        print('LEAK', found)\n"
        "        return 'leaked'\n"
        "    try:\n"
        f"        socket.create_connection(('127.0.0.1', {port}), timeout=0.5).send(b'hi')\n"
        "        return 'connected'\n"
        "    except OSError:\n"
        "        pass\n"
        "    for pid in (" + str(me) + ", os.getppid()):\n"
        "        try:\n"
        "            os.kill(pid, signal.SIGKILL)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return x + 1\n"
    )
    result, _ = _run(code, level)
    if level != "rlimits" or sb._layers(level)["seccomp"]:  # limits alone do not stop sockets
        with pytest.raises(TimeoutError):
            server.accept()  # nobody connected
    server.close()
    assert SECRET not in result.output and "leaked" not in result.reason
    assert "connected" not in result.reason
    assert psutil.pid_exists(me)  # we are alive (we would not be running otherwise)
    # os.getppid() inside a PID namespace is the sandbox's own init: killing it ends the
    # sandbox (score 0 from there on, honest); under limits as nobody the kill is refused
    assert result.score in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert result.status in ("ok", "crashed", "cpu_limit", "failed"), result


def test_detection_falls_back(monkeypatch, capsys) -> None:
    """Without bwrap and unshare on PATH the sandbox runs with limits only, says so once,
    and still scores correctly; a forced level that does not work is an error."""
    monkeypatch.setattr(sb, "_detected", {})
    monkeypatch.setattr(sb, "_warned", False)
    monkeypatch.setattr(sb, "_layers_here", lambda: {"landlock": 0, "seccomp": False})
    real_which = sb.shutil.which
    monkeypatch.setattr(sb.shutil, "which",
                        lambda name: None if name in ("bwrap", "unshare") else real_which(name))
    assert detect_isolation() == "rlimits"
    assert sb.isolation_info()["security_boundary"] is False
    with pytest.raises(RuntimeError, match="'bwrap' was asked for but does not work"):
        detect_isolation("bwrap")
    with pytest.warns(RuntimeWarning, match="NOT a security boundary"):
        ok = run_tests("def f(x):\n    return x + 1\n", TESTS, "f", LIMITS)
    assert ok.score == 1.0 and ok.isolation == "rlimits"
    with _no_warning():
        run_tests("def f(x):\n    return x + 1\n", TESTS, "f", LIMITS)  # once only
    assert capsys.readouterr().err.count("NOT a security boundary") == 1
    # only bwrap hidden: unshare is next where it works
    monkeypatch.setattr(sb, "_detected", {})
    monkeypatch.setattr(sb.shutil, "which",
                        lambda name: None if name == "bwrap" else real_which(name))
    assert detect_isolation() in ("unshare", "rlimits")
    with pytest.raises(RuntimeError, match="sandbox_require = .isolated. but the sandbox here is"):
        sb.check_required("rlimits", "isolated")
    sb.check_required("rlimits", "any")
    with pytest.raises(ValueError, match="expected auto, bwrap, unshare, landlock, rlimits"):
        detect_isolation("docker")


class _no_warning:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self._log = self._cm.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        assert not [w for w in self._log if "security boundary" in str(w.message)]


def test_infrastructure_failure_is_retried_then_masked(monkeypatch) -> None:
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        return sb.ExecResult(status="infra", reason="the sandbox did not start", isolation="x")

    monkeypatch.setattr(sb, "run_tests", flaky)
    with pytest.raises(InfraError, match="did not start .after 2 tries"):
        execute("def f(x): return x", TESTS, "f", LIMITS)
    assert len(calls) == 2
    # one failure then success: retried, scored normally
    results = [sb.ExecResult(status="infra", reason="boom"), sb.ExecResult(passed=4, total=4)]
    monkeypatch.setattr(sb, "run_tests", lambda *a, **k: results.pop(0))
    assert execute("", TESTS, "f", LIMITS).score == 1.0


def test_pool_records_reasons_counts_infra_and_survives() -> None:
    """Through the reward pool, as training runs it: hostile completions score 0 with their
    reason as a note, an infrastructure failure is counted apart and masked, and the pool
    keeps scoring correct code afterwards."""
    from rollwise.rewards.pool import mask_infra_failures
    from rollwise.tasks.code import code_verifier

    limits = SandboxLimits(cpu_s=1, wall_s=3.0, memory_mb=512, output_kb=64)

    def verifier(text, sample):
        if text == "INFRA":
            raise InfraError("sandbox: could not start")
        return code_verifier(text, sample, limits=limits)

    sample = Sample("c/0", "write f", "", meta={"tests": TESTS, "entry_point": "f"})
    texts = ["```python\ndef f(x):\n    return x + 1\n```", HOSTILE["infinite_loop"],
             HOSTILE["allocate_50gb"], "INFRA", "def f(x):\n    return x\n"]
    trajs = [Trajectory(sample, [], [], [], [], "stop", text=t) for t in texts]
    with RewardPool([RewardSpec("correct", verifier)], timeout_s=10, num_workers=2) as pool:
        stats = pool.score(trajs)
        assert [t.scores["correct"] for t in trajs] == [1.0, 0.0, 0.0, 0.0, 0.0]
        assert (stats.num_errors, stats.num_timeouts, stats.num_infra) == (0, 0, 1)
        assert any("sandbox cpu_limit" in e.message or "sandbox timeout" in e.message
                   for e in trajs[1].reward_errors)
        assert any("MemoryError" in e.message for e in trajs[2].reward_errors)
        assert [e.to_text() for e in trajs[3].reward_errors] == [
            "correct: infra: sandbox: could not start"]
        assert trajs[3].reward_errors[0].kind == "infra"
        assert mask_infra_failures(trajs) == 1 and trajs[3].reward == pytest.approx(0.25)
        again = [Trajectory(sample, [], [], [], [], "stop", text=texts[0])]
        pool.score(again)
        assert again[0].reward == 1.0


def test_killing_its_process_group_does_not_reach_ours() -> None:
    """The sandbox runs in its own session: killing its group never reaches ours (this
    test process is still here to see the result) and the code scores 0."""
    result, _ = _run("import os, signal\ndef f(x):\n    os.killpg(0, signal.SIGKILL)\n",
                     detect_isolation())
    # In a PID namespace (bwrap, unshare) the sandboxed interpreter is the namespace's init,
    # which the kernel shields from SIGKILL sent inside it: it survives and fails the tests.
    assert result.score == 0.0 and result.status in ("crashed", "cpu_limit", "failed")


def test_concurrency_slots_bound_executions_and_survive_a_killed_holder(monkeypatch) -> None:
    import multiprocessing

    monkeypatch.setattr(sb, "_SLOT_FILES", [])
    sb.set_max_concurrent(1)
    limits = SandboxLimits(wall_s=0.5)
    code = "def f(x):\n    return x + 1\n"
    # the only slot is taken: the execution cannot start
    with sb._concurrency(1.0), pytest.raises(InfraError, match="no execution slot free within"):
        execute(code, TESTS, "f", limits, isolation="rlimits")
    assert execute(code, TESTS, "f", LIMITS, isolation="rlimits").score == 1.0
    # a holder killed mid-execution (as the reward pool kills a stuck worker) frees its slot
    ctx = multiprocessing.get_context("fork")
    taken = ctx.Event()

    def hold():
        with sb._concurrency(1.0):
            taken.set()
            time.sleep(60)

    holder = ctx.Process(target=hold)
    holder.start()
    assert taken.wait(10)
    with pytest.raises(InfraError):
        execute(code, TESTS, "f", limits, isolation="rlimits")
    holder.kill()
    holder.join(5)
    assert execute(code, TESTS, "f", LIMITS, isolation="rlimits").score == 1.0


@pytest.mark.parametrize("level", LEVELS)
def test_a_background_child_does_not_hold_the_result(level) -> None:
    """Code that leaves a child running (holding the output pipe) is scored as soon as its
    tests are done, and the child is killed with the group."""
    code = ("import os, time\nif os.fork() == 0:\n    time.sleep(30)\n    os._exit(0)\n"
            "def f(x):\n    return x + 1\n")
    result, seconds = _run(code, level)
    assert result.score == 1.0 and seconds < LIMITS.wall_s
    time.sleep(0.2)
    assert _sandbox_processes() == []


def test_slot_folders_are_removed(tmp_path) -> None:
    """A run's slot folder goes when it exits; one left by a killed run goes at the next."""
    import subprocess
    import sys

    stale = tmp_path / "rollwise-sbx-slots-999999999-dead"  # no such process
    stale.mkdir()
    code = ("import tempfile\n"
            f"tempfile.tempdir = {str(tmp_path)!r}\n"
            "from rollwise.rewards import sandbox as sb\n"
            "sb.set_max_concurrent(2)\n"
            "print(sb._SLOT_FILES[0])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    slot = Path(done.stdout.strip())
    assert slot.parent.parent == tmp_path and slot.name == "slot0"
    assert not slot.parent.exists() and not stale.exists()


def test_an_interpreter_under_tmp_works_on_every_level(tmp_path) -> None:
    """bwrap and unshare hide /tmp: an interpreter that lives there (a virtual environment
    under /tmp, its base under root's 0700 home here) is mounted back; detection runs the
    real interpreter, so a level where it would not work is never chosen."""
    import json
    import subprocess
    import sys

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    code = ("import json\n"
            "from rollwise.rewards import sandbox as sb\n"
            "tests = 'def check(candidate):\\n    assert candidate(1) == 2\\n'\n"
            "out = {'detected': sb.detect_isolation()}\n"
            "for level, works in sb.isolation_info()['available'].items():\n"
            "    if works:\n"
            "        r = sb.run_tests(sb.PROBE_CODE, tests, 'f', isolation=level)\n"
            "        out[level] = r.status\n"
            "print(json.dumps(out))\n")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                          text=True, check=True, env={**os.environ,
                                                      "PYTHONPATH": str(REPO / "src")})
    out = json.loads(done.stdout.strip().splitlines()[-1])
    levels = {k: v for k, v in out.items() if k != "detected"}
    assert out["detected"] in levels and set(levels.values()) == {"ok"}, out
