"""HTTP front of an in-process engine, speaking SGLang's native API and OpenAI chat.

Why SGLang's wire format: rollout code, the router and slime-style tooling talk to every
engine the same way, so the native PyTorch engine and a real SGLang server are swappable
behind one :class:`relax.engines.client.EngineClient`. Shapes follow SGLang 0.5.x
(docs/engines.md). This module is the app and its SGLang routes, and the engine process
(``python -m relax.engines.server``); the wire translation is ``frontend.py``, OpenAI chat
``openai_routes.py``, weight sources ``weight_source.py``. Heavy imports (torch,
transformers) stay inside functions so that a server around a stub engine starts in a second.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import uuid
from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from relax.engines.frontend import Frontend
from relax.engines.guards import MAX_BODY_BYTES, Guard, check_bind, token_from_env
from relax.engines.info_routes import add_info_routes
from relax.engines.openai_routes import add_openai_routes
from relax.engines.types import EngineError, GenerateRequest, SamplingParams
from relax.engines.weight_receive import WeightReceiver
from relax.faults import fault_point, set_role_process


def error_body(message: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequest" if status < 500 else "InternalServerError",
                      "param": None, "code": status}}  # OpenAI's error shape


def create_app(engine: Any, model_path: str, weight_store_root: str | None = None, run_id: str | None = None,
               *, processor: Any = None, token: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """A FastAPI app serving ``engine`` (the NativeEngine interface) under SGLang's routes, behind the
    guard (relax.engines.guards): ``token`` (default: ``RELAX_ENGINE_TOKEN``) and the body-size limit."""
    app = FastAPI(title="Relax engine", description="SGLang-compatible native routes and OpenAI chat.")
    app.add_middleware(Guard, token=token if token is not None else token_from_env(), max_body_bytes=max_body_bytes)
    fe = Frontend(engine, model_path, processor)
    app.state.frontend = fe

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, e: EngineError) -> JSONResponse:
        return JSONResponse(error_body(str(e), e.status), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(f"invalid request: {e.errors()}", 400), status_code=400)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(body: dict[str, Any] = Body(...)) -> Any:
        return await fe.generate(body)

    @app.get("/health")
    async def health() -> dict[str, Any]:  # up = answering; /health_generate exercises the model
        return {}

    @app.get("/health_generate")
    async def health_generate() -> Response:
        req = GenerateRequest(rid=f"health-{uuid.uuid4().hex}", input_ids=[0],
                              params=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            await asyncio.wait_for(fe.run(req), timeout=20)
        except Exception as e:
            return JSONResponse(error_body(f"health generation failed: {e!r}", 503), status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        info = dict(engine.model_info())
        info["model_path"] = info.get("model_path") or model_path
        info["tokenizer_path"] = info.get("tokenizer_path") or model_path
        info["has_image_understanding"] = bool(processor is not None and processor.image_processor is not None)
        info["has_audio_understanding"] = bool(processor is not None and processor.feature_extractor is not None)
        params = getattr(getattr(engine, "model", None), "parameters", None)
        first = next(iter(params()), None) if callable(params) else None
        if first is not None:  # what a trainer casts broadcast weights to (relax.engines.weight_broadcast)
            info.setdefault("dtype", str(first.dtype).removeprefix("torch."))
        return info

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        if await asyncio.to_thread(engine.flush_cache) is False:  # SGLang: 400 while requests are running
            return PlainTextResponse("Cache not flushed: requests are running.", status_code=400)
        return PlainTextResponse("Cache flushed.")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: dict[str, Any] = Body(...)) -> JSONResponse:
        status, out = await fe.update_weights_from_disk(body, weight_store_root, run_id)
        return JSONResponse(out, status_code=status)

    receiver = WeightReceiver(engine)  # SGLang's distributed weight update (weight_receive.py)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: dict[str, Any] = Body(...)) -> JSONResponse:
        status, out = await receiver.init_group(body)
        return JSONResponse(out, status_code=status)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: dict[str, Any] = Body(...)) -> JSONResponse:
        status, out = await receiver.update(body)
        return JSONResponse(out, status_code=status)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: dict[str, Any] = Body(default={})) -> JSONResponse:
        status, out = await receiver.destroy_group(body)
        return JSONResponse(out, status_code=status)

    @app.post("/abort_request")
    async def abort_request(body: dict[str, Any] = Body(default={})) -> Response:
        rids = list(fe.inflight) if body.get("abort_all") else [str(body.get("rid", ""))]
        _ = [engine.abort(rid) for rid in rids]
        return Response(status_code=200)

    add_openai_routes(app, fe)  # /v1/chat/completions, /v1/models
    add_info_routes(app, fe)  # /get_server_info, /get_load, /version, /tokenize, /metrics
    return app


def build_native_engine(model_path: str, max_batch_size: int = 64, background: bool = True,
                        seed: int = 0, record_routes: bool = False) -> tuple[Any, Any]:
    """``(NativeEngine, processor)`` for a local HF folder (text, VL, audio or omni thinker); never downloads.
    ``seed`` keys every request's sampling stream (with its ``seed`` or rid), as in an in-process engine."""
    from relax.config import ModelConfig
    from relax.engines.native.engine import NativeEngine
    from relax.models import build_policy, build_tokenizer

    tok = build_tokenizer(model_path)
    model, processor = build_policy(ModelConfig(name_or_path=model_path, tokenizer=model_path), tok, seed=0)
    return NativeEngine(model, tok, max_batch_size=max_batch_size, model_path=model_path,
                        background=background, seed=seed, record_routes=record_routes), processor


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Serve a local HF model with the native engine over HTTP.")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--weight-store-root", default=None)
    ap.add_argument("--run-id", default=None)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (a run's seed: same tokens as in-process)")
    ap.add_argument("--num-threads", type=int, default=0,
                    help="torch threads (0: torch's default); every engine of a run uses one count, so they "
                         "compute the same floats")
    ap.add_argument("--owner-pid", type=int, default=0,
                    help="exit when this process is gone (the rollout that owns the engine)")
    ap.add_argument("--owner-start", default="", help="the owner's start time, so a reused pid is not mistaken for it")
    ap.add_argument("--registry-id", default="", help="names this process in its owner's engine registry "
                    "(lifetime.py); not a credential: the bearer token is RELAX_ENGINE_TOKEN")
    ap.add_argument("--enable-return-routed-experts", action="store_true",
                    help="MoE models: record each token's experts, returned with return_routed_experts (SGLang's flag)")
    ap.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="larger request bodies get a 413")
    args = ap.parse_args(argv)
    if bool(args.weight_store_root) != bool(args.run_id):  # a store without a run would load any run's versions
        ap.error("--weight-store-root and --run-id go together: the engine loads versions of that one run only")
    check_bind(args.host, token_from_env())  # before loading anything: no token, no network address
    set_role_process()  # an injected engine fault (RELAX_FAULT=engine:...) kills this process
    if args.owner_pid:  # first: an owner that dies while the model loads leaves no engine behind
        from relax.engines.owner import watch_owner

        watch_owner(args.owner_pid, args.owner_start or None)
    if args.num_threads > 0:
        import torch

        torch.set_num_threads(args.num_threads)
    import uvicorn

    # The engine's scheduler runs on the main thread, the thread that loaded the model: torch's
    # OpenMP pool belongs to the first thread that used it, and compute on a second thread beside
    # it measured 2x slower per op here. HTTP handling (no heavy torch) gets its own thread.
    engine, processor = build_native_engine(args.model_path, args.max_batch_size, background=False, seed=args.seed,
                                            record_routes=args.enable_return_routed_experts)
    fault_point("engine", "start")  # loaded, not yet serving
    app = create_app(engine, args.model_path, args.weight_store_root, args.run_id, processor=processor,
                     max_body_bytes=args.max_body_bytes)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    http = threading.Thread(target=server.run, name="relax-http", daemon=True)
    http.start()
    try:
        engine.run_forever()
    finally:
        server.should_exit = True
        http.join(timeout=10)


if __name__ == "__main__":
    main()
