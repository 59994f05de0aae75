"""What an engine server checks before a request reaches a route: the caller's token and the body's size.

Token. Whoever can call ``/update_weights_from_disk`` chooses the weights that generate the rollouts
(and so the gradient), ``/abort_request`` can stop every rollout and ``/flush_cache`` drops the KV
cache: these routes always need ``Authorization: Bearer <token>``, with the token from the
``RELAX_ENGINE_TOKEN`` environment variable (the rollout makes one per run and passes it to the
engines it launches; it is never saved in a config). A server started without a token answers those
routes 403. With a token set, every other route needs it too, as SGLang's ``--api-key`` does, except
``/health`` and ``/health_generate`` (liveness probes). A server refuses to listen on a non-loopback
address without a token (:func:`check_bind`).

Size. A body over the limit (default 8 MiB; ``--max-body-bytes``) is a 413 before it is read into
memory or parsed, so one huge prompt cannot stall the server for everyone else.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
from typing import Any

# the engines' token: the config's preflight reads it too (the session gateway's, AGENT_TOKEN_ENV, lives there)
from relax.config.preflight import TOKEN_ENV

MAX_BODY_BYTES = 8 << 20
MUTATING = frozenset({"/update_weights_from_disk", "/update_weights_from_distributed", "/init_weights_update_group",
                      "/destroy_weights_update_group", "/abort_request", "/flush_cache"})
PUBLIC = frozenset({"/health", "/health_generate"})


def token_from_env() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def ensure_token() -> str:
    """This process's engine token: the one in the environment, or a fresh random one put there, so
    the engines it launches (which inherit it) and its clients share it and nobody else has it."""
    if not token_from_env():
        os.environ[TOKEN_ENV] = secrets.token_hex(16)
    return os.environ[TOKEN_ENV]


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve a non-loopback address without a token: anyone on the network could swap the weights."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not token:
        raise SystemExit(f"refusing to listen on {host} without a token: set {TOKEN_ENV} (clients send it as "
                         f"'Authorization: Bearer <token>'), or listen on 127.0.0.1")


class Guard:
    """ASGI middleware: the token check, then the body-size limit, then the app."""

    def __init__(self, app: Any, token: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
        self.app, self.token, self.limit = app, token, max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, headers = scope.get("path", ""), dict(scope.get("headers") or [])
        denied = self._denied(path, headers)
        if denied is not None:
            await _reply(send, *denied)
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _reply(send, 413, self._too_large())
            return
        seen, overflow, replied = 0, False, False

        async def limited() -> dict[str, Any]:
            nonlocal seen, overflow
            message = await receive()
            if message["type"] == "http.request" and not overflow:
                seen += len(message.get("body", b""))
                if seen > self.limit:  # a chunked body without a length: stop reading it here
                    overflow = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal replied
            if not overflow:
                await send(message)
            elif message["type"] == "http.response.start" and not replied:
                # whatever the app made of the cut body, the caller's answer is the 413
                replied = True
                await _reply(send, 413, self._too_large())

        await self.app(scope, limited, guarded_send)

    def _denied(self, path: str, headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        if path in PUBLIC or (path not in MUTATING and not self.token):
            return None
        if not self.token:
            return 403, (f"{path} changes the server's state and this server was started without a token; start it "
                         f"with {TOKEN_ENV} set and send 'Authorization: Bearer <token>'")
        given = headers.get(b"authorization", b"").decode("latin-1")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return 401, f"{path} needs 'Authorization: Bearer <token>' with the server's {TOKEN_ENV}"
        return None

    def _too_large(self) -> str:
        return f"request body over {self.limit} bytes (the server's --max-body-bytes); send less or raise the limit"


async def _reply(send: Any, status: int, message: str) -> None:
    kind = {401: "AuthenticationError", 403: "PermissionDenied", 413: "RequestTooLarge"}.get(status, "BadRequest")
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
