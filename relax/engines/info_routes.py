"""The read-only routes that routers, dashboards and clients probe: server info, load, version,
tokenize and Prometheus metrics, in SGLang's shapes where SGLang has them (docs/engines.md).

sglang-router asks ``/get_server_info`` (model and limits) and ``/get_load`` (what it balances on)
of every worker; Prometheus scrapes ``/metrics``. Nothing here changes the server's state.
"""

from __future__ import annotations

import asyncio
import time
from importlib import metadata
from typing import Any

from fastapi import Body, FastAPI
from fastapi.responses import PlainTextResponse

from relax.engines.frontend import Frontend
from relax.engines.types import EngineError


def relax_version() -> str:
    try:
        return metadata.version("relax")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def server_info(fe: Frontend) -> dict[str, Any]:
    info = dict(fe.engine.model_info())
    return {"model_path": fe.model_path, "tokenizer_path": fe.model_path, "served_model_name": fe.model_path,
            "context_length": info.get("max_context_length"), "vocab_size": info.get("vocab_size"),
            "weight_version": info.get("weight_version"), "max_running_requests": getattr(fe.engine, "max_batch_size",
                                                                                          None),
            "version": relax_version(), "engine": "relax-native"}


def load_of(fe: Frontend) -> int:
    """Requests waiting or running (each prompt once, whatever its n): what a router balances on."""
    return int(getattr(fe.engine, "load", len(fe.inflight)))


def prometheus(fe: Frontend) -> str:
    info = fe.engine.model_info()
    lines = [
        "# HELP relax_engine_load Requests waiting or running in the engine.",
        "# TYPE relax_engine_load gauge",
        f"relax_engine_load {load_of(fe)}",
        "# HELP relax_engine_inflight Requests this server is answering.",
        "# TYPE relax_engine_inflight gauge",
        f"relax_engine_inflight {len(fe.inflight)}",
        "# HELP relax_engine_info The served model and weight version.",
        "# TYPE relax_engine_info gauge",
        f'relax_engine_info{{model_path="{_label(fe.model_path)}",weight_version="{_label(info.get("weight_version"))}"'
        f'}} 1',
    ]
    return "\n".join(lines) + "\n"


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def add_info_routes(app: FastAPI, fe: Frontend) -> None:
    """Register the read-only probe routes on ``app``."""

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> dict[str, Any]:
        return server_info(fe)

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:  # SGLang's shape: one entry per data-parallel rank
        return [{"dp_rank": 0, "num_reqs": load_of(fe), "num_waiting_reqs": 0,
                 "num_tokens": int(getattr(fe.engine, "tokens_in_use", 0)), "ts_tic": time.perf_counter()}]

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": relax_version()}

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        text = body.get("prompt", body.get("text"))
        if not isinstance(text, str):
            raise EngineError("tokenize takes {'prompt': <string>}")
        add_special = body.get("add_special_tokens", False)
        if not isinstance(add_special, bool):
            raise EngineError("add_special_tokens must be true or false")
        ids = list(await asyncio.to_thread(fe.tokenizer.encode, text, add_special_tokens=add_special))
        return {"tokens": ids, "count": len(ids), "max_model_len": fe.engine.max_context_length}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus(fe), media_type="text/plain; version=0.0.4")
