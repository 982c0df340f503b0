"""The embedded default: a synthetic multi-step arithmetic task and a toy reasoning model trained on it.

Everything here is reproducible from a seed and needs no network. The toy model is a real
``Qwen2ForCausalLM`` with a character-level tokenizer saved in Hugging Face format, so every code path
the pipeline takes on it is the one a real checkpoint takes.

A trajectory reads ``Q:37+45-12=<think>37+45=82;82-12=70;</think>A:70<eos>``; the stage boundary of the
default config is the second ``;`` (the end of the second reasoning step).

This module knows nothing of caches, constructions or the ledger.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

CHARS = list("0123456789+-=;:QA")
SPECIAL_TOKENS = ["<pad>", "<eos>", "<think>", "</think>"]
# The chat template is the only place the toy's prompt format lives: the pipeline prompts the toy the way
# it prompts any chat model.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}Q:{{ message['content'] }}={% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<think>{% endif %}"
)


@dataclass(frozen=True)
class ToyItem:
    item_id: str
    question: str
    gold_answer: str
    steps: tuple[str, ...]  # "37+45=82" ...


def make_item(index: int, seed: int, min_steps: int = 3, max_steps: int = 5) -> ToyItem:
    """Item ``index`` of the synthetic set with ``seed``: a left-to-right +/- chain kept inside 0..99."""
    rng = random.Random(f"stagereplay-toy:{seed}:{index}")
    n_steps = rng.randint(min_steps, max_steps)
    value = rng.randint(10, 99)
    question = str(value)
    steps = []
    for _ in range(n_steps):
        can_add, can_sub = value < 99, value > 0
        op = rng.choice(["+", "-"]) if (can_add and can_sub) else ("+" if can_add else "-")
        operand = rng.randint(1, 99 - value) if op == "+" else rng.randint(1, value)
        new_value = value + operand if op == "+" else value - operand
        steps.append(f"{value}{op}{operand}={new_value}")
        question += f"{op}{operand}"
        value = new_value
    return ToyItem(f"toy-{seed}-{index:06d}", question, str(value), tuple(steps))


def synthetic_items(n: int, seed: int) -> list[ToyItem]:
    return [make_item(i, seed) for i in range(n)]


def target_text(item: ToyItem) -> str:
    """What the model should generate after the prompt (reasoning stage, end marker, answer)."""
    return "".join(f"{s};" for s in item.steps) + f"</think>A:{item.gold_answer}"


def build_tokenizer():
    """Character-level fast tokenizer with the toy's chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        # AutoTokenizer resolves a qwen2 model to Qwen2Tokenizer, which adds its own unk token unless one is set.
        unk_token="<pad>",
        eos_token="<eos>",
        additional_special_tokens=["<think>", "</think>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@dataclass(frozen=True)
class ToyTrainingSpec:
    seed: int = 0
    steps: int = 6000
    batch_size: int = 96
    lr: float = 3e-3
    warmup: int = 200
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    threads: int = 2


def toy_config(spec: ToyTrainingSpec, vocab_size: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )


def _batch(tokenizer, items: list[ToyItem]):
    import torch

    rows, labels = [], []
    for item in items:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": item.question}], add_generation_prompt=True, tokenize=False
        )
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        t = tokenizer(target_text(item), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + t)
        # The loss covers the reasoning and the answer only: the question digits are random and unlearnable.
        labels.append([-100] * len(p) + t)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(l)] = torch.tensor(l)
        mask[i, : len(r)] = 1
    return ids, lab, mask


def train_toy(
    out_dir: str | Path,
    spec: ToyTrainingSpec = ToyTrainingSpec(),
    init_from: str | Path | None = None,
    progress: bool = True,
    device: str = "cpu",
) -> dict:
    """Train (or continue training) the toy model and save it in Hugging Face format.

    Training data are drawn from seed ``10_000 + spec.seed`` so they never overlap the evaluation set's
    default seed. Bit-reproducible for the same torch build, CPU kernel set (ATen's CPU capability: AVX2,
    AVX-512, ...) and ``spec.threads`` (``device`` cpu; another device, e.g. cuda for a quick search over specs, is
    recorded and makes no such promise). Returns the record written beside the weights (spec, loss, device, CPU
    capability, sha256 of ``model.safetensors``).
    """
    import torch
    from tqdm import tqdm
    from transformers import Qwen2ForCausalLM

    out_dir = Path(out_dir)
    torch.set_num_threads(spec.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(spec.seed)
    tokenizer = build_tokenizer()
    if init_from is not None:
        model = Qwen2ForCausalLM.from_pretrained(init_from, dtype=torch.float32)
    else:
        model = Qwen2ForCausalLM(toy_config(spec, len(tokenizer)))
    model.to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.98))
    data_seed = 10_000 + spec.seed
    losses = []
    bar = tqdm(range(spec.steps), desc=f"train toy -> {out_dir.name}", disable=not progress, mininterval=5)
    for step in bar:
        lr_scale = min(1.0, (step + 1) / spec.warmup) * 0.5 * (1 + math.cos(math.pi * step / spec.steps))
        for group in opt.param_groups:
            group["lr"] = spec.lr * lr_scale
        items = [make_item(step * spec.batch_size + j, data_seed) for j in range(spec.batch_size)]
        ids, labels, mask = (t.to(device) for t in _batch(tokenizer, items))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % 100 == 0:
            bar.set_postfix(loss=f"{sum(losses[-100:]) / len(losses[-100:]):.4f}")
    model.eval()
    model.to("cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    # Saved beside out_dir, then each file renamed into it: a crash never leaves a half-written weights file.
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    weights = staging / "model.safetensors"
    record = {
        "spec": asdict(spec),
        "init_from": None if init_from is None else Path(init_from).name,
        "final_loss": sum(losses[-100:]) / max(1, len(losses[-100:])),
        "model_safetensors_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "device": device,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    (staging / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    for path in sorted(staging.iterdir(), key=lambda p: p.name == "training.json"):  # the record last
        os.replace(path, out_dir / path.name)
    staging.rmdir()
    return record


# The shipped toy's shape: narrow and six layers deep, trained briefly, so that it stays unsure of its arithmetic
# (a few percent of answers right). Its near-ties are what a cache's bf16 bits can tip: toys trained until they
# are sure split on almost no items (bench/RESULTS.md, "How strongly the embedded toy shows the effect").
TOY_SHAPE = {"hidden_size": 32, "intermediate_size": 96, "num_hidden_layers": 6}

# The two shipped revisions under data/toy/: "later" continues training "primary" on fresh data.
TOY_REVISIONS = {
    "primary": (None, ToyTrainingSpec(seed=0, steps=600, batch_size=64, warmup=50, **TOY_SHAPE)),
    "later": ("primary", ToyTrainingSpec(seed=1, steps=400, batch_size=64, lr=1e-3, warmup=20, **TOY_SHAPE)),
}


def reproduce_revision(name: str, out_root: str | Path, progress: bool = True) -> dict:
    """Retrain shipped revision ``name`` into ``out_root/name`` (its parent revision first, if needed)."""
    if name not in TOY_REVISIONS:
        raise ValueError(f"toy revision {name!r} is not one of {sorted(TOY_REVISIONS)}")
    parent, spec = TOY_REVISIONS[name]
    out_root = Path(out_root)
    init_from = None
    if parent is not None:
        init_from = out_root / parent
        if not (init_from / "model.safetensors").is_file():
            reproduce_revision(parent, out_root, progress)
    return train_toy(out_root / name, spec, init_from=init_from, progress=progress)


class ToyNotReproduced(RuntimeError):
    """A retrained toy revision whose weights are not the shipped ones, byte for byte."""


def training_conditions(record: dict) -> dict:
    """What a toy's weights depend on beyond its spec, from its training record: torch build, CPU kernel set and
    thread count (None where the record does not name one)."""
    return {"torch": record.get("torch"), "cpu_capability": record.get("cpu_capability"),
            "threads": (record.get("spec") or {}).get("threads")}


def check_reproduced(name: str, reproduced: str | Path, shipped_root: str | Path) -> dict:
    """Compare a retrained revision's weights with the shipped ones by sha256: the comparison and the training
    conditions of both (torch build, CPU kernel set, threads) when they are identical; else raise
    :class:`ToyNotReproduced`, naming both fingerprints and every condition that differs or was not recorded."""
    shipped_record = json.loads((Path(shipped_root) / name / "training.json").read_text())
    reproduced_record = json.loads((Path(reproduced) / name / "training.json").read_text())
    shipped = shipped_record["model_safetensors_sha256"]
    got = hashlib.sha256((Path(reproduced) / name / "model.safetensors").read_bytes()).hexdigest()
    result = {"revision": name, "shipped_sha256": shipped, "reproduced_sha256": got, "identical": shipped == got,
              "shipped_conditions": training_conditions(shipped_record),
              "reproduced_conditions": training_conditions(reproduced_record)}
    if result["identical"]:
        return result
    differ = [f"{key} {result['shipped_conditions'][key]!r} (shipped) vs {value!r} (here)"
              for key, value in result["reproduced_conditions"].items()
              if result["shipped_conditions"][key] != value]
    why = ("; the conditions that differ or the shipped record does not name: " + ", ".join(differ) if differ
           else "; torch build, CPU kernel set and threads are the shipped record's, so this is a real difference")
    raise ToyNotReproduced(
        f"toy revision {name!r} retrained to weights with sha256 {got}, not the shipped {shipped}{why}. The "
        f"weights are bit-identical only for the same torch build, CPU kernel set (ATen's CPU capability) and thread "
        f"count; ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA select another kernel set.")
