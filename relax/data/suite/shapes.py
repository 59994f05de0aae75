"""Image task: count the shapes in a small synthetic picture, or name their colour.

Exercises the image path of the RL loop (PNG bytes -> processor -> vision tower) with
answers that are unambiguous by construction: shapes never overlap or touch, so the
number of connected non-white regions is the count, and all shapes share one of six
well-separated colours drawn without anti-aliasing.
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

from relax.data.errors import DataError
from relax.data.samples import IMAGE_PLACEHOLDER, MediaRef, Message, Sample
from relax.data.suite.base import TaskSpec, check_generate_args, generate_split, question_kind
from relax.data.verifiers import ANSWER_FORMAT_HINT, exact_match_reward

NAME = "shapes"

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 200, 20),
    "purple": (140, 50, 170),
    "orange": (245, 130, 20),
}
KINDS = ("circle", "square", "triangle")
BACKGROUND = (255, 255, 255)
QUESTIONS = {
    "count": "How many shapes are in the image?",
    "colour": "What colour are the shapes?",
}


@dataclass(frozen=True)
class ShapesConfig:
    """Knobs of one difficulty level.

    The image is split into a ``grid`` x ``grid`` lattice and each shape gets its own cell
    with a one-pixel margin, which is what keeps shapes apart. A shape's side is a
    fraction of its cell, drawn from ``[min_fraction, max_fraction]``: smaller shapes are
    harder for a vision tower to see. A cell of 14 pixels (``image_size // grid``) is one patch
    of the Qwen vision towers, so each shape lies in a patch of its own; larger cells straddle
    patch borders, and a count must then tell one shape over two patches from two shapes.
    """

    image_size: int = 56
    max_count: int = 4
    grid: int = 3
    min_fraction: float = 0.7
    max_fraction: float = 0.95

    def __post_init__(self) -> None:
        if not 1 <= self.max_count <= self.grid * self.grid:
            raise DataError(
                f"shapes: max_count must be in [1, grid*grid = {self.grid**2}], got {self.max_count}"
            )
        if self.cell - 2 < 4:
            raise DataError(
                f"shapes: image_size {self.image_size} is too small for a {self.grid}x{self.grid} grid; "
                f"use at least {6 * self.grid} pixels"
            )
        if not 0 < self.min_fraction <= self.max_fraction <= 1:
            raise DataError("shapes: need 0 < min_fraction <= max_fraction <= 1")

    @property
    def cell(self) -> int:
        return self.image_size // self.grid


CONFIGS: dict[int, ShapesConfig] = {
    1: ShapesConfig(max_count=4, grid=4, min_fraction=0.7, max_fraction=0.95),  # 14-px cells: one shape a patch
    2: ShapesConfig(max_count=5, min_fraction=0.55, max_fraction=0.9),
    3: ShapesConfig(max_count=7, min_fraction=0.45, max_fraction=0.8),
}


@dataclass(frozen=True)
class Shape:
    kind: str
    x: int
    y: int
    size: int

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "x": self.x, "y": self.y, "size": self.size}


@dataclass(frozen=True)
class Scene:
    question: str
    colour: str
    shapes: tuple[Shape, ...]

    @property
    def answer(self) -> str:
        return str(len(self.shapes)) if self.question == "count" else self.colour

    @property
    def key(self) -> str:
        """Identity of the question for the train/eval split: what is asked about what picture."""
        return f"{self.question}|{self.colour}|" + ";".join(
            f"{s.kind},{s.x},{s.y},{s.size}" for s in self.shapes
        )


def draw_scene(rng: random.Random, config: ShapesConfig) -> Scene:
    """Pick the question, the colour, and a kind, cell, size and position per shape."""
    question = rng.choice(tuple(QUESTIONS))
    colour = rng.choice(tuple(COLOURS))
    count = rng.randint(1, config.max_count)
    cells = rng.sample(range(config.grid * config.grid), count)
    inner = config.cell - 2  # one pixel of margin on each side of the cell
    shapes = []
    for cell in sorted(cells):
        size = max(4, round(inner * rng.uniform(config.min_fraction, config.max_fraction)))
        left = (cell % config.grid) * config.cell + 1 + rng.randint(0, inner - size)
        top = (cell // config.grid) * config.cell + 1 + rng.randint(0, inner - size)
        shapes.append(Shape(rng.choice(KINDS), left, top, size))
    return Scene(question, colour, tuple(shapes))


def _draw_shape(draw: ImageDraw.ImageDraw, shape: Shape, fill: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = shape.x, shape.y, shape.x + shape.size - 1, shape.y + shape.size - 1
    if shape.kind == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape.kind == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)


def render_png(scene: Scene, image_size: int) -> bytes:
    """The scene as PNG bytes; identical scenes give byte-identical files."""
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape in scene.shapes:
        _draw_shape(draw, shape, COLOURS[scene.colour])
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=False)
    return out.getvalue()


def scene_to_sample(scene: Scene, config: ShapesConfig, sample_id_: str, difficulty: int) -> Sample:
    prompt = f"{IMAGE_PLACEHOLDER}\n{QUESTIONS[scene.question]}\n{ANSWER_FORMAT_HINT}"
    return Sample(
        id=sample_id_,
        task=NAME,
        messages=(Message("user", prompt),),
        answer=scene.answer,
        images=(MediaRef(data=render_png(scene, config.image_size)),),
        metadata={
            "difficulty": difficulty,
            "question": scene.question,
            "count": len(scene.shapes),
            "colour": scene.colour,
            "shapes": [s.to_json() for s in scene.shapes],
        },
    )


def generate_with_config(
    seed: int, split: str, n: int, config: ShapesConfig, difficulty: int = 0
) -> list[Sample]:
    """``n`` samples of ``split`` under an explicit config, e.g. a larger ``image_size``; half
    count and half colour questions, every count and every colour equally often."""
    classes = kind_spaces(config)
    return generate_split(NAME, seed, split, n, config, lambda r: draw_scene(r, config),
                          lambda s: s.key, lambda s, sid: scene_to_sample(s, config, sid, difficulty),
                          label=lambda s: (s.question, s.answer), classes=classes)


def generate(seed: int, split: str, n: int, difficulty: int) -> list[Sample]:
    check_generate_args(NAME, split, n, difficulty, tuple(CONFIGS))
    return generate_with_config(seed, split, n, CONFIGS[difficulty], difficulty)


def kind_spaces(config: ShapesConfig) -> dict[str, list[str]]:
    """The answers of each kind of question under ``config``: counts ``1..max_count``, colour names."""
    return {"count": [str(c) for c in range(1, config.max_count + 1)], "colour": list(COLOURS)}


def kind_answer_space(difficulty: int) -> dict[str, list[str]]:
    """:func:`kind_spaces` at ``difficulty``: what a question of each kind can be answered with."""
    if difficulty not in CONFIGS:
        raise DataError(f"task {NAME!r}: difficulty must be one of {tuple(CONFIGS)}, not {difficulty!r}")
    return kind_spaces(CONFIGS[difficulty])


def answer_space(difficulty: int) -> list[str]:
    """Counts ``1..max_count`` and the six colour names: a guesser must also guess the question type."""
    return [a for space in kind_answer_space(difficulty).values() for a in space]


def nearest_colour(rgb: tuple[float, float, float]) -> str:
    """The named colour closest to ``rgb``; lets checks map decoded pixels back to names."""
    return min(COLOURS, key=lambda name: math.dist(COLOURS[name], rgb))


TASK = TaskSpec(
    name=NAME,
    modality="image",
    description=(
        "Synthetic image of 1..N non-overlapping shapes of one colour; asks for the count "
        "(answer '3') or the colour (answer 'red'). Reward: exact match."
    ),
    generate=generate,
    reward=exact_match_reward,
    answer_space=answer_space,
    difficulties=tuple(CONFIGS),
    kind=question_kind,
    kind_answer_space=kind_answer_space,
    ordinal_kinds=("count",),
)
