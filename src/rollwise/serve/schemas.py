"""Request bodies of the OpenAI-compatible endpoints and of /v1/rollouts.

Fields OpenAI clients send that change nothing here (`user`, `metadata`, `store`...) are
ignored; fields that would change the output in a way the server cannot honour
(penalties, `logit_bias`, `echo`, `suffix`, top log-probs) are refused with a 400 by
`unsupported()` rather than silently dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

TOP_LOGPROBS_LIMIT = ("top_logprobs is not available: the engine returns the log-prob of "
                      "each sampled token only (use logprobs for those)")


class SamplingBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    n: StrictInt = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: 1.0
    top_p: float | None = Field(None, gt=0, le=1)  # None: 1.0
    top_k: StrictInt = Field(0, ge=0)  # vLLM's extra field; 0: off
    max_tokens: StrictInt | None = Field(None, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: StrictBool = False  # vLLM's extra field: generate exactly max_tokens
    episode_id: StrictStr | None = None  # record this call under an episode (training)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def unsupported(self) -> str | None:
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None


class ChatBody(SamplingBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    def unsupported(self) -> str | None:
        if self.top_logprobs:
            return TOP_LOGPROBS_LIMIT
        if self.tool_choice not in (None, "auto", "none"):
            return "tool_choice supports 'auto' and 'none' only"
        return super().unsupported()


class CompletionBody(SamplingBody):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> str | None:
        if self.logprobs:
            return (f"logprobs={self.logprobs} asks for top log-probs, which are not available"
                    ": the engine returns the log-prob of each sampled token only (use "
                    "logprobs=0 for those)")
        if self.echo:
            return "echo is not supported"
        if self.suffix:
            return "suffix is not supported"
        if self.best_of not in (None, self.n):
            return "best_of is not supported"
        return super().unsupported()


class EpisodeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: StrictStr | None = None  # the caller's label, echoed in the results
    prompt: StrictStr | list[StrictInt] | None = None  # text or token ids
    messages: list[dict[str, Any]] | None = None  # chat messages (chat template applied)
    tools: list[dict[str, Any]] | None = None


class RolloutBody(SamplingBody):
    model: StrictStr | None = None  # optional here: the served model
    episodes: list[EpisodeIn] = Field(min_length=1)
