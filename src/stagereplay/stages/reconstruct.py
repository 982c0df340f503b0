"""Stage ``reconstruct_prefixes``: each item's prefix with its live cache, the matched experiment while that cache
exists, and the bridge rows (a live cache cannot cross a process boundary). Its gathers (``gather_ledger``,
``gather_prefixes``) load no model and live in :mod:`stagereplay.stages.gather`."""

from __future__ import annotations

import logging

import pandas as pd

from stagereplay.data.prompts import Prompter, check_context
from stagereplay.decode.greedy import matcher_from_config
from stagereplay.decode.plans import batch_plan, batches_of
from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments.bridge import BRIDGE_SCHEMA, bridge, bridge_rows_of, choose_bridge_items
from stagereplay.experiments.matched import matched
from stagereplay.experiments.rows import LEDGER_SCHEMA
from stagereplay.io.parquet import read_parquet, write_parquet
from stagereplay.models.loading import context_positions, eos_token_ids
from stagereplay.stages.gather import PREFIX_SCHEMA
from stagereplay.stages.jobs import config_of, load
from stagereplay.stages.preflight import check_decode_settings
from stagereplay.stages.progress import progress
from stagereplay.stages.settings import ReconstructSettings

log = logging.getLogger("stagereplay")


def reconstruct_prefixes(items_path: str, ledger_path: str, prefixes_path: str, bridge_path: str,
                         s: ReconstructSettings) -> None:
    config = config_of(s)  # what this stage was asked to do, as provenance records it
    check_decode_settings(s.batch_size, s.decode_regime, s.decode_attention, s.decode_prefill_group, s.decode_kernels)
    selection = read_parquet(items_path)
    # The plan covers the whole selection and shards take whole batches: an item's batch (and its bits) does not
    # depend on the shard count.
    plan = batch_plan(list(selection["item_id"]), s.batch_size, s.seed if s.batch_seed is None else s.batch_seed)
    batches = batches_of(selection.to_dict("records"), plan, s.shard, s.n_shards)

    def decoder_for(loaded):
        prompter = Prompter(loaded.tokenizer, **(s.prompt or {}))
        # The static regimes hold one buffer for the longest prompt plus both budgets; its length shapes the
        # attention reduction, so it comes from the whole selection (not this shard) and is recorded.
        longest = max((len(prompter(q)) for q in selection["question"]), default=0)
        return make_decoder(loaded.model, tuple(eos_token_ids(loaded)), s.decode_regime,
                            max_len=longest + s.max_stage_tokens + s.max_new_tokens, max_rows=s.batch_size,
                            attention=s.decode_attention, prefill_group=s.decode_prefill_group,
                            kernels=s.decode_kernels)

    job = load(s, s.precision, numerics=s.numerics, make_decoder=decoder_for)
    tokenizer = job.loaded.tokenizer
    prompter = Prompter(tokenizer, **(s.prompt or {}))
    matcher = matcher_from_config(s.boundary, tokenizer)
    settings = job.run_settings()
    # Every prompt of this shard, each checked against the model's context before any batch is decoded.
    context = context_positions(job.loaded.model.config)  # a shorter sliding window limits it
    prompts_of = [[prompter(item["question"]) for item in batch.items] for batch in batches]
    for batch, prompts in zip(batches, prompts_of):
        for item, prompt in zip(batch.items, prompts):
            check_context(item["item_id"], len(prompt), s.max_stage_tokens, s.max_new_tokens, context)
    chosen = set(choose_bridge_items(selection["item_index"], int(s.bridge["n_rows"]), int(s.bridge["seed"]))
                 if s.bridge else [])
    rows, prefix_rows, bridge_rows = [], [], []
    for batch, prompts in progress(list(zip(batches, prompts_of)),
                                   f"reconstruct_prefixes {s.revision}/{s.precision} shard {s.shard}",
                                   enabled=s.progress, items=lambda pair: len(pair[0].items)):
        wanted = bridge_rows_of(batch, chosen)
        result = matched(job.decoder, batch, prompts, settings, tokenizer, matcher, keep=wanted)
        rows += result.rows
        prefix_rows += result.prefix_rows
        bridge_rows += bridge(job.decoder, batch, prompts, settings, result, wanted)
    prov = job.provenance("reconstruct_prefixes", config, batch_plan=None if plan is None else plan.record())
    write_parquet(pd.DataFrame(rows, columns=LEDGER_SCHEMA.names), ledger_path, prov, LEDGER_SCHEMA)
    write_parquet(pd.DataFrame(prefix_rows, columns=PREFIX_SCHEMA.names), prefixes_path, prov, PREFIX_SCHEMA)
    write_parquet(pd.DataFrame(bridge_rows, columns=BRIDGE_SCHEMA.names), bridge_path, prov, BRIDGE_SCHEMA)
