"""Key/value storage of the native engine, in two dense regions per layer.

    prefix: [group slots, kv_heads, prefix capacity, head_dim]  one copy of each group's prompt
    rows:   [row slots,   kv_heads, row capacity,    head_dim]  each running sequence's own tokens

Live groups occupy slots 0..G-1 and live rows slots 0..R-1 (freed slots are filled by moving
the last one in), so attention reads plain views `[:G, :, :P]` and `[:R, :, :S]`, never a
gather. A decode step then reads each group's prompt keys once for all its samples, as one
matrix product. Capacities grow on demand (by reallocation, rarely); the engine's token
budget, not this class, decides how many tokens may be held.
"""

from __future__ import annotations

import torch


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class KVCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.epoch = 0  # reallocations so far: views and captured graphs of older ones are stale
        self.pk: list[torch.Tensor] = []
        self.pv: list[torch.Tensor] = []
        self.rk: list[torch.Tensor] = []
        self.rv: list[torch.Tensor] = []
        self._released: dict[str, tuple[int, int]] = {}  # region -> (slots, length) it had
        self._alloc("p", 0, 0)
        self._alloc("r", 0, 0)

    def _empty(self, slots: int, length: int) -> torch.Tensor:
        return torch.zeros(slots, self.kv_heads, length, self.head_dim, dtype=self.dtype,
                           device=self.device)

    def _alloc(self, region: str, slots: int, length: int) -> None:
        k, v = (self.pk, self.pv) if region == "p" else (self.rk, self.rv)
        self.epoch += 1
        old = list(zip(k, v))
        k.clear()
        v.clear()
        for layer in range(self.layers):
            nk, nv = self._empty(slots, length), self._empty(slots, length)
            if old:
                ok, ov = old[layer]
                s, n = min(slots, ok.shape[0]), min(length, ok.shape[2])
                nk[:s, :, :n] = ok[:s, :, :n]
                nv[:s, :, :n] = ov[:s, :, :n]
            k.append(nk)
            v.append(nv)

    @staticmethod
    def _grow(have: int, need: int, step: int) -> int:
        return have if need <= have else _round_up(max(need, int(have * 1.5)), step)

    def _ensure(self, region: str, slots: int, length: int) -> None:
        t = (self.pk if region == "p" else self.rk)[0]
        s, n = t.shape[0], t.shape[2]
        if s == 0 and region in self._released:  # at once to the size it had, not by steps
            s, n = self._released.pop(region)
        ns, nn = self._grow(s, slots, 8), self._grow(n, length, 64)
        if (ns, nn) != (t.shape[0], t.shape[2]):
            self._alloc(region, ns, nn)

    def ensure_prefix(self, slots: int, length: int) -> None:
        """Room for `slots` groups of prompts up to `length` tokens."""
        self._ensure("p", slots, length)

    def ensure_rows(self, slots: int, length: int) -> None:
        """Room for `slots` rows of up to `length` own tokens each."""
        self._ensure("r", slots, length)

    def move_row(self, src: int, dst: int, length: int) -> None:
        for k, v in zip(self.rk, self.rv):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def move_group(self, src: int, dst: int, length: int) -> None:
        for k, v in zip(self.pk, self.pv):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def take_row(self, row: int, length: int) -> torch.Tensor:
        """A copy of a row's first `length` tokens: [layers, 2, kv_heads, length, head_dim]."""
        return torch.stack([torch.stack((k[row, :, :length], v[row, :, :length]))
                            for k, v in zip(self.rk, self.rv)])

    def take_prefix(self, slot: int, length: int) -> torch.Tensor:
        """A copy of a prefix slot's first `length` tokens (layout of `take_row`)."""
        return torch.stack([torch.stack((k[slot, :, :length], v[slot, :, :length]))
                            for k, v in zip(self.pk, self.pv)])

    def put_prefix(self, slot: int, saved: torch.Tensor) -> None:
        n = saved.shape[3]
        for layer, (k, v) in enumerate(zip(self.pk, self.pv)):
            k[slot, :, :n] = saved[layer, 0]
            v[slot, :, :n] = saved[layer, 1]

    def put_row(self, row: int, saved: torch.Tensor) -> None:
        n = saved.shape[3]
        for layer, (k, v) in enumerate(zip(self.rk, self.rv)):
            k[row, :, :n] = saved[layer, 0]
            v[row, :, :n] = saved[layer, 1]

    def release(self) -> int:
        """Free both regions (nothing may live in them); the bytes freed. The next request
        allocates each region again at the size it had (one allocation, not the steps of
        growing a fresh cache)."""
        freed = self.nbytes()
        for region, t in (("p", self.pk[0]), ("r", self.rk[0])):
            if t.numel():
                self._released[region] = (t.shape[0], t.shape[2])
                self._alloc(region, 0, 0)
        return freed

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.pk, *self.pv, *self.rk, *self.rv))
