"""The decode step as one static-shape function: every resident row feeds one token.

The step loop (`native.py`) decides who runs; this module computes one token for each of
those B rows in a function whose shapes depend only on a few sizes (`StepShape`), never on
Python-level per-layer planning:

- inputs are two small tensors made on the host in one pass over the rows and copied to the
  device once: `ints` [6, B] (input token, own tokens cached = the write position, prompt
  length, the row's group for the scatter, its place among the group's rows, its group
  for the gather) and `floats` [2, B] (the row's uniform for its draw and its temperature);
- positions, rotary factors and the attention mask are computed on the device from those;
- keys and values are written in place into the preallocated cache (`KVCache`: rows
  0..B-1, positions `own`), then attention reads fixed-size views of the cache: each row's
  own keys `[:B, :, :S]` and each group's prompt keys `[:G, :, :P]` once for all its samples
  (queries scattered into a [G, nmax] group layout, as in `Decoder.forward_rows`);
- the next token is drawn on the device (greedy or temperature sampling by inverting the
  CDF at the row's counter-based uniform, exactly as `sampling.sample_tokens`), and the
  result comes back as one [2, B] tensor (ids and log-probs): one device-to-host copy.

Ways to run it (`DecodeStep.mode`; `padded` and `rows` serve tests and benchmarks):
- `eager`: the sizes are the exact ones of this step (B rows, the longest prompt and own
  length); nothing is padded, so the arithmetic is that of a plain forward pass;
- `graph` (CUDA): sizes are bucketed (B up to the next bucket, G/P/S the cache's capacities,
  nmax to a power of two) and each bucket's function is captured once as a CUDA graph and
  replayed; padded rows write into unused cache rows at position 0 and are never read;
- `compile` (opt-in, `torch.compile` with inductor, CPU or GPU): the exact-size function
  compiled once with symbolic sizes (no size may be 1, so small ones are padded to 2);
  about a minute of compilation on a 2-core CPU serves every batch.

A captured graph reads the cache tensors and the converted weights at fixed addresses:
graphs are dropped when the cache is reallocated (`KVCache.epoch`) and converted weights are
updated in place at publication (`Decoder.refresh`), so replays see new weights.
Rows that ask for top-k or top-p truncation, or for per-token statistics (top log-probs,
entropy), get their logits back and are drawn on the host (`sampling.draw`), as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollwise.engine.kvcache import KVCache
from rollwise.engine.sampling import inverse_cdf, uniforms

MODES = ("auto", "eager", "padded", "graph", "compile", "rows")


@dataclass(frozen=True)
class StepShape:
    """The sizes a step function is specialised to."""

    rows: int  # B: rows computed (padded rows included)
    groups: int  # G: prompt slots read
    per_group: int  # nmax: rows per group in the group layout
    prefix: int  # P: prompt keys read per group
    own: int  # S: own keys read per row
    sample: str  # the draw on the device: "greedy", "plain" (temperature 1 everywhere),
    # "scaled" (per-row temperatures, greedy rows among them), or "" (return the logits)


def row_bucket(n: int) -> int:
    """Batch buckets that graphs are captured for: 1, 2, 4, 8, 16, 24, 32, then multiples
    of 32 (at most 31 padded rows; a handful of graphs covers every batch)."""
    if n <= 16:
        return 1 << (n - 1).bit_length()
    return -(-n // 8) * 8 if n <= 32 else -(-n // 32) * 32


def sample_on_device(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                     kind: str = "scaled") -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], log-probs [B]) of `logits` [B, V] float32 under per-row temperatures
    [B] (0: greedy) with uniforms u [B]; value for value what `sampling.sample_tokens` gives
    each row (x / 1.0 is x, so a temperature-1 row is unchanged by the division). `kind`
    "greedy" or "plain" (every row greedy, or every row at temperature 1) skips the work
    the batch does not need."""
    if kind == "plain":
        probs = torch.softmax(logits, -1)
        tokens = inverse_cdf(probs, u)
        return tokens, probs.gather(-1, tokens[:, None])[:, 0].log()
    best = logits.argmax(-1)
    lp_best = logits.gather(-1, best[:, None])[:, 0] - torch.logsumexp(logits, -1)
    if kind == "greedy":
        return best, lp_best
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.dtype)
    probs = torch.softmax(logits / scale[:, None], -1)
    sampled = inverse_cdf(probs, u)
    lp_sampled = probs.gather(-1, sampled[:, None])[:, 0].log()
    return torch.where(greedy, best, sampled), torch.where(greedy, lp_best, lp_sampled)


class DecodeStep:
    def __init__(self, decoder, cache: KVCache, mode: str = "auto"):
        """`mode`: eager, graph (CUDA graphs; CUDA only), compile (torch.compile), auto
        (graph on CUDA, eager elsewhere), padded (the graph's bucketed shapes run eagerly:
        how the CPU tests check what a graph replays), or rows: no static step, every
        decode goes through the general chunk pass `Decoder.forward_rows` (the comparison
        in `bench rollout`)."""
        if mode not in MODES:
            raise ValueError(f"decode step mode '{mode}' is not one of {', '.join(MODES)}")
        cuda = decoder.device.type == "cuda"
        if mode == "auto":
            mode = "graph" if cuda else "eager"
        if mode == "graph" and not cuda:
            raise ValueError("decode step mode 'graph' needs a CUDA device "
                             f"(the engine is on {decoder.device})")
        self.decoder, self.cache, self.mode = decoder, cache, mode
        self.bucketed = mode in ("padded", "graph")
        # compiled with symbolic sizes: none may be 1, or torch.compile specialises on it
        self.floor = 2 if mode == "compile" else 1
        self._graphs: dict[StepShape, tuple] = {}
        self._epoch = -1  # the cache allocation the graphs were captured on
        self._pool = None
        self._compiled = None
        self.captures = 0  # graphs captured so far
        self.calls = 0  # decode steps run through this object

    # -- the host side: one pass over the rows ---------------------------------------------

    def inputs(self, reqs, rows: int) -> tuple[torch.Tensor, torch.Tensor, StepShape]:
        """The step's `ints` [6, rows] and `floats` [2, rows] for requests `reqs` in rows
        0..len(reqs)-1 (rows beyond are padding), and the exact sizes."""
        n = len(reqs)
        seen: dict[int, int] = {}
        place = []
        for r in reqs:
            j = seen.get(r.group.slot, 0)
            seen[r.group.slot] = j + 1
            place.append(j)
        nmax = max(max(seen.values()), self.floor)
        groups = max(max(seen) + 1, self.floor)
        if self.bucketed:  # the cache's slot capacity, nmax to a power of two
            nmax, groups = 1 << (nmax - 1).bit_length(), self.cache.pk[0].shape[0]
        spare = groups  # the group padded rows scatter into (never read)
        pad = rows - n
        toks = [r.tokens[-1] for r in reqs] + [0] * pad
        own = [r.cached for r in reqs] + [0] * pad
        plen = [len(r.group.tokens) for r in reqs] + [0] * pad
        slots = [r.group.slot for r in reqs]
        # host tensors on purpose: __call__ copies each to the device once (a graph's inputs)
        ints = torch.tensor([toks, own, plen, slots + [spare] * pad, place + [0] * pad,
                             slots + [0] * pad], dtype=torch.long)
        u = uniforms([r.seed for r in reqs], [len(r.tokens) for r in reqs])
        temps = torch.tensor([float(r.params.temperature) for r in reqs], dtype=torch.float64)
        floats = torch.ones(2, rows, dtype=torch.float64)
        floats[0, :n], floats[1, :n] = u, temps
        shape = StepShape(rows, groups, nmax, max(max(plen[:n]), self.floor),
                          max(max(own[:n]) + 1, self.floor), _sampling(reqs))
        return ints, floats, shape

    def __call__(self, reqs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Advance `reqs` (resident rows 0..len-1, one input token each) by one token.
        Returns ([2, len(reqs)] ids and log-probs on the host, None), or (None, [len, V]
        logits) when some row asks for top-k/top-p truncation."""
        n = len(reqs)
        self.calls += 1
        rows = row_bucket(n) if self.bucketed else max(n, self.floor)
        cache = self.cache
        cache.ensure_rows(rows, max(max(r.cached for r in reqs) + 1, self.floor))
        ints, floats, shape = self.inputs(reqs, rows)
        if self.bucketed:
            shape = StepShape(rows, shape.groups, shape.per_group, cache.pk[0].shape[2],
                              cache.rk[0].shape[2], shape.sample)
        if self.mode == "graph" and shape.sample:  # truncated sampling runs uncaptured
            out = self._replay(shape, ints, floats)
        else:
            dev = self.decoder.device
            ints, floats = ints.to(dev, non_blocking=True), floats.to(dev, non_blocking=True)
            if self.mode == "compile":
                out = self._compile()(ints, floats, shape.rows, shape.groups, shape.per_group,
                                      shape.prefix, shape.own, shape.sample)
            else:
                out = self.run(ints, floats, shape)
        if shape.sample:
            return out[:, :n].cpu(), None
        return None, out[:n]

    # -- the device side -------------------------------------------------------------------

    def run(self, ints: torch.Tensor, floats: torch.Tensor, shape: StepShape) -> torch.Tensor:
        """The step function: [2, B] float64 (ids, log-probs), or [B, V] logits when
        `shape.sample` is false. Only device work: no host synchronisation inside."""
        d, cache = self.decoder, self.cache
        b, g, nmax, p, s = shape.rows, shape.groups, shape.per_group, shape.prefix, shape.own
        kvh, rep, hd = d.kv_heads, d.rep, d.head_dim
        tok, own, plen, put, place, get = ints.unbind(0)
        pos = (plen + own).clamp(max=d.max_context - 1)
        cos, sin = d.cos[pos][:, None, None], d.sin[pos][:, None, None]  # [B, 1, 1, hd]
        keys = torch.arange(p + s, device=ints.device)
        ok = torch.where(keys < p, keys[None] < plen[:, None], keys[None] - p <= own[:, None])
        mask = torch.zeros(ok.shape, dtype=torch.float32, device=ints.device).masked_fill_(
            ~ok, float("-inf"))[:, None, None]  # [B, 1, 1, P+S]
        rows = torch.arange(b, device=ints.device)
        x = F.embedding(tok[:, None], d._w(d.embed))  # [B, 1, D]
        for i, layer in enumerate(d.layers):
            q, k, v = d._qkv(x, layer, cos, sin)  # [B, 1, heads, hd]
            rk, rv = cache.rk[i], cache.rv[i]
            rk[rows, :, own] = k[:, 0]
            rv[rows, :, own] = v[:, 0]
            q = q.view(b, kvh, rep, hd)
            pre_k, pre_v = cache.pk[i][:g, :, :p], cache.pv[i][:g, :, :p]
            s_pre = _from_groups(_to_groups(q, put, place, g, nmax) @ pre_k.transpose(-1, -2),
                                 get, place, nmax)
            s_own = q @ rk[:b, :, :s].transpose(-1, -2)  # [B, kvh, rep, S]
            scores = torch.cat([s_pre, s_own], -1).float().mul_(d.scale).add_(mask)
            probs = scores.softmax(-1).to(d.dtype)
            out = probs[..., p:] @ rv[:b, :, :s]
            out = out + _from_groups(_to_groups(probs[..., :p], put, place, g, nmax) @ pre_v,
                                     get, place, nmax)
            x = x + d._lin(out.reshape(b, 1, -1), layer.self_attn.o_proj)
            x = x + d._mlp(d._rms(x, layer.post_attention_layernorm), layer.mlp)
        logits = d.logits(x[:, 0])
        if not shape.sample:
            return logits
        tokens, logprobs = sample_on_device(logits, floats[1], floats[0], shape.sample)
        return torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64)))

    # -- capture ---------------------------------------------------------------------------

    def _fresh(self) -> None:
        """Drop captures made on an earlier cache allocation."""
        if self._epoch != self.cache.epoch:
            self._graphs.clear()
            self._epoch = self.cache.epoch

    def _replay(self, shape: StepShape, ints: torch.Tensor, floats: torch.Tensor):
        self._fresh()
        entry = self._graphs.get(shape)
        if entry is None:
            entry = self._capture(shape, ints, floats)
            self._graphs[shape] = entry
        graph, s_ints, s_floats, out = entry
        s_ints.copy_(ints, non_blocking=True)
        s_floats.copy_(floats, non_blocking=True)
        graph.replay()
        return out

    def _capture(self, shape: StepShape, ints: torch.Tensor, floats: torch.Tensor) -> tuple:
        """Capture `run` for `shape` on static input buffers. Warming up runs the real step
        (its cache writes are the same ones the replay makes: idempotent)."""
        dev = self.decoder.device
        s_ints, s_floats = ints.to(dev), floats.to(dev)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side), torch.inference_mode():
            self.run(s_ints, s_floats, shape)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), torch.inference_mode():
            out = self.run(s_ints, s_floats, shape)
        self.captures += 1
        return graph, s_ints, s_floats, out

    def _compile(self):
        """`run` compiled once with symbolic sizes (B, G, nmax, P, S vary without a
        recompilation): the cache tensors and weights are read as inputs."""
        if self._compiled is None:
            def flat(ints, floats, b, g, nmax, p, s, sample):
                return self.run(ints, floats, StepShape(b, g, nmax, p, s, sample))

            self._compiled = torch.compile(flat, dynamic=True)
        return self._compiled


def _sampling(reqs) -> str:
    """The device draw these requests need (StepShape.sample)."""
    # truncated sampling, or per-token statistics asked: the logits come back to the host
    if any(r.params.top_k > 0 or r.params.top_p < 1.0 or r.wants_stats for r in reqs):
        return ""
    temps = {float(r.params.temperature) for r in reqs}
    if temps == {0.0}:
        return "greedy"
    return "plain" if temps == {1.0} else "scaled"


def _to_groups(t: torch.Tensor, put: torch.Tensor, place: torch.Tensor, groups: int,
               nmax: int) -> torch.Tensor:
    """[B, kvh, rep, X] rows -> [G, kvh, nmax*rep, X] group layout (absent rows are zero):
    row b goes to group put[b] (G: padding, dropped) at place[b] among its rows. Written
    straight into the layout, so the result is a view, not a copy."""
    _, h, rep, x = t.shape
    buf = t.new_zeros(groups + 1, h, nmax, rep, x)
    buf[put, :, place] = t
    return buf[:groups].view(groups, h, nmax * rep, x)


def _from_groups(t: torch.Tensor, get: torch.Tensor, place: torch.Tensor,
                 nmax: int) -> torch.Tensor:
    """[G, kvh, nmax*rep, X] group layout -> [B, kvh, rep, X] rows: one gather."""
    g, h, m, x = t.shape
    return t.view(g, h, nmax, m // nmax, x)[get, :, place]
