"""A custom env for the ``rollout.env_fn`` contract tests: after the policy's first message it
shows a picture (a red or a blue square) and asks its colour; the second answer is scored.

Loaded by dotted path (``tests.relax.rollout.picture_env:make_env``), as a user's env would be."""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

from relax.data.samples import Sample

COLOURS = {"red": (220, 30, 30), "blue": (40, 70, 220)}


def square_png(colour: str) -> bytes:
    img = Image.new("RGB", (56, 56), (255, 255, 255))
    img.paste(COLOURS[colour], (14, 14, 42, 42))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def colour_of(sample: Sample) -> str:
    return "red" if int(sample.answer) % 2 else "blue"


class PictureEnv:
    def reset(self, sample: Sample) -> str:
        self.colour, self.turn = colour_of(sample), 0
        return ""

    def step(self, action_text: str) -> tuple[Any, float, bool, dict[str, Any]]:
        self.turn += 1
        if self.turn == 1:
            return ({"content": "<image>\nWhat colour is the square?", "images": [square_png(self.colour)]},
                    0.0, False, {})
        return "", float(self.colour in action_text), True, {"colour": self.colour}


def make_env(sample: Sample) -> PictureEnv:
    return PictureEnv()


def not_a_factory(a, b, c):  # wrong signature: refused by name at start
    return None
