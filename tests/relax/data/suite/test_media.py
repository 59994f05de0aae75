"""Decode the generated media and check that what is drawn or heard matches the answer.

These checks measure the pixels and samples directly (connected components, envelope
edges, FFT peak) instead of trusting the generator's own metadata.
"""

from __future__ import annotations

import io
import math
import wave

import numpy as np
import pytest
from PIL import Image

from relax.data.samples import Sample
from relax.data.suite import shapes, tones

# --- images ---------------------------------------------------------------------------


def decode_png(sample: Sample) -> np.ndarray:
    image = Image.open(io.BytesIO(sample.images[0].data))
    assert image.format == "PNG" and image.mode == "RGB"
    return np.asarray(image)


def count_components(mask: np.ndarray) -> int:
    """Connected True regions, 8-connectivity (diagonal neighbours join), by flood fill."""
    seen = np.zeros_like(mask, dtype=bool)
    height, width = mask.shape
    count = 0
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if seen[y0, x0]:
            continue
        count += 1
        stack = [(y0, x0)]
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    ny, nx = y + dy, x + dx
                    if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not seen[ny, nx]:
                        seen[ny, nx] = True
                        stack.append((ny, nx))
    return count


def dominant_colour(pixels: np.ndarray) -> str:
    """Name of the palette colour nearest to the most frequent non-white RGB value."""
    values, counts = np.unique(pixels.reshape(-1, 3), axis=0, return_counts=True)
    top = tuple(int(v) for v in values[np.argmax(counts)])
    return min(shapes.COLOURS, key=lambda name: math.dist(shapes.COLOURS[name], top))


def test_count_components_on_a_hand_drawn_mask() -> None:
    # two blobs, one of them joined only diagonally -> 2 components
    mask = np.array(
        [
            [1, 0, 0, 0],
            [0, 1, 0, 1],
            [0, 0, 0, 1],
        ],
        dtype=bool,
    )
    assert count_components(mask) == 2


@pytest.mark.parametrize("difficulty", [1, 3])
@pytest.mark.parametrize("split", ["train", "eval"])
def test_shapes_pixels_match_the_answer(difficulty: int, split: str) -> None:
    for sample in shapes.generate(11, split, 30, difficulty):
        pixels = decode_png(sample)
        assert pixels.shape == (56, 56, 3)
        ink = np.any(pixels != 255, axis=-1)
        count = count_components(ink)
        colour = dominant_colour(pixels[ink])
        # no anti-aliasing: every non-white pixel is exactly the one palette colour
        assert (pixels[ink] == shapes.COLOURS[colour]).all(), sample.id
        assert count == sample.metadata["count"] and colour == sample.metadata["colour"], sample.id
        if sample.metadata["question"] == "count":
            assert sample.answer == str(count)
            assert "How many shapes" in sample.prompt_text
        else:
            assert sample.answer == colour
            assert "What colour" in sample.prompt_text


def inked_patches(pixels: np.ndarray, patch: int = 14) -> int:
    """How many patch x patch tiles of the picture hold a non-white pixel."""
    ink = np.any(pixels != 255, axis=-1)
    h, w = ink.shape
    return int(ink.reshape(h // patch, patch, w // patch, patch).any(axis=(1, 3)).sum())


def test_at_difficulty_1_each_shape_fills_one_vision_patch_and_at_3_shapes_straddle_them() -> None:
    # difficulty 1: a 4x4 grid of 14-px cells = the towers' 14-px patches, so the inked
    # patches are exactly the shapes (a count of 3 inks 3 of the 16 patches)
    for sample in shapes.generate(5, "train", 60, 1):
        assert inked_patches(decode_png(sample)) == sample.metadata["count"], sample.id
    # difficulty 3: 18-px cells; a shape crossing a patch border inks two or four patches,
    # so some pictures ink more patches than they hold shapes
    hard = [decode_png(s) for s in shapes.generate(5, "train", 60, 3)]
    counts = [count_components(np.any(p != 255, axis=-1)) for p in hard]
    assert any(inked_patches(p) > n for p, n in zip(hard, counts, strict=True))


def test_shapes_image_size_is_a_knob() -> None:
    config = shapes.ShapesConfig(image_size=96, max_count=9)
    for sample in shapes.generate_with_config(0, "train", 10, config):
        pixels = decode_png(sample)
        assert pixels.shape == (96, 96, 3)
        assert count_components(np.any(pixels != 255, axis=-1)) == sample.metadata["count"]


def test_shapes_use_every_count_colour_and_question() -> None:
    samples = shapes.generate(0, "train", 200, 2)
    assert {s.metadata["count"] for s in samples} == {1, 2, 3, 4, 5}
    assert {s.metadata["colour"] for s in samples} == set(shapes.COLOURS)
    assert {s.metadata["question"] for s in samples} == {"count", "colour"}


@pytest.mark.parametrize("task", [shapes, tones], ids=["shapes", "tones"])
@pytest.mark.parametrize("split", ["train", "eval"])
def test_splits_are_balanced_over_kinds_and_answers(task, split) -> None:
    # 240 = 120 per kind; shapes: 120 / 4 counts = 30 each and 120 / 6 colours = 20 each,
    # tones: 120 / 4 = 30 per count and per pitch. The same question never comes twice.
    samples = task.generate(0, split, 240, 1)
    per_class: dict[tuple[str, str], int] = {}
    for s in samples:
        per_class[s.metadata["question"], s.answer] = per_class.get((s.metadata["question"], s.answer), 0) + 1
    expected = {("count", str(c)): 30 for c in range(1, 5)}
    expected.update({(("colour", c) if task is shapes else ("pitch", c)): (20 if task is shapes else 30)
                     for c in (shapes.COLOURS if task is shapes else tones.PITCHES)})
    assert per_class == expected
    assert len({(s.messages, s.images, s.audios) for s in samples}) == 240


def test_balanced_label_alternates_kinds_and_cycles_answers() -> None:
    from relax.data.suite.base import balanced_label

    classes = {"count": ["1", "2"], "colour": ["red", "blue", "green"]}
    # kinds sorted: colour, count; i even -> colour, answer (i // 2) % 3; i odd -> count, (i // 2) % 2
    got = [balanced_label(classes, i) for i in range(6)]
    assert got == [("colour", "red"), ("count", "1"), ("colour", "blue"), ("count", "2"),
                   ("colour", "green"), ("count", "1")]


# --- audio ----------------------------------------------------------------------------


def decode_wav(sample: Sample) -> tuple[int, np.ndarray]:
    with wave.open(io.BytesIO(sample.audios[0].data), "rb") as wav:
        assert wav.getnchannels() == 1
        assert wav.getsampwidth() == 2
        rate = wav.getframerate()
        frames = wav.readframes(wav.getnframes())
    return rate, np.frombuffer(frames, dtype="<i2").astype(np.float64) / 32767


def count_beeps(signal: np.ndarray, rate: int) -> int:
    """Rising edges of a 10 ms RMS envelope thresholded at half its maximum."""
    frame = rate // 100
    frames = signal[: len(signal) // frame * frame].reshape(-1, frame)
    loud = np.sqrt((frames**2).mean(axis=1)) > 0.5 * np.sqrt((frames**2).mean(axis=1)).max()
    return int(loud[0]) + int(np.sum(loud[1:] & ~loud[:-1]))


def dominant_frequency(signal: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(signal))
    return float(np.fft.rfftfreq(len(signal), 1 / rate)[np.argmax(spectrum)])


def test_count_beeps_on_a_hand_made_signal() -> None:
    # three 100 ms bursts of 500 Hz separated by 100 ms of silence -> 3 beeps, peak at 500 Hz
    rate = 16_000
    t = np.arange(rate // 10) / rate
    burst, gap = np.sin(2 * np.pi * 500 * t), np.zeros(rate // 10)
    signal = np.concatenate([gap, burst, gap, burst, gap, burst, gap])
    assert count_beeps(signal, rate) == 3
    assert abs(dominant_frequency(signal, rate) - 500) < 5


@pytest.mark.parametrize("difficulty", [1, 3])
@pytest.mark.parametrize("split", ["train", "eval"])
def test_tones_audio_matches_the_answer(difficulty: int, split: str) -> None:
    for sample in tones.generate(5, split, 30, difficulty):
        rate, signal = decode_wav(sample)
        assert rate == 16_000
        assert 0.9 <= len(signal) / rate <= 1.1
        beeps = count_beeps(signal, rate)
        peak = dominant_frequency(signal, rate)
        # the pitch class whose frequency is nearest in octaves to the measured peak
        pitch = min(tones.PITCHES, key=lambda name: abs(math.log2(peak / tones.PITCHES[name])))
        assert beeps == sample.metadata["beeps"], sample.id
        assert pitch == sample.metadata["pitch"], sample.id
        # short beeps smear the spectrum by a few Hz; half a semitone is still far from the
        # next pitch class (12 semitones away) and from the largest jitter (2 semitones)
        assert abs(12 * math.log2(peak / sample.metadata["frequency_hz"])) < 0.5, sample.id
        if sample.metadata["question"] == "count":
            assert sample.answer == str(beeps)
            assert "How many beeps" in sample.prompt_text
        else:
            assert sample.answer == pitch
            assert "low, medium, high or very high" in sample.prompt_text


def test_clips_with_the_same_layout_still_differ() -> None:
    # seeded noise: two generated clips are never byte-identical
    clips = [s.audios[0].data for s in tones.generate(0, "train", 50, 1)]
    assert len(set(clips)) == len(clips)


def test_tones_use_every_count_and_pitch() -> None:
    samples = tones.generate(0, "train", 200, 2)
    assert {s.metadata["beeps"] for s in samples} == {1, 2, 3, 4, 5}
    assert {s.metadata["pitch"] for s in samples} == set(tones.PITCHES)
