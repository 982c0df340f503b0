"""Experiments over items: prompts, the matched live-vs-prefill experiment, and its ledger rows.

The matched experiment, per item: ``live`` replica 1 is the original greedy generation continued from its
retained cache; ``live`` replica 2 reruns the whole thing from scratch; ``prefill`` replicas 1 and 2 rebuild
the boundary cache with one forward pass over the identical prefix ids. Replicas must be bit-exact (token ids
and cache bytes): a mismatch raises :class:`ReplicaMismatchError` naming the item, never a statistic.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from stagereplay.models import compat
from stagereplay.data.answers import extract_answer, is_correct
from stagereplay.engine import BoundaryMatcher, Decoder, build_cache, continue_greedy, generate_to_boundary
from stagereplay.io.fingerprints import fingerprint_ids, fingerprint_layers


class ReplicaMismatchError(RuntimeError):
    """Two replicas of one construction and precision that are not bit-identical."""


class PromptTooLongError(ValueError):
    """A prompt that leaves no room for the stage and suffix within the model's context."""


LEDGER_SCHEMA = pa.schema([
    ("item_index", pa.int32()),
    ("item_id", pa.string()),
    ("revision", pa.string()),
    ("experiment", pa.string()),
    ("precision", pa.string()),
    ("construction", pa.string()),
    ("replica", pa.int8()),
    ("status", pa.string()),  # ok | boundary_missing | nonfinite
    ("prompt_ids", pa.list_(pa.int32())),
    ("stage_ids", pa.list_(pa.int32())),  # generated ids up to and including the boundary token
    ("prefix_fingerprint", pa.string()),
    ("cache_fingerprint", pa.string()),
    ("cache_k_fingerprints", pa.list_(pa.string())),
    ("cache_v_fingerprints", pa.list_(pa.string())),
    ("suffix_ids", pa.list_(pa.int32())),  # boundary_missing: everything generated within the stage budget
    ("suffix_fingerprint", pa.string()),
    ("margins", pa.list_(pa.float32())),  # top-2 logit margin at every decode step
    ("stop_reason", pa.string()),
    ("suffix_text", pa.string()),
    ("answer", pa.string()),
    ("gold_answer", pa.string()),
    ("correct", pa.bool_()),
    ("decode_regime", pa.string()),  # eager | static | cuda_graph (stagereplay.fastdecode): part of the construction
    ("batch_index", pa.int32()),  # batched runs: the item's batch in the seeded plan, its row, the batch's size
    ("batch_row", pa.int16()),
    ("batch_rows", pa.int16()),
    ("numerics", pa.string()),  # the numerics regime (default | invariant): a construction factor
])


@dataclass
class Prompter:
    """Question text -> prompt ids: the chat template when the tokenizer has one, else a raw template."""

    tokenizer: object
    system: str | None = None
    instruction: str | None = None
    template: str | None = None  # raw text with {question}; bypasses the chat template

    def __call__(self, question: str) -> list[int]:
        content = f"{self.instruction}\n\n{question}" if self.instruction else question
        if self.template is not None:
            return self.tokenizer(self.template.format(question=content), add_special_tokens=False)["input_ids"]
        if getattr(self.tokenizer, "chat_template", None):
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
                {"role": "user", "content": content}
            ]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(content)["input_ids"]


def make_matcher(boundary: dict, tokenizer) -> BoundaryMatcher:
    occurrence = int(boundary.get("occurrence", 1))
    if boundary.get("token_id") is not None:
        return BoundaryMatcher(occurrence, token_ids=[int(boundary["token_id"])])
    marker = boundary.get("marker")
    if not marker:
        raise ValueError("boundary: set either marker (a string) or token_id")
    return BoundaryMatcher(occurrence, text=marker, decode=lambda ids: tokenizer.decode(ids))


@dataclass
class Settings:
    """What the matched experiment needs besides the model: plain values from the config."""

    revision: str
    precision: str
    max_stage_tokens: int | None  # None: the stage replays fixed prefixes and generates none
    max_new_tokens: int
    answer_format: str = "last_number"
    stage_end: str | None = "</think>"
    decode_regime: str = "eager"
    numerics: str = "default"  # default | invariant (stagereplay.invariant)

    def __post_init__(self):
        for key in ("max_stage_tokens", "max_new_tokens"):
            value = getattr(self, key)
            if key == "max_stage_tokens" and value is None:  # stages that never generate a stage (replays)
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} is {value!r}; it must be a whole number of tokens, at least 1")


def _cache_fields(cache) -> dict:
    whole, ks, vs = fingerprint_layers(compat.cache_layers(cache))
    return {"cache_fingerprint": whole, "cache_k_fingerprints": ks, "cache_v_fingerprints": vs}


def _row(item, settings: Settings, experiment, construction, replica, status, prompt_ids, stage_ids,
         cache_fields, suffix_ids, margins, stop_reason, tokenizer) -> dict:
    text = tokenizer.decode(suffix_ids) if suffix_ids else ""
    answer = extract_answer(text, settings.answer_format, settings.stage_end) if status == "ok" else None
    return {
        "item_index": int(item["item_index"]),
        "item_id": item["item_id"],
        "revision": settings.revision,
        "experiment": experiment,
        "precision": settings.precision,
        "construction": construction,
        "replica": replica,
        "status": status,
        "prompt_ids": list(prompt_ids),
        "stage_ids": list(stage_ids),
        "prefix_fingerprint": fingerprint_ids(list(prompt_ids) + list(stage_ids)),
        "cache_fingerprint": cache_fields.get("cache_fingerprint", ""),
        "cache_k_fingerprints": cache_fields.get("cache_k_fingerprints", []),
        "cache_v_fingerprints": cache_fields.get("cache_v_fingerprints", []),
        "suffix_ids": list(suffix_ids),
        "suffix_fingerprint": fingerprint_ids(suffix_ids),
        "margins": list(margins),
        "stop_reason": stop_reason,
        "suffix_text": text,
        "answer": answer,
        "gold_answer": item["gold_answer"],
        "correct": is_correct(answer, item["gold_answer"]) if status == "ok" else None,
        "decode_regime": settings.decode_regime,
        "numerics": settings.numerics,
    }


def check_replicas(rows: list[dict], item_id: str) -> None:
    """Raise if rows of one (construction, precision) differ in any id or fingerprint."""
    first = rows[0]
    for other in rows[1:]:
        for key in ("status", "stage_ids", "cache_fingerprint", "suffix_fingerprint", "stop_reason"):
            if first[key] != other[key]:
                detail = ""
                if key == "cache_fingerprint":
                    layers = [i for i, (a, b) in enumerate(zip(first["cache_k_fingerprints"], other["cache_k_fingerprints"]))
                              if a != b]
                    detail = f" (K differs from layer {layers[0] if layers else '?'})"
                raise ReplicaMismatchError(
                    f"item {item_id!r}: {first['construction']} replicas {first['replica']} and {other['replica']} "
                    f"at {first['precision']} differ in {key}{detail}. Replicas must be bit-exact: check that "
                    "deterministic algorithms are on and nothing else runs kernels with a different schedule"
                )


def check_context(item_id: str, n_prompt: int, max_stage_tokens: int, max_new_tokens: int,
                  context_limit: int | None) -> None:
    """Raise :class:`PromptTooLongError` naming the item if its prompt and both budgets overrun the context."""
    if context_limit is not None and n_prompt + max_stage_tokens + max_new_tokens > context_limit:
        raise PromptTooLongError(
            f"item {item_id!r}: prompt of {n_prompt} tokens + max_stage_tokens {max_stage_tokens} + "
            f"max_new_tokens {max_new_tokens} exceeds the model's context of {context_limit}; lower the budgets "
            "or drop the item"
        )


def matched_item(decoder: Decoder, tokenizer, prompter: Prompter, matcher: BoundaryMatcher, item: dict,
                 settings: Settings, context_limit: int | None = None,
                 on_live_boundary=None) -> tuple[list[dict], dict]:
    """Ledger rows of the matched experiment for one item, and its prefixes row.

    ``on_live_boundary(item, prompt_ids, boundary)``, when given, sees replica 1's live boundary (its retained
    cache included) before the cache is continued: the only moment a live cache exists (the bridge uses it).
    """
    prompt_ids = prompter(item["question"])
    check_context(item["item_id"], len(prompt_ids), settings.max_stage_tokens, settings.max_new_tokens, context_limit)
    rows: list[dict] = []
    live_rows = []
    for replica in (1, 2):
        boundary = generate_to_boundary(decoder, prompt_ids, matcher, settings.max_stage_tokens)
        if boundary.status != "ok":
            if on_live_boundary is not None and replica == 1:
                on_live_boundary(item, prompt_ids, boundary)
            live_rows.append(_row(item, settings, "matched", "live", replica, boundary.status, prompt_ids, [], {},
                                  boundary.generated_ids, [], boundary.status, tokenizer))
            continue
        if on_live_boundary is not None and replica == 1:
            on_live_boundary(item, prompt_ids, boundary)
        fields = _cache_fields(boundary.cache)
        cont = continue_greedy(decoder, boundary.cache, boundary.stage_ids[-1], settings.max_new_tokens,
                               copy_cache=False)
        status = "nonfinite" if cont.stop_reason == "nonfinite" else "ok"
        live_rows.append(_row(item, settings, "matched", "live", replica, status, prompt_ids, boundary.stage_ids,
                              fields, cont.suffix_ids, cont.margins, cont.stop_reason, tokenizer))
    check_replicas(live_rows, item["item_id"])
    rows += live_rows
    reference = live_rows[0]
    prefix_row = {
        "item_index": int(item["item_index"]),
        "item_id": item["item_id"],
        "revision": settings.revision,
        "precision": settings.precision,
        "status": reference["status"],
        "prompt_ids": list(prompt_ids),
        "stage_ids": reference["stage_ids"],
        "prefix_fingerprint": reference["prefix_fingerprint"],
        "gold_answer": item["gold_answer"],
    }
    if not reference["stage_ids"]:  # no boundary reached (missing, or non-finite logits during the stage)
        return rows, prefix_row
    stage_ids = reference["stage_ids"]
    prefill_rows = []
    for replica in (1, 2):
        cache = build_cache(decoder, "prefill", prompt_ids, stage_ids)
        fields = _cache_fields(cache)
        cont = continue_greedy(decoder, cache, stage_ids[-1], settings.max_new_tokens, copy_cache=False)
        status = "nonfinite" if cont.stop_reason == "nonfinite" else "ok"
        prefill_rows.append(_row(item, settings, "matched", "prefill", replica, status, prompt_ids, stage_ids,
                                 fields, cont.suffix_ids, cont.margins, cont.stop_reason, tokenizer))
    check_replicas(prefill_rows, item["item_id"])
    rows += prefill_rows
    return rows, prefix_row
