"""Greedy decoding, stage boundaries and cache constructions.

The boundary state (DESIGN.md): the KV cache over every prefix token but the last, with that last token
pending. Every suffix token, the first included, is computed by a decode step that reads the boundary cache.

Constructions of the boundary cache:
- ``live``: the cache retained from the original greedy generation, taken when it has chosen the boundary
  token and not yet fed it;
- ``prefill``: one forward pass over all boundary-cache ids at once;
- ``incremental``: prompt prefill, then the stage tokens fed one at a time (teacher forcing);
- ``chunked:C``: prompt prefill, then the stage tokens fed in chunks of C (C=1 is ``incremental``).

The engine works on token ids only: it knows nothing of tokenizers beyond the boundary matcher it is given,
nothing of the ledger and nothing of Snakemake.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from stagereplay.models import compat


class NonFiniteLogitsError(RuntimeError):
    """Logits with NaN/inf: the precision overflowed (Qwen2-family models are known to in fp16)."""


@dataclass
class Decoder:
    """One loaded model, stepped by hand so that every forward pass is explicit (no ``generate`` magic)."""

    model: torch.nn.Module
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self):
        self.cache_kw = compat.cache_keyword(self.model)
        self.device = next(self.model.parameters()).device

    def new_cache(self):
        return compat.new_dynamic_cache(self.model)

    @torch.inference_mode()
    def forward(self, ids: list[int], cache) -> torch.Tensor:
        """Feed ``ids`` (new tokens only) into ``cache`` (mutated); return the last position's fp32 logits.

        ``logits_to_keep=1`` everywhere: it changes the last row's numerics against computing all rows.
        """
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
        return out.logits[0, -1].float()  # (vocab,)


def argmax_and_margin(logits: torch.Tensor) -> tuple[int, float, bool]:
    """Greedy choice (lowest index on ties), its top-2 margin, and whether all logits are finite."""
    finite = bool(torch.isfinite(logits).all())
    top = torch.topk(logits, 2)
    choice = int(torch.argmax(logits))
    return choice, float(top.values[0] - top.values[1]), finite


class BoundaryMatcher:
    """Finds the stage boundary in generated ids: the ``occurrence``-th appearance of a marker.

    A marker is either a token id sequence (matched on ids) or a string (matched on the decoded text, so a
    marker that a BPE tokenizer merges with its neighbours is still found). The boundary token is the token
    whose addition completes the marker's ``occurrence``-th appearance.
    """

    def __init__(self, occurrence: int = 1, token_ids: list[int] | None = None, text: str | None = None,
                 decode=None):
        if (token_ids is None) == (text is None):
            raise ValueError("a boundary marker is either token ids or a string, not both or neither")
        if occurrence < 1:
            raise ValueError("boundary occurrence counts from 1")
        if text is not None and decode is None:
            raise ValueError("a string boundary marker needs a decode function")
        self.occurrence, self.token_ids, self.text, self.decode = occurrence, token_ids, text, decode

    def reached(self, generated: list[int]) -> bool:
        """Whether the last id of ``generated`` completes the boundary."""
        if self.token_ids is not None:
            n = len(self.token_ids)
            if generated[-n:] != list(self.token_ids):
                return False
            count = sum(generated[i:i + n] == list(self.token_ids) for i in range(len(generated) - n + 1))
            return count == self.occurrence
        last_piece = self.decode(generated[-1:])
        if not last_piece or self.text[-1] not in last_piece:
            return False
        text = self.decode(generated)
        before = self.decode(generated[:-1])
        return text.count(self.text) >= self.occurrence > before.count(self.text)


@dataclass
class BoundaryResult:
    status: str  # "ok" | "boundary_missing"
    prompt_ids: list[int]
    stage_ids: list[int]  # generated ids up to and including the boundary token
    cache: object | None = None  # live boundary cache: prompt + stage[:-1]
    generated_ids: list[int] = field(default_factory=list)  # everything generated (when the boundary is missing)
    nonfinite: bool = False

    @property
    def prefix_ids(self) -> list[int]:
        return self.prompt_ids + self.stage_ids


def generate_to_boundary(decoder: Decoder, prompt_ids: list[int], matcher: BoundaryMatcher,
                         max_stage_tokens: int) -> BoundaryResult:
    """Greedy generation from the prompt until the boundary token is chosen; keeps the live cache.

    The prompt goes in as one prefill, then one token per step: exactly the ``incremental`` schedule.
    """
    cache = decoder.new_cache()
    logits = decoder.forward(prompt_ids, cache)
    generated: list[int] = []
    while len(generated) < max_stage_tokens:
        token, _, finite = argmax_and_margin(logits)
        if not finite:
            return BoundaryResult("nonfinite", prompt_ids, [], generated_ids=generated, nonfinite=True)
        generated.append(token)
        if matcher.reached(generated):
            return BoundaryResult("ok", prompt_ids, generated, cache=cache)
        if token in decoder.eos_ids:
            break
        logits = decoder.forward([token], cache)
    return BoundaryResult("boundary_missing", prompt_ids, [], generated_ids=generated)


def build_cache(decoder: Decoder, construction: str, prompt_ids: list[int], stage_ids: list[int]):
    """A boundary cache over ``prompt_ids + stage_ids[:-1]`` built the way ``construction`` says."""
    cached = stage_ids[:-1]
    cache = decoder.new_cache()
    if construction == "prefill":
        decoder.forward(prompt_ids + cached, cache)
        return cache
    if construction == "incremental":
        chunk = 1
    elif construction.startswith("chunked:"):
        chunk = int(construction.split(":", 1)[1])
    else:
        raise ValueError(f"construction {construction!r} cannot be rebuilt from ids (live is only retained)")
    decoder.forward(prompt_ids, cache)
    for start in range(0, len(cached), chunk):
        decoder.forward(cached[start:start + chunk], cache)
    return cache


@dataclass
class Continuation:
    suffix_ids: list[int]
    margins: list[float]  # top-2 logit margin at every decode step (fp32 logits)
    stop_reason: str  # "eos" | "max_new_tokens" | "nonfinite"


def continue_greedy(decoder: Decoder, cache, pending_id: int, max_new_tokens: int,
                    copy_cache: bool = True) -> Continuation:
    """Greedy suffix from a boundary cache and its pending token.

    The first suffix token comes from feeding the pending token into the boundary cache. With
    ``copy_cache`` the caller's cache is left untouched.
    """
    if copy_cache:
        cache = copy.deepcopy(cache)
    suffix: list[int] = []
    margins: list[float] = []
    token = pending_id
    stop = "max_new_tokens"
    while len(suffix) < max_new_tokens:
        logits = decoder.forward([token], cache)
        token, margin, finite = argmax_and_margin(logits)
        if not finite:
            stop = "nonfinite"
            break
        suffix.append(token)
        margins.append(margin)
        if token in decoder.eos_ids:
            stop = "eos"
            break
    return Continuation(suffix, margins, stop)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two suffixes differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
