"""Load: the matched and fixed-prefix experiments keep no tensor per item, so a shard's memory is the model plus
its ledger rows."""

import gc

import torch

from stagereplay.data import datasets
from stagereplay.engine import Decoder
from stagereplay.experiment import Prompter, Settings, make_matcher, matched_item
from stagereplay.fixed_prefix import fixed_prefix_item, has_prefix


def live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))  # type(): no proxy lookups


def test_no_tensor_outlives_its_item(loaded_bf16):
    tokenizer = loaded_bf16.tokenizer
    decoder = Decoder(loaded_bf16.model, (1,))
    prompter, matcher = Prompter(tokenizer), make_matcher({"token_id": 5}, tokenizer)
    settings = Settings("tiny", "bf16", max_stage_tokens=6, max_new_tokens=6)
    rows = datasets.select_items(datasets.load_source({"source": "synthetic", "size": 50, "seed": 0}), 12, 0)
    items = rows.to_dict("records")
    kept = []

    def run(item):
        rows, prefix = matched_item(decoder, tokenizer, prompter, matcher, item, settings)
        kept.extend(rows)
        if has_prefix(prefix):
            kept.extend(fixed_prefix_item(decoder, tokenizer, item, prefix, settings))

    for item in items[:2]:  # warm-up: lazily created buffers
        run(item)
    before = live_tensors()
    for item in items[2:]:
        run(item)
    assert live_tensors() == before
    assert any(row["experiment"] == "fixed_prefix" for row in kept)
    assert len(kept) >= 2 * len(items)  # the rows themselves are kept, as plain Python values
    assert not any(isinstance(v, torch.Tensor) for row in kept for v in row.values())
