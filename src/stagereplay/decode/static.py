"""The static regimes: one preallocated K/V buffer, a forward written over it, the one-token step in a CUDA graph.

- ``static``: the model's own weights and modules, driven by a forward written over a preallocated K/V buffer of
  ``max_len`` positions per row (:mod:`stagereplay.decode.static_forward`). Every forward (prefill, chunk or one
  token) attends over the whole buffer under a mask, so a decode step has the same shapes at every position. Runs
  on CPU too.
- ``cuda_graph``: the ``static`` forward with the one-token step captured once in a CUDA graph and replayed
  (multi-token forwards stay eager). Launch cost disappears; what is left is reading the weights.

A regime is part of a construction: graph-replayed kernels, masked full-buffer attention and the buffer length
all change the bits against the eager regime, so results are only comparable within one regime (the ledger records
it).

Layout: the rows of a batch share the buffer, left-padded so that every prompt ends at the same position ``W``
(the batch's longest prompt); row r's token j sits at buffer position ``pads[r] + j`` whatever the construction,
and the live schedule steps the rows in lockstep (one shared write position per step). A row's bits can depend on its
padding and on the number of rows (not on the other rows' values): the layout is part of the construction, recorded
per row. A batch from ``build`` may also step each row at its own position (``cursors``: the one-token step then
writes and reads row r at its own buffer position, through the same kernels and shapes), so that a built
construction's rows continue from their own boundaries and decode only their suffixes (``rows_from_boundaries``;
:func:`stagereplay.decode.greedy.decode_rows` says why the bits are those of the live schedule, and
``bench/suffix_schedule.py`` proves it byte for byte). The live schedule's own construction (``incremental``) is
still made by the schedule itself: a multi-row ``build`` of one-token segments runs one row at a time, another shape.

``decode_kernels`` (``library`` or ``fused``) and ``decode_attention`` (``masked`` or ``triton``) say how the
forward runs, and ``numerics: invariant`` switches it to row-invariant kernels: each is another regime parameter,
and :mod:`stagereplay.decode.static_forward` says how each computes. This module owns the buffer, which batch is
resident in it, the graphs and the decoder protocol; it holds none of the forward's arithmetic. Qwen2-style decoders
only (Qwen2/2.5, Llama-like layouts with q/k/v/o projections and full attention).
"""

from __future__ import annotations

import torch

from stagereplay.decode.fused import fuse_layer
from stagereplay.decode.options import check_device_options, check_static_options
from stagereplay.decode.protocol import Layers, RegimeError
from stagereplay.decode.static_forward import StaticForward
from stagereplay.models.invariant import describe as describe_invariant


class StaticKV:
    """One batch's K/V in the static regime: ``rows`` rows, their left pads, ``length`` buffer positions written.

    The decoder owns one working buffer (a CUDA graph reads fixed addresses); a batch is either resident in it or
    holds its own copy of the positions written (``store``), e.g. a built boundary cache waiting to be swapped in.
    """

    def __init__(self, decoder: "StaticDecoder", pads: list[int]):
        self.decoder = decoder
        self.rows = len(pads)
        self.length = 0
        self.pads = torch.tensor(pads, dtype=torch.long)
        self.store: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # own copy when not resident
        # each row's next write position when the rows sit at their own positions (a built batch continuing from
        # its rows' boundaries), on the host and as a (rows, 1) index on the device; None: every row at ``length``
        self.cursors: list[int] | None = None
        self.cursor_index: torch.Tensor | None = None

    def seat(self, positions: list[int]) -> None:
        """Put row r's next one-token write at buffer position ``positions[r]`` (at most ``length``): the rows
        then step each at its own position. Rows all at ``length`` stay in the shared-position form."""
        if len(positions) != self.rows:
            raise ValueError(f"{len(positions)} positions for a batch of {self.rows} rows")
        if any(not 0 < p <= self.length for p in positions):
            raise ValueError(f"row positions {positions} outside the {self.length} positions written")
        if all(p == self.length for p in positions):
            self.cursors, self.cursor_index = None, None
            return
        self.cursors = [int(p) for p in positions]
        self.cursor_index = torch.tensor(self.cursors, dtype=torch.long, device=self.decoder.device)[:, None]

    def moved(self, steps: int) -> None:
        """Every row's position moved on by ``steps`` (negative: taken back)."""
        if self.cursors is None:
            self.length += steps
            return
        self.cursors = [c + steps for c in self.cursors]
        self.cursor_index += steps
        self.length = max(self.length, max(self.cursors))

    def tensors(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s (K, V) over every row and the positions written: (rows, kv_heads, length, head_dim)."""
        if self.decoder.resident is self:
            return self.decoder.k[i][: self.rows, :, : self.length], self.decoder.v[i][: self.rows, :, : self.length]
        if self.store is None:
            raise RuntimeError("a static batch that was never filled has no layers")
        return self.store[i]

class StaticDecoder(StaticForward):
    """The static/cuda_graph regime for one model: a K/V buffer of ``max_len`` positions for ``max_rows`` rows.

    Implements :class:`stagereplay.decode.protocol.Decoder` over :class:`StaticKV` batches. ``forward_rows(ids,
    batch)`` feeds a (rows, T) tensor at the batch's next positions and returns the last position's fp32 logits;
    one-token forwards replay a CUDA graph in the ``cuda_graph`` regime (one graph per row count, captured at
    first use).
    The forwards themselves are :class:`~stagereplay.decode.static_forward.StaticForward`'s.
    """

    def __init__(self, model: torch.nn.Module, eos_ids: tuple[int, ...] = (), *, max_len: int, max_rows: int = 1,
                 regime: str = "static", pad_id: int = 0, attention: str = "masked",
                 prefill_group: int | None = None, kernels: str = "library", suffix_schedule: bool = True):
        if regime not in ("static", "cuda_graph"):
            raise RegimeError(f"decode_regime {regime!r}: StaticDecoder runs 'static' or 'cuda_graph'")
        self.model, self.eos_ids, self.regime = model, tuple(eos_ids), regime
        self.device = next(model.parameters()).device
        if regime == "cuda_graph" and self.device.type != "cuda":
            raise RegimeError("decode_regime 'cuda_graph' needs the model on a CUDA device; use 'static' or 'eager'")
        cfg = model.config
        self.n_layers = int(cfg.num_hidden_layers)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
            raise RegimeError("the static regime does not support sliding-window attention")
        self.max_len, self.max_rows, self.pad_id = int(max_len), int(max_rows), int(pad_id)
        check_static_options(regime, attention, prefill_group, kernels)  # the options' one check
        self.attention = attention
        # rows of a multi-token forward (a batch's one-shot prefill) run in groups of this many, in row order: the
        # memory of a prefill's attention grows with rows x tokens x span. A regime parameter (in the default
        # numerics a row's bits may depend on the rows it is computed with); None: every row in one forward
        self.prefill_group = int(prefill_group) if prefill_group else None
        self.decode_kernels = kernels
        self.kernels = getattr(model, "_stagereplay_kernels", None)  # numerics: invariant
        if kernels == "fused" and self.kernels is not None:
            raise RegimeError("decode_kernels: fused is an option of numerics: default; numerics: invariant computes "
                              "every operation through its own row-invariant kernels: leave decode_kernels at "
                              "library")
        check_device_options(self.device.type, attention, kernels)
        if attention == "triton":  # each row's keys only, up to its position, in 64-key blocks
            from stagereplay.models.invariant_triton import TritonKernels  # optional dependency: Triton

            self._triton = TritonKernels()
        if kernels == "fused":
            if "silu" not in type(model.model.layers[0].mlp.act_fn).__name__.lower():
                raise RegimeError(f"decode_kernels: fused implements the SiLU-gated MLP only, not "
                                  f"{type(model.model.layers[0].mlp.act_fn).__name__}: use decode_kernels library")
            from stagereplay.decode.fused_kernels import FusedKernels  # optional dependency: Triton

            self._fused_ops = FusedKernels()
        self.dtype = next(model.parameters()).dtype
        shape = (self.max_rows, self.n_kv, self.max_len, self.head_dim)  # (rows, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self.pads = torch.zeros(self.max_rows, dtype=torch.long, device=self.device)
        self.positions = torch.arange(self.max_len, device=self.device)
        self.resident: StaticKV | None = None
        # (rows, span, rows at their own positions) -> (graph, ids, index, logits)
        self.graphs: dict[tuple[int, int, bool], tuple] = {}
        self.cache_kw = "static"
        self.fused = [fuse_layer(layer) for layer in model.model.layers]
        self.numerics = "invariant" if self.kernels is not None else "default"
        self.lookahead = regime == "cuda_graph"  # see step(): the greedy loop may launch a step before it syncs
        # built constructions' rows continue from their own boundaries (the same bits as the live schedule, proven
        # by bench/suffix_schedule.py; not recorded); False keeps every construction in the live schedule
        self.suffix_schedule = bool(suffix_schedule)
        if self.kernels is not None:
            self.block_size = int(describe_invariant(model)["attention_block_size"])
        if self.kernels is not None or kernels == "fused":
            with torch.no_grad():  # the regime's rotary table, gathered by position in the forward (no host sync)
                probe = torch.empty(0, dtype=self.dtype, device=self.device)
                cos, sin = model.model.rotary_emb(probe, self.positions[None])
            self.cos_table, self.sin_table = cos[0], sin[0]  # (max_len, head_dim)

    def record(self) -> dict:
        return {"decode_regime": self.regime, "decode_max_len": self.max_len, "decode_max_rows": self.max_rows,
                "decode_attention": self.attention,
                "decode_prefill_group": self.prefill_group, "decode_kernels": self.decode_kernels}

    def span(self, end: int) -> int:
        """How many buffer positions a forward ending at ``end`` (exclusive) attends over: the whole buffer, so that
        every step has the same shapes at every position (a benchmark may override it)."""
        return self.max_len

    # -- caches -------------------------------------------------------------------------------------------
    def _evict(self) -> None:
        cache = self.resident
        if cache is not None:
            cache.store = [(self.k[i][: cache.rows, :, : cache.length].clone(),
                            self.v[i][: cache.rows, :, : cache.length].clone()) for i in range(self.n_layers)]
        self.resident = None

    def _make_resident(self, cache: StaticKV) -> None:
        if self.resident is cache:
            return
        self._evict()
        for i in range(self.n_layers):
            self.k[i].zero_()
            self.v[i].zero_()
            if cache.store is not None:
                k, v = cache.store[i]
                self.k[i][: cache.rows, :, : cache.length].copy_(k)
                self.v[i][: cache.rows, :, : cache.length].copy_(v)
        self.pads.zero_()
        self.pads[: cache.rows].copy_(cache.pads)
        cache.store = None
        self.resident = cache

    # -- forwards -----------------------------------------------------------------------------------------
    def _capture(self, rows: int, span: int, own: bool):
        ids = torch.full((rows, 1), self.pad_id, dtype=torch.long, device=self.device)
        # The warm-up really runs: it writes the span's last position, which no cache of this span has used yet
        # and which is zeroed again below (positions past a cache's length stay zero).
        index = torch.full((rows, 1) if own else (1,), span - 1, dtype=torch.long, device=self.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph: allocator pools, cuBLAS handles
            for _ in range(2):
                self._forward(ids, index, rows, span)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._forward(ids, index, rows, span)
        for k, v in zip(self.k, self.v):
            k[:rows, :, span - 1].zero_()
            v[:rows, :, span - 1].zero_()
        self.graphs[rows, span, own] = (graph, ids, index, logits)
        return self.graphs[rows, span, own]

    @torch.inference_mode()
    def forward_rows(self, ids: torch.Tensor, cache: StaticKV) -> torch.Tensor:
        """Feed ``ids`` (rows, T) into ``cache`` (mutated); fp32 logits (rows, vocab) of the last position."""
        rows, T = ids.shape
        if rows != cache.rows:
            raise ValueError(f"{rows} rows of ids for a cache of {cache.rows} rows")
        own = cache.cursors is not None  # every row at its own position (one-token steps only)
        if own and T != 1:
            raise ValueError("a batch whose rows sit at their own positions takes one-token steps only")
        end = (max(cache.cursors) if own else cache.length) + T
        if end > self.max_len:
            raise ValueError(f"the static cache holds {self.max_len} positions; a forward to position {end} does "
                             "not fit: raise decode_max_len")
        self._make_resident(cache)
        ids = ids.to(self.device)
        if T == 1 and self.regime == "cuda_graph":
            span = self.span(end)
            graph, g_ids, g_index, g_logits = self.graphs.get((rows, span, own)) or self._capture(rows, span, own)
            g_ids.copy_(ids)
            if own:
                g_index.copy_(cache.cursor_index)
            else:
                g_index.fill_(cache.length)
            graph.replay()
            logits = g_logits.clone()
        else:
            index = cache.cursor_index if own else torch.arange(cache.length, cache.length + T, device=self.device)
            span = self.span(end)
            group = self.prefill_group if T > 1 and self.prefill_group else rows
            logits = torch.cat([self._forward(ids[r0:r0 + group], index, min(group, rows - r0), span, r0)
                                for r0 in range(0, rows, group)])
        cache.moved(T)
        return logits

    # -- the decoder protocol -----------------------------------------------------------------------------
    def independent_rows(self, rows: int) -> bool:
        return rows == 1

    def rows_from_boundaries(self, rows: int) -> bool:
        return self.suffix_schedule

    def _layout(self, prompts: list[list[int]]) -> list[int]:
        if not 1 <= len(prompts) <= self.max_rows:
            raise ValueError(f"a batch of {len(prompts)} rows does not fit the decoder's {self.max_rows}")
        width = max(len(p) for p in prompts)
        return [width - len(p) for p in prompts]

    def open(self, prompts: list[list[int]]) -> tuple[StaticKV, torch.Tensor]:
        batch = StaticKV(self, self._layout(prompts))
        ids = [[self.pad_id] * int(pad) + list(p) for pad, p in zip(batch.pads, prompts)]
        return batch, self.forward_rows(torch.tensor(ids, dtype=torch.long), batch)

    def step(self, batch: StaticKV, tokens: list[int | None] | torch.Tensor) -> torch.Tensor:
        if isinstance(tokens, torch.Tensor):  # ids already on the device (the greedy loop's lookahead): no sync
            return self.forward_rows(tokens.view(-1, 1), batch)
        feed = [[self.pad_id if t is None else int(t)] for t in tokens]  # idle rows write padding they never read
        return self.forward_rows(torch.tensor(feed, dtype=torch.long), batch)

    def advance(self, batch: StaticKV, steps: int) -> bool:
        """Skip ``steps`` one-token steps: their positions stay as they are until each row's cache is written over
        them (a step's bits depend on the positions it reads, the row's ids and the batch's shape, not on when
        the positions were written)."""
        if batch.cursors is not None:
            raise ValueError("a batch whose rows sit at their own positions is not in the lockstep schedule")
        if batch.length + steps > self.max_len:
            raise ValueError(f"the static cache holds {self.max_len} positions; {batch.length} used + {steps} "
                             "skipped do not fit: raise decode_max_len")
        batch.length += steps
        return True

    def rewind(self, batch: StaticKV) -> None:
        """Take back the last one-token step: the next step writes the same position again, and no forward reads
        a position at or after its own."""
        if batch.length < 1:
            raise ValueError("a batch with no position written has no step to take back")
        batch.moved(-1)

    @torch.inference_mode()
    def build(self, prompts: list[list[int]], cached: list[list[int] | None],
              segments: list[list[int]] | None) -> StaticKV:
        batch = StaticKV(self, self._layout(prompts))
        width = int(batch.pads[0]) + len(prompts[0])
        length = width + max([len(c) - len(p) for c, p in zip(cached, prompts) if c is not None], default=0)
        # each row's next step at its own boundary (a row without a prefix: after its prompt)
        ends = [int(pad) + len(c if c is not None else p) for pad, c, p in zip(batch.pads, cached, prompts)]
        if segments is None or batch.rows == 1 and segments[0] is None:  # one forward over every row
            ids = [[self.pad_id] * int(pad) + list(c if c is not None else p) for pad, c, p in
                   zip(batch.pads, cached, prompts)]
            ids = [row + [self.pad_id] * (length - len(row)) for row in ids]  # right filler: written, never read
            self.forward_rows(torch.tensor(ids, dtype=torch.long), batch)
            batch.seat(ends)
            return batch
        if batch.rows == 1:  # the row's own forwards (one-token ones through the graph, as the schedule's steps)
            start = 0
            for n in segments[0]:
                self.forward_rows(torch.tensor([cached[0][start:start + n]], dtype=torch.long), batch)
                start += n
            return batch
        self._make_resident(batch)
        for r, (row_ids, sizes) in enumerate(zip(cached, segments)):
            if row_ids is None:
                continue
            at = int(batch.pads[r])
            for n in sizes:
                ids = torch.tensor([row_ids[at - int(batch.pads[r]):][:n]], dtype=torch.long, device=self.device)
                index = torch.arange(at, at + n, device=self.device)
                self._forward(ids, index, 1, self.span(at + n), r)
                at += n
        batch.length = length
        batch.seat(ends)
        return batch

    @torch.inference_mode()
    def place(self, pads: list[int], caches: list[Layers | None]) -> StaticKV:
        """Rows continuing from given boundary caches, each at its own position: the buffer zeroed, row r's cache
        copied over positions [pads[r], pads[r] + its length), the rest left at zero, which no row reads (keys
        before a row's pad or after its position are masked, and a masked key adds exactly nothing)."""
        if not self.suffix_schedule:
            raise RegimeError("this decoder was built with suffix_schedule=False: its rows do not continue from "
                              "their own boundaries, so given boundary caches cannot be placed")
        if len(caches) != len(pads):
            raise ValueError(f"{len(caches)} caches for {len(pads)} rows")
        batch = StaticKV(self, self._checked_pads(pads))
        ends = [int(p) + (0 if c is None else int(c[0][0].shape[2])) for p, c in zip(pads, caches)]
        batch.length = max(ends + [1])
        if batch.length > self.max_len:
            raise ValueError(f"a boundary cache to position {batch.length} does not fit the static cache's "
                             f"{self.max_len} positions: raise decode_max_len")
        self._make_resident(batch)
        for r, cache in enumerate(caches):
            if cache is None:
                continue
            if len(cache) != self.n_layers:
                raise ValueError(f"row {r}: a cache of {len(cache)} layers for a model of {self.n_layers}")
            lo, hi = int(pads[r]), ends[r]
            for i, (k, v) in enumerate(cache):
                self.k[i][r:r + 1, :, lo:hi].copy_(k)
                self.v[i][r:r + 1, :, lo:hi].copy_(v)
        batch.seat([e if c is not None else batch.length for e, c in zip(ends, caches)])
        return batch

    def _checked_pads(self, pads: list[int]) -> list[int]:
        if not 1 <= len(pads) <= self.max_rows:
            raise ValueError(f"a batch of {len(pads)} rows does not fit the decoder's {self.max_rows}")
        if any(int(p) < 0 for p in pads):
            raise ValueError(f"left pads {pads} must not be negative")
        return [int(p) for p in pads]

    def row_layers(self, batch: StaticKV, row: int, end: int) -> Layers:
        pad = int(batch.pads[row])
        return [(k[row:row + 1, :, pad:end], v[row:row + 1, :, pad:end])
                for k, v in (batch.tensors(i) for i in range(self.n_layers))]

    def pad(self, batch: StaticKV, row: int) -> int:
        return int(batch.pads[row])
