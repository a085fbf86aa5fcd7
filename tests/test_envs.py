"""The environments that ship, the tool-call parser, the safe calculator and the
gymnasium-style adapter (no model)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollwise.envs import CalcEnv, CalcError, GuessEnv, GymTextEnv, LookupEnv, parse_tool_calls
from rollwise.envs.calc import safe_eval
from rollwise.tasks import make_task
from rollwise.types import Sample


@pytest.mark.parametrize("expr, value", [
    ("23 + 45", 68), ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("-7 // 2", -4), ("7 % 3", 1),
    ("2 ** 10", 1024), ("1 / 4", 0.25), ("6 / 3", 2), ("max(3, 9, 4) - abs(-2)", 7),
    ("round(2.6)", 3)])
def test_safe_eval_values(expr, value):
    assert safe_eval(expr) == value


@pytest.mark.parametrize("expr, reason", [
    ("__import__('os').system('true')", "not allowed"), ("x + 1", "not allowed"),
    ("(1).__class__", "not allowed"), ("[1, 2]", "not allowed"), ("lambda: 1", "not allowed"),
    ("open('f')", "not allowed"), ("9 ** 999", "too large"), ("10 ** 60", "out of range"),
    ("1 / 0", "division by zero"), ("1 +", "cannot parse"), ("1" * 300, "longer than"),
    ("'a' * 3", "not allowed")])
def test_safe_eval_refuses_what_is_not_arithmetic(expr, reason):
    with pytest.raises(CalcError, match=reason):
        safe_eval(expr)


def test_parse_tool_calls_both_spellings_and_malformed():
    text = ('a <tool_call>calc(2 + 3)</tool_call> b <tool_call>{"name": "lookup", '
            '"arguments": {"name": "bob"}}</tool_call> <tool_call>{"name": 1}</tool_call>'
            '<tool_call>not a call</tool_call><tool_call>calc(1')
    calls, errors = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("calc", {"_arg": "2 + 3"}),
                                                      ("lookup", {"name": "bob"})]
    assert len(errors) == 3 and "without </tool_call>" in errors[-1]
    assert parse_tool_calls("no call here, #### 5") == ([], [])


def _sample(task: str, **options) -> Sample:
    return make_task(task, num_train=4, num_eval=2, **options).train[0]


def test_calc_env_tool_then_answer():
    s = _sample("calc_tool")
    env = CalcEnv()
    env.reset(s)
    expr = s.prompt.split("What is ")[1].split("?")[0]
    r1 = env.step(f"Let me compute. <tool_call>calc({expr})</tool_call>")
    assert not r1.done and r1.reward == 0.0 and r1.observation.endswith(f"= {s.answer}")
    assert r1.info["malformed"] == 0
    r2 = env.step(f"The answer is #### {s.answer}")
    assert r2.done and r2.reward == 1.0 and r2.info["success"]
    env.reset(s)
    wrong = env.step(f"#### {int(s.answer) + 1}")
    assert wrong.done and wrong.reward == 0.0 and not wrong.info["success"]


def test_calc_env_malformed_calls_are_observations_and_counted():
    env = CalcEnv(max_calls=2)
    env.reset(_sample("calc_tool"))
    r = env.step("<tool_call>calc(import os)</tool_call><tool_call>{bad json}</tool_call>"
                 "<tool_call>search(x)</tool_call>")
    assert not r.done and r.info["malformed"] == 3
    assert r.observation.count("error:") == 3 and "unknown tool 'search'" in r.observation
    r = env.step("<tool_call>calc(1+1)</tool_call><tool_call>calc(2+2)</tool_call>")
    assert "at most 2 tool calls" in r.observation  # the budget: one call was left


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="<>/_{}()\"':,tolcaumpex 0123456789+-*#", max_size=80))
def test_tool_env_never_raises_on_any_text(text):
    env = LookupEnv()
    env.reset(Sample(id="x", prompt="q", answer="3", meta={"secrets": {"bob": 1, "eve": 2}}))
    r = env.step(text)
    assert isinstance(r.observation, str) and math.isfinite(r.reward)


def test_lookup_needs_two_calls():
    s = _sample("lookup")
    a, b = s.meta["secrets"]
    env = LookupEnv()
    env.reset(s)
    assert a in s.prompt and str(s.meta["secrets"][a]) not in s.prompt.split("Tools")[0]
    r = env.step(f'<tool_call>lookup({a})</tool_call>')
    assert r.observation == f"lookup({a}) = {s.meta['secrets'][a]}" and not r.done
    r = env.step(f'<tool_call>{{"name": "lookup", "arguments": {{"name": "{b}"}}}}</tool_call>')
    assert r.observation.endswith(f"= {s.meta['secrets'][b]}") and r.info["state"] == "calls=2"
    r = env.step(f"#### {s.meta['secrets'][a] + s.meta['secrets'][b]}")
    assert r.done and r.reward == 1.0


def test_guess_binary_search_solves_every_secret_with_step_rewards():
    high = 16
    for secret in range(1, high + 1):
        env = GuessEnv(max_guesses=5)
        env.reset(Sample(id="g", prompt="guess", answer=str(secret),
                         meta={"secret": secret, "high": high}))
        lo, hi, total, steps = 1, high, 0.0, 0
        while True:
            g = (lo + hi) // 2
            r = env.step(f"I guess {g}")
            steps += 1
            total += r.reward
            if r.done:
                break
            assert r.reward == pytest.approx(0.1)  # consistent moves earn the bonus
            lo, hi = (g + 1, hi) if "higher" in r.observation else (lo, g - 1)
            assert r.info["state"] == f"{lo}-{hi}"
        assert r.info["success"] and steps <= 5
        assert total == pytest.approx(1.0 + 0.1 * steps)


def test_guess_inconsistent_and_malformed_moves():
    env = GuessEnv(max_guesses=3)
    env.reset(Sample(id="g", prompt="guess", answer="5", meta={"secret": 5, "high": 8}))
    assert env.step("3").observation == "3 is wrong, higher"
    r = env.step("2")  # below the interval [4, 8] the feedback left: no bonus
    assert r.reward == 0.0 and r.info["state"] == "4-8"
    r = env.step("no idea")
    assert r.info["malformed"] == 1 and not r.done and "from 4 to 8" in r.observation
    r = env.step("7")  # third guess: the game ends unsolved
    assert r.done and not r.info["success"] and r.reward == pytest.approx(0.1)


class _CountdownGym:
    """A gymnasium-style text environment: say the numbers from n down to 0."""

    def reset(self, seed=None, options=None):
        self.n = options["n"]
        self.seed = seed
        return f"say {self.n}", {}

    def step(self, action):
        ok = action.strip() == str(self.n)
        self.n -= 1
        return f"say {self.n}", float(ok), self.n < 0, not ok, {"success": self.n < 0}


def test_gym_text_adapter():
    env = GymTextEnv(_CountdownGym)
    s = Sample(id="c/1", prompt="count", answer="", meta={"n": 1})
    assert env.reset(s) == "say 1"
    seed = env.env.seed
    env = GymTextEnv(_CountdownGym)
    env.reset(s)
    assert env.env.seed == seed  # the sample's id seeds the reset
    r1, r2 = env.step("1"), env.step("0")
    assert (r1.reward, r1.done, r2.reward, r2.done) == (1.0, False, 1.0, True)
    env.reset(s)
    bad = env.step("7")  # truncated ends the episode as well
    assert bad.done and bad.reward == 0.0


def _smollm2_tokenizer():
    from rollwise.models.tiny import cache_root

    path = cache_root() / "models" / "smollm2-135m-instruct"
    if not (path / "tokenizer_config.json").is_file():
        pytest.skip("SmolLM2-135M-Instruct is not converted in the local cache")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_rendered_turns_equal_the_chat_templates_own_tokens():
    """Prompt ids + sampled turn ids + observation ids (each tokenized once, never the
    history again) are exactly the chat template's tokens of the whole conversation."""
    from rollwise.envs.render import TurnRenderer

    tok = _smollm2_tokenizer()
    renderer = TurnRenderer(tok, chat=True, stop_ids=[tok.eos_token_id])
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = list(tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"])
    messages = list(user)
    for turn, obs in (("Let me check <tool_call>calc(2 + 3)</tool_call>", "calc(2 + 3) = 5"),
                      ("It is", "error: cannot read")):
        sampled = tok(turn, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids += sampled + renderer.observation_ids(obs, sampled)
        messages += [{"role": "assistant", "content": turn}, {"role": renderer.role,
                                                              "content": obs}]
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    assert ids == list(want)
    # a turn cut at max_tokens (no stop token sampled): the renderer closes it
    cut = tok("Hello", add_special_tokens=False)["input_ids"]
    closed = renderer.observation_ids("x", cut)
    assert tok.decode(closed).startswith("<|im_end|>\n<|im_start|>user\nx")
