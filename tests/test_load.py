"""Load: the matched, fixed-prefix and bridge experiments keep no tensor per item, so a shard's memory is the model
plus its ledger rows."""

import gc

import torch

from stagereplay.data import datasets
from stagereplay.data.prompts import Prompter
from stagereplay.decode.eager import EagerDecoder
from stagereplay.decode.greedy import matcher_from_config
from stagereplay.decode.plans import Batch
from stagereplay.experiments.bridge import bridge
from stagereplay.experiments.matched import fixed_prefix, matched
from stagereplay.experiments.rows import RunSettings


def live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))  # type(): no proxy lookups


def test_no_tensor_outlives_its_item(loaded_bf16):
    tokenizer = loaded_bf16.tokenizer
    decoder = EagerDecoder(loaded_bf16.model, (1,))
    prompter, matcher = Prompter(tokenizer), matcher_from_config({"token_id": 5}, tokenizer)
    settings = RunSettings("tiny", "bf16", max_stage_tokens=6, max_new_tokens=6)
    rows = datasets.choose_items(datasets.load_source({"source": "synthetic", "size": 50, "seed": 0}), 12, 0)
    items = rows.to_dict("records")
    kept, bridged = [], []

    def run(item):
        batch, prompts = Batch(None, (item,)), [prompter(item["question"])]
        result = matched(decoder, batch, prompts, settings, tokenizer, matcher, keep={0})  # kept caches: the bridge
        kept.extend(result.rows)
        bridged.extend(bridge(decoder, batch, prompts, settings, result, {0}))
        stages = result.stages()
        if stages[0] is not None:
            kept.extend(fixed_prefix(decoder, batch, prompts, stages, settings, tokenizer))

    for item in items[:2]:  # warm-up: lazily created buffers
        run(item)
    before = live_tensors()
    for item in items[2:]:
        run(item)
    assert live_tensors() == before
    assert any(row["experiment"] == "fixed_prefix" for row in kept)
    assert any(row["status"] == "ok" for row in bridged)
    assert len(kept) >= 2 * len(items)  # the rows themselves are kept, as plain Python values
    assert not any(isinstance(v, torch.Tensor) for row in kept + bridged for v in row.values())
