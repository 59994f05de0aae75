"""Judge prompts and verdict parsers (relax.rollout.verdicts): pure functions, hand-derived cases."""

from __future__ import annotations

import math

import pytest

from relax.config.genrm import check_template
from relax.data.samples import IMAGE_PLACEHOLDER, Message, Sample
from relax.rollout.verdicts import (
    NO_REFERENCE,
    TEMPLATES,
    parse_boxed,
    parse_score,
    parse_yes_no,
    question_of,
    render,
    template_hash,
)


def _sample(text: str = "What is 2 + 3?", answer: str = "5") -> Sample:
    return Sample(id="s1", messages=(Message("user", text),), answer=answer, task="arithmetic")


def test_score_tags_last_one_wins_and_out_of_range_is_named():
    assert parse_score("<score>0</score> on second thought <score> 0.75 </score>").score == 0.75
    missing = parse_score("looks right to me")
    assert missing.score is None and missing.kind == "unparsable" and "<score>S</score>" in missing.invalid
    high = parse_score("<score>1.5</score>")
    assert high.score is None and high.kind == "out_of_range" and "1.5" in high.invalid
    assert parse_score("<score>-0.5</score>").kind == "out_of_range"


def test_boxed_verdicts():
    assert parse_boxed("so \\boxed{0} ... no, \\boxed{1}").score == 1.0
    assert parse_boxed("\\boxed{.25}").score == 0.25
    assert parse_boxed("\\boxed{yes}").kind == "unparsable"
    assert parse_boxed("\\boxed{2}").kind == "out_of_range"


def test_yes_no_probability_from_the_first_tokens_log_probs():
    words = {1: "yes", 2: " Yes", 3: "no", 4: "maybe", 5: "y", 6: "N"}
    decode = words.__getitem__
    # p(yes) = 0.6 + 0.1 = 0.7 (ids 1, 2), p(no) = 0.2 (id 3), "maybe" ignored -> 0.7 / 0.9
    v = parse_yes_no([(math.log(0.6), 1), (math.log(0.2), 3), (math.log(0.1), 2), (math.log(0.1), 4)], decode)
    assert v.score == pytest.approx(0.7 / 0.9)
    # a vocabulary that spells the answers over tokens: "y" starts yes, "N" starts no -> 0.3 / (0.3 + 0.1)
    assert parse_yes_no([(math.log(0.3), 5), (math.log(0.1), 6)], decode).score == pytest.approx(0.75)
    none = parse_yes_no([(math.log(0.9), 4)], decode)
    assert none.score is None and none.kind == "unparsable" and "maybe" in none.invalid


def test_render_fills_question_response_and_optional_reference():
    s = _sample(f"How many {IMAGE_PLACEHOLDER} shapes?", "3")
    assert question_of(s) == "How many [image] shapes?"
    text = render(TEMPLATES["yes_no"], "<answer>4</answer>", s)
    assert "How many [image] shapes?" in text and "Reference answer: 3" in text and "<answer>4</answer>" in text
    assert f"Reference answer: {NO_REFERENCE}" in render(TEMPLATES["yes_no"], "x", s, reference=False)


def test_templates_are_checked_and_hashed():
    for t in TEMPLATES.values():
        check_template(t, "built-in")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['answer'\]"):
        check_template("{question} {answer} {response}", "mine.txt")
    with pytest.raises(ValueError, match="never shows the judge the {response}"):
        check_template("{question}", "mine.txt")
    with pytest.raises(ValueError, match="not a format template"):
        check_template("{response} {", "mine.txt")
    assert template_hash("a") == template_hash("a") != template_hash("b")
    assert len(template_hash("a")) == 16

