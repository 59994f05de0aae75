"""The prompt order is a pure function of (seed, position): a resumed stream continues exactly."""

from __future__ import annotations

import pytest

from relax.data.schema import Message, Sample
from relax.rollout.prompts import PromptStream


def _samples(n):
    return [Sample(id=f"s{i}", messages=(Message("user", f"q{i}"),), answer=str(i)) for i in range(n)]


def test_epochs_visit_every_prompt_once_in_a_seeded_order():
    stream = PromptStream(_samples(5), seed=3)
    first, second = stream.take(5), stream.take(5)
    assert sorted(s.id for _, s in first) == sorted(s.id for _, s in second) == [f"s{i}" for i in range(5)]
    assert [p for p, _ in first + second] == list(range(10))


def test_resume_from_position_matches_uninterrupted_stream():
    whole = [s.id for _, s in PromptStream(_samples(7), seed=1).take(20)]
    head = PromptStream(_samples(7), seed=1)
    got = [s.id for _, s in head.take(9)]
    got += [s.id for _, s in PromptStream(_samples(7), seed=1, position=head.position).take(11)]
    assert got == whole
    assert [s.id for _, s in PromptStream(_samples(7), seed=2).take(20)] != whole


def test_empty_split_is_refused():
    with pytest.raises(ValueError, match="training split is empty"):
        PromptStream([], seed=0)
