"""bfloat16 master weights: stochastic rounding, and the AdamW that updates with it.

With `learner.master_dtype = "bfloat16"` the policy's parameters (and so their gradients)
are bfloat16: half the memory of float32 for each, and the rollout engine can read them in
place. bfloat16 keeps 8 significant bits, so a weight w changes only when an update exceeds
about |w| * 2^-9; the quickstart's AdamW updates (lr 2e-5 against weights of 0.01-0.1) are
mostly below that and would vanish under round-to-nearest. Stochastic rounding keeps them
in expectation: a float32 value x lying between the bfloat16 neighbours lo < x < hi becomes
hi with probability (x - lo) / (hi - lo), else lo. On the bit pattern that is: add 16
uniform random bits below bfloat16's last kept bit, then truncate the low 16 bits (a carry
into the kept bits happens with exactly that probability).

`StochasticAdamW` is AdamW (decoupled weight decay, bias corrections, as torch's) computing
each update in float32 and writing every bfloat16 tensor it keeps (the parameter, and the
moments when `moment_dtype` is bfloat16) with stochastic rounding. It walks each parameter in
chunks of CHUNK values, so its float32 temporaries stay a few MiB whatever the parameter's
size (the 135M model's tied embedding has 28M values). The random bits come from the
optimizer's own generator, whose state is part of its state dict: a resumed run rounds
exactly as an uninterrupted one. One draw of 16 bits a value serves the parameter and both
moments of that value (each is still rounded without bias; their roundings are correlated,
which no expectation depends on): the draw is the step's dominant cost.

Imports: torch.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 18  # values per pass: 1 MiB of float32 per temporary, cache-sized
_LOW16 = (1 << 16) - 1
_HIGH16 = -(1 << 16)  # int32 mask keeping the sign, exponent and 7 mantissa bits


def random_bits(shape, generator: torch.Generator | None = None,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 values uniform in [0, 2^16): the bits `stochastic_round` adds."""
    bits = torch.empty(shape, dtype=torch.int32, device=device)
    return bits.random_(0, 1 << 16, generator=generator)


def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None,
                     out: torch.Tensor | None = None,
                     noise: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `x` to bfloat16, rounded up or down at random with the probabilities that
    keep the expectation (module docstring); written into `out` when given; `noise`: the
    `random_bits` to use (else drawn from `generator`; not modified). A value can
    round up into the next binade, as it should. Non-finite values are not guarded (a NaN
    may come out as an infinity): the learner never steps on a non-finite gradient, and a
    check would cost as much as the rounding."""
    if noise is None:
        bits = random_bits(x.shape, generator, x.device)
        bits.add_(x.contiguous().view(torch.int32))
    else:
        bits = noise.add(x.contiguous().view(torch.int32))
    bits.bitwise_and_(_HIGH16)
    rounded = bits.view(torch.float32)
    if out is None:
        return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero
    return out.copy_(rounded)


class StochasticAdamW(torch.optim.Optimizer):
    """AdamW whose bfloat16 parameters and moments are written with stochastic rounding.

    `moment_dtype`: torch.float32 (8 bytes a parameter) or torch.bfloat16 (4 bytes; the
    second moment's 1 - beta2 = 0.001 steps would vanish under round-to-nearest too).
    float32 parameters are updated as by torch's AdamW (up to float32 rounding order).
    """

    def __init__(self, params, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0,
                 moment_dtype: torch.dtype = torch.float32, seed: int = 0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.moment_dtype = moment_dtype
        # parameters some of whose tensors (the parameter or its moments) are bfloat16
        self.rounds = {p: torch.bfloat16 in (p.dtype, moment_dtype)
                       for group in self.param_groups for p in group["params"]}
        device = self.param_groups[0]["params"][0].device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            # a host counter, as torch's own AdamW keeps it (read with int() each step)
            state["step"] = torch.zeros((), dtype=torch.float32, device="cpu")
            state["exp_avg"] = torch.zeros_like(p, dtype=self.moment_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moment_dtype)
        state["step"] += 1
        step = int(state["step"])
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        decay = 1 - lr * group["weight_decay"]
        step_size = lr / (1 - beta1**step)
        root_bc2 = (1 - beta2**step) ** 0.5
        flat_p, flat_g = p.view(-1), p.grad.view(-1)
        flat_m, flat_v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        for s in range(0, flat_p.numel(), CHUNK):
            part = slice(s, s + CHUNK)
            g = flat_g[part].float()
            m, v = self._load(flat_m[part]), self._load(flat_v[part])
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = v.sqrt().div_(root_bc2).add_(eps)
            w = self._load(flat_p[part])
            if decay != 1:
                w.mul_(decay)
            w.addcdiv_(m, denom, value=-step_size)
            # one draw of random bits serves the chunk's three tensors: each is rounded
            # without bias; drawing three would triple the step's dominant cost
            noise = random_bits(g.shape, self.generator, g.device) if self.rounds[p] else None
            for target, value in ((flat_m[part], m), (flat_v[part], v), (flat_p[part], w)):
                self._store(target, value, noise)

    @staticmethod
    def _load(t: torch.Tensor) -> torch.Tensor:
        """A float32 view (float32 tensors: updated in place) or copy of `t`."""
        return t if t.dtype == torch.float32 else t.float()

    def _store(self, target: torch.Tensor, value: torch.Tensor,
               noise: torch.Tensor | None) -> None:
        if target.dtype == torch.float32:
            return  # `value` is `target` itself, already updated
        if target.dtype == torch.bfloat16:
            stochastic_round(value, out=target, noise=noise)
        else:
            target.copy_(value)

    def state_dict(self) -> dict:
        return super().state_dict() | {"rounding_rng": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        rng = state_dict.pop("rounding_rng", None)
        super().load_state_dict(state_dict)
        # torch casts loaded moments to their parameter's dtype: float32 moments of a
        # bfloat16 parameter would lose their low bits, so they are put back as saved
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            state = self.state[params[int(index)]]
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved:
                    state[key] = saved[key].to(state[key].device, self.moment_dtype)
        if rng is not None:
            self.generator.set_state(rng)


_STREAM = "_rollwise_float32_stream"  # set on an embedding whose output is cast to float32


def bfloat16_master(model: torch.nn.Module, keep_stream: bool) -> None:
    """The model's parameters in bfloat16 (`learner.master_dtype = "bfloat16"`), in place.
    With `keep_stream` (a bf16-autocast learner) the residual stream is float32, as under
    autocast over float32 weights: the embeddings' outputs are cast to float32 (a forward
    hook; the tables stay bfloat16, so a tied output layer and the engine read them in
    place) and the norms' gains stay float32, while every product reads bfloat16 weights as
    it would there. All-bfloat16 (the stream rounded to 8 bits at every layer) cost the
    quickstart 6.5 points (53.5% against 60.0%, docs/performance.md). Idempotent."""
    model.to(torch.bfloat16)
    if not keep_stream:
        return
    for module in model.modules():
        if is_norm(module):
            module.float()
        elif isinstance(module, torch.nn.Embedding) and not getattr(module, _STREAM, False):
            module.register_forward_hook(_float_output)
            setattr(module, _STREAM, True)


def _float_output(module, args, output):
    return output.float()


def is_norm(module: torch.nn.Module) -> bool:
    """A normalisation layer with a gain (RMSNorm, LayerNorm) of torch or transformers."""
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
