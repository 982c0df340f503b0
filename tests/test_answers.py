import pytest

from stagereplay.data.answers import extract_answer, is_correct, normalize_answer


@pytest.mark.parametrize("text,fmt,expected", [
    ("37+45=82;82-12=70;</think>A:70<eos>", "last_number", "70"),
    ("<think>1+2=3;</think>", "last_number", None),
    ("no digits here", "last_number", None),
    ("so she pays 3 * 4 = 12 dollars.\n#### 1,200", "gsm8k", "1200"),
    ("no marker 12", "gsm8k", None),
    (r"thus \boxed{\frac{3}{4}} wait \boxed{6/4}", "boxed", "3/2"),
    (r"\boxed{-7.50}", "boxed", "-7.5"),
    ("A: -3.0", "last_number", "-3"),
])
def test_extract(text, fmt, expected):
    assert extract_answer(text, fmt) == expected


def test_normalization_makes_equal_numbers_equal():
    assert normalize_answer("1,000") == normalize_answer("1000.0") == "1000"
    assert normalize_answer("0.50") == "0.5"
    assert normalize_answer("6/4") == "3/2"
    assert normalize_answer("  ") is None
    assert is_correct("12", "12.0") and not is_correct(None, "12") and not is_correct("11", "12")


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="answer format"):
        extract_answer("1", "roman")
