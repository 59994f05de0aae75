"""``relax scale``: add and remove rollout engines of a running run through its REST API.

A thin client of :mod:`relax.services.api.elastic` on ``urllib`` (no extra dependency), so an
operator can scale from any machine with the package installed. Responses are printed as
JSON; an HTTP error prints ``error: <status> <detail>`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

TOKEN_ENV = "RELAX_API_TOKEN"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", help="add or remove rollout engines through the rollout REST API",
                       description="relax scale {out,in,engines,operation} API_URL ...")
    actions = p.add_subparsers(dest="action", required=True, metavar="{out,in,engines,operation}")
    for name, helptext in (("out", "add engines: launch --replicas N or add running --engine-url U"),
                           ("in", "drain and remove engines: --replicas N or --engine-url U")):
        a = actions.add_parser(name, help=helptext, description=helptext)
        a.add_argument("url", help="the rollout API, e.g. http://head:8000")
        which = a.add_mutually_exclusive_group(required=True)
        which.add_argument("--replicas", type=int, help="how many engines")
        which.add_argument("--engine-url", action="append", dest="engine_urls", metavar="U",
                           help="an engine URL (repeat for several)")
        a.add_argument("--operation-id", default=None, help="idempotency key: a retry returns the same operation")
        _common(a, token=True)
        a.set_defaults(func=_scale, route=f"/rollout/scale_{name}")
    e = actions.add_parser("engines", help="list the engines of the pool")
    e.add_argument("url", help="the rollout API")
    _common(e, token=False)
    e.set_defaults(func=_engines)
    o = actions.add_parser("operation", help="show a scale operation")
    o.add_argument("url", help="the rollout API")
    o.add_argument("operation_id")
    _common(o, token=False)
    o.set_defaults(func=_operation)


def _common(p: argparse.ArgumentParser, token: bool) -> None:
    if token:
        p.add_argument("--token", default=None, help=f"API bearer token (default: env {TOKEN_ENV})")
    # Operations answer when done: a scale-in waits for in-flight requests to drain.
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the answer")


def _call(method: str, url: str, timeout: float, body: dict[str, Any] | None = None,
          token: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            detail = json.loads(raw).get("detail", raw.decode(errors="replace"))
        except (ValueError, AttributeError):
            detail = raw.decode(errors="replace")
        return e.code, detail


def _report(status: int, payload: Any) -> int:
    if status >= 400:
        print(f"error: {status} {payload}", file=sys.stderr)
        return 2
    print(json.dumps(payload, indent=2))
    return 0


def _request(method: str, args: argparse.Namespace, path: str, body: dict[str, Any] | None = None,
             token: str | None = None) -> int:
    url = args.url.rstrip("/") + path
    try:
        return _report(*_call(method, url, args.timeout, body, token))
    except (urllib.error.URLError, OSError) as e:
        print(f"error: cannot reach the rollout API at {url}: {getattr(e, 'reason', e)}; check the URL",
              file=sys.stderr)
        return 2


def _scale(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        print(f"error: no API token: pass --token or set {TOKEN_ENV}", file=sys.stderr)
        return 2
    body: dict[str, Any] = ({"num_replicas": args.replicas} if args.replicas is not None
                            else {"engine_urls": args.engine_urls})
    if args.operation_id:
        body["operation_id"] = args.operation_id
    return _request("POST", args, args.route, body, token)


def _engines(args: argparse.Namespace) -> int:
    return _request("GET", args, "/rollout/engines")


def _operation(args: argparse.Namespace) -> int:
    return _request("GET", args, f"/rollout/operations/{args.operation_id}")
