"""The library's arguments, checked before any model runs: each bad one is refused with a message naming it and
the fix, never left to fail deep in the decode or to be read as something else (a float position truncated, a
boolean taken as layer 1, a string of names taken as letters).

Knows nothing of decoding: it reads the model's config and parameters, the tokenizer, and the values given.
"""

from __future__ import annotations

import numbers
import operator

from stagereplay.decode.greedy import BoundaryMatcher
from stagereplay.experiments import constructions as registry
from stagereplay.experiments.transplant_specs import COMPONENTS, POSITIONS
from stagereplay.models.loading import PRECISIONS, context_positions, sliding_window, unsupported


def check_model(model) -> None:
    """A loaded transformers causal LM in eval mode, of a supported type, with real weights."""
    if model is None or not hasattr(model, "config") or not hasattr(model, "parameters"):
        raise TypeError(f"model is {type(model).__name__}, not a loaded transformers causal LM: give one, e.g. "
                        "AutoModelForCausalLM.from_pretrained(folder)")
    reason = unsupported(model.config)
    if reason is not None:
        raise ValueError(f"the model ({type(model).__name__}) {reason}")
    devices = {p.device.type for p in model.parameters()}
    if "meta" in devices:
        raise ValueError("the model's weights are on the meta device (a model built without its weights): load them, "
                         "e.g. AutoModelForCausalLM.from_pretrained(folder), without init_empty_weights or "
                         "device_map='meta'")
    if not devices:
        raise ValueError("the model has no parameters")
    if len(devices) > 1:
        raise ValueError(f"the model's weights are on several devices {sorted(devices)}: put it on one")
    if model.training:
        raise ValueError("the model is in training mode (dropout would make every run differ): call model.eval()")


def check_tokenizer(tokenizer) -> None:
    if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"tokenizer is {type(tokenizer).__name__}, not a tokenizer: give the model's own, e.g. "
                        "AutoTokenizer.from_pretrained(folder) (it decodes the suffixes and names the EOS ids)")


def precision_of(model, precision: str | None) -> str:
    """The precision name of the model's dtype, checked against the one asked for."""
    dtypes = {p.dtype for p in model.parameters()}
    names = {dtype: name for name, dtype in PRECISIONS.items()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in names:
        raise ValueError(f"the model's parameters are {sorted(map(str, dtypes))}: it must be in one of "
                         f"{sorted(PRECISIONS)} throughout")
    dtype = next(iter(dtypes))
    if precision is None:
        return names[dtype]
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {sorted(PRECISIONS)}")
    if PRECISIONS[precision] != dtype:
        raise ValueError(f"precision {precision!r} was asked for, but the model's weights are {dtype} (the model is "
                         f"never cast here): load it at that precision (dtype={PRECISIONS[precision]}) or leave "
                         "precision at None")
    return precision


def whole(value, name: str, minimum: int = 1) -> int:
    """A whole number of at least ``minimum``; booleans, floats and strings are refused, not converted."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} is {value!r}; it must be a whole number, at least {minimum}")
    return int(value)


def token_ids(value, what: str) -> list[int]:
    """Ids given as a list, tuple or 1-D tensor, each a whole number (booleans and floats refused)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{what} must be text or a flat sequence of token ids, got {type(value).__name__} "
                        f"{str(value)[:60]}")
    ids = list(value)
    wrong = [i for i in ids if isinstance(i, bool) or not isinstance(i, numbers.Integral)]
    if wrong:
        raise TypeError(f"{what} must be text or a flat sequence of token ids; it holds {wrong[0]!r} "
                        f"({type(wrong[0]).__name__})")
    return [int(i) for i in ids]


def ids_of(value, tokenizer, what: str, special_tokens: bool, vocab_size: int) -> list[int]:
    """Token ids of text (through ``tokenizer``) or of ids, inside the model's vocabulary."""
    if isinstance(value, str):
        if not callable(tokenizer):
            raise TypeError(f"{what} is text, and the tokenizer cannot encode it: give token ids")
        ids = list(tokenizer(value, add_special_tokens=special_tokens)["input_ids"])
    else:
        ids = token_ids(value, what)
    if not ids:
        raise ValueError(f"{what} has no tokens")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(f"{what} holds ids outside the model's vocabulary of {vocab_size}: {outside[:5]}")
    return ids


def is_batch(value) -> bool:
    """A list of prompts (each text or ids) or a 2-D tensor, not one prompt's text or ids."""
    if isinstance(value, str):
        return False
    if hasattr(value, "dim") or hasattr(value, "ndim"):
        return (value.dim() if hasattr(value, "dim") else value.ndim) == 2
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(v, str) or hasattr(v, "__iter__") for v in value)


def rows_of(prompt, stage, tokenizer, vocab_size: int) -> tuple[list[list[int]], list[list[int]] | None, bool]:
    """(prompts' ids, stages' ids or None, whether a batch was given): one prompt, or a list of them (or a 2-D
    tensor's rows, all of one length) with one stage each."""
    batch = is_batch(prompt)
    prompts = list(prompt) if batch else [prompt]
    ids = [ids_of(p, tokenizer, f"prompt {i}" if batch else "prompt", True, vocab_size)
           for i, p in enumerate(prompts)]
    if stage is None:
        return ids, None, batch
    if is_batch(stage) != batch:
        raise ValueError(f"{'a list of' if batch else 'one'} prompt{'s' if batch else ''} and "
                         f"{'a list of stages' if is_batch(stage) else 'one stage'}: give one stage per prompt "
                         "(a list of stages for a list of prompts)")
    stages = list(stage) if batch else [stage]
    if len(stages) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts and {len(stages)} stages: give one stage per prompt")
    return ids, [ids_of(s, tokenizer, f"stage {i}" if batch else "stage", False, vocab_size)
                 for i, s in enumerate(stages)], batch


def construction_names(constructions) -> tuple[str, ...]:
    """Construction names, each known and named once; one name alone is one construction."""
    names = (constructions,) if isinstance(constructions, str) else tuple(constructions)
    for name in names:
        registry.get(name)
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"constructions {list(names)}: name each construction once, at least one")
    return names


def layers_of(layers, n_layers: int) -> tuple[int, ...]:
    """Layer indices, sorted: None is every layer, a whole number is one layer."""
    if layers is None:
        return tuple(range(n_layers))
    given = [layers] if isinstance(layers, numbers.Integral) and not isinstance(layers, bool) else layers
    if isinstance(given, (str, bytes)) or not hasattr(given, "__iter__"):
        raise TypeError(f"layers is {layers!r}: give None (every layer), a layer index or a list of them")
    given = list(given)
    wrong = [i for i in given if isinstance(i, bool) or not isinstance(i, numbers.Integral)]
    if wrong:
        raise TypeError(f"layers holds {wrong[0]!r} ({type(wrong[0]).__name__}): each layer is a whole number")
    chosen = tuple(sorted({int(i) for i in given}))
    if not chosen or not all(0 <= i < n_layers for i in chosen):
        raise ValueError(f"layers {list(chosen)}: give at least one layer, each of the model's 0..{n_layers - 1}")
    return chosen


def positions_of(positions, cache_lengths: list[int]) -> str | tuple[int, int]:
    """A name of :data:`POSITIONS`, or a span ``(lo, hi)`` of whole numbers (a list of two is taken as one) that
    lies in every prompt's boundary cache (``cache_lengths``: the prompt and the stage but its last token)."""
    if isinstance(positions, str):
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {list(POSITIONS)} or a span (lo, hi), got {positions!r}")
        return positions
    if not isinstance(positions, (tuple, list)) or len(positions) != 2:
        raise ValueError(f"positions must be one of {list(POSITIONS)} or a span (lo, hi), got {positions!r}")
    if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in positions):
        raise TypeError(f"positions {positions!r}: a span's ends are whole numbers of cache positions")
    lo, hi = (int(x) for x in positions)
    shortest = min(cache_lengths)
    if not 0 <= lo < hi <= shortest:
        which = cache_lengths.index(shortest)
        raise ValueError(f"positions ({lo}, {hi}) is not a non-empty span [lo, hi) of the boundary cache: the cache "
                         f"of prompt {which} holds {shortest} positions (the prompt and the stage but its last "
                         f"token); give 0 <= lo < hi <= {shortest}")
    return lo, hi


def component_of(component) -> str:
    if component not in COMPONENTS:
        raise ValueError(f"component must be one of {list(COMPONENTS)}, got {component!r}")
    return component


def marker_matcher(marker, occurrence, tokenizer) -> BoundaryMatcher:
    """The boundary matcher of a marker: text (matched on the decoded ids) or token ids (one or a sequence)."""
    occurrence = whole(occurrence, "occurrence")
    if isinstance(marker, str):
        if not marker:
            raise ValueError("marker is empty: give the text (e.g. '</think>') or token id(s) that end the stage")
        return BoundaryMatcher(occurrence, text=marker, decode=tokenizer.decode)
    ids = [marker] if isinstance(marker, numbers.Integral) and not isinstance(marker, bool) else marker
    ids = token_ids(ids, "marker")
    if not ids:
        raise ValueError("marker is empty: give the text (e.g. '</think>') or token id(s) that end the stage")
    return BoundaryMatcher(occurrence, token_ids=ids)


def check_context(config, prompts: list[list[int]], stage_tokens: list[int], max_new_tokens: int,
                  stage_name: str = "the stage") -> None:
    """Every row's prompt, stage and suffix budget within the positions a run may take (a shorter sliding window
    included, :func:`stagereplay.models.loading.context_positions`)."""
    limit = context_positions(config)
    if limit is None:
        return
    for i, (prompt, stage) in enumerate(zip(prompts, stage_tokens)):
        total = len(prompt) + stage + max_new_tokens
        if total > limit:
            window = sliding_window(config)
            what = (f"the model's sliding window is {window} positions (sliding_window in its config), and a run "
                    "that outgrows it would read a cache that has dropped positions" if window == limit
                    else f"the model has {limit} (max_position_embeddings)")
            suffix = f" and max_new_tokens {max_new_tokens}" if max_new_tokens else ""
            name = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            raise ValueError(f"{name} ({len(prompt)} tokens), {stage_name} ({stage}){suffix} take {total} "
                             f"positions; {what}: shorten them")
