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

from relax.engines.types import Completion, GenerateRequest


class TokenStream:
    """One request's tokens as the engine samples them: ``async for index, token in TokenStream(fe, req)``,
    then ``.completions``, the engine's final answer (what the non-streaming reply is made of). The
    request counts as in flight (``/abort_request`` with ``abort_all`` finds it) while it streams."""

    def __init__(self, frontend: Any, req: GenerateRequest):
        self.frontend, self.req = frontend, req
        self.completions: list[Completion] = []

    async def __aiter__(self) -> AsyncIterator[tuple[int, int]]:
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        future = self.frontend.engine.submit(
            self.req, lambda i, t, lp: loop.call_soon_threadsafe(tokens.put_nowait, (i, t)))
        done = asyncio.wrap_future(future)
        self.frontend.inflight.add(self.req.rid)
        try:
            while True:  # the engine resolves the future after its last token callback: none is lost
                getter = asyncio.ensure_future(tokens.get())
                finished, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in finished:
                    getter.cancel()
                    break
                yield getter.result()
            self.completions = done.result()
        finally:
            self.frontend.inflight.discard(self.req.rid)


def stream_response(frontend: Any, req: GenerateRequest, t0: float, opts: dict[str, Any]) -> StreamingResponse:
    return StreamingResponse(_events(frontend, req, t0, opts), media_type="text/event-stream")


async def _events(frontend: Any, req: GenerateRequest, t0: float, opts: dict[str, Any]) -> AsyncIterator[bytes]:
    n = req.params.n
    ids: list[list[int]] = [[] for _ in range(n)]
    stream = TokenStream(frontend, req)
    async for i, token in stream:
        ids[i].append(token)
        chunk = {"text": frontend.text(ids[i], req.params), "output_ids": list(ids[i]),
                 "meta_info": {"id": req.rid if n == 1 else f"{req.rid}-{i}", "finish_reason": None,
                               "prompt_tokens": len(req.input_ids), "completion_tokens": len(ids[i]),
                               "e2e_latency": time.perf_counter() - t0}}
        if n > 1:
            chunk["index"] = i
        yield _event(chunk)
    for c in stream.completions:  # the final state of every sample, exactly as the non-streaming reply
        final = frontend.to_native(c, n, t0, opts, req.params)
        if n > 1:
            final["index"] = c.index
        yield _event(final)
    yield b"data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"
