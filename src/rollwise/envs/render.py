"""Observations into tokens: the one place the text of an episode's turns meets the
tokenizer, so that a trajectory's tokens are exactly those the engine saw.

The history is never re-tokenized. After a policy turn (its sampled ids, kept as they
are), the environment's observation is appended as separately tokenized ids:

    chat models   what the chat template itself writes between an assistant message and
                  the next generation prompt: the rest of the assistant's end-of-turn (e.g.
                  ChatML's "\\n" after the sampled <|im_end|>, or the whole end-of-turn when
                  the turn hit max_tokens), the observation as a message (role "tool" when
                  the template knows tools, else "user"), then the generation prompt
    plain models  "\\n" + observation + "\\n" (the built-in tiny model has no template)
"""

from __future__ import annotations

from typing import Any

_A, _O = "\x00RWA\x00", "\x00RWO\x00"  # marker contents, found again in the rendered text


class TurnRenderer:
    def __init__(self, tokenizer: Any, chat: bool, stop_ids: list[int]):
        self.tokenizer, self.chat, self.stop_ids = tokenizer, chat, set(stop_ids)
        if chat:
            template = getattr(tokenizer, "chat_template", None) or ""
            self.role = "tool" if "tool" in template else "user"
            base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _A}]
            t1 = tokenizer.apply_chat_template(base, tokenize=False)
            t2 = tokenizer.apply_chat_template(
                base + [{"role": self.role, "content": _O}], tokenize=False,
                add_generation_prompt=True)
            if not t2.startswith(t1) or _O not in t2[len(t1):]:
                raise ValueError("this chat template does not render a conversation as a "
                                 "prefix of its continuation; multi-turn rollouts need one")
            self.end_of_turn = t1[t1.rindex(_A) + len(_A):]
            self.obs_prefix, self.obs_suffix = t2[len(t1):].split(_O, 1)

    def observation_ids(self, observation: str, turn: list[int]) -> list[int]:
        """Token ids inserted after the policy's `turn` (its sampled ids) to show
        `observation` and open the next policy turn."""
        if not self.chat:
            text = f"\n{observation}\n"
        else:
            closer = self.end_of_turn
            if turn and turn[-1] in self.stop_ids:  # the sampled stop token closed part of it
                stop = self.tokenizer.decode([turn[-1]])
                closer = closer.removeprefix(stop)
            text = closer + self.obs_prefix + observation + self.obs_suffix
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
