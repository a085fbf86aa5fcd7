r"""LLM-as-judge: a reward term scored by any OpenAI-compatible chat endpoint.

``task.rewards = { judge = 1.0 }`` with a ``[judge]`` section (built from `Judge`'s
fields): ``base_url``, ``model``, ``api_key_env`` (the *name*
of the environment variable holding the
key; the key itself never goes in a config), ``prompt`` (a template with ``{question}``,
``{reference}`` and ``{response}``), ``score_regex`` (its first group is the grade),
``max_score`` (grades are divided by it and clipped to [0, 1]), ``timeout_s``, ``retries``,
``max_concurrent`` and ``cache``.

Calls go through the `openai` client (``chat.completions.create``, temperature 0). A grade
that cannot be parsed scores 0 with the reply noted; a judge that does not answer after its
retries raises `InfraError` (counted apart and masked, docs/rewards.md). Results are cached
by (prompt, response) in the judging process (each reward worker holds its own cache; the
build's preflight call is made before they fork). `preflight` calls the judge once at
start-up: an unreachable judge fails there, with its URL, not in the middle of a run.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rollwise.rewards.pool import InfraError, Scored
from rollwise.types import Sample

DEFAULT_PROMPT = (
    "You are grading an answer.\nQuestion:\n{question}\n\nReference answer:\n{reference}\n\n"
    "Response to grade:\n{response}\n\nReply with 'GRADE: <n>' where n is 0 (wrong) to 10 "
    "(fully correct)."
)


def question_of(sample: Sample) -> str:
    """The prompt as text (the last user message of a chat prompt)."""
    if isinstance(sample.prompt, str):
        return sample.prompt
    users = [m["content"] for m in sample.prompt if m.get("role") == "user"]
    return users[-1] if users else "\n".join(m["content"] for m in sample.prompt)


@dataclass
class Judge:
    """A callable verifier `(completion, sample) -> score in [0, 1]` backed by an endpoint.
    The fields with help text are its settings, declared here once: the config's [judge]
    section is built from them (compose/schema.py `section_of`)."""

    base_url: str = field(default="", metadata={
        "help": "Endpoint, e.g. 'http://127.0.0.1:8000/v1'."})
    model: str = field(default="", metadata={"help": "Model name the endpoint serves."})
    api_key_env: str = field(default="OPENAI_API_KEY", metadata={
        "help": "Name of the environment variable holding the API key (never the key itself)."})
    prompt: str | None = field(default=None, metadata={
        "help": "Template with {question}, {reference}, {response} (default: a 0-10 grading "
        "prompt)."})
    score_regex: str = field(default=r"GRADE:\s*([0-9]+(?:\.[0-9]+)?)", metadata={
        "help": "Regex whose first group is the grade."})
    max_score: float = field(default=10.0, metadata={
        "gt": 0, "help": "Grades are divided by this, clipped to [0, 1]."})
    timeout_s: float = field(default=30.0, metadata={
        "gt": 0, "help": "Time limit of one request."})
    retries: int = field(default=2, metadata={"ge": 0, "help": "Retries of a failed request."})
    max_concurrent: int = field(default=4, metadata={
        "ge": 1, "help": "Requests at once per reward worker."})
    cache: bool = field(default=True, metadata={
        "help": "Cache grades by (prompt, response)."})
    cache_size: int = 100_000
    calls: int = 0  # requests sent by this process (cache hits excluded)
    _cache: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _pattern: Any = field(default=None, repr=False)
    _client: Any = field(default=None, repr=False)
    _slots: Any = field(default=None, repr=False)
    _pid: int = field(default=0, repr=False)

    def __post_init__(self):
        self.prompt = self.prompt or DEFAULT_PROMPT
        for key in ("{question}", "{response}"):
            if key not in self.prompt:
                raise ValueError(f"judge.prompt must contain {key}")
        try:
            self._pattern = re.compile(self.score_regex)
        except re.error as err:
            raise ValueError(f"judge.score_regex {self.score_regex!r}: {err}") from None
        if self._pattern.groups < 1:
            raise ValueError(f"judge.score_regex {self.score_regex!r}: needs a group, e.g. "
                             r"'GRADE:\s*(\d+)'")
        if self.max_score <= 0 or self.retries < 0 or self.max_concurrent < 1:
            raise ValueError("judge: max_score > 0, retries >= 0, max_concurrent >= 1")

    def _api(self):
        """The client, made per process (a forked worker must not share the parent's
        connections); a semaphore bounds this process's concurrent requests."""
        if self._client is None or self._pid != os.getpid():
            from openai import OpenAI

            key = os.environ.get(self.api_key_env) or "not-needed"  # local servers ignore it
            self._client = OpenAI(base_url=self.base_url, api_key=key, timeout=self.timeout_s,
                                  max_retries=self.retries)
            self._slots = threading.BoundedSemaphore(self.max_concurrent)
            self._pid = os.getpid()
        return self._client

    def render(self, completion: str, sample: Sample) -> str:
        return (self.prompt.replace("{question}", question_of(sample))
                .replace("{reference}", sample.reference or sample.answer or "")
                .replace("{response}", completion))

    def ask(self, text: str, client: Any = None) -> str:
        """The judge's reply to `text`; InfraError (with the URL) when it does not answer."""
        client = client or self._api()
        try:
            with self._slots:
                reply = client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": text}],
                    temperature=0.0, max_tokens=64)
        except Exception as err:  # noqa: BLE001 - openai's connection and status errors
            raise InfraError(f"judge at {self.base_url} did not answer after "
                             f"{self.retries + 1} tries: {type(err).__name__}: {err}") from None
        self.calls += 1
        return reply.choices[0].message.content or ""

    def parse(self, reply: str) -> float | None:
        """The grade in [0, 1], or None when the reply holds none.

        >>> j = Judge("http://127.0.0.1:1/v1", "m")
        >>> j.parse("GRADE: 7"), j.parse("grade twelve"), j.parse("GRADE: 40")
        (0.7, None, 1.0)
        """
        found = self._pattern.search(reply)
        if not found:
            return None
        try:
            value = float(found.group(1))
        except ValueError:
            return None
        return min(max(value / self.max_score, 0.0), 1.0)

    def __call__(self, completion: str, sample: Sample) -> float:
        text = self.render(completion, sample)
        key = hashlib.sha256(f"{text}\x00{completion}".encode()).hexdigest()
        if self.cache and key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        reply = self.ask(text)
        grade = self.parse(reply)
        score = Scored(0.0, f"judge reply without a grade: {reply[:120]!r}") if grade is None \
            else Scored(grade)
        if self.cache:
            self._cache[key] = score
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return score

    def preflight(self) -> None:
        """One request now; ValueError naming the URL when the judge is unreachable or its
        reply does not match `score_regex`."""
        probe = Sample("judge/preflight", "What is 1 + 1?", "2", reference="2")
        try:
            quick = self._api().with_options(max_retries=0, timeout=min(self.timeout_s, 10.0))
            reply = self.ask(self.render("2", probe), quick)
        except InfraError as err:
            raise ValueError(f"judge: cannot reach {self.base_url} (model {self.model!r}): "
                             f"{err}") from None
        if self.parse(reply) is None:
            raise ValueError(f"judge at {self.base_url}: its reply {reply[:200]!r} does not "
                             f"match judge.score_regex {self.score_regex!r}")


def make_judge(options: dict[str, Any], check: bool = True) -> Judge:
    """A Judge from the [judge] section's values; `check` runs the preflight call."""
    if not options.get("base_url") or not options.get("model"):
        raise ValueError("task.rewards.judge needs [judge] base_url and model, e.g. "
                         "base_url = \"http://127.0.0.1:8000/v1\", model = \"my-judge\"")
    judge = Judge(**options)
    if check:
        judge.preflight()
    return judge
