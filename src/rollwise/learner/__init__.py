"""The learner: response-token log-probs in chunks, micro-batches, AdamW, LoRA, checkpoints.

May import: types, system, algos, models, engine. The engine's grouped-prefix attention
is the learner's too (learner/grouped.py).
"""

from rollwise.learner.batch import collate, micro_batches
from rollwise.learner.learner import Learner
from rollwise.learner.logprobs import token_logprobs
from rollwise.learner.prepare import prepare_batch

__all__ = ["Learner", "collate", "micro_batches", "prepare_batch", "token_logprobs"]
