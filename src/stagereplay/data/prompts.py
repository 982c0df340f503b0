"""Question text -> prompt ids, and the context check that refuses an item before any work."""

from __future__ import annotations

import string
from dataclasses import dataclass


class PromptTooLongError(ValueError):
    """A prompt that leaves no room for the stage and suffix within the model's context."""


class UnknownCharactersError(ValueError):
    """A question holding characters the tokenizer cannot encode, which it would drop or turn into its unknown token."""


def check_template(template: str | None) -> None:
    """Refuse a raw prompt template that is not text with exactly the placeholder ``{question}``.

    Without ``{question}`` every item would get the same prompt; any other placeholder has no value to fill it.
    """
    if template is None:
        return
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as exc:  # a lone { or }
        raise ValueError(f"prompt.template {template!r} cannot be filled in ({exc}); write {{{{ and }}}} for a "
                         "literal brace and {question} where the question goes") from None
    others = sorted({f"{{{field}}}" for field in fields if field != "question"})
    if others:
        raise ValueError(f"prompt.template {template!r} has the placeholder {', '.join(others)}, but the only one "
                         "filled in is {question}: rename it to {question}, or write {{ and }} for a literal brace")
    if "question" not in fields:
        raise ValueError(f"prompt.template {template!r} has no {{question}}, so every item would get the same "
                         "prompt: put {question} where the question goes")


@dataclass
class Prompter:
    """Question text -> prompt ids: the chat template when the tokenizer has one, else a raw template."""

    tokenizer: object
    system: str | None = None
    instruction: str | None = None
    template: str | None = None  # raw text with {question}; bypasses the chat template

    def __post_init__(self):
        check_template(self.template)

    def text(self, question: str) -> tuple[str, bool]:
        """The prompt's text as the tokenizer gets it, and whether the tokenizer adds its special tokens to it."""
        content = f"{self.instruction}\n\n{question}" if self.instruction else question
        if self.template is not None:
            return self.template.format(question=content), False
        if getattr(self.tokenizer, "chat_template", None):
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
                {"role": "user", "content": content}
            ]
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), False
        return content, True

    def written_parts(self, question: str) -> list[str]:
        """The prompt's text that the config and the item write (the chat template's own text aside, which comes
        with the tokenizer): the filled-in raw template, else the user message and the system prompt."""
        content = f"{self.instruction}\n\n{question}" if self.instruction else question
        if self.template is not None:
            return [self.template.format(question=content)]
        return [content] + ([self.system] if self.system and getattr(self.tokenizer, "chat_template", None) else [])

    def settings(self) -> str:
        """The prompt keys in use, for messages."""
        used = [f"prompt.{key}: {value!r}" for key, value in
                (("instruction", self.instruction), ("template", self.template), ("system", self.system))
                if value is not None]
        chat = getattr(self.tokenizer, "chat_template", None) and self.template is None
        return ", ".join(used + (["the tokenizer's chat template"] if chat else [])) or "no prompt settings"

    def __call__(self, question: str) -> list[int]:
        text, special = self.text(question)
        return self.tokenizer(text, add_special_tokens=special)["input_ids"]


def check_context(item_id: str, n_prompt: int, max_stage_tokens: int, max_new_tokens: int,
                  context_limit: int | None) -> None:
    """Raise :class:`PromptTooLongError` naming the item if its prompt and both budgets overrun the context."""
    if context_limit is not None and n_prompt + max_stage_tokens + max_new_tokens > context_limit:
        raise PromptTooLongError(
            f"item {item_id!r}: prompt of {n_prompt} tokens + max_stage_tokens {max_stage_tokens} + "
            f"max_new_tokens {max_new_tokens} exceeds the model's context of {context_limit}; lower the budgets "
            "or drop the item"
        )


def unknown_characters(tokenizer, text: str, alone: dict | None = None) -> list[str]:
    """The characters of ``text`` that reach the model as nothing: the tokenizer drops them, or reads them as its
    unknown token (``alone`` caches, across calls, whether a character alone encodes to nothing but that token).

    A character is unknown when removing it from ``text`` leaves the ids the model sees (unknown tokens aside)
    unchanged. Only the characters that alone encode to nothing are tried so (a space alone does, for some
    tokenizers that attach it to the next word), so a tokenizer that covers every byte costs one encoding each.
    """
    unk = getattr(tokenizer, "unk_token_id", None)
    alone = {} if alone is None else alone

    def seen(t: str) -> list[int]:
        return [i for i in tokenizer(t, add_special_tokens=False)["input_ids"] if i != unk]

    for c in set(text) - alone.keys():
        alone[c] = not seen(c)
    suspects = sorted(c for c in set(text) if alone[c])
    if not suspects:
        return []
    ids = seen(text)
    return [c for c in suspects if seen(text.replace(c, "")) == ids]


def _known_characters(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    # A small vocabulary (the toy's 21 tokens) can be listed: it says what the model reads.
    return (f"; it knows only the characters {''.join(sorted(t for t in vocab if len(t) == 1))!r} (the embedded "
            "toy model reads arithmetic chains such as 37+45-12, not word problems)" if len(vocab) <= 256 else "")


def check_characters(item_id: str, question: str, tokenizer, model: str, alone: dict | None = None,
                     prompter: Prompter | None = None) -> None:
    """Raise :class:`UnknownCharactersError` naming the item and the characters its tokenizer cannot encode.

    A character-level tokenizer such as the toy's drops every other character: "Natalia sold clips to 48
    friends" would reach the model as ``48``. ``alone`` is :func:`unknown_characters`' cache. With ``prompter`` the
    whole prompt is checked as the model sees it, so that characters of the instruction, the template or the system
    prompt (``prompt.instruction: "Solve this:"`` reached the toy as ``Q::12+7=``) are refused too.
    """
    unknown = unknown_characters(tokenizer, question, alone)
    if unknown:
        raise UnknownCharactersError(
            f"item {item_id!r}: the question {question[:60]!r} has characters the tokenizer of {model} does not know "
            f"({', '.join(map(repr, unknown))}), which the model would never see (dropped, or read as the unknown "
            f"token){_known_characters(tokenizer)}. Fix or remove the item, or use a model whose tokenizer covers it"
        )
    if prompter is None:
        return
    joined = " (an instruction is joined to the question by a blank line, '\\n\\n')" if prompter.instruction else ""
    for text in prompter.written_parts(question):
        unknown = unknown_characters(tokenizer, text, alone)
        if unknown:
            raise UnknownCharactersError(
                f"item {item_id!r}: the prompt text {text[:80]!r} ({prompter.settings()}) has characters the "
                f"tokenizer of {model} does not know ({', '.join(map(repr, unknown))}), which the model would never "
                f"see (dropped, or read as the unknown token){_known_characters(tokenizer)}. Change the prompt "
                f"settings to text the tokenizer covers{joined}, or use a model whose tokenizer covers it"
            )


class UnreachableBoundaryError(ValueError):
    """A boundary marker the model's tokenizer cannot produce, so no generated text could reach the boundary."""


def check_marker(marker: str | None, tokenizer, model: str) -> None:
    """Refuse a ``boundary.marker`` that no generated text could contain: the boundary is matched on the decoded
    text, so every character of the marker must be in the decoded text of some token of the vocabulary. (The marker
    alone need not encode to itself: a vocabulary of ``~0``, ``~1``, ... writes ``~`` only inside other tokens.)"""
    if not marker:
        return
    ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.decode(ids)
    if marker in decoded:
        return
    written = set("".join(tokenizer.batch_decode([[i] for i in range(len(tokenizer))])))
    unknown = sorted({c for c in marker if c not in written})
    if not unknown:
        return
    why = f"it has characters no token of the vocabulary writes ({', '.join(map(repr, unknown))})"
    raise UnreachableBoundaryError(
        f"boundary.marker {marker!r} cannot be produced by the tokenizer of {model}: {why}, so no generated text "
        f"could contain it and no item would reach the stage boundary{_known_characters(tokenizer)}. Give a marker "
        "the model writes, or its token id as boundary.token_id"
    )
