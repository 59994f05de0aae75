"""Config fields: every bad value names the field and the fix; every field is documented."""

from __future__ import annotations

import dataclasses
import re

import pytest

from relax.config import (
    ConfigError,
    RelaxConfig,
    load_config,
)


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("trainer.lrr=1", ["unknown config key trainer.lrr", "did you mean trainer.lr"]),
        ("rolout.temperature=1", ["unknown config key rolout", "did you mean rollout"]),
        ("trainer.lr=fast", ["trainer.lr must be a number", "'fast'"]),
        ("rollout.top_p=1.5", ["rollout.top_p = 1.5 is out of range", "0.0 <= rollout.top_p <= 1.0"]),
        ("queue.max_staleness=-1", ["queue.max_staleness = -1 is out of range"]),
        ("rollout.n_samples_per_prompt=2.5", ["rollout.n_samples_per_prompt must be an integer"]),
        ("topology=asynk", ["topology = 'asynk' is not accepted", "did you mean 'async'", "disaggregated"]),
        ("model.value_head=yes please", ["model.value_head must be true or false"]),
        ("data.tasks=5", ["data.tasks must be a list"]),
        ("trainer=1", ["trainer must be a mapping"]),
        ("novalue", ["not of the form key=value"]),
        ("run_id=a/b", ["run_id", "without '/'"]),
    ],
)
def test_bad_values_name_the_field_and_the_fix(override, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    for fragment in fragments:
        assert fragment in str(err.value)


def test_every_field_is_documented():
    def walk(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            assert f.metadata.get("help"), f"{prefix}{f.name} has no help text"
            if dataclasses.is_dataclass(value):
                walk(value, prefix + f.name + ".")

    walk(RelaxConfig())


# a sentence ends at . ! or ? followed by a space and a capital, a digit or an opening quote/bracket
# ("0 = off.", "'ray' needs ..."); the dots of e.g. / i.e. / etc. / vs. end nothing
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9'\"`(\[])")


ABBREVIATIONS = re.compile(r"\b(?:e\.g|i\.e|etc|vs|cf)\.", re.IGNORECASE)


def sentences(text: str) -> list[str]:
    text = ABBREVIATIONS.sub(lambda m: m.group(0).replace(".", ""), text.strip())
    return [s for s in SENTENCE_END.split(text) if s.strip()]


def test_sentences_counts_sentences_not_abbreviations():
    assert len(sentences("One (e.g. [a:2]). Two, i.e. more. 0 = off.")) == 3
    assert len(sentences("A 0.5 share; [] = none. 'ray' needs it.")) == 2


def test_help_texts_are_at_most_two_sentences_and_300_characters():
    def walk(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, prefix + f.name + ".")
                continue
            text = f.metadata["help"]
            assert len(text) <= 300, f"{prefix}{f.name}: help is {len(text)} characters (at most 300)"
            assert len(sentences(text)) <= 2, f"{prefix}{f.name}: help has {len(sentences(text))} sentences (at most 2)"

    walk(RelaxConfig())


@pytest.mark.parametrize("override", ["trainer.lr=nan", "algorithm.clip_high=.inf", "trainer.grad_clip=NaN"])
def test_non_finite_floats_are_refused(override):
    # NaN compares false with both ends of a range, so it used to pass every range check
    with pytest.raises(ConfigError, match=r"is not a finite number"):
        load_config(None, [override])
