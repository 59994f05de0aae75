"""Audio task: count the beeps in a short clip, or name the pitch class of the tone.

Exercises the audio path of the RL loop (WAV bytes -> feature extractor -> audio tower)
with answers fixed by construction: beeps are separated by real silence (plus a little
seeded noise, so no two clips are identical) and the four pitch classes are an octave
apart, far beyond any jitter added at higher difficulty.
"""

from __future__ import annotations

import io
import random
import wave
from dataclasses import dataclass

import numpy as np

from relax.data.errors import DataError
from relax.data.samples import AUDIO_PLACEHOLDER, MediaRef, Message, Sample
from relax.data.suite.base import TaskSpec, check_generate_args, generate_split, question_kind
from relax.data.verifiers import ANSWER_FORMAT_HINT, exact_match_reward

NAME = "tones"
SAMPLE_RATE = 16_000
PITCHES: dict[str, float] = {"low": 220.0, "medium": 440.0, "high": 880.0, "very high": 1760.0}
QUESTIONS = {
    "count": "How many beeps do you hear?",
    "pitch": "Is the tone low, medium, high or very high?",
}
RAMP_MS = 5  # fade in/out so beeps start without clicks


@dataclass(frozen=True)
class TonesConfig:
    """Knobs of one difficulty level.

    Beeps last ``beep_ms`` (a range), are separated by at least ``min_gap_ms`` of silence
    and sit inside a ``duration_ms`` clip. ``noise`` is the std of Gaussian noise relative
    to full scale; ``jitter_semitones`` detunes the tone around its pitch class.
    """

    duration_ms: int = 1000
    max_beeps: int = 4
    beep_ms: tuple[int, int] = (100, 130)
    min_gap_ms: int = 80
    margin_ms: int = 30
    noise: float = 0.005
    jitter_semitones: float = 0.0

    def __post_init__(self) -> None:
        needed = (
            2 * self.margin_ms + self.max_beeps * self.beep_ms[1] + (self.max_beeps - 1) * self.min_gap_ms
        )
        if self.max_beeps < 1 or needed > self.duration_ms:
            raise DataError(
                f"tones: {self.max_beeps} beeps of up to {self.beep_ms[1]} ms with {self.min_gap_ms} ms gaps "
                f"need {needed} ms; raise duration_ms or shorten the beeps"
            )
        if not 0 < self.beep_ms[0] <= self.beep_ms[1]:
            raise DataError(
                f"tones: beep_ms must be a (min, max) range of positive durations, got {self.beep_ms}"
            )
        if self.jitter_semitones >= 6:
            raise DataError(
                "tones: jitter_semitones must stay below 6 so pitch classes an octave apart stay distinct"
            )


CONFIGS: dict[int, TonesConfig] = {
    1: TonesConfig(max_beeps=4, beep_ms=(100, 130), min_gap_ms=80, noise=0.005),
    2: TonesConfig(max_beeps=5, beep_ms=(90, 120), min_gap_ms=70, noise=0.02, jitter_semitones=1.0),
    3: TonesConfig(max_beeps=5, beep_ms=(70, 110), min_gap_ms=60, noise=0.04, jitter_semitones=2.0),
}


@dataclass(frozen=True)
class Clip:
    question: str
    pitch: str
    frequency: float
    amplitude: float
    beeps: tuple[tuple[int, int], ...]  # (onset_ms, length_ms)
    noise_seed: int

    @property
    def answer(self) -> str:
        return str(len(self.beeps)) if self.question == "count" else self.pitch

    @property
    def key(self) -> str:
        """Identity for the train/eval split; the noise seed is left out on purpose."""
        return f"{self.question}|{self.pitch}|{self.frequency:.2f}|" + ";".join(
            f"{o},{n}" for o, n in self.beeps
        )


def _layout(rng: random.Random, config: TonesConfig, count: int) -> tuple[tuple[int, int], ...]:
    """Onsets and lengths of ``count`` beeps, with the clip's spare time spread randomly between them."""
    lengths = [rng.randint(*config.beep_ms) for _ in range(count)]
    spare = config.duration_ms - 2 * config.margin_ms - sum(lengths) - (count - 1) * config.min_gap_ms
    weights = [rng.random() for _ in range(count + 1)]
    extra = [int(spare * w / sum(weights)) for w in weights]
    beeps, t = [], config.margin_ms + extra[0]
    for i, length in enumerate(lengths):
        beeps.append((t, length))
        t += length + config.min_gap_ms + extra[i + 1]
    return tuple(beeps)


def draw_clip(rng: random.Random, config: TonesConfig) -> Clip:
    question = rng.choice(tuple(QUESTIONS))
    pitch = rng.choice(tuple(PITCHES))
    detune = rng.uniform(-config.jitter_semitones, config.jitter_semitones)
    frequency = round(PITCHES[pitch] * 2 ** (detune / 12), 2)
    count = rng.randint(1, config.max_beeps)
    return Clip(
        question=question,
        pitch=pitch,
        frequency=frequency,
        amplitude=round(rng.uniform(0.4, 0.6), 3),
        beeps=_layout(rng, config, count),
        noise_seed=rng.getrandbits(63),
    )


def synthesize(clip: Clip, config: TonesConfig) -> np.ndarray:
    """The clip as float samples in [-1, 1] at :data:`SAMPLE_RATE`."""
    n = config.duration_ms * SAMPLE_RATE // 1000
    signal = np.random.default_rng(clip.noise_seed).normal(0.0, config.noise, n)
    ramp = RAMP_MS * SAMPLE_RATE // 1000
    for onset_ms, length_ms in clip.beeps:
        start, length = onset_ms * SAMPLE_RATE // 1000, length_ms * SAMPLE_RATE // 1000
        t = np.arange(length) / SAMPLE_RATE
        envelope = np.minimum(1.0, np.minimum(np.arange(length), np.arange(length)[::-1]) / ramp)
        signal[start : start + length] += clip.amplitude * envelope * np.sin(2 * np.pi * clip.frequency * t)
    return np.clip(signal, -1.0, 1.0)


def encode_wav(samples: np.ndarray) -> bytes:
    """16-bit mono PCM WAV bytes (stdlib ``wave``; no timestamps, so bytes are reproducible)."""
    pcm = np.round(samples * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(SAMPLE_RATE)
        wav.writeframes(pcm.tobytes())
    return out.getvalue()


def clip_to_sample(clip: Clip, config: TonesConfig, sample_id_: str, difficulty: int) -> Sample:
    prompt = f"{AUDIO_PLACEHOLDER}\n{QUESTIONS[clip.question]}\n{ANSWER_FORMAT_HINT}"
    return Sample(
        id=sample_id_,
        task=NAME,
        messages=(Message("user", prompt),),
        answer=clip.answer,
        audios=(MediaRef(data=encode_wav(synthesize(clip, config))),),
        metadata={
            "difficulty": difficulty,
            "question": clip.question,
            "beeps": len(clip.beeps),
            "pitch": clip.pitch,
            "frequency_hz": clip.frequency,
            "beep_ms": [list(b) for b in clip.beeps],
        },
    )


def generate_with_config(
    seed: int, split: str, n: int, config: TonesConfig, difficulty: int = 0
) -> list[Sample]:
    """``n`` samples of ``split`` under an explicit config, e.g. longer clips; half count and
    half pitch questions, every count and every pitch equally often."""
    classes = kind_spaces(config)
    return generate_split(NAME, seed, split, n, config, lambda r: draw_clip(r, config),
                          lambda c: c.key, lambda c, sid: clip_to_sample(c, config, sid, difficulty),
                          label=lambda c: (c.question, c.answer), classes=classes)


def generate(seed: int, split: str, n: int, difficulty: int) -> list[Sample]:
    check_generate_args(NAME, split, n, difficulty, tuple(CONFIGS))
    return generate_with_config(seed, split, n, CONFIGS[difficulty], difficulty)


def kind_spaces(config: TonesConfig) -> dict[str, list[str]]:
    """The answers of each kind of question under ``config``: counts ``1..max_beeps``, pitch names."""
    return {"count": [str(c) for c in range(1, config.max_beeps + 1)], "pitch": list(PITCHES)}


def kind_answer_space(difficulty: int) -> dict[str, list[str]]:
    """:func:`kind_spaces` at ``difficulty``: what a question of each kind can be answered with."""
    if difficulty not in CONFIGS:
        raise DataError(f"task {NAME!r}: difficulty must be one of {tuple(CONFIGS)}, not {difficulty!r}")
    return kind_spaces(CONFIGS[difficulty])


def answer_space(difficulty: int) -> list[str]:
    """Beep counts ``1..max_beeps`` and the four pitch names."""
    return [a for space in kind_answer_space(difficulty).values() for a in space]


TASK = TaskSpec(
    name=NAME,
    modality="audio",
    description=(
        "Synthetic 1 s, 16 kHz mono WAV of 1..N beeps; asks for the beep count (answer '3') "
        "or the pitch class (answer 'low', 'medium', 'high' or 'very high'). Reward: exact match."
    ),
    generate=generate,
    reward=exact_match_reward,
    answer_space=answer_space,
    difficulties=tuple(CONFIGS),
    kind=question_kind,
    kind_answer_space=kind_answer_space,
    ordinal_kinds=("count",),
)
