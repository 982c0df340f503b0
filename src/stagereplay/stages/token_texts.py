"""The item browser's stage: the ledger's token ids as text, decoded with each revision's own tokenizer.

The ledger holds token ids (and each suffix's text decoded whole); the browser marks the first divergent token,
so it needs every token's text on its own. This stage loads each revision's tokenizer as the generation loaded it
(:func:`~stagereplay.models.loading.checked_config` and :func:`~stagereplay.models.loading.checked_tokenizer`,
never the weights), refuses a ledger that was generated from another model source than the config names, decodes
every id the page shows once, and hands the texts to :func:`stagereplay.analysis.browser_page.write_item_browser`.

Each id is decoded alone (special tokens kept, no clean-up of spaces): a token that is part of a multi-byte
character shows as the replacement character, and a tokenizer that drops a word's leading space when the word
stands alone shows it without; the ledger's ``suffix_text`` keeps the whole decoding. Knows nothing of Snakemake.
"""

from __future__ import annotations

from stagereplay.analysis.browser_data import read_results, suffix_token_ids
from stagereplay.analysis.browser_page import write_item_browser
from pathlib import Path

from stagereplay.io.parquet import read_provenance
from stagereplay.models.loading import checked_config, checked_tokenizer
from stagereplay.models.snapshot import checked_stand_in
from stagereplay.models.sources import ModelLoadError, resolve_source
from stagereplay.models.store import ModelStore, read_record


def load_tokenizer(model: str, revision: str, trust_remote_code: bool = False, allow_pickle: bool = False,
                   offline: bool = True, base_dir: str = ".", prepared_models: str | None = None):
    """(source, tokenizer) of one revision of the config's model, loaded and checked as the generation does: from
    the revision's prepared snapshot in the model store where the run's record ``prepared_models`` names a whole
    one (a GGUF's metadata is not parsed again), else from the source."""
    source = resolve_source(model, revision, base_dir)
    if prepared_models and Path(prepared_models).is_file():
        record = read_record(prepared_models)
        store = ModelStore(record["store"])
        folders = [store.path(snap["key"]) for snap in record.get("snapshots", {}).values()]
        stand_in = checked_stand_in(folders, source, {"sha256": record.get("source_sha256")})
        if stand_in is not None:
            return source, stand_in[2]
    resolved, _, config, common = checked_config(source, trust_remote_code, allow_pickle, offline)
    return source, checked_tokenizer(resolved, source, common, getattr(config, "vocab_size", None))


def token_texts(tokenizer, ids) -> dict[int, str]:
    """{id: the text ``id`` decodes to alone}, special tokens included, spaces as the tokenizer gives them."""
    return {i: tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for i in sorted({int(i) for i in ids})}


def recorded_sources(ledger_path: str) -> set[str]:
    """The model sources a ledger's parts record in their provenance (empty where none is recorded)."""
    provenance = read_provenance(ledger_path)
    parts = provenance.get("parts", [provenance])
    return {part["model_source"] for part in parts if isinstance(part, dict) and part.get("model_source")}


def build_item_browser(out_html: str, ledgers: dict[str, str], tokenizers: dict[str, dict],
                       transplants: dict[str, str] | None = None, selection: str | None = None,
                       run: str = "") -> dict:
    """Write ``out_html`` (the item browser) from ``ledgers`` ({revision: ledger.parquet}) and ``transplants``
    ({revision: transplant.parquet}); ``tokenizers`` maps each ledger's revision to the keyword arguments of
    :func:`load_tokenizer` (model, revision, trust_remote_code, allow_pickle, offline)."""
    frames, transplant_frames, chosen = read_results(ledgers, transplants, selection)
    texts = {}
    for revision, ids in suffix_token_ids(frames).items():
        source, tokenizer = load_tokenizer(**tokenizers[revision])
        recorded = recorded_sources(ledgers[revision])
        if recorded and recorded != {source.describe()}:
            raise ModelLoadError(
                f"{ledgers[revision]} was generated from {sorted(recorded)} but the config's revision "
                f"{tokenizers[revision]['revision']!r} is {source.describe()!r}: its token ids would be decoded with "
                "another tokenizer. Rerun the run's generation, or point model/revisions at the ledger's source")
        texts[revision] = token_texts(tokenizer, ids)
    return write_item_browser(out_html, frames, texts, transplant_frames, chosen, run)
