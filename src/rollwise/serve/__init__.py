"""`rollwise serve`: an OpenAI-compatible HTTP server over the native engine, and the
rollout service (/v1/rollouts, recorded episodes) that training uses. See docs/serve.md.

May import: types, system, models, engine, envs, run.
"""

from __future__ import annotations

from rollwise.serve.model import Served, load_served
from rollwise.serve.records import as_trajectory
from rollwise.serve.routes_openai import EPISODE_HEADER
from rollwise.serve.server import Limits, RolloutServer


def make_server(model: str, *, step: int | None = None, dtype: str = "float32",
                api_key: str | None = None, limits: Limits | None = None,
                max_num_seqs: int | None = None, kv_budget_tokens: int | None = None,
                device: str = "cpu", served_model_name: str | None = None,
                tiny_context: int | None = None) -> RolloutServer:
    """Load `model` (a name, a Hugging Face folder or a run directory) on `device` and put
    a native engine and the HTTP app over it, serving it as `served_model_name` (default:
    the model's own name, which stays accepted). `max_num_seqs`, `kv_budget_tokens`: None
    leaves the engine's own default (the config's engine.batch_size and kv_budget_tokens)."""
    from rollwise.engine import NativeEngine

    served = load_served(model, step=step, device=device, tiny_context=tiny_context)
    policy = served.policy
    sizes = {k: v for k, v in {"max_num_seqs": max_num_seqs,
                               "kv_budget_tokens": kv_budget_tokens}.items() if v is not None}
    engine = NativeEngine(policy.model, eos_token_ids=policy.stop_ids, dtype=dtype,
                          version=served.version, **sizes)
    return RolloutServer(policy, engine, name=served_model_name or served.name, api_key=api_key,
                         limits=limits, source=served.source,
                         aliases=(served.name, *served.aliases))


__all__ = ["EPISODE_HEADER", "Limits", "RolloutServer", "Served", "as_trajectory", "load_served",
           "make_server"]
