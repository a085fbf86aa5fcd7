"""KL estimators per token, fn(logprobs [N,T], ref_logprobs [N,T]) -> [N,T], estimating
KL(pi_theta || pi_ref) from samples of pi_theta (Schulman, "Approximating KL divergence").

k1 = log(pi/pi_ref);  k2 = (log(pi/pi_ref))^2 / 2;  k3 = pi_ref/pi - log(pi_ref/pi) - 1.
"""

from __future__ import annotations

import torch

from rollwise.algos.registry import kl_estimators, register


@register(kl_estimators, "k1")
def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


@register(kl_estimators, "k2")
def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


@register(kl_estimators, "k3")
def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    log_r = ref_logprobs - logprobs
    return torch.exp(log_r) - log_r - 1
