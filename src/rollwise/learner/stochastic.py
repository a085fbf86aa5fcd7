"""bfloat16 master weights: stochastic or compensated rounding, and the AdamW updating them.

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

Stochastic rounding is right on average but noisy: an update of a tenth of a bfloat16 step
moves the weight a whole step one time in ten, so after n such updates the weight has
drifted n/10 steps and wandered about 0.3 * sqrt(n) steps around that, as much as it
drifted over the quickstart's 20 updates. `compensated = True` removes the noise for one
byte a parameter: an int8 residual per weight keeps the part of the float32 value that
round-to-nearest bfloat16 dropped, in units of 1/256 of the weight's bfloat16 step
(`compensated_load`, `compensated_store`). The weight the model reads is the nearest
bfloat16 to the float32 master, and the master keeps 16 significant bits (float32: 24):
each store lands within half a unit, 1/512 of a step, of the float32 value (a whole unit
where the residual saturates at 127, one value in about 500), so updates accumulate as in
float32 (Kahan's compensated summation with an 8-bit compensation). It needs no random
bits, and the moments, when bfloat16, keep their stochastic rounding. The residuals start
from the float32 weights when the model is converted from them (`bfloat16_master(...,
residuals=True)`), so the master starts as the float32 model. On the quickstart's batch the
compensated learner moves the policy as float32 AdamW does (scripts/master_drift.py, mean
|change of a token's log-prob| after 6 updates: 0.616 against 0.592; stochastic rounding
0.792), yet its runs reached lower held-out accuracy than stochastic rounding's on the same
seeds (docs/performance.md, Memory): it is a choice, not the default.

Imports: torch.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 18  # values per pass: 1 MiB of float32 per temporary, cache-sized
_LOW16 = (1 << 16) - 1
_HIGH16 = -(1 << 16)  # int32 mask keeping the sign, exponent and 7 mantissa bits


def compensation_unit(hi: torch.Tensor) -> torch.Tensor:
    """float32 1/256 of the bfloat16 step (unit in the last place) of each value of `hi`:
    2^(E - 142) for the biased exponent E of a normal bfloat16 (its step is 2^(E - 134)),
    read from the bits. Subnormals and zero get the smallest normal unit, 2^-126: a residual
    there is a few units at most, and weights so small do not occur."""
    exponent = (hi.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    return ((exponent - 15).clamp_(min=1) << 23).view(torch.float32)


def compensated_load(hi: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The float32 master value of bfloat16 `hi` and its int8 `residual` (module docstring)."""
    return hi.float().addcmul_(residual.float(), compensation_unit(hi))


def compensated_store(value: torch.Tensor, hi: torch.Tensor, residual: torch.Tensor) -> None:
    """Write float32 `value` as its nearest bfloat16 into `hi` and what that dropped, in units
    of `compensation_unit`, into int8 `residual` (at most half a step: 128 units; over
    127.5 it saturates at 127, within one unit). `value` is overwritten."""
    rounded = value.to(torch.bfloat16)
    dropped = value.sub_(rounded.float()).div_(compensation_unit(rounded))
    residual.copy_(dropped.round_().clamp_(-128, 127))
    hi.copy_(rounded)


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
    `compensated`: bfloat16 parameters keep an int8 residual each (state "residual") and are
    written by `compensated_store` instead (module docstring). float32 parameters are
    updated as by torch's AdamW (up to float32 rounding order).
    """

    def __init__(self, params, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0,
                 moment_dtype: torch.dtype = torch.float32, seed: int = 0,
                 compensated: bool = False):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.moment_dtype = moment_dtype
        params = [p for group in self.param_groups for p in group["params"]]
        # parameters written with a residual, and those with a tensor (the parameter or its
        # moments) rounded stochastically
        self.compensates = {p: compensated and p.dtype == torch.bfloat16 for p in params}
        self.rounds = {p: moment_dtype == torch.bfloat16 or (
            p.dtype == torch.bfloat16 and not self.compensates[p]) for p in params}
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
            if self.compensates[p]:  # from the conversion, else zero
                residual = getattr(p, RESIDUAL, None)
                state["residual"] = (torch.zeros_like(p, dtype=torch.int8) if residual is None
                                     else residual)
                if residual is not None:
                    delattr(p, RESIDUAL)
        state["step"] += 1
        step = int(state["step"])
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        decay = 1 - lr * group["weight_decay"]
        step_size = lr / (1 - beta1**step)
        root_bc2 = (1 - beta2**step) ** 0.5
        flat_p, flat_g = p.view(-1), p.grad.view(-1)
        flat_m, flat_v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        flat_r = state["residual"].view(-1) if self.compensates[p] else None
        for s in range(0, flat_p.numel(), CHUNK):
            part = slice(s, s + CHUNK)
            g = flat_g[part].float()
            m, v = self._load(flat_m[part]), self._load(flat_v[part])
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = v.sqrt().div_(root_bc2).add_(eps)
            w = (self._load(flat_p[part]) if flat_r is None
                 else compensated_load(flat_p[part], flat_r[part]))
            if decay != 1:
                w.mul_(decay)
            w.addcdiv_(m, denom, value=-step_size)
            # one draw of random bits serves the chunk's tensors: each is rounded without
            # bias; drawing three would triple the step's dominant cost
            noise = random_bits(g.shape, self.generator, g.device) if self.rounds[p] else None
            self._store(flat_m[part], m, noise)
            self._store(flat_v[part], v, noise)
            if flat_r is None:
                self._store(flat_p[part], w, noise)
            else:
                compensated_store(w, flat_p[part], flat_r[part])

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
        # bfloat16 parameter would lose their low bits, and a residual would turn bfloat16,
        # so they are put back as saved
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            state = self.state[params[int(index)]]
            for key, dtype in (("exp_avg", self.moment_dtype),
                               ("exp_avg_sq", self.moment_dtype), ("residual", torch.int8)):
                if key in saved:
                    state[key] = saved[key].to(state[key].device, dtype)
        if rng is not None:
            self.generator.set_state(rng)


_STREAM = "_rollwise_float32_stream"  # set on an embedding whose output is cast to float32
RESIDUAL = "_rollwise_bfloat16_residual"  # a converted parameter's int8 residual


def bfloat16_master(model: torch.nn.Module, keep_stream: bool, residuals: bool = False) -> None:
    """The model's parameters in bfloat16 (`learner.master_dtype = "bfloat16"`), in place.
    With `keep_stream` (a bf16-autocast learner) the residual stream is float32, as under
    autocast over float32 weights: the embeddings' outputs are cast to float32 (a forward
    hook; the tables stay bfloat16, so a tied output layer and the engine read them in
    place) and the norms' gains stay float32, while every product reads bfloat16 weights as
    it would there. All-bfloat16 (the stream rounded to 8 bits at every layer) cost the
    quickstart 6.5 points (53.5% against 60.0%, docs/performance.md). `residuals`: each
    float32 parameter keeps what its rounding dropped (an int8 tensor in the attribute
    RESIDUAL, which `StochasticAdamW(compensated=True)` takes as its start). Idempotent."""
    dropped = {p: _residual(p) for p in model.parameters()
               if residuals and p.dtype == torch.float32}
    model.to(torch.bfloat16)
    for module in model.modules() if keep_stream else ():
        if is_norm(module):
            module.float()
        elif isinstance(module, torch.nn.Embedding) and not getattr(module, _STREAM, False):
            module.register_forward_hook(_float_output)
            setattr(module, _STREAM, True)
    for p, residual in dropped.items():
        if p.dtype == torch.bfloat16:  # not a norm's gain, float32 again
            setattr(p, RESIDUAL, residual)


def _residual(p: torch.Tensor) -> torch.Tensor:
    """What rounding float32 `p` to bfloat16 drops, as `compensated_store` keeps it."""
    residual = torch.empty_like(p, dtype=torch.int8)
    compensated_store(p.detach().clone(), torch.empty_like(p, dtype=torch.bfloat16), residual)
    return residual


def _float_output(module, args, output):
    return output.float()


def is_norm(module: torch.nn.Module) -> bool:
    """A normalisation layer with a gain (RMSNorm, LayerNorm) of torch or transformers."""
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
