"""Answer extraction, normalization and the two generic reward functions."""

from __future__ import annotations

import pytest

from relax.data.samples import Message, Sample
from relax.data.verifiers import (
    exact_match_reward,
    extract_final_answer,
    integer_distance,
    normalize_answer,
    numbers_equal,
    numeric_match_reward,
    parse_number,
)


def make_sample(answer: str) -> Sample:
    return Sample(id="s-1", messages=(Message("user", "q"),), answer=answer)


# --- extract_final_answer: one case per format, in priority order -------------------


def test_answer_tag_last_one_wins() -> None:
    # two tags: the model corrected itself, the last one (12) counts
    assert extract_final_answer("<answer>10</answer> wait, no\n<answer> 12 </answer>") == "12"


def test_answer_tag_spans_lines_and_is_case_insensitive() -> None:
    assert extract_final_answer("<ANSWER>\nred\n</ANSWER>") == "red"


def test_answer_tag_beats_boxed_and_hashes() -> None:
    assert extract_final_answer("\\boxed{1}\n#### 2\n<answer>3</answer>") == "3"


def test_empty_answer_tag_is_none() -> None:
    assert extract_final_answer("<answer>  </answer>") is None


def test_boxed() -> None:
    assert extract_final_answer("so x = \\boxed{42}.") == "42"


def test_boxed_with_nested_braces_last_one() -> None:
    # nested braces are kept whole; the second \boxed is the final one
    assert extract_final_answer("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"


def test_hashes_gsm8k_style() -> None:
    assert extract_final_answer("She has 3+4 = 7 apples.\n#### 7") == "7"


def test_hashes_beats_phrase() -> None:
    assert extract_final_answer("The answer is 5.\n#### 6") == "6"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: 17", "17"),
        ("final answer:   blue", "blue"),
        ("Thinking...\nThe answer is 9.", "9"),  # trailing period dropped
        ("THE ANSWER IS very high\nbye", "very high"),  # only the rest of that line
    ],
)
def test_answer_phrases(text: str, expected: str) -> None:
    assert extract_final_answer(text) == expected


def test_last_short_line_fallback() -> None:
    assert extract_final_answer("Let me count the beeps.\n\n3!\n\n") == "3"


def test_long_last_line_is_none() -> None:
    # 40+ characters of reasoning with no marker: no answer, rather than a wrong guess
    assert extract_final_answer("I am still thinking about this one, hmm, maybe") is None


def test_empty_text_is_none() -> None:
    assert extract_final_answer("") is None
    assert extract_final_answer("\n \n") is None


# --- normalize_answer ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  Red. ", "red"),
        ("$1,200", "1200"),
        ("7.0", "7"),
        ("+3.50", "3.5"),
        ("-5", "-5"),
        ("The Blue", "blue"),
        ("a", "a"),  # a lone article is a choice label, not noise
        ("very   high", "very high"),
        ("1,234,567", "1234567"),
        ("**42**", "42"),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_normalize_keeps_non_thousands_commas() -> None:
    # "12,5" is not a thousands separator (two digits follow), so it is left alone
    assert normalize_answer("12,5") == "12,5"


# --- numbers_equal / parse_number ----------------------------------------------------


def test_numbers_equal() -> None:
    assert numbers_equal("1,200", "1200.0")
    assert numbers_equal("$72", 72)
    assert numbers_equal("1/2", "0.5")
    assert numbers_equal("-3", "-3.000")
    assert not numbers_equal("3", "-3")
    assert not numbers_equal("seven", "7")
    assert not numbers_equal("1/0", "0")


def test_numbers_equal_tolerance() -> None:
    # 1/3 written to 7 places is within 1e-6 relative, to 3 places it is not
    assert numbers_equal("0.3333333", "1/3")
    assert not numbers_equal("0.333", "1/3")


def test_parse_number() -> None:
    assert parse_number("2.5") == parse_number("5/2")
    assert parse_number("abc") is None


# --- reward functions ----------------------------------------------------------------


def test_exact_match_reward_right_and_wrong() -> None:
    sample = make_sample("red")
    assert exact_match_reward("The shapes are red.\n<answer>Red</answer>", sample) == 1.0
    assert exact_match_reward("<answer>blue</answer>", sample) == 0.0
    assert exact_match_reward("I cannot tell what colour these are, sorry about that.", sample) == 0.0


def test_exact_match_reward_distinguishes_high_and_very_high() -> None:
    assert exact_match_reward("<answer>high</answer>", make_sample("very high")) == 0.0
    assert exact_match_reward("<answer>very high</answer>", make_sample("very high")) == 1.0


def test_exact_match_reward_on_counts() -> None:
    # "3.0" normalizes to "3"
    assert exact_match_reward("<answer>3.0</answer>", make_sample("3")) == 1.0


def test_numeric_match_reward_right_and_wrong() -> None:
    sample = make_sample("1200")
    assert numeric_match_reward("#### 1,200", sample) == 1.0
    assert numeric_match_reward("\\boxed{1200.00}", sample) == 1.0
    assert numeric_match_reward("The answer is $1,200.", sample) == 1.0
    assert numeric_match_reward("<answer>1201</answer>", sample) == 0.0
    assert numeric_match_reward("no idea at all, this is way too hard for me", sample) == 0.0


def test_numeric_match_reward_uses_last_number_of_a_worded_answer() -> None:
    # extracted "3 + 4 = 7" -> last number 7; "7 apples" -> 7
    assert numeric_match_reward("Answer: 3 + 4 = 7", make_sample("7")) == 1.0
    assert numeric_match_reward("<answer>7 apples</answer>", make_sample("7")) == 1.0
    assert numeric_match_reward("<answer>7 apples</answer>", make_sample("8")) == 0.0


def test_numeric_match_reward_negative() -> None:
    assert numeric_match_reward("<answer>-57</answer>", make_sample("-57")) == 1.0
    assert numeric_match_reward("<answer>57</answer>", make_sample("-57")) == 0.0


def test_integer_distance_is_defined_between_integers_only() -> None:
    # |3 - 4| = 1; "4.0" is the integer 4 (distance 0); "three", "3/2", "blue" and no answer: None
    assert integer_distance("<answer>3</answer>", make_sample("4")) == 1
    assert integer_distance("<answer>4.0</answer>", make_sample("4")) == 0
    assert integer_distance("<answer>1</answer>", make_sample("4")) == 3
    for response in ("<answer>three</answer>", "<answer>3/2</answer>", "<answer>blue</answer>", ""):
        assert integer_distance(response, make_sample("4")) is None
    assert integer_distance("<answer>3</answer>", make_sample("red")) is None


def test_given_answer_normalises_as_exact_match_compares():
    from relax.data.verifiers import given_answer

    assert given_answer("<answer> Yellow. </answer>") == "yellow"
    assert given_answer("<answer>3.0</answer>") == "3"
    assert given_answer("") is None  # the evaluation's confusion records this as ""
