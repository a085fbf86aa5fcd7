"""Draft sources for speculative verification: sibling responses of the same group (Seer's
grouped speculative decoding) through an n-gram index, verified by the engine."""

from __future__ import annotations

from collections import Counter, defaultdict


class GroupNgramIndex:
    """Next-token counts after every context of 1..`max_context` tokens, over the responses
    of one group's finished siblings (and the prompt tail they continue).

    `draft(tokens, k)` follows the most frequent continuation of the longest context that
    matches the end of `tokens`, for up to `k` tokens (Seer drafts from a suffix tree of
    sibling responses; an n-gram table is the same lookup at this scale)."""

    def __init__(self, max_context: int = 4, min_context: int = 1, min_share: float = 0.0):
        self.max_context, self.min_context = max_context, min_context
        self.min_share = min_share  # stop drafting where siblings disagree more than this
        self.table: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        self.references = 0

    def add(self, tokens: list[int], start: int = 1) -> None:
        """Index the next-token events of `tokens` from position `start` on."""
        self.references += start <= 1
        for i in range(max(1, start), len(tokens)):
            for m in range(self.min_context, self.max_context + 1):
                if i - m < 0:
                    break
                self.table[tuple(tokens[i - m: i])][tokens[i]] += 1

    def next_token(self, context: list[int]) -> int | None:
        for m in range(min(self.max_context, len(context)), self.min_context - 1, -1):
            counts = self.table.get(tuple(context[-m:]))
            if counts:
                token, count = counts.most_common(1)[0]
                return token if count >= self.min_share * counts.total() else None
        return None

    def draft(self, context: list[int], k: int) -> list[int]:
        out: list[int] = []
        ctx = list(context[-self.max_context:])
        for _ in range(k):
            t = self.next_token(ctx)
            if t is None:
                break
            out.append(t)
            ctx = (ctx + [t])[-self.max_context:]
        return out
