"""The flash_beep video task: reproducible MP4s whose frames and track hold the answer, a held-out
split of its own, balanced kinds, and a verifier that a random policy cannot pass."""

from __future__ import annotations

import numpy as np
import pytest

from relax.data.suite import TASKS, flash_beep, kind_of, random_policy_score
from relax.data.suite.base import split_of
from relax.data.video import decode_video


@pytest.fixture(scope="module")
def train():
    return flash_beep.generate(0, "train", 16, 1)


def test_same_seed_same_bytes_other_seed_other_clips(train):
    assert flash_beep.generate(0, "train", 16, 1) == train  # media bytes included
    assert [s.videos[0].data for s in flash_beep.generate(1, "train", 16, 1)] != [s.videos[0].data for s in train]


def test_the_answer_is_in_the_frames_and_the_track(train):
    for sample in train:
        clip = decode_video(sample.videos[0].data, 4.0, 16)
        lit = [i for i, f in enumerate(clip.frames) if (f.astype(int).sum(-1) < 600).sum() > 100]  # non-white square
        starts = [f for f, _ in sample.metadata["flashes"]]
        assert lit == [f + k for f in starts for k in (0, 1)], sample.id  # each flash fills a pair of frames
        assert all(f % 2 == 0 for f in starts)  # ... the pair the vision tower merges into one temporal patch
        # the beep sits inside its flash's 2 frames (0.5 s = 8000 samples at 16 kHz)
        beep = 2 * int(np.argmax([np.abs(clip.audio[i * 8000:(i + 1) * 8000]).max() for i in range(6)]))
        assert beep == sample.metadata["beep_frame"] in starts
        colour = dict((f, c) for f, c in sample.metadata["flashes"])[beep]
        assert sample.answer == (str(len(starts)) if kind_of(sample) == "count" else colour)


def test_held_out_split_and_balanced_kinds(train):
    held = flash_beep.generate(0, "eval", 8, 1)
    assert {kind_of(s) for s in train} == {"count", "beep"}
    assert sum(kind_of(s) == "count" for s in train) == 8
    # each count and each colour in turn
    assert sorted(s.answer for s in train if kind_of(s) == "beep") == sorted(list(flash_beep.COLOURS) * 2)
    for split, samples in (("train", train), ("eval", held)):  # the split is a property of the question
        for s in samples:
            flashes = [tuple(f) for f in s.metadata["flashes"]]
            beep = [f for f, _ in flashes].index(s.metadata["beep_frame"])
            clip = flash_beep.Clip(kind_of(s), tuple(flashes), beep, *s.metadata["square_xy"], noise_seed=0)
            assert split_of(flash_beep.NAME, clip.key) == split
    assert all(s.task == "flash_beep" and s.modality == "video" for s in train + held)


def test_verifier_and_random_policy():
    task = TASKS["flash_beep"]
    for sample in flash_beep.generate(3, "eval", 6, 2):
        assert task.reward(task.oracle_response(sample), sample) == 1.0
        assert sample.answer in task.answers_for(sample, 2)
    assert random_policy_score(task, seed=0, n=40, difficulty=1) <= 0.3
