"""Record or check the native engine's exact outputs on SmolLM2-135M (a refactoring guard).

    python scripts/engine_identity.py record /tmp/engine_ref.json   # on the old code
    python scripts/engine_identity.py check /tmp/engine_ref.json    # on the new code
    python scripts/engine_identity.py record /tmp/engine_int8.json int8   # engine.dtype

The optional third argument is the engine's dtype (float32, the default; bfloat16; int8).

Runs greedy and seeded sampled `generate` (4 prompts x n=4, 48 tokens, seed 7), then the
same sampled requests through submit/step with divided rollout (`chunk_tokens`), a tight
KV budget (preemption, park and restore), a drafter (exact verification), reused drafts
with SPEC-RL lenience, a static batch, and aborts with resumes across a publication.
`check` exits 1 unless every token id and log-prob, every finish reason and the
deterministic counters equal the recorded ones bit for bit.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace

import torch

from rollwise.engine import NativeEngine, SamplingParams
from rollwise.engine.sampling import derive_seed
from rollwise.models import load_policy

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Three reasons to learn a second language:", "Once upon a time, in a small village,"]
COUNTERS = ("forward_passes", "prefill_tokens", "recompute_tokens", "generated_tokens",
            "decode_tokens", "row_forwards", "steps", "preemptions", "parks", "peak_kv_tokens",
            "spec_verifies", "spec_drafted", "spec_accepted")


def _out(completions, engine) -> dict:
    return {"completions": [
        {"ids": c.token_ids, "logprobs": [float(x).hex() for x in c.logprobs],
         "reason": c.finish_reason, "versions": c.versions} for c in completions],
        "stats": {k: getattr(engine.stats, k) for k in COUNTERS}}


DTYPE: str | None = None  # the engines' dtype (None: the model's)


def _stepped(model, prompts, params, eos, *, budget, chunk, drafter=None, reuse=None):
    engine = NativeEngine(model, kv_budget_tokens=budget, max_num_seqs=16, eos_token_ids=eos,
                          drafter=drafter, spec_tokens=4, spec_max_batch=6, dtype=DTYPE)
    one = replace(params, n=1)
    ids = []
    for i, p in enumerate(prompts):
        for k in range(params.n):
            j = i * params.n + k
            kw = {}
            if reuse is not None:
                kw = {"draft": reuse[j].token_ids, "draft_logprobs": reuse[j].logprobs,
                      "lenience": 1.5}
            ids.append(engine.submit(p, one, seed=derive_seed(7, j), tag=i, chunk_tokens=chunk,
                                     priority=float(j % 3), **kw))
    done = {}
    while engine.has_unfinished():
        for c in engine.step():
            done[c.request_id] = c
    return _out([done[i] for i in ids], engine)


def _static_and_abort(model, prompts, params, eos) -> dict:
    """A static batch (finished rows compute on until the batch ends), then aborts, a
    priority change, a publication and resumes in a continuous batch."""
    engine = NativeEngine(model, kv_budget_tokens=4096, max_num_seqs=6, eos_token_ids=eos,
                          dtype=DTYPE)
    one = replace(params, n=1)
    ids = [engine.submit(p, one, seed=derive_seed(7, j), tag=j) for j, p in enumerate(prompts * 3)]
    done = {}
    while engine.has_unfinished():
        for c in engine.step(static_batch=True):
            done[c.request_id] = c
    out = [done[i] for i in ids]
    ids = [engine.submit(p, one, seed=derive_seed(8, j), tag=j) for j, p in enumerate(prompts * 2)]
    for _ in range(5):
        engine.step()
    engine.set_priority(ids[-1], 2.0)
    parts = {i: engine.abort(i) for i in ids[:3]}
    engine.publish(1)
    ids += [engine.submit(prompts[j], one, seed=derive_seed(8, j), tag=j, resume=parts[i])
            for j, i in enumerate(ids[:3])]
    done = {}
    while engine.has_unfinished():
        for c in engine.step():
            done[c.request_id] = c
    out += list(parts.values()) + [done[i] for i in ids[3:]]
    return _out(out, engine)


def run() -> dict:
    torch.manual_seed(0)
    policy = load_policy("smollm2-135m")
    prompts = [policy.encode(p) for p in PROMPTS]
    eos = policy.stop_ids or None
    greedy = SamplingParams(n=4, temperature=0.0, max_tokens=48, seed=7)
    sampled = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_tokens=48, seed=7)
    result = {}
    for name, params in (("greedy", greedy), ("sampled", sampled)):
        engine = NativeEngine(policy.model, eos_token_ids=eos, dtype=DTYPE)
        result[name] = _out(engine.generate(prompts, params), engine)
    width = max(map(len, prompts)) + 48 + 1
    result["parked"] = _stepped(policy.model, prompts, sampled, eos, budget=3 * width, chunk=8)

    def drafter(reqs, k):  # propose the last tokens again (often rejected, sometimes right)
        return [toks[-k:] for _, toks in reqs]

    result["drafted"] = _stepped(policy.model, prompts, sampled, eos, budget=3 * width,
                                 chunk=8, drafter=drafter)
    ref = NativeEngine(policy.model, eos_token_ids=eos, dtype=DTYPE)
    old = ref.generate(prompts, replace(sampled, temperature=0.9))
    result["reused"] = _stepped(policy.model, prompts, sampled, eos, budget=2 * width,
                                chunk=16, reuse=old)
    result["static_abort"] = _static_and_abort(policy.model, prompts, sampled, eos)
    result["params"] = {"greedy": asdict(greedy), "sampled": asdict(sampled)}
    return result


def main() -> int:
    global DTYPE
    mode, path = sys.argv[1], sys.argv[2]
    DTYPE = sys.argv[3] if len(sys.argv) > 3 else None
    got = run()
    if mode == "record":
        with open(path, "w") as f:
            json.dump(got, f)
        print(f"recorded {path}")
        return 0
    with open(path) as f:
        want = json.load(f)
    bad = [k for k in want if json.loads(json.dumps(got[k])) != want[k]]
    for k in want:
        stats = got[k].get("stats") if isinstance(got[k], dict) else None
        print(k, "identical" if k not in bad else "DIFFERENT", stats or "")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
