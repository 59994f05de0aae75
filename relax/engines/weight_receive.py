"""The engine's side of SGLang's distributed weight update (``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group``) for the native engine.

Each request's tensors arrive by broadcast from rank 0 (the trainer, ``relax.engines.weight_broadcast``)
in ``names`` order with the announced dtypes and shapes. The engine always receives a well-formed
bucket in full before judging it, so that a refused bucket leaves the group in step with the trainer;
only then are names and shapes checked against the model (a wrong one: ``{success: false}`` naming the
tensor and both shapes, and the old weights keep serving).

Unlike SGLang, which loads every bucket as it arrives, the native engine stages buckets and swaps the
weights once every tensor of the model has arrived (``engine.update_weights``, between scheduler steps):
a completion never mixes two versions and always reports the version its weights are. Collectives block,
so they run on a worker thread; the server's event loop keeps answering meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

DEFAULT_GROUP = "weight_update_group"
JOIN_TIMEOUT_S = 600.0  # how long a join or a bucket waits for the trainer's side


@dataclass
class _Group:
    pg: Any
    store: Any
    device: Any  # where broadcast buffers live: the model's CUDA device for nccl, the CPU for gloo
    lock: threading.Lock = field(default_factory=threading.Lock)  # one bucket at a time: collectives are ordered
    staged: dict[str, Any] = field(default_factory=dict)
    version: str | None = None


def _fail(message: str, status: int = 400) -> tuple[int, dict[str, Any]]:
    return status, {"success": False, "message": message}


class WeightReceiver:
    """The native engine's weight-update groups, by name."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.groups: dict[str, _Group] = {}

    @property
    def model(self) -> Any:
        return self.engine.model

    def _model_device(self) -> Any:
        return next(self.model.parameters()).device

    def _backend_problem(self, backend: str) -> str | None:
        import torch
        import torch.distributed as dist

        if backend == "gloo":
            return None if dist.is_gloo_available() else "backend 'gloo' is not built into this torch"
        if backend == "nccl":
            if not (torch.cuda.is_available() and dist.is_nccl_available()):
                return "backend 'nccl' needs CUDA and this engine has none; ask for backend='gloo'"
            if self._model_device().type != "cuda":
                return "backend 'nccl' needs the model on a GPU and this engine serves it on the CPU; use 'gloo'"
            return None
        return f"backend {backend!r} is not served; use 'nccl' (engine on a GPU) or 'gloo'"

    async def init_group(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = body.get("group_name") or DEFAULT_GROUP
        backend = body.get("backend") or "nccl"
        try:
            address, port = str(body["master_address"]), int(body["master_port"])
            offset, world = int(body["rank_offset"]), int(body["world_size"])
        except (KeyError, TypeError, ValueError):
            return _fail("init_weights_update_group takes master_address, master_port, rank_offset and world_size")
        problem = self._backend_problem(str(backend))
        if problem is None and not 1 <= offset < world:
            problem = f"rank_offset {offset} must be in [1, world_size={world}): rank 0 is the trainer"
        if problem is not None:
            return _fail(problem)
        if name in self.groups:  # a trainer that reconnects under the same name replaces its old group
            await self.destroy_group({"group_name": name})
        try:
            group = await asyncio.to_thread(self._join, str(backend), address, port, offset, world, name)
        except Exception as e:
            return _fail(f"could not join weight group {name!r} at {address}:{port} as rank {offset} of {world} "
                         f"over {backend}: {type(e).__name__}: {e}")
        self.groups[name] = group
        return 200, {"success": True, "message": f"joined weight group {name!r} as rank {offset} of {world} "
                                                 f"over {backend}"}

    def _join(self, backend: str, address: str, port: int, rank: int, world: int, name: str) -> _Group:
        import torch
        import torch.distributed as dist

        from relax.engines.weight_broadcast import open_group

        device = self._model_device() if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore(address, port, world, is_master=False, timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        return _Group(open_group(backend, store, rank, world, name, JOIN_TIMEOUT_S), store, device)

    async def destroy_group(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = body.get("group_name") or DEFAULT_GROUP
        group = self.groups.pop(name, None)
        if group is None:
            return _fail(f"no weight group {name!r} to destroy")
        import torch.distributed as dist

        await asyncio.to_thread(dist.destroy_process_group, group.pg)
        return 200, {"success": True, "message": f"left weight group {name!r}"}

    async def update(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """One bucket: receive, check, stage; swap the weights once the model is complete."""
        from relax.engines.weight_broadcast import parse_dtype

        name = body.get("group_name") or DEFAULT_GROUP
        group = self.groups.get(name)
        if group is None:
            return _fail(f"no weight group {name!r}: call /init_weights_update_group first")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and names and len(names) == len(dtypes) == len(shapes)):
            return _fail("names, dtypes and shapes must be non-empty lists of one length")
        wire = [parse_dtype(d) for d in dtypes]
        bad = next((i for i, (d, s) in enumerate(zip(wire, shapes, strict=True)) if d is None or not isinstance(s, list)
                    or not all(isinstance(x, int) and x >= 0 for x in s)), None)
        if bad is not None:
            return _fail(f"tensor {names[bad]!r}: dtype {dtypes[bad]!r} / shape {shapes[bad]!r} is not a torch dtype "
                         f"name and a list of sizes")
        version = body.get("weight_version")
        return await asyncio.to_thread(self._receive, group, [str(n) for n in names], wire, shapes,
                                       None if version is None else str(version), body.get("load_format"))

    def _receive(self, group: _Group, names: list[str], dtypes: list[Any], shapes: list[list[int]],
                 version: str | None, load_format: Any) -> tuple[int, dict[str, Any]]:
        import torch
        import torch.distributed as dist

        from relax.engines.weight_source import complete_tied

        with group.lock:
            bufs = [torch.empty(s, dtype=d, device=group.device) for d, s in zip(dtypes, shapes, strict=True)]
            try:
                for b in bufs:
                    dist.broadcast(b, group=group.pg, group_src=0)
            except Exception as e:  # a trainer that died or timed out mid-bucket: nothing staged is trusted
                group.staged, group.version = {}, None
                return _fail(f"receiving {names[0]!r}.. failed: {type(e).__name__}: {e}; the group is out of step "
                             f"(destroy and init it again); still serving weight_version {self.engine.weight_version}")
            serving = self.engine.weight_version
            current = self.model.state_dict()
            problems = [f"{n!r} is not a tensor of this model (sent with shape {list(b.shape)})" if n not in current
                        else f"{n!r} has shape {list(b.shape)} but the model's {n!r} has shape {list(current[n].shape)}"
                        for n, b in zip(names, bufs, strict=True)
                        if n not in current or tuple(b.shape) != tuple(current[n].shape)]
            if load_format is not None:
                problems.append(f"load_format {load_format!r} is not served by the native engine (send null)")
            if problems:  # the push is broken: drop what it staged, keep serving
                group.staged, group.version = {}, None
                return _fail(f"{'; '.join(problems[:3])}; still serving weight_version {serving}")
            if version is not None and group.version is not None and version != group.version:
                group.staged = {}  # a new version began before the last one completed: start over
            group.staged.update(zip(names, bufs, strict=True))
            group.version = version or group.version
            full = complete_tied(group.staged, self.model)
            if not set(current) <= set(full):
                return 200, {"success": True, "message": f"staged {len(group.staged)} of {len(current)} tensors for "
                                                         f"weight_version {group.version}; the weights swap once "
                                                         f"all have arrived"}
            state, label = {k: full[k] for k in current}, group.version
            group.staged, group.version = {}, None
            if label is None:
                return _fail(f"every tensor arrived but no request named a weight_version; still serving "
                             f"weight_version {serving}")
            try:
                self.engine.update_weights(state, label)
            except Exception as e:  # the engine keeps its old weights
                return _fail(f"{type(e).__name__}: {e}")
            return 200, {"success": True, "message": f"loaded {len(state)} tensors as weight_version {label}"}
