"""The session gateway: the HTTP face of :class:`~relax.rollout.sessions.SessionHub` for external agents.

Routes (docs/agents.md), all behind the agents' bearer token (``RELAX_AGENT_TOKEN``, never the
engines' ``RELAX_ENGINE_TOKEN``; :class:`~relax.engines.guards.Guard`) except ``GET /health``:

* ``POST /v1/sessions`` -> ``{id, base_url, sample}``; 503 with ``Retry-After`` while no episode is
  open (between batches, or every episode of the batch taken). ``{"wait_s": s}`` waits up to s seconds
  for one first.
* ``POST /v1/sessions/{id}/v1/chat/completions`` -- OpenAI chat (``stream`` and ``tools`` included;
  the policy's calls, in its family's format (relax.rollout.tool_calls), come back as ``tool_calls``).
* ``POST /v1/sessions/{id}/v1/responses`` (OpenAI Responses, relax.services.api.responses_api) and
  ``POST /v1/sessions/{id}/v1/messages`` (Anthropic Messages, relax.services.api.messages_api): the same
  session turn in those APIs' shapes (``x-api-key`` is taken as the bearer token).
* ``POST /v1/sessions/{id}/reward`` ``{"reward": r, "turn_rewards"?: [...]}``, ``POST .../close``,
  ``GET /v1/sessions/{id}``.

uvicorn serves it on a daemon thread of the rollout process; handlers never generate, they wait for
the rollout's thread (:meth:`SessionHub.run_batch`) to answer.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from relax import objstore
from relax.config.preflight import AGENT_TOKEN_ENV
from relax.data.samples import Sample
from relax.engines.guards import TOKEN_ENV, Guard
from relax.engines.server import error_body
from relax.rollout.session_requests import SessionError
from relax.rollout.sessions import SessionHub
from relax.services.api import messages_api, responses_api
from relax.services.api.messages_api import AnthropicDialect
from relax.services.api.server import ServerThread

log = logging.getLogger(__name__)
_FINISH = {"stop": "stop", "length": "length"}
_KIND = {400: "BadRequest", 404: "NotFound", 405: "MethodNotAllowed", 409: "Conflict", 503: "ServiceUnavailable"}
_MEDIA = re.compile(r"(<image>|<audio>)")
RETRY_AFTER_S = 1
PORT_FILE = "gateway_port.json"  # the port a run's gateway last had (port 0): a restarted rollout binds it again
MAX_WAIT_S = 60.0


class GatewayStartError(RuntimeError):
    """The gateway could not listen (port taken, bad address); the message names the setting."""


def openai_messages(sample: Sample, load: Callable[[Any], bytes]) -> list[dict[str, Any]]:
    """A sample's prompt as OpenAI messages: ``<image>``/``<audio>`` placeholders become data: parts."""
    images, audios = iter([load(r) for r in sample.images]), iter([load(r) for r in sample.audios])
    out = []
    for m in sample.messages:
        if not _MEDIA.search(m.content):
            out.append({"role": m.role, "content": m.content})
            continue
        parts: list[dict[str, Any]] = []
        for piece in _MEDIA.split(m.content):
            if piece == "<image>":
                url = "data:image/png;base64," + base64.b64encode(next(images)).decode()
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif piece == "<audio>":
                data = base64.b64encode(next(audios)).decode()
                parts.append({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})
            elif piece:
                parts.append({"type": "text", "text": piece})
        out.append({"role": m.role, "content": parts})
    return out


def turn_calls(turn: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool calls a hub turn returns to the agent: those parsed from its text (in the policy's format,
    relax.rollout.tool_calls), as its tool_choice allows."""
    return turn["tool_choice"].calls(turn["calls"])


def chat_reply(turn: dict[str, Any], model: str) -> dict[str, Any]:
    """A hub turn as a ``chat.completion``: tool-call blocks parsed into OpenAI ``tool_calls``."""
    text = turn["text"]
    calls = [{"id": f"call_{turn['id'].removeprefix('chatcmpl-')}_{k}", "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
             for k, c in enumerate(turn_calls(turn))]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    finish = "tool_calls" if calls else _FINISH.get(turn["finish"], "stop")
    done, prompt = turn["completion_tokens"], turn["prompt_tokens"]
    return {"id": turn["id"], "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done},
            # why the episode ended with this turn (a limit: max_turns, max_episode_tokens), else null
            "episode_ended": turn.get("ended") or None}


def stream_events(reply: dict[str, Any]) -> Iterator[bytes]:
    """A finished ``chat.completion`` as ``chat.completion.chunk`` server-sent events, then ``[DONE]``
    (the turn is generated whole on the rollout's thread; only its delivery is streamed)."""
    choice = reply["choices"][0]
    head = {k: reply[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def event(delta: dict[str, Any], finish: str | None) -> bytes:
        body = head | {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    yield event({"role": "assistant", "content": choice["message"]["content"]}, None)
    calls = choice["message"].get("tool_calls") or []
    if calls:
        yield event({"tool_calls": [{"index": i} | c for i, c in enumerate(calls)]}, None)
    last = event({}, choice["finish_reason"])  # the last chunk also says whether the episode ended
    yield last[:-3] + b', "episode_ended": ' + json.dumps(reply.get("episode_ended")).encode() + b"}\n\n"
    yield b"data: [DONE]\n\n"


def create_gateway_app(hub: SessionHub, token: str, media: Callable[[Any], bytes] | None = None) -> Any:
    """The FastAPI app on ``hub``, behind the bearer-token guard."""
    from fastapi import Body, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    load = media or (lambda ref: ref.data)
    history = responses_api.ResponseHistory()  # previous_response_id -> the conversation it ended
    app = FastAPI(title="Relax session gateway", description="External agents' episodes (docs/agents.md).")

    def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        body = error_body(message, status)
        body["error"]["type"] = _KIND.get(status, body["error"]["type"])
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(SessionError)
    async def _refused(_: Request, e: SessionError) -> JSONResponse:
        return error(e.status, e.message)

    @app.exception_handler(HTTPException)
    async def _no_route(request: Request, e: HTTPException) -> JSONResponse:  # the documented shape, not FastAPI's
        why = {404: f"no route {request.url.path}: see docs/agents.md for the gateway's routes",
               405: f"{request.url.path} does not take {request.method}: see docs/agents.md"}.get(e.status_code)
        return error(e.status_code, why or str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, e: RequestValidationError) -> JSONResponse:
        return error(400, f"the request body must be a JSON object ({e.errors()[0].get('msg', 'invalid')})")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/sessions")
    async def open_session(body: dict[str, Any] | None = Body(None)) -> Any:
        wait = (body or {}).get("wait_s", 0)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_WAIT_S:
            return error(400, f"wait_s must be a number of seconds in [0, {MAX_WAIT_S:g}], got {wait!r}")
        deadline = time.monotonic() + wait
        while (claimed := hub.open_session()) is None and time.monotonic() < deadline and not hub.stopped:
            await asyncio.sleep(0.02)
        if claimed is None:
            return error(503, f"no episode is open now (between batches, or every episode of this batch is taken); "
                              f"retry after {RETRY_AFTER_S} s", {"Retry-After": str(RETRY_AFTER_S)})
        sid, sample = claimed
        messages = await asyncio.to_thread(openai_messages, sample, load)
        return {"id": sid, "base_url": f"{hub.base_url}/v1/sessions/{sid}/v1",
                "anthropic_base_url": f"{hub.base_url}/v1/sessions/{sid}",  # the anthropic client adds /v1
                "sample": {"id": sample.id, "task": sample.task, "messages": messages,
                           "tools": list(sample.metadata.get("tools", [])), "metadata": dict(sample.metadata)}}

    @app.post("/v1/sessions/{sid}/v1/chat/completions")
    async def chat(sid: str, body: dict[str, Any] = Body(...)) -> Any:
        turn = await asyncio.wrap_future(hub.chat(sid, body))
        reply = chat_reply(turn, str(body.get("model") or "relax-policy"))
        if body.get("stream"):
            return StreamingResponse(stream_events(reply), media_type="text/event-stream")
        return reply

    @app.post("/v1/sessions/{sid}/v1/responses")
    async def responses(sid: str, body: dict[str, Any] = Body(...)) -> Any:
        previous = body.get("previous_response_id")
        request = responses_api.chat_request(body, history.get(sid, previous) if previous else None)
        turn = await asyncio.wrap_future(hub.chat(sid, request))
        reply = responses_api.response_object(turn, turn_calls(turn), body, str(body.get("model") or "relax-policy"))
        history.put(sid, reply["id"], [*request["messages"], {"role": "assistant", "content": turn["text"]}])
        if body.get("stream"):
            return StreamingResponse(responses_api.response_events(reply), media_type="text/event-stream")
        return reply

    @app.post("/v1/sessions/{sid}/v1/messages")
    async def messages(sid: str, body: dict[str, Any] = Body(...)) -> Any:
        turn = await asyncio.wrap_future(hub.chat(sid, messages_api.chat_request(body)))
        reply = messages_api.message_object(turn, turn_calls(turn), body, str(body.get("model") or "relax-policy"))
        if body.get("stream"):
            return StreamingResponse(messages_api.message_events(reply), media_type="text/event-stream")
        return reply

    @app.post("/v1/sessions/{sid}/reward")
    async def reward(sid: str, body: dict[str, Any] = Body(...)) -> Any:
        return hub.post_reward(sid, body)

    @app.post("/v1/sessions/{sid}/close")
    async def close(sid: str) -> Any:
        return await asyncio.wrap_future(hub.close(sid))

    @app.get("/v1/sessions/{sid}")
    async def describe(sid: str) -> Any:
        return hub.describe(sid)

    return AnthropicDialect(Guard(app, token=token))


def _bound(host: str, port: int) -> socket.socket | str:
    """A socket bound to ``host:port`` (bound here, so a taken port is an error naming the setting, and
    port 0 has its number at once), or why it cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        return str(e.strerror)
    return sock


def _remembered_port(run_url: str | None) -> int | None:
    if run_url is None or not objstore.exists(objstore.join(run_url, PORT_FILE)):
        return None
    try:
        return int(json.loads(objstore.read_bytes(objstore.join(run_url, PORT_FILE)))["port"])
    except (ValueError, KeyError, TypeError):
        return None


class Gateway:
    """The gateway app on ``host:port`` (0 = a free port) in a daemon thread; ``url`` once started.
    With ``run_url`` its URL (no token) is written to ``<run>/gateway.json`` for agents to find."""

    def __init__(self, hub: SessionHub, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 run_url: str | None = None, media: Callable[[Any], bytes] | None = None):
        token = token or os.environ.get(AGENT_TOKEN_ENV)
        engine_token = os.environ.get(TOKEN_ENV)
        if not token or (engine_token and hmac.compare_digest(token, engine_token)):
            raise GatewayStartError(
                f"the session gateway needs its own bearer token: set {AGENT_TOKEN_ENV} to a secret "
                f"for your agents (not {TOKEN_ENV}, which controls the run's engines)"
            )
        self.hub, self.run_url = hub, run_url
        # port 0: the port this run's gateway had before, so a restarted rollout keeps the agents' address
        earlier = _remembered_port(run_url) if port == 0 else None
        sock = _bound(host, earlier) if earlier else ""
        if isinstance(sock, str):
            if earlier:
                log.warning("the session gateway's earlier port %d is taken (%s); agents must re-read gateway.json",
                            earlier, sock)
            sock = _bound(host, port)
        if isinstance(sock, str):
            raise GatewayStartError(f"rollout.gateway_port {port} on {host} cannot be bound ({sock}); choose "
                                    f"another rollout.gateway_port, or 0 for a free one")
        self._sock = sock
        self._sock.listen(128)
        shown = socket.gethostname() if host in ("0.0.0.0", "::") else host
        self.url = f"http://{shown}:{self._sock.getsockname()[1]}"
        hub.base_url = self.url
        app = create_gateway_app(hub, token, media)
        self._serving = ServerThread(app, "relax-session-gateway", sockets=[self._sock])

    def start(self, timeout_s: float = 30.0) -> Gateway:
        problem = self._serving.start(timeout_s)
        if problem:
            self.stop()
            raise GatewayStartError(f"the session gateway on {self.url} {problem}")
        if self.run_url is not None:
            objstore.write_bytes(objstore.join(self.run_url, "gateway.json"), json.dumps({"url": self.url}).encode())
            port = self._sock.getsockname()[1]  # kept when the gateway stops: a restart binds it again
            objstore.write_bytes(objstore.join(self.run_url, PORT_FILE), json.dumps({"port": port}).encode())
        log.info("session gateway for external agents on %s (docs/agents.md)", self.url)
        return self

    def stop(self) -> None:
        self.hub.shutdown()
        self._serving.stop()
        self._sock.close()
        if self.run_url is not None:  # agents reading it would wait on a gateway that is gone
            objstore.delete(objstore.join(self.run_url, "gateway.json"))
