"""Request bodies of every route: the OpenAI-compatible ones, /v1/rollouts, the token routes
(/v1/generate, /v1/abort, /tokenize, /detokenize) and the weight updates.

Every field a body may carry is declared. Fields OpenAI clients send that change nothing
here (`user`, `metadata`, `store`...) are read and ignored; any other field, and any declared
field set to a value the server cannot honour (penalties, `logit_bias`, `min_tokens`,
constrained decoding, more than `TOP_LOGPROBS_MAX` top log-probs), is refused by `refusal()`
with a 400 naming it rather than silently dropped. A field sent as null counts as not sent.

Imports pydantic only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

# the most candidates per token any route returns: OpenAI's chat limit (and vLLM's default
# max_logprobs); the legacy completions route takes the same, above OpenAI's 5
TOP_LOGPROBS_MAX = 20
# read and ignored: they label or route a call, they do not change its tokens
IGNORED = frozenset({"user", "metadata", "store", "parallel_tool_calls", "service_tier"})

Refusal = tuple[str, str]  # (the field, why it is refused)


def top_refusal(name: str, k: int | None) -> Refusal | None:
    """`name` asks for more top log-probs per token than any route returns."""
    if k is not None and k > TOP_LOGPROBS_MAX:
        return name, (f"{name}={k} is over the limit of {TOP_LOGPROBS_MAX} top log-probs "
                      "per token")
    return None


def unknown_field(body: BaseModel) -> Refusal | None:
    """The first field sent that the body does not declare (null and ignored ones aside)."""
    for name, value in (body.model_extra or {}).items():
        if value is not None and name not in IGNORED:
            return name, (f"{name} is not supported by this server (the request would be "
                          "answered without it)")
    return None


class SamplingBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    n: StrictInt = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: 1.0
    top_p: float | None = Field(None, gt=0, le=1)  # None: 1.0
    top_k: StrictInt = Field(0, ge=0)  # vLLM's extra field; 0: off
    max_tokens: StrictInt | None = Field(None, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None  # vLLM's: ids that end a choice besides EOS
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: StrictBool = False  # vLLM's extra field: generate exactly max_tokens
    episode_id: StrictStr | None = None  # record this call under an episode (training)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: StrictInt = 0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def refusal(self) -> Refusal | None:
        """The first field this request sets that the server cannot honour, and why."""
        kind = (self.response_format or {}).get("type", "text")
        checks = [
            ("presence_penalty", self.presence_penalty != 0, "is not supported"),
            ("frequency_penalty", self.frequency_penalty != 0, "is not supported"),
            ("repetition_penalty", self.repetition_penalty != 1,
             "is not supported (1.0, off, is accepted)"),
            ("min_p", self.min_p != 0, "is not supported (0, off, is accepted)"),
            ("min_tokens", self.min_tokens != 0,
             ("is not supported: the engine's sampling cannot hold back its stop tokens "
              "(0 is accepted)")),
            ("logit_bias", bool(self.logit_bias), "is not supported"),
            ("response_format", kind != "text",
             (f"type {kind!r} is not supported: the engine has no constrained decoding "
              "(type 'text' is accepted)")),
        ]
        for name, refused, why in checks:
            if refused:
                return name, f"{name} {why}"
        return unknown_field(self)


class ChatBody(SamplingBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    @property
    def top_k_logprobs(self) -> int:
        """Candidates asked per sampled token (0: none)."""
        return (self.top_logprobs or 0) if self.logprobs else 0

    def refusal(self) -> Refusal | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if (refused := top_refusal("top_logprobs", self.top_logprobs)) is not None:
            return refused
        if self.tool_choice not in (None, "auto", "none"):
            return "tool_choice", "tool_choice supports 'auto' and 'none' only"
        return super().refusal()


class CompletionBody(SamplingBody):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    @property
    def top_k_logprobs(self) -> int:
        """Candidates asked per sampled token (0: none)."""
        return self.logprobs or 0

    def refusal(self) -> Refusal | None:
        if (refused := top_refusal("logprobs", self.logprobs)) is not None:
            return refused
        for name, refused in (("echo", self.echo), ("suffix", bool(self.suffix)),
                              ("best_of", self.best_of not in (None, self.n))):
            if refused:
                return name, f"{name} is not supported"
        return super().refusal()


class EpisodeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: StrictStr | None = None  # the caller's label, echoed in the results
    prompt: StrictStr | list[StrictInt] | None = None  # text or token ids
    messages: list[dict[str, Any]] | None = None  # chat messages (chat template applied)
    tools: list[dict[str, Any]] | None = None


class RolloutBody(SamplingBody):
    model: StrictStr | None = None  # optional here: the served model
    episodes: list[EpisodeIn] = Field(min_length=1)


# -- token routes ---------------------------------------------------------------------------

class Partial(BaseModel):
    """A sample to continue: its tokens so far with their log-probs and policy versions (and
    their top log-probs when the call asks for them: the engine continues those lists)."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[StrictInt]
    logprobs: list[float]
    versions: list[StrictInt] = Field(default_factory=list)
    top_logprobs: list[list[tuple[StrictInt, float]]] | None = None


class GenerateBody(BaseModel):
    """/v1/generate: token ids in, token ids, log-probs and versions out."""

    model_config = ConfigDict(extra="allow")

    prompt_token_ids: list[StrictInt] = Field(min_length=1)
    model: StrictStr | None = None
    n: StrictInt = Field(1, ge=1)
    seeds: list[StrictInt] | None = None  # sample k: the engine's per-request seed seeds[k]
    seed: StrictInt | None = None  # or one base seed, derived per sample as engine.generate
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=0)
    max_tokens: StrictInt | None = Field(None, ge=1)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    priority: float = 0.0
    request_id: StrictStr | None = None
    resume: list[Partial] | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0)  # per token, the k likeliest [id, lp]

    def refusal(self) -> Refusal | None:
        if (refused := top_refusal("top_logprobs", self.top_logprobs)) is not None:
            return refused
        if self.seeds is not None and len(self.seeds) != self.n:
            return "seeds", f"seeds has {len(self.seeds)} entries; n={self.n} needs one each"
        if self.resume is not None and len(self.resume) != self.n:
            return "resume", f"resume has {len(self.resume)} entries; n={self.n} needs one each"
        for k, part in enumerate(self.resume or []):
            if len(part.logprobs) != len(part.token_ids) or (
                    part.versions and len(part.versions) != len(part.token_ids)):
                return "resume", (f"resume[{k}]: token_ids, logprobs and versions (when given) "
                                  "must have the same length")
            if self.top_logprobs and part.token_ids and len(part.top_logprobs or []) != len(
                    part.token_ids):
                return "resume", (f"resume[{k}]: top_logprobs asked, so each resumed token "
                                  "needs its top_logprobs entry (the sample's own, as returned)")
        return unknown_field(self)


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: StrictStr


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    text: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool = True  # text only: the BOS the model expects


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: list[StrictInt]


class WeightsBody(BaseModel):
    """/v1/weights/update: a folder of safetensors to load as policy `version`."""

    model_config = ConfigDict(extra="forbid")

    path: StrictStr
    version: StrictInt = Field(ge=0)
    mode: Literal["pause", "abort"] = "pause"
    timeout_s: float = Field(30.0, gt=0, le=3600)
