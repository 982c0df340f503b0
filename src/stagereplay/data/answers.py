"""Answer extraction and correctness: from a suffix's text to a normalised answer string.

Formats: ``last_number`` (the last number after the stage end marker, else in the whole text), ``gsm8k``
(the number after ``####``), ``boxed`` (the content of the last ``\\boxed{}``). Normalisation makes
``1,000``, ``1000.0`` and ``1000`` equal and reduces fractions (``6/4`` == ``3/2``). Knows nothing of models.
"""

from __future__ import annotations

import re
from fractions import Fraction

ANSWER_FORMATS = ("last_number", "gsm8k", "boxed")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_EXPONENT = re.compile(r"[eE]([+-]?\d+)\s*$")
MAX_EXPONENT = 308  # a float's range: 1e308 is about its largest value


def parse_fraction(s: str) -> Fraction:
    """``s`` as an exact fraction: ValueError where it is no number, OverflowError where its exponent puts it
    beyond a float's range (``1e400``; ``Fraction`` would write out every digit of ``1e999999999`` first)."""
    exponent = _EXPONENT.search(s)
    if exponent and abs(int(exponent.group(1))) > MAX_EXPONENT:
        raise OverflowError(f"{s!r} is beyond a float's range")
    return Fraction(s)


def normalize_answer(text: str | None) -> str | None:
    """Canonical string of a numeric answer (``"3/2"``, ``"-4"``, ``"0.25"``), else the stripped text."""
    if text is None:
        return None
    s = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if not s:
        return None
    try:
        value = parse_fraction(s)
    except (ValueError, ZeroDivisionError, OverflowError):
        return s  # no number, or one too large to write out: compared as written
    if value.denominator == 1:
        return str(value.numerator)
    try:
        decimal = value.numerator / value.denominator
    except OverflowError:  # a quotient beyond a float's range has no decimal form: the reduced fraction
        return f"{value.numerator}/{value.denominator}"
    if "/" not in s and Fraction(repr(decimal)) == value:
        return repr(decimal)
    return f"{value.numerator}/{value.denominator}"


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str, answer_format: str = "last_number", stage_end: str | None = "</think>") -> str | None:
    """The normalised answer in ``text``, or None when there is none."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer format {answer_format!r} is not one of {ANSWER_FORMATS}")
    if answer_format == "boxed":
        return normalize_answer(_last_boxed(text))
    if answer_format == "gsm8k":
        if "####" not in text:
            return None
        numbers = _NUMBER.findall(text.rsplit("####", 1)[1])
        return normalize_answer(numbers[0]) if numbers else None
    if stage_end and stage_end in text:
        text = text.rsplit(stage_end, 1)[1]
    numbers = _NUMBER.findall(text)
    return normalize_answer(numbers[-1]) if numbers else None


def gold_from_gsm8k(answer_field: str) -> str | None:
    """The gold answer of a GSM8K ``answer`` field: the number after ``####``."""
    return extract_answer(answer_field, "gsm8k")


def is_correct(answer: str | None, gold: str | None) -> bool:
    return answer is not None and gold is not None and normalize_answer(answer) == normalize_answer(gold)
