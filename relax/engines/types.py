"""Requests and results every engine speaks, whatever serves them.

Field names and defaults follow SGLang's ``sampling_params`` (docs/engines.md) so one
client talks to the native engine and to real SGLang servers alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class EngineError(ValueError):
    """A request the engine refuses; ``status`` is the HTTP status the server answers with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False
    sampling_seed: int | None = None  # per-request seed: same seed -> same tokens, whatever else is batched

    @staticmethod
    def from_json(d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        known = set(SamplingParams.__dataclass_fields__)
        for ignored in ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "min_new_tokens"):
            d.pop(ignored, None)  # accepted for SGLang compatibility; the native engine ignores them
        unknown = sorted(set(d) - known)
        if unknown:
            raise EngineError(f"unknown sampling_params {unknown}; supported: {sorted(known)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        p = SamplingParams(**{k: v for k, v in d.items() if v is not None})
        p.validate()
        return p

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise EngineError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise EngineError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise EngineError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.n < 1:
            raise EngineError(f"n must be >= 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6


@dataclass
class GenerateRequest:
    """One prompt. ``mm_inputs`` are extra model kwargs for the prefill (pixel_values,
    image_grid_thw, input_features, ...), already expanded into ``input_ids`` placeholders."""

    rid: str
    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    mm_inputs: dict[str, Any] | None = None


@dataclass
class Completion:
    """One sampled continuation. ``logprobs[i]`` is log pi(output_ids[i] | prefix) under the
    weights of ``weight_version`` (after temperature scaling, as sampled)."""

    rid: str
    index: int
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any]  # {"type": "stop", "matched": id|str} | {"type": "length", "length": n} | abort
    prompt_tokens: int
    weight_version: str
