"""The `hf` engine against full forward passes of the same model, and its sampling statistics."""

from __future__ import annotations

import math

import pytest
import torch

from rollwise.engine.base import Engine, SamplingParams
from rollwise.engine.hf import HFEngine, warp_logits
from rollwise.types import Completion

PAD, EOS = 0, 2
PROMPTS = [[1, 20, 30, 40, 12, 7, 9, 33], [1, 5], [1, 44, 45, 46, 47]]  # lengths 8, 2, 5
CHI2_CRITICAL_DF7_P1E3 = 24.3219  # chi-square quantile: P(X > 24.3219) = 1e-3 for df = 7


@pytest.fixture
def model(tiny_llama):
    """The tiny Llama with its logits scaled by 6 (final-norm gain): untrained logits are
    nearly uniform, which would make truncation and goodness-of-fit checks toothless."""
    m = tiny_llama()
    with torch.no_grad():
        m.model.norm.weight.mul_(6.0)
    return m


def _engine(model, batch_size: int = 64) -> HFEngine:
    return HFEngine(model, pad_token_id=PAD, eos_token_ids=[EOS], batch_size=batch_size)


def _reference_logprobs(logits: torch.Tensor, temperature: float, top_k: int,
                        top_p: float) -> list[float]:
    """log-probs of the sampling distribution for one row of logits, token by token:
    softmax(logits / T), keep the top_k most likely, then the smallest most-likely prefix
    whose (renormalised) mass reaches top_p, renormalise; -inf outside."""
    x = logits.double().tolist()
    if temperature > 0:
        x = [v / temperature for v in x]
    order = sorted(range(len(x)), key=lambda v: -x[v])
    keep = order[:top_k] if top_k > 0 else order
    z = sum(math.exp(x[v]) for v in keep)
    if top_p < 1.0:
        kept, mass = [], 0.0
        for v in keep:
            kept.append(v)
            mass += math.exp(x[v]) / z
            if mass >= top_p:
                break
        keep = kept
        z = sum(math.exp(x[v]) for v in keep)
    out = [-math.inf] * len(x)
    for v in keep:
        out[v] = x[v] - math.log(z)
    return out


def _forward_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] logits predicting each token: one unpadded full forward pass."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    return logits[len(prompt) - 1: len(prompt) + len(tokens) - 1]


# -- behaviour log-probs -------------------------------------------------------------------


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9), (0.7, 5, 0.9)])
def test_behaviour_logprobs_equal_full_forward(model, temperature, top_k, top_p) -> None:
    engine = _engine(model, batch_size=4)  # 6 requests: two left-padded batches
    params = SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p,
                            max_tokens=8, seed=0, stop_token_ids=(EOS,))
    outs = engine.generate(PROMPTS, params)
    assert len(outs) == 6
    for c in outs:
        assert len(c.logprobs) == len(c.token_ids) >= 1
        logits = _forward_logits(model, PROMPTS[c.prompt_index], c.token_ids)
        for step, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            ref = _reference_logprobs(logits[step], temperature, top_k, top_p)
            assert ref[tok] > -math.inf, "sampled a token outside the truncated support"
            assert abs(lp - ref[tok]) < 1e-4, (c.prompt_index, step)


def test_greedy_equals_argmax_loop_with_full_forward() -> None:
    from rollwise.models import load_policy

    policy = load_policy("tiny")  # the built-in (untrained) tiny model, 4 layers
    m = policy.model
    prompts = [policy.encode("12+34="), policy.encode("7*8="), policy.encode("how much is 5+5?")]

    def reference(prompt, max_tokens, stops):
        seq = list(prompt)
        for _ in range(max_tokens):
            with torch.no_grad():
                tok = int(m(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(tok)
            if tok in stops:
                return seq[len(prompt):], "stop"
        return seq[len(prompt):], "length"

    engine = HFEngine(m, pad_token_id=policy.tokenizer.pad_token_id,
                      eos_token_ids=policy.stop_ids, batch_size=8)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    refs = [reference(p, 10, set(policy.stop_ids)) for p in prompts]
    assert [(c.token_ids, c.finish_reason) for c in outs] == refs
    assert [c.prompt_index for c in outs] == [0, 1, 2]
    # with a stop id the greedy path does produce, generation ends right after it
    stop = refs[0][0][3]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10,
                                                   stop_token_ids=(stop,)))
    refs = [reference(p, 10, {stop}) for p in prompts]
    assert [(c.token_ids, c.finish_reason) for c in outs] == refs
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) <= 4


def test_a_bfloat16_learners_float32_stream_runs_under_autocast(model) -> None:
    """A model as a bfloat16 learner under autocast keeps it (bfloat16 projections and
    table, float32 norm gains, float32 embedding output) cannot run its products without
    autocast; the engine runs it as the learner does: greedy tokens equal an argmax loop of
    the full forward pass under bfloat16 autocast."""
    from rollwise.learner.stochastic import bfloat16_master

    bfloat16_master(model, keep_stream=True)
    prompts = [[1, 5, 9, 14], [1, 30, 31]]
    with pytest.raises(RuntimeError):  # the mixed dtypes, without autocast
        with torch.no_grad():
            model(input_ids=torch.tensor([prompts[0]]))

    def reference(prompt):
        seq = list(prompt)
        for _ in range(6):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        return seq[len(prompt):]

    outs = _engine(model).generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                           ignore_eos=True))
    assert [c.token_ids for c in outs] == [reference(p) for p in prompts]


# -- completions: order, finish reasons, seeds ---------------------------------------------------


def test_n_completions_per_prompt_in_order(model) -> None:
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]  # longest first: sorted inside, restored
    outs = _engine(model, batch_size=4).generate(
        prompts, SamplingParams(n=3, max_tokens=4, seed=1, temperature=1.0))
    assert all(isinstance(c, Completion) for c in outs)
    assert [c.prompt_index for c in outs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # each completion continues its own prompt: its log-probs are that prompt's
    for c in outs:
        logits = _forward_logits(model, prompts[c.prompt_index], c.token_ids)
        ref = torch.log_softmax(logits.double(), -1)
        for step, tok in enumerate(c.token_ids):
            assert abs(c.logprobs[step] - float(ref[step, tok])) < 1e-4


def test_finish_reason_stop_iff_last_token_is_a_stop_id(model) -> None:
    stops = tuple(range(4, 88, 3))  # a third of the vocabulary: some completions stop early
    params = SamplingParams(n=6, max_tokens=5, seed=2, stop_token_ids=stops)
    outs = _engine(model).generate(PROMPTS, params)
    reasons = {c.finish_reason for c in outs}
    assert reasons == {"stop", "length"}
    for c in outs:
        assert 1 <= len(c.token_ids) <= 5 and len(c.logprobs) == len(c.token_ids)
        assert not any(t in stops for t in c.token_ids[:-1])  # ends at the first stop id
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in stops
        else:
            assert c.finish_reason == "length"
            assert len(c.token_ids) == 5 and c.token_ids[-1] not in stops


def test_ignore_eos_gives_exactly_max_tokens(model) -> None:
    stops = tuple(range(4, 88, 3))
    params = SamplingParams(n=4, max_tokens=6, seed=2, stop_token_ids=stops, ignore_eos=True)
    outs = _engine(model).generate(PROMPTS, params)
    assert all(len(c.token_ids) == 6 and len(c.logprobs) == 6 for c in outs)
    assert all(c.finish_reason == "length" for c in outs)
    assert any(t in stops for c in outs for t in c.token_ids)  # stop ids were sampled, ignored


def test_same_seed_same_output_different_seed_different(model) -> None:
    engine = _engine(model)

    def run(seed):
        outs = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=8, seed=seed))
        return [c.token_ids for c in outs], [c.logprobs for c in outs]

    a, b, c = run(11), run(11), run(12)
    assert a == b
    assert a[0] != c[0]  # 12 completions of 8 tokens: equal by chance ~never


def test_hf_engine_satisfies_the_engine_protocol(model) -> None:
    engine = _engine(model)
    assert isinstance(engine, Engine)
    engine.publish(7)
    assert engine.version == 7
    assert engine.generate([], SamplingParams()) == []


# -- warp_logits -----------------------------------------------------------------------------


def test_warp_logits_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = probs.log() + 3.0  # any shift: same distribution
    cases = {0.45: {1: 1.0}, 0.7: {1: 0.5 / 0.8, 3: 0.3 / 0.8},
             0.85: {1: 0.5 / 0.95, 3: 0.3 / 0.95, 2: 0.15 / 0.95},
             0.99: {0: 0.05, 1: 0.5, 2: 0.15, 3: 0.3}}
    for top_p, kept in cases.items():
        got = warp_logits(logits, 1.0, 0, top_p)[0].exp()
        want = torch.tensor([kept.get(v, 0.0) for v in range(4)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"top_p={top_p}")


def test_warp_logits_temperature_top_k_and_order_of_truncations() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    # temperature 2: p^(1/2), renormalised
    want = probs.sqrt() / probs.sqrt().sum()
    torch.testing.assert_close(warp_logits(logits, 2.0, 0, 1.0).exp(), want)
    # top_k = 2: {0.5, 0.3} renormalised
    torch.testing.assert_close(warp_logits(logits, 1.0, 2, 1.0).exp(),
                               torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    # top-k first, then top-p on the renormalised top-k distribution: 0.625 >= 0.6
    torch.testing.assert_close(warp_logits(logits, 1.0, 2, 0.6).exp(),
                               torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    # temperature 0 (greedy) leaves logits unscaled; top_k >= V is a no-op
    torch.testing.assert_close(warp_logits(logits, 0.0, 10, 1.0).exp(), probs)


def test_warp_logits_matches_reference_on_random_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=gen) * 2
    for temperature, top_k, top_p in [(0.7, 0, 0.8), (1.3, 7, 1.0), (1.0, 12, 0.5)]:
        got = warp_logits(logits, temperature, top_k, top_p)
        for row in range(5):
            ref = torch.tensor(_reference_logprobs(logits[row], temperature, top_k, top_p),
                               dtype=torch.float64)
            finite = ref > -math.inf
            assert torch.equal(got[row] > -math.inf, finite)
            torch.testing.assert_close(got[row][finite].double(), ref[finite], rtol=0,
                                       atol=1e-5)


# -- sampling statistics -------------------------------------------------------------------------


def _chi_square(counts: list[int], probs: list[float]) -> tuple[float, float]:
    """(statistic, p-value) of Pearson's goodness-of-fit test; p from the regularised upper
    incomplete gamma function, Q(df / 2, x / 2)."""
    n = sum(counts)
    assert all(n * p >= 5 for p in probs), "expected counts too small for the chi-square test"
    stat = sum((o - n * p) ** 2 / (n * p) for o, p in zip(counts, probs))
    df = len(counts) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, p_value


def test_chi_square_helper_matches_the_tabulated_critical_value() -> None:
    df7 = torch.special.gammaincc(torch.tensor(3.5, dtype=torch.float64),
                                  torch.tensor(CHI2_CRITICAL_DF7_P1E3 / 2, dtype=torch.float64))
    assert float(df7) == pytest.approx(1e-3, rel=1e-3)


def _first_tokens(model, n: int, **sampling) -> tuple[list[int], torch.Tensor]:
    """`n` first tokens sampled after PROMPTS[0], and the model's next-token log-probs."""
    engine = _engine(model, batch_size=n)
    outs = engine.generate([PROMPTS[0]], SamplingParams(n=n, max_tokens=1, seed=0, **sampling))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1].double()
    return [c.token_ids[0] for c in outs], logits


def test_sampling_follows_renormalised_top_k_distribution(model) -> None:
    tokens, logits = _first_tokens(model, 2000, temperature=1.0, top_k=8)
    top = torch.topk(logits, 8).indices.tolist()
    probs = torch.softmax(logits[top], -1).tolist()
    assert set(tokens) <= set(top)
    counts = [tokens.count(t) for t in top]
    stat, p_value = _chi_square(counts, probs)
    assert stat < CHI2_CRITICAL_DF7_P1E3, (stat, counts, [round(2000 * p) for p in probs])
    assert p_value > 1e-3


def test_sampling_follows_full_distribution_without_truncation(model) -> None:
    tokens, logits = _first_tokens(model, 2000, temperature=1.0)
    probs = torch.softmax(logits, -1)
    ranked = torch.argsort(logits, descending=True).tolist()  # 88 tokens, by probability
    bins = [(0, 1), (1, 4), (4, 10), (10, 20), (20, 35), (35, 50), (50, 65), (65, len(ranked))]
    bin_of = {tok: b for b, (lo, hi) in enumerate(bins) for tok in ranked[lo:hi]}
    counts = [0] * len(bins)
    for t in tokens:
        counts[bin_of[t]] += 1
    mass = [float(probs[ranked[lo:hi]].sum()) for lo, hi in bins]
    stat, p_value = _chi_square(counts, mass)
    assert stat < CHI2_CRITICAL_DF7_P1E3, (stat, counts, [round(2000 * p) for p in mass])
    assert p_value > 1e-3
