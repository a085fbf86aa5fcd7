"""The decode step as one static-shape function: every resident row feeds one token.

The step loop (`native.py`) decides who runs; this module computes one token for each of
those B rows in a function whose shapes depend only on a few sizes (`StepShape`), never on
Python-level per-layer planning:

- inputs are two small tensors made on the host in one pass over the rows and copied to the
  device once: `ints` [6, B] (input token, own tokens cached = the write position, prompt
  length, the row's group for the scatter, its place among the group's rows, its group
  for the gather) and `floats` [2, B] (the row's uniform for its draw and its temperature);
- positions, rotary factors and the attention mask are computed on the device from those;
- the layers are the one layer body (`Layers.forward`); keys and values are written in
  place into the preallocated cache (`KVCache`: rows 0..B-1, positions `own`), then the one
  attention (`attention.attend_regions`, as in the chunk pass) reads fixed-size views of the
  cache: each row's own keys `[:B, :, :S]` and each group's prompt keys `[:G, :, :P]` once
  for all its samples;
- the next token is drawn on the device (greedy or temperature sampling by inverting the
  CDF at the row's counter-based uniform, exactly as `sampling.sample_tokens`), and the
  result comes back as one [2, B] tensor (ids and log-probs): one device-to-host copy.

Ways to run it (`DecodeStep.mode`; `padded` and `rows` serve tests and benchmarks):
- `eager`: the sizes are the exact ones of this step (B rows, the longest prompt and own
  length); nothing is padded, so the arithmetic is that of a plain forward pass;
- `graph` (CUDA): sizes are bucketed (B up to the next bucket, nmax to a power of two, G/P/S
  the cache's capacities) and each bucket's function is captured once as a CUDA graph and
  replayed; padded rows write into unused cache rows at position 0 and are never read.
  Graphs are keyed by the buckets (`graph_key`: B, nmax, the draw), not by the cache's
  capacities: the first bucketed step sizes the cache to the engine's limits (`reserve`:
  a slot per row of the largest bucket, each row's share of the KV budget), so the views
  a graph reads stay where they are while sequences grow. Only a reallocation (a row past
  its share, more prompts than rows, a `release`) drops the graphs;
- `compile` (opt-in, `torch.compile` with inductor, CPU or GPU): the exact-size function
  compiled once with symbolic sizes (no size may be 1, so small ones are padded to 2);
  about a minute of compilation on a 2-core CPU serves every batch.

A captured graph reads the cache tensors and the converted weights at fixed addresses:
graphs are dropped when the cache is reallocated (`KVCache.epoch`) and converted weights are
updated in place at publication (`Decoder.refresh`), so replays see new weights. On CUDA
(any mode) the inputs go through pinned host buffers and the result comes back into one
(`Staging`), so the copies are asynchronous; on a CPU staging does nothing.
Rows that ask for top-k or top-p truncation, or for per-token statistics (top log-probs,
entropy), get their logits back and are drawn on the host (`sampling.draw`), as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollwise.engine.attention import GroupLayout, attend_regions, region_mask
from rollwise.engine.kvcache import KVCache
from rollwise.engine.layers import Layers
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


def graph_key(shape: StepShape) -> tuple[int, int, str]:
    """What a captured graph is looked up by: the batch bucket, the rows-per-group bucket
    and the draw. The cache's capacities (G, P, S) are not in it: they are those of the
    cache the graph was captured on, dropped when the cache is reallocated."""
    return shape.rows, shape.per_group, shape.sample


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


class Staging:
    """The host side of a step's inputs and result. On CUDA, pinned host buffers per batch
    bucket, so the host-to-device copies of the inputs are asynchronous (they overlap with
    the host's work until the replay needs them) and the result comes back by one copy into
    pinned memory. Elsewhere (a CPU engine) it does nothing: the tensors are used as made."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self._host: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._copied = None  # CUDA event: the last copy out of the pinned input buffers

    def inputs(self, ints: torch.Tensor, floats: torch.Tensor,
               into: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`ints`, `floats` on the device: copied into `into` (a graph's static inputs) when
        given, else new device tensors."""
        if not self.pinned:
            if into is None:
                return ints.to(self.device), floats.to(self.device)
            into[0].copy_(ints)
            into[1].copy_(floats)
            return into
        h_ints, h_floats, _ = self._buffers(ints.shape[1])
        if self._copied is not None:  # the previous step's copies have left these buffers
            self._copied.synchronize()
        h_ints.copy_(ints)
        h_floats.copy_(floats)
        if into is None:
            into = (torch.empty_like(h_ints, device=self.device),
                    torch.empty_like(h_floats, device=self.device))
        into[0].copy_(h_ints, non_blocking=True)
        into[1].copy_(h_floats, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return into

    def result(self, out: torch.Tensor, n: int) -> torch.Tensor:
        """The first `n` columns of the step's [2, B] ids and log-probs, on the host (waits
        for them). On CUDA the whole (contiguous) result is copied into the bucket's pinned
        buffer, then the columns are taken from it."""
        if not self.pinned:
            return out[:, :n].cpu()
        host = self._buffers(out.shape[1])[2]
        host.copy_(out, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host[:, :n].clone()  # the buffer is the next step's

    def _buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pinned host buffers (on the host on purpose) of a batch bucket: ints, floats,
        result."""
        if rows not in self._host:
            self._host[rows] = (
                torch.empty(6, rows, dtype=torch.long, device="cpu", pin_memory=True),
                torch.empty(2, rows, dtype=torch.float64, device="cpu", pin_memory=True),
                torch.empty(2, rows, dtype=torch.float64, device="cpu", pin_memory=True))
        return self._host[rows]


class DecodeStep:
    def __init__(self, layers: Layers, cache: KVCache, mode: str = "auto", *,
                 max_rows: int = 128, kv_budget_tokens: int = 65536):
        """`mode`: eager, graph (CUDA graphs; CUDA only), compile (torch.compile), auto
        (graph on CUDA, eager elsewhere), padded (the graph's bucketed shapes run eagerly:
        how the CPU tests check what a graph replays), or rows: no static step, every
        decode goes through the general chunk pass `Passes.forward_rows` (the comparison
        in `bench rollout`). `max_rows`, `kv_budget_tokens`: the engine's limits, which
        size the cache the bucketed shapes read (`reserve`)."""
        if mode not in MODES:
            raise ValueError(f"decode step mode '{mode}' is not one of {', '.join(MODES)}")
        cuda = layers.device.type == "cuda"
        if mode == "auto":
            mode = "graph" if cuda else "eager"
        if mode == "graph" and not cuda:
            raise ValueError("decode step mode 'graph' needs a CUDA device "
                             f"(the engine is on {layers.device})")
        self.layers, self.cache, self.mode = layers, cache, mode
        self.max_context = layers.decoder.max_context
        self.max_rows, self.kv_budget_tokens = max_rows, kv_budget_tokens
        self.bucketed = mode in ("padded", "graph")
        # compiled with symbolic sizes: none may be 1, or torch.compile specialises on it
        self.floor = 2 if mode == "compile" else 1
        self.staging = Staging(layers.device)
        self._graphs: dict[tuple, tuple] = {}  # graph_key -> (graph, inputs, output)
        self._epoch = -1  # the cache allocation the graphs were captured on
        self._pool = None
        self._compiled = None
        self.captures = 0  # graphs captured so far
        self.calls = 0  # decode steps run through this object

    def reserve(self, rows: int, length: int) -> None:
        """Room for `rows` rows of `length` own tokens, and for bucketed shapes the cache's
        fixed maximum: a slot per row of the largest batch bucket in each region, each
        slot as long as a row's share of the KV budget (at least 64 tokens, at most the
        model's context). Bucketed shapes read the whole capacity, so it is set once: growth
        within it moves nothing, and graphs stay valid. A longer row, or more prompts than
        rows, still grows the cache (by reallocation: its graphs are then captured again)."""
        if not self.bucketed:
            self.cache.ensure_rows(rows, length)
            return
        slots = max(rows, row_bucket(self.max_rows))
        share = max(64, min(self.max_context, self.kv_budget_tokens // slots))
        self.cache.ensure_rows(slots, max(length, share))
        self.cache.ensure_prefix(slots, share)

    # -- the host side: one pass over the rows ---------------------------------------------

    def inputs(self, reqs, rows: int) -> tuple[torch.Tensor, torch.Tensor, StepShape]:
        """The step's `ints` [6, rows] and `floats` [2, rows] for requests `reqs` in rows
        0..len(reqs)-1 (rows beyond are padding), and the sizes: the exact ones, or for
        bucketed shapes the bucket's with the cache's capacities."""
        n, cache = len(reqs), self.cache
        seen: dict[int, int] = {}
        place = []
        for r in reqs:
            j = seen.get(r.group.slot, 0)
            seen[r.group.slot] = j + 1
            place.append(j)
        nmax = max(max(seen.values()), self.floor)
        groups = max(max(seen) + 1, self.floor)
        if self.bucketed:  # the cache's slot capacity, nmax to a power of two
            nmax, groups = 1 << (nmax - 1).bit_length(), cache.pk[0].shape[0]
        spare = groups  # the group padded rows scatter into (never read)
        pad = rows - n
        toks = [r.tokens[-1] for r in reqs] + [0] * pad
        own = [r.cached for r in reqs] + [0] * pad
        plen = [len(r.group.tokens) for r in reqs] + [0] * pad
        slots = [r.group.slot for r in reqs]
        # host tensors on purpose: `Staging` copies each to the device once (a graph's inputs)
        ints = torch.tensor([toks, own, plen, slots + [spare] * pad, place + [0] * pad,
                             slots + [0] * pad], dtype=torch.long)
        u = uniforms([r.seed for r in reqs], [len(r.tokens) for r in reqs])
        temps = torch.tensor([float(r.params.temperature) for r in reqs], dtype=torch.float64)
        floats = torch.ones(2, rows, dtype=torch.float64)
        floats[0, :n], floats[1, :n] = u, temps
        if self.bucketed:
            shape = StepShape(rows, groups, nmax, cache.pk[0].shape[2], cache.rk[0].shape[2],
                              _sampling(reqs))
        else:
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
        self.reserve(rows, max(max(r.cached for r in reqs) + 1, self.floor))
        ints, floats, shape = self.inputs(reqs, rows)
        if self.mode == "graph" and shape.sample:  # truncated sampling runs uncaptured
            out = self._replay(shape, ints, floats)
        else:
            ints, floats = self.staging.inputs(ints, floats)
            if self.mode == "compile":
                out = self._compile()(ints, floats, shape.rows, shape.groups, shape.per_group,
                                      shape.prefix, shape.own, shape.sample)
            else:
                out = self.run(ints, floats, shape)
        if shape.sample:
            return self.staging.result(out, n), None
        return None, out[:n]

    # -- the device side -------------------------------------------------------------------

    def run(self, ints: torch.Tensor, floats: torch.Tensor, shape: StepShape) -> torch.Tensor:
        """The step function: [2, B] float64 (ids, log-probs), or [B, V] logits when
        `shape.sample` is false. Only device work: no host synchronisation inside."""
        lay, cache = self.layers, self.cache
        b, g, nmax, p, s = shape.rows, shape.groups, shape.per_group, shape.prefix, shape.own
        kvh, rep, hd = lay.kv_heads, lay.rep, lay.head_dim
        tok, own, plen, put, place, get = ints.unbind(0)
        pos = (plen + own).clamp(max=self.max_context - 1)
        cos = lay.decoder.cos[pos][:, None, None]  # [B, 1, 1, hd]
        sin = lay.decoder.sin[pos][:, None, None]
        mask = region_mask(plen, own, 1, p, s, rep)  # [B, 1, 1, P+S]
        layout = GroupLayout(put, get, place, g, nmax)
        rows = torch.arange(b, device=ints.device)

        def attend(i, q, k, v):  # q [B, 1, heads, hd]
            rk, rv = cache.rk[i], cache.rv[i]
            rk[rows, :, own] = k[:, 0]
            rv[rows, :, own] = v[:, 0]
            out = attend_regions(q.view(b, kvh, rep, hd), rk[:b, :, :s], rv[:b, :, :s],
                                 cache.pk[i][:g, :, :p], cache.pv[i][:g, :, :p], layout, mask,
                                 lay.scale, lay.dtype)
            return out.reshape(b, 1, -1)

        x = lay.forward(lay.embed(tok[:, None]), cos, sin, attend)  # [B, 1, D]
        logits = lay.logits(x[:, 0])
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
        key = graph_key(shape)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(shape, ints, floats)
            self._graphs[key] = entry
        graph, static_in, out = entry
        self.staging.inputs(ints, floats, into=static_in)
        graph.replay()
        return out

    def _capture(self, shape: StepShape, ints: torch.Tensor, floats: torch.Tensor) -> tuple:
        """Capture `run` for `shape` on static input buffers. Warming up runs the real step
        (its cache writes are the same ones the replay makes: idempotent)."""
        dev = self.layers.device
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
        return graph, (s_ints, s_floats), out

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
