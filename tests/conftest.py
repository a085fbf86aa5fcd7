"""Shared test settings and tiny builders."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

# `auto` precision means float32 in tests: results must not depend on how fast this CPU's
# bfloat16 or int8 kernels are (tests of the probe itself unset this).
os.environ.setdefault("ROLLWISE_AUTO_PRECISION", "float32")
# `run.memory = "auto"` sees 1 TiB free: runs keep their settings whatever this machine has
# free (tests of the choice fake their own figure, tests/test_memory_auto.py).
os.environ.setdefault("ROLLWISE_FREE_MEMORY_MB", str(2**20))
# Under pytest-xdist (make test) each worker keeps its temporary files apart, so a test that
# looks for sandbox processes left behind (test_sandbox.py) sees its own worker's only. Ray
# keeps its usual folder (its socket paths have a length limit).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("RAY_TMPDIR", tempfile.gettempdir())
    tempfile.tempdir = tempfile.mkdtemp(prefix=f"rollwise-{os.environ['PYTEST_XDIST_WORKER']}-")
    os.environ["TMPDIR"] = tempfile.tempdir
    atexit.register(shutil.rmtree, tempfile.tempdir, ignore_errors=True)

from rollwise.types import Sample, Trajectory


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The test models are tiny: handing a 32-wide matmul to a second thread costs
    milliseconds on a 2-core machine, far more than the arithmetic (0.01 ms on one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny_llama(dtype: torch.dtype = torch.float32, seed: int = 0):
    """A 2-layer, 32-wide Llama (vocabulary 88, tied embeddings), randomly initialised."""
    from rollwise.models.tiny import build_model

    return build_model(hidden=32, layers=2, heads=2, kv_heads=1, seed=seed).to(dtype).eval()


def _make_trajectory(prompt_ids: list[int], response_ids: list[int],
                    logprobs: list[float] | None = None, version: int = 0) -> Trajectory:
    return Trajectory(
        sample=Sample(id="x", prompt="1+1=", answer="2"), prompt_ids=list(prompt_ids),
        response_ids=list(response_ids),
        logprobs=list(logprobs) if logprobs is not None else [-1.0] * len(response_ids),
        versions=[version] * len(response_ids), finish_reason="stop")


def _random_trajectories(n: int, seed: int = 0, vocab: int = 88) -> list[Trajectory]:
    """`n` trajectories of ragged prompt (2-6) and response (1-7) lengths; BOS-led prompts."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(1, 6, (1,), generator=gen))
        r = int(torch.randint(1, 8, (1,), generator=gen))
        prompt = [1] + torch.randint(4, vocab, (p,), generator=gen).tolist()
        response = torch.randint(4, vocab, (r,), generator=gen).tolist()
        logprobs = (-torch.rand(r, generator=gen) * 3 - 3).tolist()
        out.append(_make_trajectory(prompt, response, logprobs))
    return out


def _teacher_logprobs(model, prompts, completions) -> list[torch.Tensor]:
    """Each completion's log-probs ([T], float64) from one teacher-forced forward pass of
    `model` over its prompt and tokens."""
    from rollwise.learner.logprobs import token_logprobs

    out = []
    for c in completions:
        p = prompts[c.prompt_index]
        ids = torch.tensor([p + c.token_ids])
        mask = torch.zeros(ids.shape)
        mask[0, len(p):] = 1
        with torch.no_grad():
            lp = token_logprobs(model, ids, torch.ones_like(ids), mask)
        out.append(lp[0, len(p):].double())
    return out


@pytest.fixture
def test_device() -> torch.device:
    """The device of `device`-marked tests: $ROLLWISE_TEST_DEVICE (default cpu), so the same
    tests run on a GPU where one is there (scripts/gpu_check.sh). A device this torch
    cannot use skips the test with the reason."""
    name = os.environ.get("ROLLWISE_TEST_DEVICE", "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"ROLLWISE_TEST_DEVICE={name} but this torch sees no CUDA device")
    return device


@pytest.fixture
def teacher_logprobs():
    """Builder: teacher_logprobs(model, prompts, completions) -> [log-probs per completion]."""
    return _teacher_logprobs


@pytest.fixture
def tiny_llama():
    """Builder: tiny_llama(dtype=torch.float32, seed=0) -> LlamaForCausalLM."""
    return _tiny_llama


@pytest.fixture
def make_trajectory():
    """Builder: make_trajectory(prompt_ids, response_ids, logprobs=None, version=0)."""
    return _make_trajectory


@pytest.fixture
def random_trajectories():
    """Builder: random_trajectories(n, seed=0) -> ragged list of Trajectory."""
    return _random_trajectories


def pytest_collection_modifyitems(config, items):
    """`make test` runs two pytest-xdist workers with `--dist loadgroup`: each test file stays
    on one worker (its module fixtures are built once), and the files on a local Ray
    cluster share one worker, so two clusters never start at once."""
    for item in items:
        group = "ray" if item.get_closest_marker("ray") else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
