"""Requests and results every engine speaks, whatever serves them.

Field names and defaults follow SGLang's ``sampling_params`` (docs/engines.md) so one
client talks to the native engine and to real SGLang servers alike.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# SGLang sampling_params the native engine does not implement: accepted only at their neutral values
NEUTRAL: dict[str, tuple] = {"min_new_tokens": (None, 0), "regex": (None,), "json_schema": (None,), "ebnf": (None,),
                             "structural_tag": (None,), "logit_bias": (None,), "stop_regex": (None,),
                             "custom_params": (None,)}


def refuse_unless_neutral(d: dict[str, Any], accepted: dict[str, tuple], where: str = "") -> None:
    """Fields the native engine does not serve pass only at a value in ``accepted[name]`` (clients send
    some at their defaults on every call); any other value is a 400 naming the field, since ignoring it
    would answer something other than what was asked."""
    for name, ok in accepted.items():
        if name in d and d[name] not in ok:
            raise EngineError(f"{where}{name}={d[name]!r} is not supported by the native engine (only "
                              f"{' or '.join(map(repr, ok))}); drop it or use an SGLang server")
_INTS = ("max_new_tokens", "top_k", "n", "sampling_seed", "top_logprobs_num")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def check_types(d: dict[str, Any], where: str = "sampling_params", ints: tuple[str, ...] = _INTS,
                floats: tuple[str, ...] = _FLOATS) -> None:
    """JSON types of the fields SamplingParams takes: a wrong type is the caller's 400, naming the field
    (``max_new_tokens: 2.5`` or ``"5"`` and ``temperature: "hot"`` used to run, or fail as a 500)."""
    def bad(name: str, want: str) -> EngineError:
        return EngineError(f"{where}.{name} must be {want}, got {d[name]!r}")

    for name in ints:
        if d.get(name) is not None and (isinstance(d[name], bool) or not isinstance(d[name], int)):
            raise bad(name, "an integer")
    for name in floats:
        v = d.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise bad(name, "a finite number")
    for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
        if d.get(name) is not None and not isinstance(d[name], bool):
            raise bad(name, "true or false")
    stop = d.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise bad("stop", "a string or a list of strings")
    ids = d.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids)):
        raise bad("stop_token_ids", "a list of token ids (integers >= 0)")


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
    min_p: float = 0.0  # keep tokens with p >= min_p * max p (after temperature)
    repetition_penalty: float = 1.0  # CTRL's, on every token of the prompt and the output
    frequency_penalty: float = 0.0  # OpenAI's, per occurrence in the output
    presence_penalty: float = 0.0  # OpenAI's, once per token present in the output
    top_logprobs_num: int = 0  # with each sampled token, the k likeliest tokens' logprobs (the model's)
    # how the output ids become text, as SGLang decodes (slime sends both false): special tokens kept or
    # dropped; spaces around them (a slow tokenizer's option: a fast one never adds any)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @staticmethod
    def from_json(d: dict[str, Any] | None) -> SamplingParams:
        if d is not None and not isinstance(d, dict):
            raise EngineError(f"sampling_params must be an object, got {type(d).__name__}")
        d = dict(d or {})
        known = set(SamplingParams.__dataclass_fields__)
        d.pop("no_stop_trim", None)  # a reply option: Frontend reads it from the request
        refuse_unless_neutral(d, NEUTRAL, "sampling_params.")
        for name in NEUTRAL:
            d.pop(name, None)
        unknown = sorted(set(d) - known)
        if unknown:
            raise EngineError(f"unknown sampling_params {unknown}; supported: {sorted(known)}")
        check_types(d)
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
        if not 0 <= self.top_logprobs_num <= 20:
            raise EngineError(f"top_logprobs_num must be in [0, 20], got {self.top_logprobs_num}")
        if not 0 <= self.min_p <= 1:
            raise EngineError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty <= 2:
            raise EngineError(f"repetition_penalty must be in (0, 2] (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise EngineError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

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
    top_logprobs: list[list[tuple[float, int]]] | None = None  # per output token, with top_logprobs_num > 0
    # MoE: (prompt_tokens + len(output_ids) - 1, layers, k) int16 expert ids of every position fed
    # to the model (relax.engines.native.expert_routes); None for dense models
    routed_experts: Any = None


def routes_to_wire(routes: np.ndarray) -> str:
    """Recorded experts as SGLang's ``meta_info.routed_experts``: base64 of the int32 ids, flattened."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype=np.int32).tobytes()).decode("ascii")


def routes_from_wire(text: Any, rid: str) -> np.ndarray | None:
    """SGLang's ``routed_experts`` back to flat int32 ids (the rollout gives them their (positions,
    layers, k) shape, relax.services.queue_contract.routes_column); None when absent."""
    if text is None:
        return None
    try:
        return np.frombuffer(base64.b64decode(text, validate=True), dtype=np.int32)
    except (binascii.Error, TypeError, ValueError) as e:
        raise EngineError(f"engine answered unreadable routed_experts for request {rid}: {e}") from None
