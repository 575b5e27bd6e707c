"""GSM8K-style final-answer extraction and scoring."""

from __future__ import annotations

from fractions import Fraction

import pytest

from spmd_rlhf.rewards import RULES, extract_gsm8k_answer, gsm8k_score, parse_number

EXTRACTION = [
    # text, flexible answer, strict answer
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", "72"),
    ("#### 17\nHmm, maybe it is 18 after all", "17", "17"),  # #### wins over later numbers
    ("#### $1,234.50", "1,234.50", "1,234.50"),
    ("#### -5", "-5", "-5"),
    ("So the total is \\boxed{1,000}.", "1,000", "1,000"),
    ("\\boxed{18 \\text{ dollars}} and then 3 more words", "18", "18"),
    ("\\boxed{2} first, then \\boxed{x = 7}", "7", "7"),  # the last box, the last number in it
    ("She pays $18.", "18", None),
    ("It drops by -3 degrees", "-3", None),
    ("1,2,3 are the choices", "3", None),
    ("The answer is 0.5", "0.5", None),
    ("\\boxed{x} but 4 otherwise", "4", None),  # a box without a number does not count
    ("no idea", None, None),
]


@pytest.mark.parametrize("text, flexible, strict", EXTRACTION)
def test_final_answer_extraction(text, flexible, strict):
    assert extract_gsm8k_answer(text) == flexible
    assert extract_gsm8k_answer(text, strict=True) == strict


@pytest.mark.parametrize(
    "text, value",
    [
        ("1,234", Fraction(1234)),
        ("$5", None),
        ("72.0", Fraction(72)),
        ("42.", Fraction(42)),
        (" -7 ", Fraction(-7)),
        (".5", Fraction(1, 2)),
        ("1,23", None),
        ("12a", None),
        ("", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


SCORES = [
    # response, ground truth, strict, format_score, score
    ("So 72 clips.\n#### 72", "72", True, 0.0, 1.0),
    ("#### 1,234", "1234", True, 0.0, 1.0),
    ("#### 72.00", "72", True, 0.0, 1.0),
    ("\\boxed{\\$1,234}", "1234", True, 0.0, 1.0),
    ("#### 72.5", "72", False, 0.1, 0.1),  # close but wrong: the format score only
    ("#### -72", "72", False, 0.0, 0.0),
    ("The answer is 72", "72", False, 0.0, 1.0),
    ("The answer is 72", "72", True, 0.1, 0.0),  # strict: a bare number is no answer at all
    ("I cannot tell", "72", False, 0.1, 0.0),
    ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", True, 0.0, 1.0),  # GSM8K's own answer field
]


@pytest.mark.parametrize("response, ground_truth, strict, format_score, expected", SCORES)
def test_gsm8k_score(response, ground_truth, strict, format_score, expected):
    assert gsm8k_score("openai/gsm8k", response, ground_truth, {}, strict=strict, format_score=format_score) == expected


def test_a_ground_truth_without_a_number_is_an_error_not_a_wrong_answer():
    with pytest.raises(ValueError, match="GSM8K ground truth 'seventy' is neither a number"):
        gsm8k_score("openai/gsm8k", "#### 70", "seventy", {})


def test_registered_under_verl_and_short_names():
    assert RULES["openai/gsm8k"] is gsm8k_score and RULES["gsm8k"] is gsm8k_score
