"""Code tasks: pycode is seeded with disjoint splits and its references pass their tests;
humaneval's canonical solutions pass in the sandbox, whole-function and continuation style."""

from __future__ import annotations

import pytest

from rollwise.tasks import make_task
from rollwise.tasks.code import extract_code, program_of


def test_pycode_splits_references_and_partial_credit() -> None:
    task = make_task("pycode", seed=0, num_train=60, num_eval=12, chat=True)
    again = make_task("pycode", seed=0, num_train=60, num_eval=12, chat=True)
    assert [s.prompt for s in task.train] == [s.prompt for s in again.train]

    def keys(samples):
        return {s.prompt[0]["content"] for s in samples}

    assert not keys(task.train) & keys(task.eval)
    assert len({s.meta["template"] for s in task.train}) >= 8  # the kinds are mixed
    for s in task.eval:
        assert s.meta["tests"].count("assert candidate(") == 5
        assert task.verifier(s.reference, s) == 1.0
    s = task.eval[0]
    fn = s.meta["entry_point"]
    arg = s.meta["solution"].split("(")[1].split(")")[0]
    wrong = f"```python\ndef {fn}({arg}):\n    return None\n```"
    score = task.verifier(wrong, s)
    assert score == 0.0 and "sandbox failed (0/5)" in score.note
    missing = task.verifier("```python\ndef other(x):\n    return 1\n```", s)
    assert missing == 0.0 and f"no function named {fn}" in missing.note


def test_extract_code_and_program_of() -> None:
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_code("no fence") == "no fence"
    from rollwise.types import Sample

    s = Sample("h/0", "", "", meta={"entry_point": "f", "code_prompt": "import math\ndef f(x):\n"})
    assert program_of("    return math.sqrt(x)\n", s).startswith("import math\ndef f(x):\n    ret")
    assert program_of("def f(x):\n    return 1\n", s).endswith("def f(x):\n    return 1\n")


@pytest.mark.parametrize("count", [pytest.param(16, id="first16"),
                                   pytest.param(164, id="all", marks=pytest.mark.slow)])
def test_humaneval_canonical_solutions_pass(count) -> None:
    task = make_task("humaneval", seed=0, num_train=0, num_eval=count, chat=True)
    assert len(task.eval) == count and task.train == []
    for i, s in enumerate(task.eval):
        body = s.reference[len(s.meta["code_prompt"]):]
        # continuation style on even problems, a whole function in a fence on odd ones
        text = body if i % 2 == 0 else f"```python\n{s.reference}\n```"
        score = task.verifier(text, s)
        assert score == 1.0, (s.id, score.note)


def test_sandbox_require_isolated_refuses_limits_only() -> None:
    """`sandbox_require = "isolated"` builds the task only where a boundary holds the code."""
    from rollwise.rewards.sandbox import SECURITY_BOUNDARY, detect_isolation

    small = {"seed": 0, "num_train": 2, "num_eval": 1, "chat": True}
    with pytest.raises(RuntimeError, match='sandbox_require = "isolated" but the sandbox'):
        make_task("pycode", **small, isolation="rlimits", sandbox_require="isolated")
    with pytest.raises(ValueError, match="sandbox_require='anything'"):
        make_task("pycode", **small, sandbox_require="anything")
    if detect_isolation() in SECURITY_BOUNDARY:
        task = make_task("pycode", **small, sandbox_require="isolated")
        assert task.info["sandbox"]["security_boundary"] is True
        assert "verdict outside the code's process" in task.info["sandbox"]["layers"]
