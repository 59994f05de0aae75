"""``input_audio`` in OpenAI's second format, mp3, decoded to the WAV bytes the processors read.

OpenAI's chat API takes ``input_audio: {data, format}`` with format ``wav`` or ``mp3``. The model's
processor reads WAV; an mp3 part is decoded here with PyAV (FFmpeg, already installed for video),
resampled to mono 16 kHz float, and written as a 16-bit PCM WAV. A decoded clip may last at most
:data:`MAX_SECONDS`, so a small compressed body cannot expand into minutes of audio.
"""

from __future__ import annotations

import io

import numpy as np

from relax.data.suite.tones import SAMPLE_RATE, encode_wav
from relax.engines.types import EngineError

MAX_SECONDS = 600.0  # what one mp3 part may decode to
RATE = SAMPLE_RATE  # 16 kHz, the rate Qwen2.5-Omni's audio processor wants, as the built-in audio tasks write


def mp3_to_wav(data: bytes, index: int) -> bytes:
    """The mp3 ``data`` of ``input_audio[index]`` as WAV bytes; a 400 naming the part when it does not decode."""
    import av

    where = f"input_audio[{index}]"
    try:
        container = av.open(io.BytesIO(data), format="mp3")
    except Exception as e:  # PyAV raises FFmpeg's many error types
        raise EngineError(f"{where} is not a decodable mp3 file: {e}") from None
    resampler = av.AudioResampler(format="flt", layout="mono", rate=RATE)
    chunks, total = [], 0
    try:
        with container:
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    chunk = out.to_ndarray().reshape(-1)
                    total += len(chunk)
                    if total > MAX_SECONDS * RATE:
                        raise EngineError(f"{where} lasts more than {MAX_SECONDS:g} s; send a shorter clip")
                    chunks.append(chunk)
    except EngineError:
        raise
    except Exception as e:
        raise EngineError(f"{where} is not a decodable mp3 file: {e}") from None
    if not total:
        raise EngineError(f"{where} holds no audio")
    return encode_wav(np.clip(np.concatenate(chunks), -1.0, 1.0))
