"""The built-in judge templates are format strings whose only fields are the judge's."""

from __future__ import annotations

import pytest

from relax.config.genrm import check_template
from relax.data.samples import Message, Sample
from relax.rollout.verdicts import TEMPLATES, parse_boxed, parse_score, render


@pytest.mark.parametrize("verdict", sorted(TEMPLATES))
def test_every_built_in_template_renders_with_its_literal_tags(verdict):
    template = TEMPLATES[verdict]
    check_template(template, verdict)
    sample = Sample(id="s", task="t", messages=(Message("user", "What is 2 + 3?"),), answer="5")
    text = render(template, "<answer>5</answer>", sample)
    assert "What is 2 + 3?" in text and "Reference answer: 5" in text and "<answer>5</answer>" in text
    # the instructions show the verdict's own tag, which its parser reads back
    if verdict == "boxed":
        assert "\\boxed{1}" in text and parse_boxed(text).score == 0.0
    if verdict == "score":
        assert "<score>1</score>" in text and parse_score(text).score == 0.0
