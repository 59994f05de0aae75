"""The prompt order is a pure function of (seed, position): a resumed stream continues exactly;
encoded prompts are remembered by sample id within a byte budget."""

from __future__ import annotations

import pytest
import torch

from relax.data.samples import Message, Sample
from relax.rollout.prompts import EncodedPromptCache, PromptStream, encode_prompt


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


def test_a_cached_prompt_is_the_same_encoding_as_a_fresh_one():
    from relax.config import ModelConfig
    from relax.data.suite import shapes, tones
    from relax.models import build_processor, build_tokenizer

    tok = build_tokenizer("bpe-tiny")
    processor = build_processor(ModelConfig(name_or_path="tiny-omni", family="qwen2_5_omni"), tok)
    samples = shapes.generate(0, "train", 2, 1) + tones.generate(0, "train", 2, 1)

    def fresh(sample):
        return encode_prompt(sample, [r.data for r in sample.images], [r.data for r in sample.audios], tok, processor)

    cache = EncodedPromptCache(fresh)
    first = [cache(s) for s in samples]
    again = [cache(s) for s in samples]
    assert (cache.misses, cache.hits) == (4, 4) and all(a is b for a, b in zip(first, again, strict=True))
    for sample, enc in zip(samples, again, strict=True):
        ref = fresh(sample)
        assert enc.input_ids == ref.input_ids and set(enc.mm_inputs) == set(ref.mm_inputs)
        assert all(torch.equal(enc.mm_inputs[k], ref.mm_inputs[k]) for k in ref.mm_inputs)


def test_the_cache_drops_the_least_recently_used_prompt_past_its_byte_budget():
    from relax.rollout.prompts import EncodedPrompt

    def encode(sample):  # 1000 float32 = 4000 bytes of media + 4096 per entry = 8096 bytes each
        return EncodedPrompt([1, 2], {"x": torch.zeros(1000)}, [], [])

    a, b, c = _samples(3)
    cache = EncodedPromptCache(encode, max_bytes=2 * 8096)
    cache(a), cache(b), cache(a)  # a is now the most recent
    cache(c)  # 3 x 8096 > budget: b goes
    assert list(cache.entries) == ["s0", "s2"] and cache.bytes == 2 * 8096
    # a prompt larger than the whole budget is returned but never kept
    small = EncodedPromptCache(encode, max_bytes=8000)
    small(a)
    assert not small.entries and small.bytes == 0
