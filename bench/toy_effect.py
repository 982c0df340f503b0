"""How strongly a toy model shows the effect: the matched experiment's live vs prefill divergence on the default
selection, without the pipeline (one replica per construction, no ledger).

    PYTHONPATH=src python bench/toy_effect.py data/toy/primary --precisions bf16 fp32

Prints, per precision, the divergent items (suffix ids of ``live`` and ``prefill`` differ), accuracy, tokens decoded
and the seconds taken; ``--json`` writes the per-item figures. A quick gauge for choosing the embedded toy
(bench/RESULTS.md, "How strongly the embedded toy shows the effect"); the pipeline's own numbers come from a run.
"""

from __future__ import annotations

import argparse
import json
import time

import yaml


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a toy revision folder (config, weights, tokenizer)")
    ap.add_argument("--config", default="config.yaml", help="the run config whose selection and budgets are used")
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--n-items", type=int, default=None, help="the first N of the selection (default: all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="instead of the config's")
    ap.add_argument("--batch-size", type=int, default=1, help="rows decoded together (the pipeline's batch plan)")
    ap.add_argument("--regime", default="eager", help="decode regime: eager, static")
    ap.add_argument("--attention", default="masked", help="decode_attention of the static regime")
    ap.add_argument("--json", default=None, help="write per-item results here")
    args = ap.parse_args()
    report = measure(args.model, args.config, args.precisions, args.n_items, args.threads, args.max_new_tokens,
                     args.batch_size, args.regime, args.attention)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def measure(model: str, config: str = "config.yaml", precisions=("bf16", "fp32"), n_items: int | None = None,
            threads: int = 1, max_new_tokens: int | None = None, batch_size: int = 1, regime: str = "eager",
            attention: str = "masked") -> dict:
    """Per precision: the summary (printed) and the per-item figures."""
    from stagereplay.data.answers import extract_answer, is_correct
    from stagereplay.data.datasets import choose_items, load_synthetic
    from stagereplay.data.prompts import Prompter
    from stagereplay.decode.greedy import matcher_from_config
    from stagereplay.decode.plans import batch_plan, batches_of
    from stagereplay.decode.regimes import make_decoder
    from stagereplay.experiments.recipe import run
    from stagereplay.experiments.rows import RunSettings
    from stagereplay.models.loading import eos_token_ids, load_model, set_determinism
    from stagereplay.models.sources import resolve_source

    cfg = yaml.safe_load(open(config))
    ds = cfg["dataset"]
    rows = load_synthetic(int(ds["size"]), int(ds["seed"]))
    items = choose_items(rows, int(cfg["n_items"]), int(cfg["seed"])).to_dict("records")[: n_items]
    set_determinism(threads)
    report = {}
    for precision in precisions:
        loaded = load_model(resolve_source(model, None), precision, "cpu", cfg.get("attn_implementation", "sdpa"))
        tok = loaded.tokenizer
        decoder = make_decoder(loaded.model, tuple(eos_token_ids(loaded)), "eager")
        prompter = Prompter(tok)
        matcher = matcher_from_config(cfg["boundary"], tok)
        settings = RunSettings("x", precision, int(cfg["max_stage_tokens"]),
                               max_new_tokens or int(cfg["max_new_tokens"]))
        t0, per_item, tokens = time.time(), [], 0
        seed = cfg["seed"] if cfg.get("batch_seed") is None else cfg["batch_seed"]  # as reconstruct_prefixes plans
        plan = batch_plan([i["item_id"] for i in items], batch_size, int(seed))
        if regime != "eager":
            budget = int(cfg["max_stage_tokens"]) + (max_new_tokens or int(cfg["max_new_tokens"]))
            longest = max(len(prompter(i["question"])) for i in items)
            decoder = make_decoder(loaded.model, tuple(eos_token_ids(loaded)), regime, max_len=longest + budget + 8,
                                   max_rows=batch_size, attention=attention)
        for batch in batches_of(items, plan):
            prompts = [prompter(item["question"]) for item in batch.items]
            lives = run(decoder, "live", prompts, settings, matcher=matcher)
            kept = [j for j, live in enumerate(lives) if live.stage_ids]
            pres = run(decoder, "prefill", [prompts[j] for j in kept], settings,
                       stages=[lives[j].stage_ids for j in kept]) if kept else []
            pre_of = dict(zip(kept, pres))
            for j, (item, live) in enumerate(zip(batch.items, lives)):
                rec = {"item_id": item["item_id"], "stage": len(live.stage_ids), "suffix": len(live.suffix_ids),
                       "status": live.stop_reason}
                tokens += len(live.stage_ids) + len(live.suffix_ids)
                if j in pre_of:
                    pre = pre_of[j]
                    tokens += len(pre.suffix_ids)
                    rec["divergent"] = pre.suffix_ids != live.suffix_ids
                    text = tok.decode(live.suffix_ids)
                    rec["correct"] = is_correct(extract_answer(text, "last_number"), str(item["gold_answer"]))
                    rec["min_margin"] = min(live.margins) if live.margins else None
                    if rec["divergent"]:
                        k = next((i for i, (a, b) in enumerate(zip(live.suffix_ids, pre.suffix_ids)) if a != b),
                                 min(len(live.suffix_ids), len(pre.suffix_ids)))
                        rec.update(first=k, margin_live=live.margins[k] if k < len(live.margins) else None,
                                   live_text=text, prefill_text=tok.decode(pre.suffix_ids))
                per_item.append(rec)
        ok = [r for r in per_item if "divergent" in r]
        secs = time.time() - t0
        summary = {"divergent": sum(r["divergent"] for r in ok), "n_ok": len(ok), "n": len(per_item),
                   "accuracy": sum(r["correct"] for r in ok) / max(1, len(ok)), "tokens": tokens,
                   "mean_stage": sum(r["stage"] for r in per_item) / len(per_item),
                   "mean_suffix": sum(r["suffix"] for r in per_item) / len(per_item),
                   "seconds": round(secs, 1)}
        print(precision, json.dumps(summary), flush=True)
        report[precision] = {"summary": summary, "items": per_item}
    return report


if __name__ == "__main__":
    main()
