"""A fast decode regime: a static KV cache, one forward over it, and the one-token step in a CUDA graph.

The engine's default regime (``eager``) runs the Hugging Face forward with a ``DynamicCache``: exact and
simple, but launch-bound on a GPU (a few hundred small kernels per token, each issued from Python). This
module is a second numerical regime that every construction of a run can use instead:

- ``static``: the model's own weights and modules, driven by a forward written here over a preallocated
  K/V buffer of ``max_len`` positions per row. Every forward (prefill, chunk or one token) attends over the
  whole buffer under a mask, so a decode step has the same shapes at every position. Runs on CPU too.
- ``cuda_graph``: the ``static`` forward, with the one-token step captured once in a CUDA graph and replayed
  (multi-token forwards stay eager). Launch cost disappears; what is left is reading the weights.

A regime is part of a construction: compiled or graph-replayed kernels, masked full-buffer attention and the
buffer length ``max_len`` all change the bits against the eager regime, so results are only comparable within
one regime (the ledger records it). An optional ``bucket`` makes each forward attend over the next multiple
of ``bucket`` positions rather than the whole buffer (one graph per span): faster at long buffers, exact within
itself because the span is a function of the position alone, but another regime parameter (recorded too). Within a regime, replicas are bit-exact and ``live`` equals ``incremental``
byte for byte, because both feed stage tokens through the same one-token step.

Batching: several items share one buffer, left-padded so that every row writes the same buffer position at
each step; a row's mask hides its padding and its RoPE positions start at 0 after it. A row's numbers can
depend on its padding (the reduction over the buffer sees its keys at other offsets): batch composition is a
further construction factor, fixed by a seeded :func:`batch_plan` and checked by a batch-invariance control.

:class:`StaticDecoder` quacks like :class:`stagereplay.engine.Decoder` (``new_cache``, ``forward``), and its
cache like a ``DynamicCache`` as far as :mod:`stagereplay.compat` reads one, so the engine's
``generate_to_boundary``, ``build_cache`` and ``continue_greedy`` run in this regime unchanged.
Qwen2-style decoders only (Qwen2/2.5, Llama-like layouts with q/k/v/o projections and full attention).

Under ``numerics: invariant`` (a model switched by :func:`stagereplay.invariant.apply`) the static forward
computes through the regime's kernels instead (Triton on CUDA): every GEMM, norm, rotary and activation is
row-invariant and the attention reads each row's own keys only, in blocks aligned at its first real key. A
row's bits then depend neither on its padding nor on the other rows: batched results equal batch-1 results
byte for byte, and prefill equals live.
"""

from __future__ import annotations

import os
import random
from contextlib import contextmanager
from dataclasses import dataclass

import torch

REGIMES = ("eager", "static", "cuda_graph")
# the static forward's attention: ``masked`` (one GEMM over the buffer span under an additive mask, softmax, GEMM)
# or ``triton`` (a flash loop over each row's own keys up to its position; needs Triton): another regime parameter
ATTENTIONS = ("masked", "triton")
TRITON_ATTENTION_BLOCK = 64


class RegimeError(ValueError):
    """A decode regime that is unknown or cannot run here."""


@contextmanager
def _unique_index_writes():
    """K/V writes go to distinct positions, so the non-sorting ``index_copy_`` is deterministic; the sorting
    variant that deterministic mode would pick is not capturable in a CUDA graph on every build."""
    was = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    if was:
        torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        if was:
            torch.use_deterministic_algorithms(True, warn_only=warn)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _fuse_layer(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One weight for q/k/v and one for gate/up, so that each is one GEMM (fewer launches per token).

    The modules' own weights are rebound to row slices of the fused tensors: no memory is duplicated, and the
    eager forward reads the same values with the same layout. Idempotent: a layer fused before is reused.
    """
    if hasattr(layer, "_stagereplay_fused"):
        return layer._stagereplay_fused
    attn, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv_w = torch.cat([p.weight for p in projs])
        qkv_b = torch.cat([p.bias for p in projs]) if all(p.bias is not None for p in projs) else None
        gate_up_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        start = 0
        for p in projs:
            n = p.weight.shape[0]
            p.weight.data = qkv_w[start:start + n]
            if qkv_b is not None:
                p.bias.data = qkv_b[start:start + n]
            start += n
        n = mlp.gate_proj.weight.shape[0]
        mlp.gate_proj.weight.data = gate_up_w[:n]
        mlp.up_proj.weight.data = gate_up_w[n:]
    layer._stagereplay_fused = (qkv_w, qkv_b, gate_up_w)
    return layer._stagereplay_fused


class StaticKV:
    """A boundary cache in the static regime: ``rows`` items, left pads, and ``length`` buffer positions used.

    The decoder owns one working buffer (the CUDA graph reads fixed addresses); a cache is either resident in
    it or holds its own copy of the used positions. ``layers`` gives per-layer views whose ``keys``/``values``
    are the used positions of the row(s), shaped like a DynamicCache layer's: (rows, kv_heads, length, head_dim).
    For a single row, its left padding is dropped so that fingerprints do not depend on the buffer layout.
    """

    def __init__(self, decoder: "StaticDecoder", rows: int):
        self.decoder = decoder
        self.rows = rows
        self.length = 0
        self.pads = torch.zeros(rows, dtype=torch.long)
        self.store: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # own copy when not resident

    # -- what compat reads ------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length - int(self.pads.min()) if self.rows == 1 else self.length

    @property
    def layers(self):
        return [_LayerView(self, i) for i in range(self.decoder.n_layers)]

    def crop(self, n: int) -> None:
        drop = -n if n < 0 else self.get_seq_length() - n
        self.length -= max(0, drop)

    def _tensors(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.decoder.resident is self:
            return self.decoder.k[i][: self.rows, :, : self.length], self.decoder.v[i][: self.rows, :, : self.length]
        if self.store is None:
            raise RuntimeError("a static cache that was never filled has no layers")
        return self.store[i]

    def row_layers(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) per layer for one row, its padding dropped: (1, kv_heads, used, head_dim)."""
        pad = int(self.pads[row])
        out = []
        for i in range(self.decoder.n_layers):
            k, v = self._tensors(i)
            out.append((k[row:row + 1, :, pad:], v[row:row + 1, :, pad:]))
        return out

    def __deepcopy__(self, memo):
        other = StaticKV(self.decoder, self.rows)
        other.length = self.length
        other.pads = self.pads.clone()
        other.store = [(k.clone(), v.clone()) for k, v in (self._tensors(i) for i in range(self.decoder.n_layers))]
        return other


class _LayerView:
    def __init__(self, cache: StaticKV, index: int):
        self.cache, self.index = cache, index

    def _get(self, which: int) -> torch.Tensor:
        t = self.cache._tensors(self.index)[which]
        if self.cache.rows == 1:
            t = t[:, :, int(self.cache.pads[0]):]
        return t

    def _set(self, which: int, value: torch.Tensor) -> None:
        cache = self.cache
        if cache.rows != 1 or int(cache.pads[0]) != 0:
            raise NotImplementedError("replacing layers of a padded or batched static cache is not supported")
        if tuple(value.shape) != tuple(self._get(which).shape):
            raise ValueError(f"layer {self.index}: replacement of shape {tuple(value.shape)} does not match "
                             f"{tuple(self._get(which).shape)}")
        if cache.decoder.resident is cache:
            cache.decoder._evict()
        pair = list(cache.store[self.index])
        pair[which] = value.clone()
        cache.store[self.index] = tuple(pair)

    keys = property(lambda self: self._get(0), lambda self, t: self._set(0, t))
    values = property(lambda self: self._get(1), lambda self, t: self._set(1, t))


class StaticDecoder:
    """The static/cuda_graph regime for one model: a K/V buffer of ``max_len`` positions for ``max_rows`` rows.

    ``forward(ids, cache)`` (one row, the engine's interface) and ``forward_rows(ids, cache)`` (a (rows, T)
    tensor) feed new tokens and return the last position's fp32 logits. One-token forwards replay a CUDA graph
    in the ``cuda_graph`` regime (one graph per row count, captured at first use).
    """

    def __init__(self, model: torch.nn.Module, eos_ids: tuple[int, ...] = (), *, max_len: int, max_rows: int = 1,
                 regime: str = "static", pad_id: int = 0, bucket: int | None = None, attention: str = "masked",
                 prefill_group: int | None = None):
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
        if bucket is not None and bucket < 1:
            raise RegimeError("decode_bucket must be a positive number of positions")
        self.bucket = int(bucket) if bucket else None
        if attention not in ATTENTIONS:
            raise RegimeError(f"decode_attention {attention!r} is not one of {list(ATTENTIONS)}")
        self.attention = attention
        if prefill_group is not None and int(prefill_group) < 1:
            raise RegimeError(f"decode_prefill_group {prefill_group!r}: a positive number of rows, or null for all rows")
        # rows of a multi-token forward (a batch's one-shot prefill) run in groups of this many, in row order: the
        # memory of a prefill's attention grows with rows x tokens x span. A regime parameter (in the default
        # numerics a row's bits may depend on the rows it is computed with); None: every row in one forward
        self.prefill_group = int(prefill_group) if prefill_group else None
        if attention == "triton":  # each row's keys only, up to its position, in 64-key blocks (no span to bucket)
            if self.bucket is not None:
                raise RegimeError("decode_bucket has no effect with decode_attention 'triton' (it reads each row's "
                                  "keys up to its position); drop one of them")
            if next(model.parameters()).device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise RegimeError("decode_attention 'triton' runs Triton kernels on a CUDA device and the model is "
                                  "on the CPU: use decode_attention masked there (TRITON_INTERPRET=1 runs the "
                                  "kernels in Triton's slow interpreter, for tests)")
            from stagereplay.models.invariant_triton import TritonKernels

            self._triton = TritonKernels()
        self.dtype = next(model.parameters()).dtype
        shape = (self.max_rows, self.n_kv, self.max_len, self.head_dim)  # (rows, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self.pads = torch.zeros(self.max_rows, dtype=torch.long, device=self.device)
        self.positions = torch.arange(self.max_len, device=self.device)
        self.resident: StaticKV | None = None
        self.graphs: dict[tuple[int, int], tuple] = {}  # (rows, span) -> (graph, ids, index, logits)
        self.cache_kw = "static"
        self.fused = [_fuse_layer(layer) for layer in model.model.layers]
        self.kernels = getattr(model, "_stagereplay_kernels", None)  # numerics: invariant
        if self.kernels is not None:
            from stagereplay.models.invariant import describe

            self.block_size = int(describe(model)["attention_block_size"])
            with torch.no_grad():  # the regime's rotary table, gathered by position in the forward (no host sync)
                probe = torch.empty(0, dtype=self.dtype, device=self.device)
                cos, sin = model.model.rotary_emb(probe, self.positions[None])
            self.cos_table, self.sin_table = cos[0], sin[0]  # (max_len, head_dim)

    def describe(self) -> dict:
        return {"decode_regime": self.regime, "decode_max_len": self.max_len, "decode_max_rows": self.max_rows,
                "decode_bucket": self.bucket, "decode_attention": self.attention,
                "decode_prefill_group": self.prefill_group}

    def span(self, end: int) -> int:
        """How many buffer positions a forward ending at ``end`` (exclusive) attends over: the whole buffer, or
        with ``bucket`` the next multiple of it. A function of the position alone, so that live and incremental
        steps at one position still share every kernel shape (the bridge holds), while short contexts do not
        pay for reading the whole buffer."""
        if self.bucket is None:
            return self.max_len
        return min(self.max_len, -(-end // self.bucket) * self.bucket)

    # -- caches -------------------------------------------------------------------------------------------
    def new_cache(self, rows: int = 1) -> StaticKV:
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"a static cache of {rows} rows does not fit the decoder's {self.max_rows}")
        return StaticKV(self, rows)

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
    def _forward(self, ids: torch.Tensor, index: torch.Tensor, rows: int, span: int, row0: int = 0) -> torch.Tensor:
        """Feed ``ids`` (rows, T) at buffer positions ``index`` (T,) into buffer rows ``row0``..``row0 + rows``;
        return fp32 logits of the last position.

        Every query attends over the first ``span`` buffer positions under an additive mask: keys at or after the row's padding
        and at or before the query's own position (a padding query sees itself only, so it stays finite).
        Written for few kernels per layer (a graph replays them all, but each still costs a launch on the
        device): fused RMSNorm, one RoPE over q and k together, scale and mask folded into one batched GEMM.
        """
        if self.kernels is not None:
            return self._forward_invariant(ids, index, rows, row0)
        inner = self.model.model
        T = ids.shape[1]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        group = H // KV
        pads = self.pads[row0:row0 + rows]
        position_ids = (index[None, :] - pads[:, None]).clamp_min(0)  # (rows, T)
        h = inner.embed_tokens(ids)  # (rows, T, hidden)
        cos, sin = inner.rotary_emb(h, position_ids)  # (rows, T, D)
        # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated)
        half = D // 2
        cos = cos[:, None]
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]  # (rows, 1, T, D)
        if self.attention == "masked":
            keys = self.positions[None, None, :span]  # (1, 1, span)
            allowed = ((keys >= pads[:, None, None]) & (keys <= index[None, :, None])) | (keys == index[None, :, None])
            bias = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed,
                                                                                                 float("-inf"))
            # (rows*KV, group*T, span): the query heads sharing a K/V head side by side, T innermost
            bias = bias[:, None, None].expand(rows, KV, group, T, span).reshape(rows * KV, group * T, span)
        hidden = h.shape[-1]
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            norm = layer.input_layernorm
            x = torch.nn.functional.rms_norm(h, (hidden,), norm.weight, norm.variance_epsilon)
            qkv_w, qkv_b, gate_up_w = self.fused[i]
            qkv = torch.nn.functional.linear(x, qkv_w, qkv_b)  # (rows, T, (H + 2 KV) D)
            qk = qkv[..., : (H + KV) * D].view(rows, T, H + KV, D).transpose(1, 2)
            qk = torch.addcmul(qk * cos, torch.roll(qk, half, dims=-1), sin)  # RoPE: (rows, H+KV, T, D)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[..., (H + KV) * D:].view(rows, T, KV, D).transpose(1, 2)
            kb, vb = self.k[i][row0:row0 + rows], self.v[i][row0:row0 + rows]  # (rows, KV, max_len, D)
            with _unique_index_writes():
                kb.index_copy_(2, index, k)
                vb.index_copy_(2, index, v)
            if self.attention == "triton":
                out = self._triton.attention_rows(q.transpose(1, 2), kb, vb, pads, index, attn.scaling,
                                                  TRITON_ATTENTION_BLOCK).reshape(rows, T, H * D)
            else:
                qg = q.reshape(rows * KV, group * T, D)
                kspan = kb.view(rows * KV, self.max_len, D)[:, :span]  # (rows*KV, span, D), strided
                scores = torch.baddbmm(bias, qg, kspan.transpose(1, 2), alpha=attn.scaling)
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
                out = torch.bmm(probs, vb.view(rows * KV, self.max_len, D)[:, :span])  # (rows*KV, group*T, D)
                out = out.view(rows, H, T, D).transpose(1, 2).reshape(rows, T, H * D)
            h = h + attn.o_proj(out)
            norm = layer.post_attention_layernorm
            x = torch.nn.functional.rms_norm(h, (hidden,), norm.weight, norm.variance_epsilon)
            gate, up = torch.nn.functional.linear(x, gate_up_w).chunk(2, dim=-1)
            h = h + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        norm = inner.norm
        h = torch.nn.functional.rms_norm(h[:, -1:], (hidden,), norm.weight, norm.variance_epsilon)
        return self.model.lm_head(h)[:, 0].float()  # (rows, vocab)

    def _forward_invariant(self, ids: torch.Tensor, index: torch.Tensor, rows: int, row0: int = 0) -> torch.Tensor:
        """``_forward`` under ``numerics: invariant``: the same layer, every operation through the regime's
        row-invariant kernels (token rows flattened to (rows * T, features)), attention over each row's own keys."""
        ops = self.kernels
        inner = self.model.model
        T = ids.shape[1]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        pads = self.pads[row0:row0 + rows]
        position_ids = (index[None, :] - pads[:, None]).clamp_min(0)  # (rows, T)
        cos = self.cos_table[position_ids].reshape(rows * T, D)
        sin = self.sin_table[position_ids].reshape(rows * T, D)
        h = inner.embed_tokens(ids).reshape(rows * T, -1)
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b, gate_up_w = self.fused[i]
            norm = layer.input_layernorm
            qkv = ops.linear(ops.rms_norm(h, norm.weight, norm.variance_epsilon), qkv_w, qkv_b)
            q = ops.rotary(qkv[:, : H * D].reshape(rows * T, H, D), cos, sin)
            k = ops.rotary(qkv[:, H * D: (H + KV) * D].reshape(rows * T, KV, D), cos, sin)
            v = qkv[:, (H + KV) * D:].reshape(rows, T, KV, D).transpose(1, 2)
            kb, vb = self.k[i][row0:row0 + rows], self.v[i][row0:row0 + rows]  # (rows, KV, max_len, D)
            with _unique_index_writes():
                kb.index_copy_(2, index, k.view(rows, T, KV, D).transpose(1, 2))
                vb.index_copy_(2, index, v)
            out = ops.attention_rows(q.view(rows, T, H, D), kb, vb, pads, index, attn.scaling, self.block_size)
            h = h + ops.linear(out.reshape(rows * T, H * D), attn.o_proj.weight, attn.o_proj.bias)
            norm = layer.post_attention_layernorm
            gate_up = ops.linear(ops.rms_norm(h, norm.weight, norm.variance_epsilon), gate_up_w, None)
            width = gate_up.shape[1] // 2
            hidden = ops.gated_act(mlp.act_fn, gate_up[:, :width], gate_up[:, width:])
            h = h + ops.linear(hidden, mlp.down_proj.weight, mlp.down_proj.bias)
        last = h.view(rows, T, -1)[:, -1]
        norm = inner.norm
        return ops.linear(ops.rms_norm(last, norm.weight, norm.variance_epsilon), self.model.lm_head.weight,
                          self.model.lm_head.bias).float()  # (rows, vocab)

    def _capture(self, rows: int, span: int):
        ids = torch.full((rows, 1), self.pad_id, dtype=torch.long, device=self.device)
        # The warm-up really runs: it writes the span's last position, which no cache of this span has used yet
        # and which is zeroed again below (positions past a cache's length stay zero).
        index = torch.full((1,), span - 1, dtype=torch.long, device=self.device)
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
        self.graphs[rows, span] = (graph, ids, index, logits)
        return self.graphs[rows, span]

    @torch.inference_mode()
    def forward_rows(self, ids: torch.Tensor, cache: StaticKV) -> torch.Tensor:
        """Feed ``ids`` (rows, T) into ``cache`` (mutated); fp32 logits (rows, vocab) of the last position."""
        rows, T = ids.shape
        if rows != cache.rows:
            raise ValueError(f"{rows} rows of ids for a cache of {cache.rows} rows")
        if cache.length + T > self.max_len:
            raise ValueError(f"the static cache holds {self.max_len} positions; {cache.length} used + {T} new do "
                             "not fit: raise decode_max_len")
        self._make_resident(cache)
        ids = ids.to(self.device)
        if T == 1 and self.regime == "cuda_graph":
            span = self.span(cache.length + 1)
            graph, g_ids, g_index, g_logits = self.graphs.get((rows, span)) or self._capture(rows, span)
            g_ids.copy_(ids)
            g_index.fill_(cache.length)
            graph.replay()
            logits = g_logits.clone()
        else:
            index = torch.arange(cache.length, cache.length + T, device=self.device)
            span = self.span(cache.length + T)
            group = self.prefill_group if T > 1 and self.prefill_group else rows
            logits = torch.cat([self._forward(ids[r0:r0 + group], index, min(group, rows - r0), span, r0)
                                for r0 in range(0, rows, group)])
        cache.length += T
        return logits

    def forward(self, ids: list[int], cache: StaticKV) -> torch.Tensor:
        """The engine's interface: one row, ``ids`` the new tokens; fp32 logits (vocab,)."""
        return self.forward_rows(torch.tensor([ids], dtype=torch.long), cache)[0]

    def prefill_rows(self, rows_ids: list[list[int]], cache: StaticKV) -> torch.Tensor:
        """Left-pad ``rows_ids`` to one length and feed them into an empty ``cache`` in one forward."""
        if cache.length:
            raise ValueError("prefill_rows needs an empty cache")
        width = max(len(r) for r in rows_ids)
        cache.pads = torch.tensor([width - len(r) for r in rows_ids], dtype=torch.long)
        if self.resident is cache:
            self.pads[: cache.rows].copy_(cache.pads)
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + list(r) for r in rows_ids], dtype=torch.long)
        return self.forward_rows(ids, cache)


def check_static_options(regime: str, attention: str = "masked", prefill_group: int | None = None) -> None:
    """Refuse static-buffer options for the eager regime, which has no static buffer (the decoder factory and the
    workflow's parse-time check both call this)."""
    if regime == "eager" and (attention != "masked" or prefill_group is not None):
        raise RegimeError(
            f"decode_attention: {attention} and decode_prefill_group: {prefill_group} set the forward over the static "
            "K/V buffer, which decode_regime: eager does not have: they need decode_regime static or cuda_graph; set "
            "decode_regime: static or cuda_graph, or leave them at their defaults (masked, null)")


def make_decoder(model, eos_ids=(), regime: str = "eager", max_len: int | None = None, max_rows: int = 1,
                 bucket: int | None = None, attention: str = "masked", prefill_group: int | None = None):
    """The decoder of a regime: the engine's eager Decoder, or a StaticDecoder for ``static``/``cuda_graph``."""
    if regime not in REGIMES:
        raise RegimeError(f"decode_regime {regime!r} is not one of {list(REGIMES)}")
    check_static_options(regime, attention, prefill_group)
    if regime == "eager":
        from stagereplay.engine import Decoder

        return Decoder(model, tuple(eos_ids))
    if max_len is None:
        raise RegimeError(f"decode_regime {regime!r} needs max_len (prompt + stage + suffix budget)")
    return StaticDecoder(model, tuple(eos_ids), max_len=max_len, max_rows=max_rows, regime=regime, bucket=bucket,
                         attention=attention, prefill_group=prefill_group)


def regime_info(decoder) -> dict:
    """What the ledger and provenance record about the regime a decoder runs."""
    if isinstance(decoder, StaticDecoder):
        return decoder.describe()
    return {"decode_regime": "eager", "decode_max_len": None, "decode_max_rows": 1, "decode_bucket": None}


# -- batching -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchPlan:
    """Which items are decoded together: ``batches[j]`` lists item ids in row order. Fixed by ``seed``."""

    seed: int
    batch_size: int
    batches: tuple[tuple[str, ...], ...]

    def records(self) -> list[dict]:
        """One record per item (for the ledger): its batch, its row, and the batch's size."""
        return [{"item_id": item, "batch_index": j, "batch_row": r, "batch_rows": len(batch),
                 "batch_seed": self.seed}
                for j, batch in enumerate(self.batches) for r, item in enumerate(batch)]


def batch_plan(item_ids: list[str], batch_size: int, seed: int) -> BatchPlan:
    """A seeded shuffle of the items cut into batches of ``batch_size`` (the last may be smaller)."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if len(set(item_ids)) != len(item_ids):
        raise ValueError("batch_plan: item ids must be unique")
    order = list(item_ids)
    random.Random(seed).shuffle(order)
    batches = tuple(tuple(order[i:i + batch_size]) for i in range(0, len(order), batch_size))
    return BatchPlan(seed, batch_size, batches)


@dataclass
class RowResult:
    stage_ids: list[int]  # up to and including the boundary token ([] when missing)
    suffix_ids: list[int]
    margins: list[float]
    stop_reason: str  # eos | max_new_tokens | boundary_missing
    cache_layers: list | None  # the live boundary cache of the row (prompt + stage[:-1]), unpadded
    # (whole, K per layer, V per layer) of that cache when only its fingerprints were kept (``keep_rows``)
    fingerprints: tuple | None = None


def row_fingerprints(res: RowResult) -> tuple | None:
    """A row result's boundary-cache fingerprints: kept ones, else computed from its layers (None: no cache)."""
    from stagereplay.io.fingerprints import fingerprint_layers

    if res.fingerprints is not None:
        return res.fingerprints
    return fingerprint_layers(res.cache_layers) if res.cache_layers else None


def _kept(layers, r: int, keep_rows: set[int] | None) -> tuple[list | None, tuple | None]:
    """A row's boundary cache as a result keeps it: a copy of every layer (``keep_rows`` None), or its
    fingerprints, plus a copy for the rows in ``keep_rows`` (a paper-scale batch cannot hold a copy of every
    row's cache per replica and construction beside the K/V buffer)."""
    from stagereplay.io.fingerprints import fingerprint_layers

    if keep_rows is None:
        return [(k.clone(), v.clone()) for k, v in layers], None
    return ([(k.clone(), v.clone()) for k, v in layers] if r in keep_rows else None), fingerprint_layers(layers)


def _greedy(logits: torch.Tensor):
    """Per row: greedy id (lowest index on ties), top-2 margin, all-finite; one device-to-host copy."""
    top = torch.topk(logits, 2, dim=-1)
    choice = torch.argmax(logits, dim=-1)
    finite = torch.isfinite(logits).all(dim=-1)
    return choice, (top.values[:, 0] - top.values[:, 1]), finite


def generate_batch(decoder: StaticDecoder, prompts: list[list[int]], boundary_reached, max_stage_tokens: int,
                   max_new_tokens: int, keep_cache: bool = True, forced: list[list[int] | None] | None = None,
                   at_boundary=None, keep_rows: set[int] | None = None) -> list[RowResult]:
    """Live construction for several items at once: greedy from each prompt to its boundary, then its suffix.

    ``boundary_reached(generated_ids) -> bool`` is the engine's matcher. Every row steps until all rows have a
    suffix of ``max_new_tokens``, an EOS, or no boundary within ``max_stage_tokens``; rows that finished are fed
    their own last token as filler (their results no longer change). A row's live boundary cache is the buffer
    over its prompt and stage but the last token: positions written before its boundary was chosen.

    ``forced`` makes this the ``incremental`` construction in the live run's own batched schedule: row r is fed
    ``forced[r]`` (its stage ids, the boundary token last) one token per step instead of its greedy choices, then
    continues greedily; a row whose entry is None is filler from the start (fed padding; its result is empty,
    stop reason ``no_prefix``). Every row still writes the same buffer positions at each step as in the live
    run, so a forced row whose ids are the live row's own is the live row, byte for byte (the batched bridge).
    ``at_boundary(row, cache, end)``, when given, runs when a row's boundary token is chosen and before it is
    fed: the row's boundary cache is then buffer positions [its padding, ``end``) (a transplant swaps them there).
    With ``keep_rows`` a result keeps its cache's fingerprints, and a copy of the cache only for those rows.
    """
    rows = len(prompts)
    if forced is not None and len(forced) != rows:
        raise ValueError(f"forced: {len(forced)} stages for {rows} prompts")
    cache = decoder.new_cache(rows)
    logits = decoder.prefill_rows(prompts, cache)
    width = cache.length
    generated = [[] for _ in range(rows)]
    margins = [[] for _ in range(rows)]
    boundary_at = [None] * rows  # index into generated of the boundary token
    done = [None] * rows  # stop reason
    if forced is not None:
        done = [None if f is not None else "no_prefix" for f in forced]
        if any(f is not None and not f for f in forced):
            raise ValueError("forced: a row's stage ids are empty (give None for a row without a prefix)")
        max_stage_tokens = max([len(f) for f in forced if f is not None], default=0)
    budget = max_stage_tokens + max_new_tokens
    for _ in range(budget):
        if all(done):
            break
        choice, margin, finite = (t.cpu() for t in _greedy(logits))
        for r in range(rows):
            if done[r]:
                continue
            teacher = forced is not None and boundary_at[r] is None
            if not teacher and not bool(finite[r]):  # teacher forcing reads no logits (as build_cache)
                done[r] = "nonfinite"
                continue
            token = forced[r][len(generated[r])] if teacher else int(choice[r])
            generated[r].append(token)
            margins[r].append(float(margin[r]))
            if boundary_at[r] is None:
                if teacher and len(generated[r]) == len(forced[r]):
                    boundary_at[r] = len(generated[r]) - 1
                elif not teacher and boundary_reached(generated[r]):
                    boundary_at[r] = len(generated[r]) - 1
                elif not teacher and (len(generated[r]) >= max_stage_tokens or token in decoder.eos_ids):
                    done[r] = "boundary_missing"
                if boundary_at[r] is not None and at_boundary is not None:
                    at_boundary(r, cache, width + boundary_at[r])
            elif token in decoder.eos_ids:
                done[r] = "eos"
            elif len(generated[r]) - 1 - boundary_at[r] >= max_new_tokens:
                done[r] = "max_new_tokens"
        if all(done):
            break
        feed = torch.tensor([[g[-1] if g else decoder.pad_id] for g in generated], dtype=torch.long)
        logits = decoder.forward_rows(feed, cache)
    results = []
    for r in range(rows):
        b = boundary_at[r]
        if b is None:
            results.append(RowResult([], generated[r], [], done[r] or "boundary_missing", None))
            continue
        layers = fingerprints = None
        if keep_cache:
            end = width + b  # buffer positions of prompt + stage[:-1] end here
            layers, fingerprints = _kept(row_layers(cache, r, end), r, keep_rows)
        results.append(RowResult(generated[r][: b + 1], generated[r][b + 1:], margins[r][b + 1:],
                                 done[r] or "max_new_tokens", layers, fingerprints))
    return results


def continue_batch(decoder: StaticDecoder, cache: StaticKV, pending: list[int], max_new_tokens: int):
    """Greedy suffixes for every row of a (batched) boundary cache; returns (suffix ids, margins, stop) per row."""
    rows = cache.rows
    suffix = [[] for _ in range(rows)]
    margins = [[] for _ in range(rows)]
    stop = [None] * rows
    feed = list(pending)
    for _ in range(max_new_tokens):
        logits = decoder.forward_rows(torch.tensor([[t] for t in feed], dtype=torch.long), cache)
        choice, margin, finite = (t.cpu() for t in _greedy(logits))
        for r in range(rows):
            if stop[r]:
                continue
            if not bool(finite[r]):
                stop[r] = "nonfinite"
                continue
            feed[r] = int(choice[r])
            suffix[r].append(feed[r])
            margins[r].append(float(margin[r]))
            if feed[r] in decoder.eos_ids:
                stop[r] = "eos"
        if all(stop):
            break
    return [(suffix[r], margins[r], stop[r] or "max_new_tokens") for r in range(rows)]


def build_batch(decoder: StaticDecoder, construction: str, prompts: list[list[int]], stages: list[list[int]]):
    """A batched boundary cache over each row's prompt + stage[:-1], built the way ``construction`` says.

    ``prefill``: rows left-padded to one width, one forward. ``incremental``: prompts prefilled (left-padded),
    then stage tokens fed one position per step; a row whose stage is shorter is fed filler after its end and
    its cache is cropped back (positions past its boundary are never read by its own continuation: use
    :func:`row_caches` to take per-row caches).
    """
    rows = len(prompts)
    cache = decoder.new_cache(rows)
    if construction == "prefill":
        decoder.prefill_rows([p + s[:-1] for p, s in zip(prompts, stages)], cache)
        return cache, [cache.length] * rows
    if construction != "incremental":
        raise ValueError(f"build_batch supports prefill and incremental, not {construction!r}")
    decoder.prefill_rows(prompts, cache)
    ends = [cache.length + len(s) - 1 for s in stages]
    longest = max(len(s) - 1 for s in stages)
    for t in range(longest):
        feed = [[s[t] if t < len(s) - 1 else decoder.pad_id] for s in stages]
        decoder.forward_rows(torch.tensor(feed, dtype=torch.long), cache)
    return cache, ends


def row_layers(cache: StaticKV, r: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row ``r``'s (K, V) layers over [its padding, ``end``): views of the buffer, what its fingerprint covers."""
    pad = int(cache.pads[r])
    return [(k[r:r + 1, :, pad:end], v[r:r + 1, :, pad:end])
            for k, v in (cache._tensors(i) for i in range(cache.decoder.n_layers))]


def row_caches(cache: StaticKV, ends: list[int]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per-row (K, V) layers over [row padding, end): what the row's fingerprint covers."""
    return [row_layers(cache, r, end) for r, end in enumerate(ends)]


def construct_batch(decoder: StaticDecoder, construction: str, prompts: list[list[int]],
                    stages: list[list[int] | None], max_new_tokens: int,
                    keep_rows: set[int] | None = None) -> dict[int, RowResult]:
    """Boundary caches of one batch built the way ``construction`` says, each continued: {row: RowResult}.

    Rows whose stage is None take no part (they have no prefix). ``prefill``: the rows with a stage, left-padded
    to one width, one forward, continued together (the matched experiment's schedule). ``incremental``: the live
    run's batched schedule with the stage ids teacher-forced (:func:`generate_batch` with ``forced``); rows
    without a stage stay in the batch as filler, so the batch keeps the plan's rows and prompt padding.
    ``keep_rows``: as :func:`generate_batch` (fingerprints of every row, a copy of the cache for those rows).
    """
    if construction == "incremental":
        results = generate_batch(decoder, prompts, None, 0, max_new_tokens, forced=stages, keep_rows=keep_rows)
        return {r: res for r, res in enumerate(results) if stages[r] is not None}
    if construction != "prefill":
        raise ValueError(f"construct_batch builds prefill and incremental, not {construction!r}")
    rows = [r for r, s in enumerate(stages) if s is not None]
    if not rows:
        return {}
    cache, ends = build_batch(decoder, "prefill", [prompts[r] for r in rows], [stages[r] for r in rows])
    kept = [_kept(row, r, keep_rows) for r, row in zip(rows, row_caches(cache, ends))]  # before continuing
    conts = continue_batch(decoder, cache, [stages[r][-1] for r in rows], max_new_tokens)
    return {r: RowResult(list(stages[r]), suffix, margins, stop, lay, fps)
            for r, (lay, fps), (suffix, margins, stop) in zip(rows, kept, conts)}


def write_row_layers(cache: StaticKV, row: int, end: int, layers) -> None:
    """Overwrite row ``row``'s boundary cache (buffer positions [its padding, ``end``)) with ``layers``: (K, V) per
    layer, each (1, kv_heads, end - padding, head_dim). How a transplant enters a batched cache."""
    pad = int(cache.pads[row])
    for i, (k, v) in enumerate(layers):
        bk, bv = cache._tensors(i)
        if tuple(k.shape) != tuple(bk[row:row + 1, :, pad:end].shape) or tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"layer {i}: a row cache of shape {tuple(k.shape)} does not fit row {row}'s "
                             f"{tuple(bk[row:row + 1, :, pad:end].shape)}")
        bk[row:row + 1, :, pad:end].copy_(k)
        bv[row:row + 1, :, pad:end].copy_(v)


def continue_in_batch(decoder: StaticDecoder, construction: str, prompts: list[list[int]],
                      stages: list[list[int] | None], row: int, layers, max_new_tokens: int) -> RowResult:
    """Row ``row``'s continuation inside its batch when its boundary cache is replaced by ``layers`` (a
    transplant); every other row is built and continued as :func:`construct_batch` builds ``construction``, so
    with the row's own layers this is the row's own continuation there."""
    if construction == "prefill":
        rows = [r for r, s in enumerate(stages) if s is not None]
        cache, ends = build_batch(decoder, "prefill", [prompts[r] for r in rows], [stages[r] for r in rows])
        at = rows.index(row)
        write_row_layers(cache, at, ends[at], layers)
        suffix, margins, stop = continue_batch(decoder, cache, [stages[r][-1] for r in rows], max_new_tokens)[at]
        return RowResult(list(stages[row]), suffix, margins, stop, [(k.clone(), v.clone()) for k, v in layers])
    if construction == "incremental":
        def swap(r, cache, end):
            if r == row:
                write_row_layers(cache, r, end, layers)

        return generate_batch(decoder, prompts, None, 0, max_new_tokens, forced=stages, at_boundary=swap)[row]
    raise ValueError(f"continue_in_batch continues prefill and incremental rows, not {construction!r}")


def compare_rows(batched: list[RowResult], single: list[RowResult], rows: list[int]) -> list[dict]:
    """Batch-invariance records: each sampled row of a batched run against the same item run alone."""
    from stagereplay.engine import first_divergence

    out = []
    for r, alone in zip(rows, single):
        b = batched[r]
        fp_b = (row_fingerprints(b) or ("",))[0]
        fp_s = (row_fingerprints(alone) or ("",))[0]
        out.append({"row": r, "stage_equal": b.stage_ids == alone.stage_ids,
                    "suffix_equal": b.stage_ids == alone.stage_ids and b.suffix_ids == alone.suffix_ids,
                    "cache_equal": fp_b == fp_s and fp_b != "",
                    "suffix_first_divergence": first_divergence(b.stage_ids + b.suffix_ids,
                                                                alone.stage_ids + alone.suffix_ids)})
    return out


def batch_invariance(decoder: StaticDecoder, prompts: list[list[int]], batched: list[RowResult], boundary_reached,
                     max_stage_tokens: int, max_new_tokens: int, sample: int, seed: int) -> list[dict]:
    """The batch-invariance control: a seeded sample of rows of a batched live run, each rerun at batch 1.

    Disagreements are reported, not raised: batch composition is a construction factor, and a row whose
    padding differs may legitimately get other bits.
    """
    rows = sorted(random.Random(seed).sample(range(len(prompts)), min(sample, len(prompts))))
    single = [generate_batch(decoder, [prompts[r]], boundary_reached, max_stage_tokens, max_new_tokens)[0]
              for r in rows]
    return compare_rows(batched, single, rows)


# -- the matched experiment, batched ----------------------------------------------------------------------------

def batch_row_fields(row: dict, batch_row: int, batch_rows: int, batch_index: int) -> dict:
    """Tag a ledger row with its place in the plan: batch composition is part of the construction."""
    row.update(batch_index=batch_index, batch_row=batch_row, batch_rows=batch_rows)
    return row


def ledger_row(item: dict, settings, experiment: str, construction: str, replica: int, prompt: list[int],
               res: RowResult, tokenizer) -> dict:
    """The ledger row of one row's result (the engine path's statuses: ok, nonfinite, boundary_missing)."""
    from stagereplay.experiment import _row

    if not res.stage_ids:
        status = "nonfinite" if res.stop_reason == "nonfinite" else "boundary_missing"
        return _row(item, settings, experiment, construction, replica, status, prompt, [], {}, res.suffix_ids, [],
                    status, tokenizer)
    whole, ks, vs = row_fingerprints(res)
    fields = {"cache_fingerprint": whole, "cache_k_fingerprints": ks, "cache_v_fingerprints": vs}
    status = "nonfinite" if res.stop_reason == "nonfinite" else "ok"
    return _row(item, settings, experiment, construction, replica, status, prompt, res.stage_ids, fields,
                res.suffix_ids, res.margins, res.stop_reason, tokenizer)


def matched_batch(decoder: StaticDecoder, tokenizer, prompter, matcher, items: list[dict], settings,
                  batch_index: int, replicas: tuple[int, ...] = (1, 2),
                  on_live_batch=None, live_rows_kept=None) -> tuple[list[dict], list[dict]]:
    """Ledger rows of the matched experiment for the items of one batch, decoded together.

    ``live`` replicas 1 and 2 are two batched greedy runs of the same rows; ``prefill`` replicas 1 and 2 are
    two batched one-shot prefills of the items whose boundary was found, continued together. Replicas must be
    bit-exact as at batch 1 (:class:`stagereplay.experiment.ReplicaMismatchError` otherwise). Every row records
    its batch (index, row, size): batch composition is part of the construction. The audit recomputes with
    ``replicas=(1,)``. ``on_live_batch(items, prompts, results)`` sees replica 1's live rows, caches included
    (the only moment a live cache exists: the batched bridge uses it); ``live_rows_kept(items)`` names the rows
    whose live cache it needs (the others keep fingerprints only; None: every row).
    """
    from stagereplay.experiment import check_replicas

    n = len(items)
    prompts = [prompter(item["question"]) for item in items]
    runs = []
    for replica in replicas:
        observed = replica == replicas[0] and on_live_batch is not None
        keep = (None if live_rows_kept is None else set(live_rows_kept(items))) if observed else set()
        runs.append(generate_batch(decoder, prompts, matcher.reached, settings.max_stage_tokens,
                                   settings.max_new_tokens, keep_rows=keep))
        if replica == replicas[0] and on_live_batch is not None:
            on_live_batch(items, prompts, runs[0])
    rows, prefix_rows = [], []
    for r, item in enumerate(items):
        live_rows = [batch_row_fields(ledger_row(item, settings, "matched", "live", replica, prompts[r], run[r],
                                                 tokenizer), r, n, batch_index)
                     for replica, run in zip(replicas, runs)]
        check_replicas(live_rows, item["item_id"])
        rows += live_rows
        reference = live_rows[0]
        prefix_rows.append({"item_index": int(item["item_index"]), "item_id": item["item_id"],
                            "revision": settings.revision, "precision": settings.precision,
                            "status": reference["status"], "prompt_ids": list(prompts[r]),
                            "stage_ids": reference["stage_ids"], "prefix_fingerprint": reference["prefix_fingerprint"],
                            "gold_answer": item["gold_answer"]})
    stages = [run.stage_ids if run.stage_ids else None for run in runs[0]]
    prefill = [construct_batch(decoder, "prefill", prompts, stages, settings.max_new_tokens, keep_rows=set())
               for _ in replicas]
    for r in sorted(prefill[0]):
        cell = [batch_row_fields(ledger_row(items[r], settings, "matched", "prefill", replica, prompts[r], run[r],
                                            tokenizer), r, n, batch_index)
                for replica, run in zip(replicas, prefill)]
        check_replicas(cell, items[r]["item_id"])
        rows += cell
    return rows, prefix_rows


def shard_batches(plan: BatchPlan, shard: int, n_shards: int) -> list[int]:
    """Indexes of the plan's batches that shard ``shard`` runs: shards take whole batches, so an item's batch
    (and its bits) does not depend on the shard count."""
    return [j for j in range(len(plan.batches)) if j % n_shards == shard]


def plan_record(plan: BatchPlan | None) -> dict | None:
    """The plan as provenance records it (every file made from, or rebuilding, batched rows carries it)."""
    if plan is None:
        return None
    return {"seed": plan.seed, "batch_size": plan.batch_size, "batches": [list(b) for b in plan.batches]}


def recorded_plan(path) -> BatchPlan | None:
    """The batch plan recorded in a results file's provenance (a gathered file: its parts'), or None at batch 1."""
    from stagereplay.io.provenance import recorded_batch_plan

    plan = recorded_batch_plan(path)
    if plan is None:
        return None
    return BatchPlan(int(plan["seed"]), int(plan["batch_size"]), tuple(tuple(b) for b in plan["batches"]))


# -- the regime, as later stages rebuild it ----------------------------------------------------------------------

REGIME_KEYS = ("decode_regime", "decode_max_len", "decode_max_rows", "decode_bucket", "decode_attention",
               "decode_prefill_group")


def recorded_regime(path) -> dict:
    """The decode regime recorded in a results file's provenance (a gathered file: its first part that has one).

    Files made before regimes were recorded read as ``eager``."""
    from stagereplay.io.parquet import read_provenance

    prov = read_provenance(path)
    for record in [prov, *prov.get("parts", [])]:
        if "decode_regime" in record:
            return {key: record.get(key) for key in REGIME_KEYS}
    return {"decode_regime": "eager", "decode_max_len": None, "decode_max_rows": 1, "decode_bucket": None}


def decoder_from_record(model, eos_ids, record: dict):
    """A decoder in the regime ``record`` describes: every stage after generation rebuilds its caches in the
    regime, buffer length and row count the ledger was made in, so constructions stay comparable bit for bit
    (batched rows are rebuilt in their recorded batch: :func:`recorded_plan`)."""
    return make_decoder(model, tuple(eos_ids), record.get("decode_regime") or "eager",
                        max_len=record.get("decode_max_len"), max_rows=int(record.get("decode_max_rows") or 1),
                        bucket=record.get("decode_bucket"), attention=record.get("decode_attention") or "masked",
                        prefill_group=record.get("decode_prefill_group"))
