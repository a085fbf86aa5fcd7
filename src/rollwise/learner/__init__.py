"""The learner: response-token log-probs in chunks, micro-batches, AdamW, LoRA, checkpoints."""

from rollwise.learner.batch import collate, micro_batches
from rollwise.learner.learner import Learner
from rollwise.learner.logprobs import token_logprobs

__all__ = ["Learner", "collate", "micro_batches", "token_logprobs"]
