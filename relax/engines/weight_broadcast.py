"""The trainer's side of SGLang's distributed weight update: one process group with the engines, then
each bucket of tensors announced over HTTP and broadcast from rank 0.

Protocol (SGLang 0.5.x ``/init_weights_update_group`` and ``/update_weights_from_distributed``, as slime
drives it): the trainer is rank 0 and hosts the group's TCPStore; engine ``i`` joins as ranks
``rank_offset_i + tp_rank`` with ``rank_offset_i = 1 + sum(tp_size_j, j < i)``, so the world size is
``1 + sum(tp_size)``. A push sends the tensors in buckets of about ``bucket_bytes``: for each bucket the
trainer POSTs ``{names, dtypes, shapes, group_name, weight_version}`` to every engine and, at the same
time, broadcasts the bucket's tensors in ``names`` order (an engine answers once it has received them).
Tensors are cast to the engines' dtype before sending, as SGLang expects (half the bytes of fp32).

The group is a process group of its own (:func:`open_group`, built the way SGLang's
``init_custom_process_group`` builds it): it never creates or touches the default process group, so a
trainer with Megatron's groups and an engine server without any can both join it. Collectives block, so
they run on a thread of their own while the event loop serves the HTTP side.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from relax.engines.client import EngineClient

DEFAULT_BUCKET_BYTES = 512 << 20  # slime's default update_weight_buffer_size


class WeightPushError(RuntimeError):
    """An engine refused to join the group or to take a bucket; the message names the engine and its reason."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, the spelling SGLang's ``dtypes`` field takes."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> torch.dtype | None:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) -> ``torch.bfloat16``; None for anything else ("auto", "")."""
    value = getattr(torch, str(name).removeprefix("torch."), None) if isinstance(name, str) and name else None
    return value if isinstance(value, torch.dtype) else None


def open_group(backend: str, store: Any, rank: int, world_size: int, group_name: str,
               timeout_s: float) -> dist.ProcessGroup:
    """A process group of ``world_size`` ranks over ``store`` that is not the default group and needs none.

    Built as SGLang's ``init_custom_process_group``: a ``PrefixStore(group_name)`` over the rendezvous
    store and torch's group constructor with no global ranks, then an identity rank map so that
    ``dist.broadcast(src=0, group=...)`` works as well as ``group_src=0``. Destroy it with
    ``dist.destroy_process_group(group)``; the same name can then be opened again."""
    from torch.distributed import distributed_c10d as c10d

    pg, _ = c10d._new_process_group_helper(world_size, rank, [], backend, dist.PrefixStore(group_name, store),
                                           group_name=group_name, timeout=timedelta(seconds=timeout_s))
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def plan_buckets(sizes: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Names in order, cut into consecutive buckets of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    out: list[list[str]] = []
    used = 0
    for name, size in sizes:
        if not out or (used + size > bucket_bytes and out[-1]):
            out.append([])
            used = 0
        out[-1].append(name)
        used += size
    return out


def reachable_address(urls: Sequence[str]) -> str:
    """The trainer's address as the engines at ``urls`` reach it: loopback when they all are, else the
    address of the interface that routes to the first one (a UDP connect sends nothing)."""
    hosts = [urlparse(u).hostname or "127.0.0.1" for u in urls]

    def loopback(h: str) -> bool:
        try:
            return h == "localhost" or ipaddress.ip_address(h).is_loopback
        except ValueError:
            return False

    if all(loopback(h) for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((next(h for h in hosts if not loopback(h)), 80))
        return s.getsockname()[0]


def in_thread(fn: Callable[[], Any], name: str) -> asyncio.Future:
    """Run blocking ``fn`` on a daemon thread; a collective stuck on a dead peer must not hold up exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:  # handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is gone: a push gave up on this collective long ago
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def _reason(reply: Any) -> str:
    if isinstance(reply, BaseException):
        return f"{type(reply).__name__}: {reply}"
    return str(reply.get("message")) if isinstance(reply, dict) else repr(reply)


class WeightBroadcaster:
    """``await b.connect(engines)``, then ``await b.push(state_dict, version)`` per weight version, ``await b.close()``.

    ``backend``: "nccl" when CUDA is available, else "gloo" (CPU tensors). ``dtype``: what tensors are cast
    to before sending; None asks the engines (SGLang's ``/get_server_info`` ``dtype``, the native engine's
    ``/get_model_info`` ``dtype``) and sends tensors as they are when none names one. ``master_address``:
    where the engines reach this process (default: see :func:`reachable_address`). ``timeout_s`` bounds
    every collective and the group's rendezvous.
    """

    def __init__(self, *, backend: str | None = None, group_name: str | None = None, dtype: torch.dtype | None = None,
                 master_address: str | None = None, timeout_s: float = 600.0):
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.group_name = group_name or f"relax-weights-{uuid.uuid4().hex[:8]}"
        self.dtype = dtype
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.clients: list[EngineClient] = []
        self.ranks: list[int] = []  # each engine's rank_offset
        self.group: dist.ProcessGroup | None = None
        self._store: Any = None
        self._owned: list[EngineClient] = []
        self._in_step = True  # False once a failed bucket left the engines and the trainer out of step
        self._lock = asyncio.Lock()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    async def connect(self, engines: Sequence[EngineClient | str], tp_sizes: Sequence[int] | None = None) -> None:
        """Open the group with every engine (URLs or clients). ``tp_sizes`` default: each engine's
        ``/get_server_info`` ``tp_size`` (1 when it names none, as the native engine)."""
        if self.group is not None:
            raise RuntimeError(f"already connected (group {self.group_name}); close() first")
        self.clients = [c if isinstance(c, EngineClient) else EngineClient(c) for c in engines]
        self._owned = [c for c, e in zip(self.clients, engines, strict=True) if not isinstance(e, EngineClient)]
        if not self.clients:
            raise ValueError("connect() needs at least one engine")
        infos = await asyncio.gather(*(self._probe(c) for c in self.clients))
        sizes = list(tp_sizes) if tp_sizes is not None else [tp for tp, _ in infos]
        self._resolve_dtype([d for _, d in infos])
        self.ranks = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world = 1 + sum(sizes)
        address = self.master_address or reachable_address([c.url for c in self.clients])
        # port 0: the store picks a free port, so two trainers on one host never race for one
        store = dist.TCPStore(address, 0, world, is_master=True, timeout=timedelta(seconds=self.timeout_s),
                              wait_for_workers=False)
        joins = [asyncio.ensure_future(c.init_weights_update_group(address, store.port, r, world,
                                                                   self.group_name, self.backend))
                 for c, r in zip(self.clients, self.ranks, strict=True)]
        mine = in_thread(lambda: open_group(self.backend, store, 0, world, self.group_name, self.timeout_s),
                         "relax-weight-group")
        replies = await asyncio.gather(*joins, return_exceptions=True)
        failed = [(c.url, r) for c, r in zip(self.clients, replies, strict=True)
                  if isinstance(r, BaseException) or not (isinstance(r, dict) and r.get("success"))]
        if failed:  # this side's join then waits for the missing ranks until timeout_s, on its own thread
            raise WeightPushError("; ".join(f"{url} did not join weight group {self.group_name}: {_reason(r)}"
                                            for url, r in failed))
        self.group, self._store = await mine, store  # the store serves the group while it lives
        self._in_step = True

    async def _probe(self, c: EngineClient) -> tuple[int, torch.dtype | None]:
        server, model = await asyncio.gather(c.request("GET", "/get_server_info"), c.model_info())
        server, model = server if isinstance(server, dict) else {}, model if isinstance(model, dict) else {}
        return int(server.get("tp_size") or 1), parse_dtype(server.get("dtype")) or parse_dtype(model.get("dtype"))

    def _resolve_dtype(self, found: list[torch.dtype | None]) -> None:
        if self.dtype is not None:
            return
        named = {d for d in found if d is not None}
        if len(named) > 1:
            raise WeightPushError(f"the engines serve different dtypes {sorted(map(dtype_name, named))}, but one "
                                  f"broadcast reaches them all; give WeightBroadcaster(dtype=...)")
        self.dtype = next(iter(named), None)

    async def push(self, state_dict: Mapping[str, torch.Tensor], version: int | str, *,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES, flush_cache: bool = True) -> dict[str, Any]:
        """Send every tensor of ``state_dict`` (HF names) as weight ``version``; returns ``{buckets, bytes,
        seconds}``. ``flush_cache`` goes with the last bucket (SGLang then flushes its radix cache, which
        it refuses while requests run: pause generation first, as slime does)."""
        if self.group is None:
            raise RuntimeError("push() before connect()")
        if not self._in_step:
            raise WeightPushError(f"weight group {self.group_name} is out of step after a failed push; "
                                  f"close() and connect() again")
        async with self._lock:
            t0 = time.perf_counter()
            wire = {n: (self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype)
                    for n, t in state_dict.items()}
            plan = plan_buckets([(n, t.numel() * wire[n].itemsize) for n, t in state_dict.items()], bucket_bytes)
            sent = 0
            for i, names in enumerate(plan):
                tensors = [state_dict[n].detach().to(device=self.device, dtype=wire[n]).contiguous() for n in names]
                await self._bucket(names, tensors, str(version), flush_cache and i == len(plan) - 1)
                sent += sum(t.numel() * t.element_size() for t in tensors)
            return {"buckets": len(plan), "bytes": sent, "seconds": time.perf_counter() - t0}

    async def _bucket(self, names: list[str], tensors: list[torch.Tensor], version: str, flush: bool) -> None:
        dtypes, shapes = [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors]
        posts = [asyncio.ensure_future(c.update_weights_from_distributed(
            names, dtypes, shapes, self.group_name, weight_version=version, flush_cache=flush)) for c in self.clients]
        group = self.group

        def send() -> None:
            for t in tensors:
                dist.broadcast(t, group=group, group_src=0)

        broadcast = in_thread(send, "relax-weight-broadcast")
        replies = await asyncio.gather(*posts, return_exceptions=True)
        failed = [(c.url, r) for c, r in zip(self.clients, replies, strict=True)
                  if isinstance(r, BaseException) or not (isinstance(r, dict) and r.get("success"))]
        if not failed:
            await broadcast
            return
        # an engine that refused after receiving (a wrong name or shape) leaves the group in step; one that
        # refused before receiving leaves this broadcast waiting for it until timeout_s
        await asyncio.wait({broadcast}, timeout=5.0)
        self._in_step = broadcast.done() and broadcast.exception() is None
        tail = "" if self._in_step else " (the group is now out of step: close() and connect() again)"
        raise WeightPushError("; ".join(f"{url} refused weight_version {version} ({len(names)} tensors from "
                                        f"{names[0]!r}): {_reason(r)}" for url, r in failed) + tail)

    async def close(self) -> None:
        """Leave the group on every engine (``/destroy_weights_update_group``) and here."""
        if self.group is not None:
            await asyncio.gather(*(c.request("POST", "/destroy_weights_update_group", {"group_name": self.group_name},
                                             retries=0) for c in self.clients), return_exceptions=True)
            dist.destroy_process_group(self.group)
            self.group = None
        self._store = None
        for c in self._owned:
            await c.close()
        self._owned = []
