"""Server-sent-event streaming of ``/generate``, in SGLang's format.

Each event is ``data: <json>\\n\\n`` holding the *cumulative* output so far (text,
output_ids, meta_info with finish_reason null until the end; ``index`` for n > 1), and the
stream ends with ``data: [DONE]``. Tokens reach the HTTP thread from the engine thread
through ``loop.call_soon_threadsafe``, so the event loop never blocks on the model.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from relax.engines.types import GenerateRequest


def stream_response(frontend: Any, req: GenerateRequest, t0: float, opts: dict[str, Any]) -> StreamingResponse:
    return StreamingResponse(_events(frontend, req, t0, opts), media_type="text/event-stream")


async def _events(frontend: Any, req: GenerateRequest, t0: float, opts: dict[str, Any]) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    tokens: asyncio.Queue = asyncio.Queue()
    future = frontend.engine.submit(req, lambda i, t, lp: loop.call_soon_threadsafe(tokens.put_nowait, (i, t, lp)))
    done = asyncio.wrap_future(future)
    n = req.params.n
    ids: list[list[int]] = [[] for _ in range(n)]
    frontend.inflight.add(req.rid)
    try:
        while True:
            getter = asyncio.ensure_future(tokens.get())
            finished, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in finished:
                getter.cancel()
                break
            i, token, _lp = getter.result()
            ids[i].append(token)
            chunk = {"text": frontend.tokenizer.decode(ids[i], skip_special_tokens=True), "output_ids": list(ids[i]),
                     "meta_info": {"id": req.rid if n == 1 else f"{req.rid}-{i}", "finish_reason": None,
                                   "prompt_tokens": len(req.input_ids), "completion_tokens": len(ids[i]),
                                   "e2e_latency": time.perf_counter() - t0}}
            if n > 1:
                chunk["index"] = i
            yield _event(chunk)
        for c in done.result():  # the final state of every sample, exactly as the non-streaming reply
            final = frontend.to_native(c, n, t0, opts)
            if n > 1:
                final["index"] = c.index
            yield _event(final)
        yield b"data: [DONE]\n\n"
    finally:
        frontend.inflight.discard(req.rid)


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"
