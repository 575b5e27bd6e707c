"""MATH-style answers: the last \\boxed{} (balanced braces), normalisation and equivalence, scoring."""

from __future__ import annotations

import pytest

from spmd_rlhf.rewards import MATH_DATA_SOURCES, RULES, last_boxed, math_equal, math_score, normalize_math_answer

BOXED = [
    ("so the answer is \\boxed{5}.", "5"),
    ("\\boxed{1} at first, finally \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),  # nested braces
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are literal
    ("\\fbox{7}", "7"),
    ("$\\boxed 9$", "9"),  # LaTeX's one-token form
    ("\\boxed {x+1}", "x+1"),
    ("\\boxed{3} then \\boxed{\\frac{1}{", None),  # the last box is cut off: no answer, not the earlier one
    ("\\boxedx{3}", None),
    ("no box, 5", None),
]


@pytest.mark.parametrize("text, content", BOXED)
def test_last_boxed(text, content):
    assert last_boxed(text) == content


EQUIVALENCE = [
    # answer, reference, equal
    ("\\frac{1}{2}", "\\frac12", True),
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
    ("\\tfrac{3}{4}", "3/4", True),
    ("0.5", "\\frac12", True),
    (".5", "0.5", True),
    ("-\\frac{1}{2}", "\\frac{-1}{2}", True),
    ("-1/2", "-0.5", True),
    ("\\frac{2}{4}", "\\frac{1}{2}", True),  # same value
    ("10\\text{ cm}", "10", True),
    ("5 \\text{cm}^2", "5", True),
    ("12 \\mbox{ inches}", "12", True),
    ("\\text{(B)}", "(B)", True),
    ("\\text{Monday}", "Monday", True),
    ("x = 3", "3", True),
    ("y = 2x + 3", "2x+3", True),
    ("90^\\circ", "90", True),
    ("90^{\\circ}", "90", True),
    ("50\\%", "50", True),
    ("\\$5.00", "5", True),
    ("3.0", "3", True),
    ("7.", "7", True),
    ("1,000", "1000", True),
    ("\\sqrt2", "\\sqrt{2}", True),
    ("2\\sqrt 3", "2\\sqrt{3}", True),
    ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}", True),
    ("\\frac\\pi2", "\\frac{\\pi}{2}", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
    ("\\!\\, 4", "4", True),
    ("\\displaystyle\\frac{1}{3}", "\\frac13", True),
    # wrong answers that look close
    ("\\frac{1}{3}", "0.33", False),
    ("0.333", "\\frac{1}{3}", False),
    ("\\frac{1}{2}", "\\frac{2}{1}", False),
    ("-5", "5", False),
    ("2\\sqrt{2}", "\\sqrt{2}", False),
    ("\\sqrt{3}", "\\sqrt[3]{3}", False),
    ("(1,2)", "(2,1)", False),
    ("x^2", "x^3", False),
    ("10\\text{ cm}", "100", False),
    ("1,2", "12", False),  # a list of two answers, not a thousands comma
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", False),  # equal values, but nothing symbolic is attempted
    ("", "0", False),
]


@pytest.mark.parametrize("answer, reference, equal", EQUIVALENCE)
def test_math_equal(answer, reference, equal):
    assert math_equal(answer, reference) is equal
    assert math_equal(reference, answer) is equal


@pytest.mark.parametrize(
    "answer, normal",
    [
        ("\\left[ \\dfrac12 , 3 \\right)", "[\\frac{1}{2},3)"),
        ("x = \\sqrt2", "\\sqrt{2}"),
        ("4.50", "4.50"),  # only all-zero decimals go: 4.5 and 4.50 are still equal numerically
        ("\\frac{a+1}{b}", "\\frac{a+1}{b}"),
    ],
)
def test_normal_forms(answer, normal):
    assert normalize_math_answer(answer) == normal


SCORES = [
    # response, ground truth, format_score, score
    ("The sum is $\\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}", 0.0, 1.0),
    ("... so \\boxed{0.5}", "\\frac12", 0.0, 1.0),
    ("... so \\boxed{\\frac{1}{3}}", "\\frac12", 0.1, 0.1),
    ("the answer is 1/2", "\\frac12", 0.1, 0.0),  # no box: no answer
    ("\\boxed{7}", "Thus the total is $\\boxed{7}$.", 0.0, 1.0),  # a ground truth that is a whole solution
]


@pytest.mark.parametrize("response, ground_truth, format_score, expected", SCORES)
def test_math_score(response, ground_truth, format_score, expected):
    assert math_score("lighteval/MATH", response, ground_truth, {}, format_score=format_score) == expected


def test_registered_under_verl_math_data_sources():
    verl_sources = {"lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"}
    assert set(MATH_DATA_SOURCES) == verl_sources | {"math"}
    assert all(RULES[source] is math_score for source in MATH_DATA_SOURCES)
