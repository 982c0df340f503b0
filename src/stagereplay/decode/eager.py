"""The eager regime: the Hugging Face forward with a ``DynamicCache`` per row.

Each row is computed alone (its own forwards, no padding), so rows are independent and a batch of N rows gives
every row the bits it has at batch 1. Exact and simple, but launch-bound on a GPU: the static regimes
(:mod:`stagereplay.decode.static`) are the fast ones. ``logits_to_keep=1`` everywhere: it changes the last
row's numerics against computing all rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stagereplay.decode.protocol import Layers
from stagereplay.models import compat, invariant


@dataclass
class EagerBatch:
    caches: list  # one DynamicCache per row (None: a row without a prefix)


class EagerDecoder:
    def __init__(self, model: torch.nn.Module, eos_ids: tuple[int, ...] = ()):
        self.model, self.eos_ids = model, tuple(eos_ids)
        self.cache_kw = compat.cache_keyword(model)
        self.device = next(model.parameters()).device
        self.n_layers = int(model.config.num_hidden_layers)
        self.numerics = "invariant" if invariant.is_invariant(model) else "default"

    lookahead = False  # the greedy loop reads each step's choice before it feeds the next (see rewind)

    def record(self) -> dict:
        return {"decode_regime": "eager", "decode_max_len": None, "decode_max_rows": 1}

    def advance(self, batch: EagerBatch, steps: int) -> bool:
        return False  # each row's cache grows by its own forwards: the steps are fed

    def rewind(self, batch: EagerBatch) -> None:
        raise NotImplementedError("the eager regime does not take steps back (its lookahead is off)")

    def independent_rows(self, rows: int) -> bool:
        return True

    def rows_from_boundaries(self, rows: int) -> bool:
        return True

    @torch.inference_mode()
    def _feed(self, ids: list[int], cache) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
        return out.logits[0, -1].float()  # (vocab,)

    def _stack(self, logits: list[torch.Tensor | None]) -> torch.Tensor:
        width = next(t for t in logits if t is not None)
        return torch.stack([t if t is not None else torch.zeros_like(width) for t in logits])  # (rows, vocab)

    def open(self, prompts: list[list[int]]) -> tuple[EagerBatch, torch.Tensor]:
        batch = EagerBatch([compat.new_dynamic_cache(self.model) for _ in prompts])
        return batch, self._stack([self._feed(list(p), c) for p, c in zip(prompts, batch.caches)])

    def step(self, batch: EagerBatch, tokens: list[int | None]) -> torch.Tensor:
        return self._stack([None if t is None else self._feed([int(t)], c) for t, c in zip(tokens, batch.caches)])

    def build(self, prompts: list[list[int]], cached: list[list[int] | None],
              segments: list[list[int]] | None) -> EagerBatch:
        caches = []
        for r, ids in enumerate(cached):
            if ids is None:
                caches.append(None)
                continue
            cache = compat.new_dynamic_cache(self.model)
            start = 0
            for n in ([len(ids)] if segments is None else segments[r]):
                self._feed(ids[start:start + n], cache)
                start += n
            caches.append(cache)
        return EagerBatch(caches)

    def place(self, pads: list[int], caches: list[Layers | None]) -> EagerBatch:
        """Each row's own cache holding a copy of ``caches[r]`` (rows have no padding here: ``pads`` must be 0)."""
        if any(int(p) for p in pads):
            raise ValueError(f"the eager regime pads no row; got left pads {pads}")
        if len(caches) != len(pads):
            raise ValueError(f"{len(caches)} caches for {len(pads)} rows")
        return EagerBatch([None if c is None else compat.cache_from_tensors(self.model, c) for c in caches])

    def row_layers(self, batch: EagerBatch, row: int, end: int) -> Layers:
        layers = compat.cache_layers(batch.caches[row])
        if layers and layers[0][0].shape[2] != end:
            raise ValueError(f"row {row}: its cache holds {layers[0][0].shape[2]} positions, not {end}")
        return layers

    def pad(self, batch: EagerBatch, row: int) -> int:
        return 0
