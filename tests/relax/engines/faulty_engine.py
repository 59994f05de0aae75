"""A real HTTP engine that misbehaves on demand: ``/generate`` answers according to ``state["mode"]``.

Modes other than ``ok`` are the faults the client must catch after a 200: a body that is not
JSON, missing fields, output ids and logprobs of different lengths, a NaN logprob, a token id
outside the vocabulary, the wrong number of items, or no answer in time (``slow``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

VOCAB = 1000  # the vocabulary size tests give the client
GARBAGE = ("not_json", "missing_ids", "length_mismatch", "nan_logprob", "out_of_vocab", "wrong_count")


def _item(ids: list[int], lps: list[float]) -> dict[str, Any]:
    return {"text": "x", "output_ids": ids,
            "meta_info": {"weight_version": "faulty", "finish_reason": {"type": "length", "length": len(ids)},
                          "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=False)]}}


def faulty_app() -> tuple[FastAPI, dict[str, Any]]:
    state: dict[str, Any] = {"mode": "ok", "calls": 0, "slow_s": 2.0}
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.post("/generate")
    async def generate(body: dict) -> Response:
        state["calls"] += 1
        mode = state["mode"]
        k = int((body.get("sampling_params") or {}).get("max_new_tokens", 2))
        good = _item([1] * k, [-0.1] * k)
        if mode == "ok":
            return JSONResponse(good)
        if mode == "slow":
            await asyncio.sleep(state["slow_s"])
            return JSONResponse(good)
        if mode == "not_json":
            return Response("<html><body>502 Bad Gateway</body></html>", media_type="text/html")
        if mode == "missing_ids":
            return JSONResponse({"text": "x", "meta_info": good["meta_info"]})
        if mode == "length_mismatch":
            return JSONResponse(_item([1] * (k + 1), [-0.1] * k))
        if mode == "nan_logprob":  # JSON has no NaN; Python's encoder writes it anyway (as servers do)
            return Response(json.dumps(_item([1] * k, [float("nan")] * k)), media_type="application/json")
        if mode == "out_of_vocab":
            return JSONResponse(_item([VOCAB + 5] * k, [-0.1] * k))
        if mode == "wrong_count":
            return JSONResponse([good, good])
        raise ValueError(f"unknown mode {mode!r}")

    return app, state
