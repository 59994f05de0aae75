"""Small real media files for tests: PNGs and PCM WAVs built in memory (snapshots and engines decode them)."""

from __future__ import annotations

import io
import math
import struct
import wave


def png_bytes(width: int = 8, height: int | None = None, colour: tuple = (200, 30, 30)) -> bytes:
    """A ``width`` x ``height`` (default square) PNG of one colour."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, width if height is None else height), colour).save(out, format="PNG")
    return out.getvalue()


def wav_bytes(seconds: float = 0.1, rate: int = 16000, tone: bool = True) -> bytes:
    """A 16-bit mono PCM WAV: a sine tone, or silence with ``tone=False``."""
    frames = int(seconds * rate) if tone else round(seconds * rate)
    samples = (b"".join(struct.pack("<h", int(8000 * math.sin(i / 10))) for i in range(frames)) if tone
               else bytes(2 * frames))
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples)
    return out.getvalue()
