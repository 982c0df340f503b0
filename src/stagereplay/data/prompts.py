"""Question text -> prompt ids, and the context check that refuses an item before any work."""

from __future__ import annotations

from dataclasses import dataclass


class PromptTooLongError(ValueError):
    """A prompt that leaves no room for the stage and suffix within the model's context."""


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


def check_context(item_id: str, n_prompt: int, max_stage_tokens: int, max_new_tokens: int,
                  context_limit: int | None) -> None:
    """Raise :class:`PromptTooLongError` naming the item if its prompt and both budgets overrun the context."""
    if context_limit is not None and n_prompt + max_stage_tokens + max_new_tokens > context_limit:
        raise PromptTooLongError(
            f"item {item_id!r}: prompt of {n_prompt} tokens + max_stage_tokens {max_stage_tokens} + "
            f"max_new_tokens {max_new_tokens} exceeds the model's context of {context_limit}; lower the budgets "
            "or drop the item"
        )
