"""HTTP front of an in-process engine, speaking SGLang's native API and OpenAI chat.

Why SGLang's wire format: rollout code, the router and slime-style tooling talk to every
engine the same way, so the native PyTorch engine and a real SGLang server are swappable
behind one :class:`relax.engines.client.EngineClient`. Shapes follow SGLang 0.5.x
(docs/engines.md). Heavy imports (torch, transformers) stay inside functions so that a
server around a stub engine starts in a second.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from relax.engines.streaming import stream_response
from relax.engines.types import Completion, EngineError, GenerateRequest, SamplingParams

_VERSION_URL = re.compile(r"^(?P<root>.*)/runs/(?P<run>[^/]+)/weights/(?P<version>\d+)/?$")


def error_body(message: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequest" if status < 500 else "InternalServerError", "code": status}}


def decode_media(item: Any, kind: str, index: int) -> bytes:
    """``data:<mime>;base64,<b64>`` or bare base64 -> bytes; anything else is a 400 naming the item."""
    if not isinstance(item, str) or not item:
        raise EngineError(f"{kind}[{index}] must be a non-empty data: URI or base64 string")
    payload = item
    if item.startswith("data:"):
        head, sep, payload = item.partition(",")
        if not sep or not head.endswith(";base64"):
            raise EngineError(f"{kind}[{index}] is a data: URI without ';base64,' data")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise EngineError(f"{kind}[{index}] is not valid base64 (URLs and paths are not fetched)") from None


def validate_media(images: list[bytes], audios: list[bytes]) -> None:
    """Decode every item once, so a corrupt PNG/WAV is a 400 naming it rather than a crash later."""
    import io
    import wave

    from PIL import Image

    for i, b in enumerate(images):
        try:  # PIL raises many exception types
            Image.open(io.BytesIO(b)).verify()
        except Exception as e:
            raise EngineError(f"image_data[{i}] is not a decodable image: {e}") from None
    for i, b in enumerate(audios):
        try:
            with wave.open(io.BytesIO(b)) as w:
                w.getnframes()
        except Exception as e:
            raise EngineError(f"audio_data[{i}] is not a decodable WAV file: {e}") from None


def _as_list(x: Any) -> list[Any]:
    return [] if x is None else list(x) if isinstance(x, list) else [x]


class Frontend:
    """Turns wire requests into ``GenerateRequest``s and ``Completion``s back into wire responses."""

    def __init__(self, engine: Any, model_path: str, processor: Any = None):
        self.engine = engine
        self.model_path = model_path
        self.processor = processor  # relax.models.processors.MediaProcessor or None (text-only)
        self.inflight: set[str] = set()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def tokenize(self, text: str, images: list[bytes], audios: list[bytes]) -> tuple[list[int], dict | None]:
        validate_media(images, audios)
        if not images and not audios:
            return list(self.tokenizer.encode(text, add_special_tokens=False)), None
        if self.processor is None:
            kinds = " and ".join(k for k, v in (("images", images), ("audio", audios)) if v)
            raise EngineError(f"this model takes no {kinds}; serve a multimodal model to send media")
        from relax.models.processors import prepare_inputs

        try:
            inputs = prepare_inputs(text, images, audios, self.tokenizer, self.processor)
        except ValueError as e:
            raise EngineError(str(e)) from None
        ids = inputs.pop("input_ids")[0].tolist()
        inputs.pop("attention_mask", None)
        return ids, inputs

    def media_for_ids(self, ids: list[int], images: list[bytes], audios: list[bytes]) -> dict:
        """Media tensors for ``input_ids`` that already hold the expanded media tokens (how the
        rollout sends a prompt it tokenized itself, or one that grew over agent turns)."""
        validate_media(images, audios)
        if self.processor is None:
            raise EngineError("this model takes no images or audio; serve a multimodal model to send media")
        from relax.models.processors import check_expanded, media_features

        try:
            mm, image_counts, audio_counts = media_features(images, audios, self.processor)
            check_expanded(ids, image_counts, audio_counts, self.processor)
        except ValueError as e:
            raise EngineError(str(e)) from None
        return mm

    def check_length(self, n: int) -> None:
        limit = int(self.engine.max_context_length)
        if n == 0:
            raise EngineError("the prompt is empty (input_ids=[])")
        if n >= limit:
            raise EngineError(f"The input ({n} tokens) is longer than the model's context length ({limit} tokens).")

    async def run(self, req: GenerateRequest) -> list[Completion]:
        self.inflight.add(req.rid)
        try:
            return await self.engine.generate(req)
        finally:
            self.inflight.discard(req.rid)

    def decode(self, ids: list[int], finish: dict[str, Any], trim: bool) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        matched = finish.get("matched") if finish else None
        if trim and isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
        return text

    def to_native(self, c: Completion, n: int, t0: float, opts: dict[str, Any]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": c.rid if n == 1 else f"{c.rid}-{c.index}", "finish_reason": c.finish_reason,
            "prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.output_ids), "cached_tokens": 0,
            "weight_version": c.weight_version, "e2e_latency": time.perf_counter() - t0}
        if opts.get("return_logprob"):
            with_text = bool(opts.get("return_text_in_logprobs"))
            meta["output_token_logprobs"] = [
                [float(lp), int(t), self.tokenizer.decode([t]) if with_text else None]
                for lp, t in zip(c.logprobs, c.output_ids, strict=False)
            ]
        trim = not opts.get("no_stop_trim", False)
        return {"text": self.decode(c.output_ids, c.finish_reason, trim), "output_ids": list(c.output_ids),
                "meta_info": meta}

    async def generate(self, body: dict[str, Any]) -> Any:
        """SGLang ``/generate``: a dict for one prompt with n=1, a list for a batch or n>1."""
        t0 = time.perf_counter()
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise EngineError("send exactly one of 'text' or 'input_ids'")
        batched = isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
        prompts = (text if isinstance(text, list) else [text]) if text is not None else (ids if batched else [ids])
        b = len(prompts)
        sps = body.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * b
        rids = body.get("rid") or [uuid.uuid4().hex for _ in range(b)]
        rids = rids if isinstance(rids, list) else [rids]
        if len(sps) != b or len(rids) != b or len(set(rids)) != b:
            raise EngineError(f"sampling_params and rid must have one (unique) entry per prompt ({b})")
        media = {}
        for kind in ("image_data", "audio_data"):
            items = body.get(kind)
            per = [_as_list(items)] if not batched else [_as_list(x) for x in _as_list(items)]
            if batched and items is not None and len(per) != b:
                raise EngineError(f"{kind} has {len(per)} entries for a batch of {b}")
            media[kind] = per if items is not None else [[] for _ in range(b)]
        reqs = []
        for i, p in enumerate(prompts):
            params = SamplingParams.from_json(sps[i])
            imgs = [decode_media(x, "image_data", j) for j, x in enumerate(media["image_data"][i])]
            auds = [decode_media(x, "audio_data", j) for j, x in enumerate(media["audio_data"][i])]
            if isinstance(p, str):
                pid, mm = self.tokenize(p, imgs, auds)
            else:
                if not all(isinstance(t, int) for t in p):
                    raise EngineError("input_ids must be a list of ints or a list of such lists")
                pid, mm = list(p), (self.media_for_ids(p, imgs, auds) if imgs or auds else None)
            self.check_length(len(pid))
            reqs.append(GenerateRequest(rid=str(rids[i]), input_ids=pid, params=params, mm_inputs=mm))
        if body.get("stream"):
            if len(reqs) != 1:
                raise EngineError("stream=true takes one prompt (n may be > 1); send a batch without stream")
            return stream_response(self, reqs[0], t0, body)
        results = await asyncio.gather(*(self.run(r) for r in reqs))
        out = [self.to_native(c, r.params.n, t0, body) for r, cs in zip(reqs, results, strict=True) for c in cs]
        return out if batched or len(out) > 1 else out[0]

    async def update_weights_from_disk(self, body: dict[str, Any], store_root: str | None,
                                       run_id: str | None) -> tuple[int, dict[str, Any]]:
        path = str(body.get("model_path") or "")
        try:
            state, version = await asyncio.to_thread(load_weights, path, store_root, run_id)
            version = str(body.get("weight_version") or version)
            await asyncio.to_thread(self.engine.update_weights, state, version)
        except Exception as e:  # the engine keeps its old weights; the caller decides what to do
            return 400, {"success": False, "message": f"{type(e).__name__}: {e}", "num_paused_requests": 0}
        return 200, {"success": True, "message": f"loaded {path} as weight_version {version}",
                     "num_paused_requests": 0}


_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def chat_prompt(messages: list[dict[str, Any]]) -> tuple[list[dict[str, str]], list[bytes], list[bytes]]:
    """OpenAI messages -> (plain-text messages with <image>/<audio> placeholders, images, audios)."""
    msgs, images, audios = [], [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                kind = p.get("type")
                if kind == "text":
                    parts.append(p.get("text", ""))
                elif kind == "image_url":
                    url = (p.get("image_url") or {}).get("url", "")
                    images.append(decode_media(url, "image_url", len(images)))
                    parts.append("<image>")
                elif kind == "input_audio":
                    audio = p.get("input_audio") or {}
                    if audio.get("format", "wav") != "wav":
                        raise EngineError(f"input_audio[{len(audios)}]: only format 'wav' is supported")
                    audios.append(decode_media(audio.get("data", ""), "input_audio", len(audios)))
                    parts.append("<audio>")
                else:
                    raise EngineError(f"unsupported content part type {kind!r}")
            content = "".join(parts)
        msgs.append({"role": m.get("role", "user"), "content": content or ""})
    return msgs, images, audios


async def chat_completion(fe: Frontend, body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI ``/v1/chat/completions`` (non-streaming) on top of the engine."""
    if body.get("stream"):
        raise EngineError("stream=true is not supported by this server")
    if not body.get("messages"):
        raise EngineError("messages must be a non-empty list")
    msgs, images, audios = chat_prompt(body["messages"])
    text = fe.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids, mm = fe.tokenize(text, images, audios)
    fe.check_length(len(ids))
    sp: dict[str, Any] = {"n": body.get("n") or 1, "stop": body.get("stop")}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "sampling_seed"),
                     ("max_tokens", "max_new_tokens"), ("max_completion_tokens", "max_new_tokens")):
        if body.get(src) is not None:
            sp[dst] = body[src]
    req = GenerateRequest(rid=f"chatcmpl-{uuid.uuid4().hex}", input_ids=ids, params=SamplingParams.from_json(sp),
                          mm_inputs=mm)
    completions = await fe.run(req)
    choices = []
    for c in completions:
        logprobs = None
        if body.get("logprobs"):
            toks = [fe.tokenizer.decode([t]) for t in c.output_ids]
            logprobs = {"content": [{"token": s, "logprob": float(lp), "bytes": list(s.encode()), "top_logprobs": []}
                                    for s, lp in zip(toks, c.logprobs, strict=False)]}
        choices.append({"index": c.index, "message": {"role": "assistant",
                                                      "content": fe.decode(c.output_ids, c.finish_reason, True)},
                        "logprobs": logprobs, "finish_reason": _FINISH.get(c.finish_reason.get("type"), "stop"),
                        "matched_stop": c.finish_reason.get("matched")})
    done = sum(len(c.output_ids) for c in completions)
    return {"id": req.rid, "object": "chat.completion", "created": int(time.time()), "model": fe.model_path,
            "choices": choices, "usage": {"prompt_tokens": len(ids), "completion_tokens": done,
                                          "total_tokens": len(ids) + done}}


def load_weights(path: str, store_root: str | None, run_id: str | None) -> tuple[dict[str, Any], str]:
    """``(state_dict, version)`` from a WeightStore version URL, a bare version number (with
    ``store_root``/``run_id`` configured) or a local folder of ``*.safetensors`` (an HF save)."""
    from relax.transfer.weights import WeightStore

    m = _VERSION_URL.match(path.rstrip("/"))
    if m:
        state, _ = WeightStore(m["root"], m["run"]).load(int(m["version"]))
        return state, str(int(m["version"]))
    if path.isdigit() and store_root and run_id:
        state, _ = WeightStore(store_root, run_id).load(int(path))
        return state, path
    folder = Path(path.removeprefix("file://")).expanduser()
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"{path!r} is neither a WeightStore version (<root>/runs/<run>/weights/<n>) "
                                "nor a folder with *.safetensors files")
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state, folder.name


def create_app(engine: Any, model_path: str, weight_store_root: str | None = None, run_id: str | None = None,
               *, processor: Any = None) -> FastAPI:
    """A FastAPI app serving ``engine`` (the NativeEngine interface) under SGLang's routes."""
    app = FastAPI(title="Relax engine", description="SGLang-compatible native routes and OpenAI chat.")
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

    @app.post("/abort_request")
    async def abort_request(body: dict[str, Any] = Body(default={})) -> Response:
        rids = list(fe.inflight) if body.get("abort_all") else [str(body.get("rid", ""))]
        _ = [engine.abort(rid) for rid in rids]
        return Response(status_code=200)

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        return await chat_completion(fe, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_path, "object": "model", "created": 0, "owned_by": "relax",
                                            "root": model_path, "max_model_len": engine.max_context_length}]}

    return app


def build_native_engine(model_path: str, max_batch_size: int = 64, background: bool = True,
                        seed: int = 0) -> tuple[Any, Any]:
    """``(NativeEngine, processor)`` for a local HF folder (text, VL, audio or omni thinker); never downloads.
    ``seed`` keys every request's sampling stream (with its ``seed`` or rid), as in an in-process engine."""
    from relax.config import ModelConfig
    from relax.engines.native.engine import NativeEngine
    from relax.models import build_policy, build_tokenizer

    tok = build_tokenizer(model_path)
    model, processor = build_policy(ModelConfig(name_or_path=model_path, tokenizer=model_path), tok, seed=0)
    return NativeEngine(model, tok, max_batch_size=max_batch_size, model_path=model_path,
                        background=background, seed=seed), processor


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Serve a local HF model with the native engine over HTTP.")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--weight-store-root", default=None)
    ap.add_argument("--run-id", default=None)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (a run's seed: same tokens as in-process)")
    args = ap.parse_args(argv)
    import uvicorn

    # The engine's scheduler runs on the main thread, the thread that loaded the model: torch's
    # OpenMP pool belongs to the first thread that used it, and compute on a second thread beside
    # it measured 2x slower per op here. HTTP handling (no heavy torch) gets its own thread.
    engine, processor = build_native_engine(args.model_path, args.max_batch_size, background=False, seed=args.seed)
    app = create_app(engine, args.model_path, args.weight_store_root, args.run_id, processor=processor)
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
