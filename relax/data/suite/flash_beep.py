"""Video task: count the flashes of a coloured square, or name its colour when the beep sounds.

Exercises the video path of the RL loop (MP4 bytes -> PyAV -> sampled frames and the audio
track -> the vision and audio towers, interleaved in time) with answers fixed by
construction: a clip is ``frames`` frames at ``fps`` (3 s at level 1) on white; the square
shows for ``flash_frames`` frames per flash, in a colour of its own, with at least as long a
blank between flashes, and one beep sounds while exactly one of the flashes is showing. A flash
spans two frames because the vision tower merges each pair of frames into one temporal patch: a
one-frame flash would be blended with white inside its tokens, while a two-frame flash fills its
tokens the way a still image does, so the colour is read as in the image task. "How many times"
needs the frames over time; "which colour at the beep" needs the frames and the sound
together. The MP4s are written with PyAV (H.264 + AAC), so generation needs no system codecs.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

import numpy as np

from relax.data.errors import DataError
from relax.data.samples import VIDEO_PLACEHOLDER, MediaRef, Message, Sample
from relax.data.suite.base import TaskSpec, check_generate_args, generate_split, question_kind
from relax.data.verifiers import ANSWER_FORMAT_HINT, exact_match_reward

NAME = "flash_beep"
SAMPLE_RATE = 16_000
BEEP_HZ = 880.0
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 200, 20),
}
QUESTIONS = {
    "count": "How many times does the square flash?",
    "beep": "What colour is the square when the beep sounds?",
}


@dataclass(frozen=True)
class FlashBeepConfig:
    """Knobs of one difficulty level: ``frames`` frames of ``size`` x ``size`` pixels at ``fps``,
    1..``max_flashes`` flashes of a ``square``-pixel square, each ``flash_frames`` frames long and
    starting on a multiple of it (a slot), a beep of ``beep_ms`` and audio noise of std ``noise``
    (relative to full scale)."""

    size: int = 56
    frames: int = 12
    fps: int = 4
    square: int = 20
    max_flashes: int = 3
    beep_ms: int = 150
    noise: float = 0.005
    flash_frames: int = 2

    @property
    def slots(self) -> int:
        return self.frames // self.flash_frames

    def __post_init__(self) -> None:
        if self.flash_frames < 1 or self.frames % self.flash_frames:
            raise DataError(
                f"flash_beep: frames ({self.frames}) must be a multiple of flash_frames ({self.flash_frames})"
            )
        if self.max_flashes < 1 or 2 * self.max_flashes - 1 > self.slots:
            raise DataError(f"flash_beep: {self.max_flashes} flashes of {self.flash_frames} frames with a blank as "
                            f"long between each need {(2 * self.max_flashes - 1) * self.flash_frames} frames; "
                            "raise frames or lower max_flashes")
        if self.max_flashes > len(COLOURS):
            raise DataError(f"flash_beep: each flash has its own colour, so max_flashes is at most {len(COLOURS)}")
        if self.size % 2 or self.square >= self.size:
            raise DataError("flash_beep: size must be even (H.264 4:2:0) and larger than the square")
        if self.beep_ms * self.fps > 1000 * self.flash_frames:
            raise DataError(f"flash_beep: a {self.beep_ms} ms beep outlasts a {self.flash_frames}-frame flash "
                            f"at {self.fps} fps")


CONFIGS: dict[int, FlashBeepConfig] = {
    1: FlashBeepConfig(),
    2: FlashBeepConfig(frames=14, max_flashes=4, square=14, noise=0.02),
    3: FlashBeepConfig(frames=16, max_flashes=4, square=10, beep_ms=100, noise=0.04),
}


@dataclass(frozen=True)
class Clip:
    question: str
    flashes: tuple[tuple[int, str], ...]  # (first frame, colour name)
    beep_flash: int  # index into flashes
    x: int
    y: int
    noise_seed: int

    @property
    def answer(self) -> str:
        return str(len(self.flashes)) if self.question == "count" else self.flashes[self.beep_flash][1]

    @property
    def key(self) -> str:
        """Identity for the train/eval split; the noise seed is left out on purpose."""
        return f"{self.question}|{self.x},{self.y}|{self.beep_flash}|" + ";".join(f"{f}{c}" for f, c in self.flashes)


def draw_clip(rng: random.Random, config: FlashBeepConfig) -> Clip:
    count = rng.randint(1, config.max_flashes)
    while True:  # slots with a blank slot between consecutive flashes
        slots = sorted(rng.sample(range(config.slots), count))
        if all(b - a >= 2 for a, b in zip(slots, slots[1:], strict=False)):
            break
    frames = [slot * config.flash_frames for slot in slots]
    colours = rng.sample(list(COLOURS), count)
    return Clip(
        question=rng.choice(tuple(QUESTIONS)),
        flashes=tuple(zip(frames, colours, strict=True)),
        beep_flash=rng.randrange(count),
        x=rng.randrange(config.size - config.square + 1),
        y=rng.randrange(config.size - config.square + 1),
        noise_seed=rng.getrandbits(63),
    )


def render_frames(clip: Clip, config: FlashBeepConfig) -> np.ndarray:
    """(frames, size, size, 3) uint8: white, with the square in its colour on its flash frames."""
    video = np.full((config.frames, config.size, config.size, 3), 255, dtype=np.uint8)
    for frame, colour in clip.flashes:
        video[frame:frame + config.flash_frames, clip.y:clip.y + config.square,
              clip.x:clip.x + config.square] = COLOURS[colour]
    return video


def synthesize_audio(clip: Clip, config: FlashBeepConfig) -> np.ndarray:
    """The track as float samples at 16 kHz: noise, and a beep centred in the beep flash's frames."""
    n = config.frames * SAMPLE_RATE // config.fps
    audio = np.random.default_rng(clip.noise_seed).normal(0.0, config.noise, n)
    frame_len = SAMPLE_RATE // config.fps
    length = config.beep_ms * SAMPLE_RATE // 1000
    start = clip.flashes[clip.beep_flash][0] * frame_len + (config.flash_frames * frame_len - length) // 2
    t = np.arange(length) / SAMPLE_RATE
    ramp = np.minimum(1.0, np.minimum(np.arange(length), np.arange(length)[::-1]) / 80)
    audio[start:start + length] += 0.5 * ramp * np.sin(2 * np.pi * BEEP_HZ * t)
    return np.clip(audio, -1.0, 1.0).astype(np.float32)


def encode_mp4(frames: np.ndarray, fps: int, audio: np.ndarray | None) -> bytes:
    """H.264 (4:4:4 would not play everywhere; 4:2:0) + AAC MP4 bytes, written with PyAV. One
    encoder thread and bit-exact muxing, so the same frames and samples give the same bytes."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
        video = container.add_stream("libx264", rate=fps, options={"crf": "12", "preset": "ultrafast", "threads": "1"})
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        sound = None
        if audio is not None:
            sound = container.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
        for rgb in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(video.encode(None))
        if sound is not None:
            frame = av.AudioFrame.from_ndarray(audio[None, :], format="fltp", layout="mono")
            frame.sample_rate, frame.pts = SAMPLE_RATE, 0  # pts 0: the muxer's edit list then hides AAC's priming
            container.mux(sound.encode(frame))
            container.mux(sound.encode(None))
    return out.getvalue()


def clip_to_sample(clip: Clip, config: FlashBeepConfig, sample_id_: str, difficulty: int) -> Sample:
    prompt = f"{VIDEO_PLACEHOLDER}\n{QUESTIONS[clip.question]}\n{ANSWER_FORMAT_HINT}"
    data = encode_mp4(render_frames(clip, config), config.fps, synthesize_audio(clip, config))
    return Sample(
        id=sample_id_,
        task=NAME,
        messages=(Message("user", prompt),),
        answer=clip.answer,
        videos=(MediaRef(data=data),),
        metadata={
            "difficulty": difficulty,
            "question": clip.question,
            "flashes": [[f, c] for f, c in clip.flashes],
            "beep_frame": clip.flashes[clip.beep_flash][0],
            "square_xy": [clip.x, clip.y],
            "needs_video_audio": True,  # the beep question cannot be answered without the track
        },
    )


def generate_with_config(seed: int, split: str, n: int, config: FlashBeepConfig, difficulty: int = 0) -> list[Sample]:
    """``n`` samples of ``split`` under an explicit config; half count and half beep questions,
    every answer of each kind equally often."""
    return generate_split(NAME, seed, split, n, config, lambda r: draw_clip(r, config), lambda c: c.key,
                          lambda c, sid: clip_to_sample(c, config, sid, difficulty),
                          label=lambda c: (c.question, c.answer), classes=kind_spaces(config))


def generate(seed: int, split: str, n: int, difficulty: int) -> list[Sample]:
    check_generate_args(NAME, split, n, difficulty, tuple(CONFIGS))
    return generate_with_config(seed, split, n, CONFIGS[difficulty], difficulty)


def kind_spaces(config: FlashBeepConfig) -> dict[str, list[str]]:
    """The answers of each kind of question: flash counts ``1..max_flashes``, colour names."""
    return {"count": [str(c) for c in range(1, config.max_flashes + 1)], "beep": list(COLOURS)}


def kind_answer_space(difficulty: int) -> dict[str, list[str]]:
    """:func:`kind_spaces` at ``difficulty``."""
    if difficulty not in CONFIGS:
        raise DataError(f"task {NAME!r}: difficulty must be one of {tuple(CONFIGS)}, not {difficulty!r}")
    return kind_spaces(CONFIGS[difficulty])


def answer_space(difficulty: int) -> list[str]:
    """Flash counts and the four colour names."""
    return [a for space in kind_answer_space(difficulty).values() for a in space]


TASK = TaskSpec(
    name=NAME,
    modality="video",
    description=(
        "Synthetic 3 s MP4 (12 frames of 56x56 at 4 fps, H.264 + AAC) of a square flashing 1..N times "
        "(2 frames each) in different colours, with one beep during one flash; "
        "asks for the flash count (answer '2') or the "
        "colour showing at the beep (answer 'red'). Reward: exact match."
    ),
    generate=generate,
    reward=exact_match_reward,
    answer_space=answer_space,
    difficulties=tuple(CONFIGS),
    kind=question_kind,
    kind_answer_space=kind_answer_space,
    ordinal_kinds=("count",),
)
